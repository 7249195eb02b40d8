"""Bad input: hostile or mismatched checkpoints are refused with a clear error, never followed or run.

The attacker controls every byte of a checkpoint, so where an attack needs it the
manifest is re-signed: the digests of swapped files are recomputed, then the
manifest's own checksum, exactly as ``Manifest.to_dict`` computes it. Each case
is shown end to end on a save_dir written by a real run (steps 1 and 2; step 2
is damaged):

* ``CheckpointManager(d, owner=False)`` falls back to step 1 and changes nothing
  on disk, and the problem it reports names the damaged path and what was
  expected and found;
* ``CheckpointManager(d).load()`` falls back to step 1 and moves step 2 to
  ``quarantine/``;
* ``PreemptibleRun(d, ...)`` resumes from step 1.

Where reading outside the checkpoint is the attack, an audit hook forbids any
``open`` or directory listing under the outside directory and records it.

"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from torch.utils.data import DataLoader, TensorDataset

from preempt import (
    CheckpointManager,
    CorruptCheckpointError,
    IncompatibleStateError,
    NoCheckpointError,
    Preempted,
    PreemptibleRun,
    ResumableSampler,
)
from preempt.checkpoint.hashed_io import dumps_json, hash_file
from preempt.cli import main as cli

N, BATCH = 40, 8  # 5 batches per epoch
STEP1, STEP2 = "step_000000001", "step_000000002"


# ---------------------------------------------------------------- the run


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(99)
    x = torch.arange(N, dtype=torch.float32)[:, None].repeat(1, 4)  # x[i, 0] == i: batches say which samples they hold
    data = TensorDataset(x, torch.randint(0, 2, (N,), generator=g))
    return model, opt, sched, data


def train(
    save_dir: Path,
    *,
    seen: list[int] | None = None,
    stop_after: int | None = None,
    batch_size: int = BATCH,
    sampler: ResumableSampler | None = None,
    **kwargs: Any,
) -> None:
    """One epoch; appends the index of every sample the loop sees to ``seen``; stops after ``stop_after`` steps."""
    model, opt, sched, data = build()
    kwargs.setdefault("checkpoint_interval", None)
    seen = [] if seen is None else seen
    steps = 0
    with PreemptibleRun(save_dir, model=model, optimizer=opt, scheduler=sched, **kwargs) as run:
        sampler = sampler or run.sampler(data, seed=3)
        for _ in run.epochs(1):
            for x, y in run.batches(DataLoader(data, batch_size=batch_size, sampler=sampler)):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                seen.extend(int(v) for v in x[:, 0])
                steps += 1
                if steps == stop_after:
                    run.request_stop()
                run.step()


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save_dir with the checkpoints of steps 1 and 2 (stopped at step 2: no completion marker)."""
    d = tmp_path_factory.mktemp("template") / "run"
    with pytest.raises(Preempted):
        train(d, stop_after=2, checkpoint_every_steps=1, keep_last=None, async_save=False)  # both on disk
    assert sorted(p.name for p in d.glob("step_*")) == [STEP1, STEP2]
    return d


@pytest.fixture
def save_dir(template: Path, tmp_path: Path) -> Path:
    d = tmp_path / "run"
    shutil.copytree(template, d, symlinks=True)
    return d


# ---------------------------------------------------------------- tools of the attacker


def resign(step_dir: Path, edit: Callable[[dict[str, Any]], None] | None = None, rehash: tuple[str, ...] = ()) -> None:
    """Rewrites ``manifest.json`` with ``edit`` applied, the digests of ``rehash`` recomputed, and a valid checksum."""
    raw = json.loads((step_dir / "manifest.json").read_bytes())
    raw.pop("checksum")
    for name in rehash:
        d = hash_file(step_dir / name)
        raw["files"][name] = {"size": d.size, "xxh3_128": d.xxh3_128}
    if edit is not None:
        edit(raw)
    raw["checksum"] = xxhash.xxh3_128_hexdigest(dumps_json(raw))  # what Manifest.to_dict does
    (step_dir / "manifest.json").write_text(json.dumps(raw, allow_nan=True))


def swap(step_dir: Path, name: str, data: bytes) -> None:
    """Replaces one file of the checkpoint and re-signs the manifest for it."""
    (step_dir / name).write_bytes(data)
    resign(step_dir, rehash=(name,))


def tree_of(root: Path) -> dict[str, tuple[str, bytes | str, int]]:
    """Every entry under ``root`` (not following links): kind, content or link target, mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            if p.is_symlink():
                out[str(p.relative_to(root))] = ("link", os.readlink(p), st.st_mtime_ns)
            elif p.is_file():
                out[str(p.relative_to(root))] = ("file", p.read_bytes(), st.st_mtime_ns)
            else:
                out[str(p.relative_to(root))] = ("dir", "", st.st_mtime_ns)
    return out


# ---------------------------------------------------------------- no reading outside

_FORBIDDEN: dict[str, Any] = {"roots": (), "seen": []}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    roots = _FORBIDDEN["roots"]
    if not roots or event not in ("open", "os.listdir", "os.scandir") or not args:
        return
    path = args[0]
    if path is None or isinstance(path, int):
        return
    real = os.path.realpath(os.fsdecode(path))
    if any(real == r or real.startswith(r + os.sep) for r in roots):
        _FORBIDDEN["seen"].append(f"{event} {real}")
        raise PermissionError(f"test: {event} of {real}, outside the checkpoint")


sys.addaudithook(_audit)  # cannot be removed; does nothing outside `forbidden()`


@contextlib.contextmanager
def forbidden(*roots: Path) -> Iterator[list[str]]:
    """Within the block, opening or listing anything under ``roots`` fails and is recorded."""
    _FORBIDDEN["roots"] = tuple(os.path.realpath(r) for r in roots)
    _FORBIDDEN["seen"] = seen = []
    try:
        yield seen
    finally:
        _FORBIDDEN["roots"] = ()


# ---------------------------------------------------------------- the verdicts


def problem_with(save_dir: Path, step: int = 2) -> str:
    """What a read-only manager says about one checkpoint: discovery's problem, or the error of reading it."""
    m = CheckpointManager(save_dir, owner=False)
    info = next(c for c in m.list() if c.step == step)
    if info.status != "valid":
        assert info.problem
        return info.problem
    with pytest.raises(CorruptCheckpointError) as e:
        m.read(info)
    return str(e.value)


def assert_refused(save_dir: Path, expected: str, bad: str = STEP2, verify: int | None = cli.EXIT_DAMAGED) -> None:
    """Step ``bad`` is refused with a message naming its path and matching ``expected``; all falls back to step 1.

    The read-only parts (a manager with owner=False, ``preempt ls`` and ``preempt verify``,
    whose exit code must be ``verify`` unless None) change nothing on disk. The
    owner's load then moves the bad checkpoint to quarantine/, and so does a
    PreemptibleRun resuming a copy.
    """
    twin = save_dir.with_name(save_dir.name + "-twin")
    shutil.copytree(save_dir, twin, symlinks=True)
    before = tree_of(save_dir)

    message = problem_with(save_dir, int(bad.split("_")[1]))
    assert str(save_dir / bad) in message, message
    assert re.search(expected, message), f"{expected!r} not in {message!r}"
    info, _ = CheckpointManager(save_dir, owner=False).load()
    assert info.path == save_dir / STEP1
    assert cli.main(["ls", str(save_dir)]) == cli.EXIT_OK
    code = cli.main(["verify", str(save_dir)])
    assert verify is None or code == verify
    assert tree_of(save_dir) == before, "a read-only look changed the save_dir"

    info, loaded = CheckpointManager(save_dir).load()
    assert info.path == save_dir / STEP1 and loaded.tree["user"] == {}
    assert os.path.lexists(save_dir / "quarantine" / bad)
    assert not os.path.lexists(save_dir / bad)

    model, opt, sched, _ = build(seed=7)
    with PreemptibleRun(twin, model=model, optimizer=opt, scheduler=sched, checkpoint_interval=None) as run:
        assert run.resumed_from == twin / STEP1 and run.global_step == 1
    assert os.path.lexists(twin / "quarantine" / bad)


# ================================================================ 1. manifests


def _set(*path: str | int, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        node = raw
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _delete(*path: str) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        node = raw
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return edit


def _extra_file(name: str) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        raw["files"][name] = dict(raw["files"]["model.safetensors"])

    return edit


# (id, edit of the re-signed manifest, what the message must say); `preempt verify` says DAMAGED for all but one
RESIGNED = [
    ("format-version-2", _set("format_version", value=2), r"format_version 2 is not supported, expected 1 \(.*newer"),
    ("format-version-string", _set("format_version", value="1"), r"format_version '1' is not supported, expected 1"),
    ("other-format", _set("format", value="orbax"), r"expected format 'preempt-checkpoint', found 'orbax'"),
    ("no-files", _delete("files"), r"missing field 'files'"),
    ("no-step", _delete("step"), r"missing field 'step'"),
    ("no-cursor-sample", _delete("cursor", "sample"), r"cursor: missing field 'sample'"),
    ("files-a-list", _set("files", value=[]), r"field 'files': expected an object, found list"),
    ("negative-step", _set("step", value=-1), r"field 'step': expected an integer in \[0, \d+\], found -1"),
    ("absurd-step", _set("step", value=10**30), r"field 'step': expected an integer in \[0, \d+\], found 10{30}"),
    # `preempt verify` says DAMAGED too: its files hash fine, but the directory is not the checkpoint it claims
    ("step-of-another-directory", _set("step", value=7), r"records step 7, directory says 2"),
    ("negative-epoch", _set("cursor", "epoch", value=-3), r"cursor: field 'epoch': expected an integer .*found -3"),
    (
        "cursor-past-the-epoch",
        _set("cursor", "sample", value=10**6),
        r"cursor.sample 1000000 is past the end of the epoch \(40 samples",
    ),
    (
        "absurd-file-size",
        _set("files", "model.safetensors", "size", value=1 << 60),
        r"files\['model.safetensors'\]: field 'size': expected an integer in \[0, 1125899906842624\],"
        r" found 1152921504606846976",
    ),
    (
        "negative-file-size",
        _set("files", "state.json", "size", value=-5),
        r"files\['state.json'\]: field 'size': .* found -5",
    ),
    (
        "bad-digest",
        _set("files", "state.json", "xxh3_128", value="../../etc/passwd"),
        r"files\['state.json'\].xxh3_128: expected 32 hex digits, found '../../etc/passwd'",
    ),
    ("created-infinite", _set("created", value=float("inf")), r"field 'created': expected a number in .*found inf"),
    ("created-beyond-floats", _set("created", value=10**400), r"field 'created': expected a number in .*found 1000"),
    ("metric-not-a-number", _set("metrics", value={"loss": "low"}), r"metrics: field 'loss': expected a number"),
    ("name-parent", _extra_file("../../x"), r"file name '../../x' is not a plain file name inside the checkpoint"),
    ("name-absolute", _extra_file("/etc/passwd"), r"file name '/etc/passwd' is not a plain file name"),
    ("name-with-slash", _extra_file("sub/model.safetensors"), r"file name 'sub/model.safetensors' is not a plain"),
    ("name-dotdot", _extra_file(".."), r"file name '..' is not a plain file name"),
    ("name-manifest", _extra_file("manifest.json"), r"file name 'manifest.json' is not a plain file name"),
    # verify hashes what the manifest lists; that a file is missing from the list only load() notices
    ("file-not-listed", _delete("files", "state.safetensors"), r"manifest.json: lists no state.safetensors", None),
    (
        "wrong-size",
        lambda raw: raw["files"]["state.json"].update(size=raw["files"]["state.json"]["size"] + 1),
        r"state.json: size \d+ bytes, manifest says \d+",
    ),
    (
        "wrong-digest",
        _set("files", "model.safetensors", "xxh3_128", value="0" * 32),
        r"model.safetensors: xxh3 mismatch",
    ),
]


@pytest.mark.parametrize("case", RESIGNED, ids=[c[0] for c in RESIGNED])
def test_resigned_manifest_with_bad_content_is_refused(save_dir, case):
    _, edit, expected, *verify = case
    resign(save_dir / STEP2, edit)
    assert_refused(save_dir, expected, verify=verify[0] if verify else cli.EXIT_DAMAGED)


@pytest.mark.parametrize(
    "data, expected",
    [
        (b"\x00\x01 not json at all", r"not valid JSON"),
        (b"[1, 2]", r"expected a JSON object, found array"),
        (pickle.dumps({"format": "preempt-checkpoint"}), r"not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, r"JSON nested 100000 levels deep; at most 64 expected"),
        (b'{"step": ' + b"7" * 5000 + b"}", r"not valid JSON \(ValueError: Exceeds the limit"),
        (b"", r"not valid JSON"),
    ],
    ids=["garbage", "a-list", "a-pickle", "nested-100000-deep", "5000-digit-integer", "empty"],
)
def test_manifest_that_is_not_a_manifest_is_refused(save_dir, data, expected):
    (save_dir / STEP2 / "manifest.json").write_bytes(data)
    assert_refused(save_dir, expected)


def test_manifest_edited_without_resigning_is_refused(save_dir):
    path = save_dir / STEP2 / "manifest.json"
    text = path.read_text()
    assert text.count('"reason": "') == 1
    path.write_text(text.replace('"reason": "', '"reason": "x'))
    assert_refused(save_dir, r"manifest checksum mismatch \(recorded [0-9a-f]{32}, computed [0-9a-f]{32}\)")


def test_manifest_truncated_is_refused(save_dir):
    path = save_dir / STEP2 / "manifest.json"
    path.write_bytes(path.read_bytes()[:100])
    assert_refused(save_dir, r"not valid JSON")


def test_only_a_bad_checkpoint_means_no_checkpoint_and_the_run_starts_fresh(save_dir, caplog):
    shutil.rmtree(save_dir / STEP1)
    swap(save_dir / STEP2, "model.safetensors", b"\x80\x04K\x01.")
    with pytest.raises(NoCheckpointError) as e:
        CheckpointManager(save_dir, owner=False).load()
    assert str(save_dir / STEP2 / "model.safetensors") in str(e.value)
    assert e.value.corrupt and "pickle" in e.value.corrupt[0]
    with caplog.at_level(logging.WARNING, logger="preempt"):
        train(save_dir)
    assert "starting fresh" in caplog.text and str(save_dir / STEP2 / "model.safetensors") in caplog.text


def test_no_checkpoint_error_names_a_bad_manifest(save_dir):
    shutil.rmtree(save_dir / STEP1)
    resign(save_dir / STEP2, _set("format_version", value=2))
    with pytest.raises(NoCheckpointError) as e:
        CheckpointManager(save_dir, owner=False).load()
    assert str(save_dir / STEP2 / "manifest.json") in str(e.value) and "format_version 2" in str(e.value)


# ---------------------------------------------------------------- symlinks and names outside


@pytest.fixture
def outside(tmp_path: Path, template: Path) -> Path:
    """A directory next to the save_dir holding a complete, valid checkpoint and a copy of step 2's files."""
    d = tmp_path / "outside"
    shutil.copytree(template / STEP2, d / "step_000000009")
    resign(d / "step_000000009", _set("step", value=9))
    for name in ("model.safetensors", "manifest.json"):
        shutil.copy(template / STEP2 / name, d / name)
    return d


def test_file_symlinked_outside_is_refused_unread(save_dir, outside):
    """The manifest even carries the outside file's digest, so following the link would load it."""
    target = outside / "model.safetensors"
    (save_dir / STEP2 / "model.safetensors").unlink()
    os.symlink(target, save_dir / STEP2 / "model.safetensors")
    resign(save_dir / STEP2, rehash=("model.safetensors",))
    before = tree_of(outside)
    with forbidden(outside) as seen:
        assert_refused(save_dir, r"model.safetensors: is a symlink; checkpoint files must be regular files")
    assert seen == []
    assert tree_of(outside) == before


def test_manifest_symlinked_outside_is_refused_unread(save_dir, outside):
    (save_dir / STEP2 / "manifest.json").unlink()
    os.symlink(outside / "manifest.json", save_dir / STEP2 / "manifest.json")
    before = tree_of(outside)
    with forbidden(outside) as seen:
        assert_refused(save_dir, r"manifest.json: is a symlink")
    assert seen == []
    assert tree_of(outside) == before


def test_step_directory_symlinked_outside_is_refused_unread(save_dir, outside, capsys):
    """A newer "checkpoint" that is a link to a valid one elsewhere: never chosen, never read, only the link moves."""
    link = save_dir / "step_000000009"
    os.symlink(outside / "step_000000009", link, target_is_directory=True)
    (save_dir / STEP2).rename(save_dir / "kept-aside")  # so that the fallback target is step 1, as assert_refused wants
    before = tree_of(outside)
    with forbidden(outside) as seen:
        assert_refused(save_dir, r"not a directory \(or a symlink\)", bad="step_000000009")
    assert seen == []
    assert tree_of(outside) == before
    assert (save_dir / "quarantine" / "step_000000009").is_symlink()
    assert "step_000000009" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["../../outside/model.safetensors", "ABSOLUTE"])
def test_manifest_naming_a_file_outside_is_refused_unread(save_dir, outside, name):
    """The entry even has the outside file's size and digest: the name alone is refused, before any open."""
    target = outside / "model.safetensors"
    name = str(target) if name == "ABSOLUTE" else name
    assert (save_dir / STEP2 / name).resolve() == target.resolve()
    d = hash_file(target)

    def edit(raw: dict[str, Any]) -> None:
        raw["files"][name] = {"size": d.size, "xxh3_128": d.xxh3_128}

    resign(save_dir / STEP2, edit)
    before = tree_of(outside)
    with forbidden(outside) as seen:
        assert_refused(save_dir, re.escape(f"file name {name[:40]!r}"[:-1]) + ".* is not a plain file name inside")
    assert seen == []
    assert tree_of(outside) == before


def test_quarantine_symlinked_outside_is_not_followed(save_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, save_dir / "quarantine", target_is_directory=True)
    swap(save_dir / STEP2, "model.safetensors", b"junk")
    with contextlib.suppress(Exception):
        CheckpointManager(save_dir).load()
    assert list(elsewhere.iterdir()) == []


# ---------------------------------------------------------------- special files


def _within(seconds: float, fn: Callable[[], Any], fifos: list[Path]) -> Any:
    """Runs ``fn`` in a thread; if it is still blocked after ``seconds`` (opening a FIFO), unblocks it and fails."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            out["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        for f in fifos:  # a writer that comes and goes: the blocked open returns, the read sees end-of-file
            with contextlib.suppress(OSError):
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail(f"blocked for {seconds} s opening a FIFO")
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.mark.parametrize("name", ["manifest.json", "state.json"])
def test_fifo_in_place_of_a_file_is_refused_without_blocking(save_dir, name):
    path = save_dir / STEP2 / name
    path.unlink()
    os.mkfifo(path)
    info, _ = _within(2.0, lambda: CheckpointManager(save_dir, owner=False).load(), [path])
    assert info.path == save_dir / STEP1


@pytest.mark.parametrize("name", ["manifest.json", "model.safetensors"])
def test_directory_in_place_of_a_file_is_refused(save_dir, name):
    path = save_dir / STEP2 / name
    path.unlink()
    path.mkdir()
    assert_refused(save_dir, re.escape(name))


def test_state_json_nested_too_deep_is_refused(save_dir):
    swap(save_dir / STEP2, "state.json", b"[" * 100_000 + b"]" * 100_000)
    assert_refused(save_dir, r"state.json: expected JSON")


# ================================================================ 2. code on load


class Payload:
    """Unpickling this creates ``marker``: proof that the loader ran code from the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def payload_bytes(kind: str, marker: Path) -> bytes:
    if kind == "pickle":
        return pickle.dumps(Payload(marker))
    f = io.BytesIO()
    torch.save({"weight": Payload(marker)}, f)
    return f.getvalue()


def assert_live(kind: str, data: bytes, marker: Path) -> None:
    """The payload is armed: a loader that unpickles would have created the marker."""
    if kind == "pickle":
        pickle.loads(data).close()
    else:
        torch.load(io.BytesIO(data), weights_only=False)["weight"].close()
    assert marker.exists()
    marker.unlink()


@pytest.mark.parametrize("kind", ["pickle", "torch.save"])
@pytest.mark.parametrize("name", ["model.safetensors", "state.safetensors", "state.json"])
def test_pickle_in_place_of_a_file_is_refused_and_never_run(save_dir, tmp_path, name, kind):
    marker = tmp_path / "PWNED"
    data = payload_bytes(kind, marker)
    assert_live(kind, data, marker)
    swap(save_dir / STEP2, name, data)
    found = {"pickle": "a pickle stream", "torch.save": "a zip archive"}[kind]
    expected = rf"{name}: .*found {found}" if name != "state.json" else rf"{name}: "
    assert_refused(save_dir, expected)  # the digests match, and verify still reports it: it parses too
    assert not marker.exists()


def test_pickle_as_the_manifest_is_refused_and_never_run(save_dir, tmp_path):
    marker = tmp_path / "PWNED"
    data = payload_bytes("pickle", marker)
    assert_live("pickle", data, marker)
    (save_dir / STEP2 / "manifest.json").write_bytes(data)
    assert_refused(save_dir, r"manifest.json: not valid JSON")
    assert not marker.exists()


def _rewrite_safetensors(path: Path, metadata: dict[str, str]) -> None:
    buf = path.read_bytes()
    n = int.from_bytes(buf[:8], "little")
    header = json.loads(buf[8 : 8 + n])
    header["__metadata__"] = metadata
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + buf[8 + n :])


@pytest.mark.parametrize("name", ["model.safetensors", "state.safetensors"])
def test_pickle_inside_safetensors_metadata_is_inert(save_dir, tmp_path, name):
    """Metadata is strings that nothing interprets, so the file loads and the payload stays data.

    Refusing unknown metadata would also refuse files written by other tools
    (safetensors allows any string metadata); what matters is that no code runs.
    """
    marker = tmp_path / "PWNED"
    for kind in ("pickle", "torch.save"):
        data = payload_bytes(kind, marker)
        assert_live(kind, data, marker)
        _rewrite_safetensors(save_dir / STEP2 / name, {"format": "pt", kind: data.decode("latin-1")})
        resign(save_dir / STEP2, rehash=(name,))
        info, loaded = CheckpointManager(save_dir, owner=False).load()
        assert info.path == save_dir / STEP2
        _, reference = CheckpointManager(save_dir, owner=False).load(1)
        assert loaded.model.keys() == reference.model.keys()
        assert cli.main(["verify", str(save_dir)]) == cli.EXIT_OK
        model, opt, sched, _ = build(seed=7)
        with PreemptibleRun(save_dir, model=model, optimizer=opt, scheduler=sched, exit_if_complete=False) as run:
            assert run.resumed_from == save_dir / STEP2
        assert not marker.exists()
    # Metadata that is not strings is refused, naming the file.
    _rewrite_safetensors(save_dir / STEP2 / name, {"format": {"__reduce__": "os.system"}})  # type: ignore[dict-item]
    resign(save_dir / STEP2, rehash=(name,))
    assert "__metadata__ must map strings to strings" in problem_with(save_dir)


def test_pickle_bytes_inside_state_json_strings_are_inert(save_dir, tmp_path):
    """A JSON string holding a pickle is a string: state.json never names a type to build."""
    marker = tmp_path / "PWNED"
    data = payload_bytes("pickle", marker)
    assert_live("pickle", data, marker)
    step = save_dir / STEP2
    tree = json.loads((step / "state.json").read_bytes())
    tree["user"] = {"x": data.decode("latin-1"), "__reduce__": ["builtins.open", [str(marker), "w"]]}
    swap(step, "state.json", json.dumps(tree).encode())
    model, opt, sched, _ = build(seed=7)
    with PreemptibleRun(save_dir, model=model, optimizer=opt, scheduler=sched) as run:
        assert run.resumed_from == step
        assert run.user_state["x"] == data.decode("latin-1")
    assert not marker.exists()


def test_verify_reports_a_resigned_pickle_as_damaged(save_dir, tmp_path):
    swap(save_dir / STEP2, "model.safetensors", payload_bytes("pickle", tmp_path / "PWNED"))
    assert cli.main(["verify", str(save_dir)]) == cli.EXIT_DAMAGED


# ================================================================ 3. state that does not fit


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def _stepped():
    """Objects that already hold state of their own (so that "untouched" is observable)."""
    model, opt, sched, data = build(seed=5)
    model(data.tensors[0][:4]).sum().backward()
    opt.step()
    return model, opt, sched


def test_optimizer_with_parameters_in_another_order_is_refused_and_nothing_changes(save_dir):
    """Same counts, other order: Adam's moments would land on the wrong parameters."""
    model, _, _ = _stepped()
    params = list(model.parameters())
    opt = torch.optim.Adam([params[1], params[0], *params[2:]], lr=0.01)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    before = _snapshot(model, opt)
    with pytest.raises(IncompatibleStateError) as e:
        with PreemptibleRun(save_dir, model=model, optimizer=opt):
            pass
    message = str(e.value)
    assert str(save_dir / STEP2 / "state.json") in message
    assert "group 0 parameter 0 exp_avg: checkpoint (8, 4), parameter (8,)" in message
    assert "group 0 parameter 1 exp_avg_sq: checkpoint (8,), parameter (8, 4)" in message
    _assert_same(before, _snapshot(model, opt))


def test_model_mismatch_on_resume_lists_every_key_and_changes_nothing(save_dir):
    model = torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.ReLU(), torch.nn.Linear(9, 2), torch.nn.Linear(2, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    before = _snapshot(model, opt)
    with pytest.raises(IncompatibleStateError) as e:
        with PreemptibleRun(save_dir, model=model, optimizer=opt):
            pass
    message = str(e.value)
    assert message.startswith(f"{save_dir / STEP2 / 'model.safetensors'}: the model does not match the checkpoint")
    assert "(3 of another shape, 2 missing in checkpoint)" in message
    assert "shape: 0.bias: checkpoint (8,), model (9,); 0.weight: checkpoint (8, 4), model (9, 4);" in message
    assert "2.weight: checkpoint (2, 8), model (2, 9)" in message
    assert "missing in checkpoint: 3.bias, 3.weight" in message
    _assert_same(before, _snapshot(model, opt))


def test_a_scheduler_that_refuses_its_state_leaves_model_and_optimizer_untouched(save_dir):
    """The scheduler's state can only be judged by loading it, so it is loaded before the model and optimizer."""
    step = save_dir / STEP2
    tree = json.loads((step / "state.json").read_bytes())
    tree["scheduler"]["lr_lambdas"] = [{}, {}]  # one per group, LambdaLR assumes: two for one group is an IndexError
    swap(step, "state.json", json.dumps(tree).encode())
    model, opt, _ = _stepped()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
    before = _snapshot(model, opt)
    with pytest.raises(IncompatibleStateError, match=r"state.json: scheduler state does not load: IndexError"):
        with PreemptibleRun(save_dir, model=model, optimizer=opt, scheduler=sched):
            pass
    _assert_same(before, _snapshot(model, opt))


def test_scheduler_state_that_would_replace_its_optimizer_is_refused(save_dir):
    step = save_dir / STEP2
    tree = json.loads((step / "state.json").read_bytes())
    tree["scheduler"]["optimizer"] = {"param_groups": []}
    tree["scheduler"]["get_last_lr"] = 0
    swap(step, "state.json", json.dumps(tree).encode())
    model, opt, sched = _stepped()
    before = _snapshot(model, opt)
    with pytest.raises(
        IncompatibleStateError, match=r"scheduler state holds get_last_lr, optimizer, which this StepLR"
    ):
        with PreemptibleRun(save_dir, model=model, optimizer=opt, scheduler=sched):
            pass
    assert sched.optimizer is opt
    _assert_same(before, _snapshot(model, opt))


# ================================================================ 4. data that changed


@pytest.mark.parametrize(
    "change, expected", [({"seed": 4}, "seed was 3, now 4"), ({"shuffle": False}, "shuffle was True")]
)
def test_sampler_order_change_is_refused_naming_the_manifest(tmp_path, change, expected):
    """The dataset length is covered by tests/unit/test_run.py; seed and shuffle change the order just as much."""
    with pytest.raises(Preempted):
        train(tmp_path, stop_after=2)
    sampler = ResumableSampler(N, **{"seed": 3, "shuffle": True, **change})
    with pytest.raises(IncompatibleStateError) as e:
        train(tmp_path, sampler=sampler)
    assert f"{tmp_path / STEP2 / 'manifest.json'}: sampler {expected}" in str(e.value)


def order_of_epoch_0() -> list[int]:
    return ResumableSampler(N, seed=3).order(0).tolist()


@pytest.mark.parametrize("new_batch", [3, 5, 16])
def test_batch_size_change_continues_at_the_saved_sample(tmp_path, caplog, new_batch):
    """16 samples done with batches of 8; the rest of the epoch comes once, in order, with batches of ``new_batch``."""
    seen: list[int] = []
    with pytest.raises(Preempted):
        train(tmp_path, seen=seen, stop_after=2)
    with caplog.at_level(logging.WARNING, logger="preempt"):
        train(tmp_path, seen=seen, batch_size=new_batch)
    assert f"the batch size changed (8 -> {new_batch} samples per step): continuing at sample 16" in caplog.text
    assert seen == order_of_epoch_0()


@pytest.mark.parametrize(
    "first_steps, batch, second_steps",
    [(2, 3, 1), (4, 20, None)],
    ids=["16-done-then-batches-of-3-stop-again", "32-done-then-batches-of-20"],
)
def test_batch_size_change_skips_nothing(tmp_path, first_steps, batch, second_steps):
    seen: list[int] = []
    with pytest.raises(Preempted):
        train(tmp_path, seen=seen, stop_after=first_steps)  # batches of 8
    if second_steps is not None:
        with pytest.raises(Preempted):
            train(tmp_path, seen=seen, stop_after=second_steps, batch_size=batch)
    train(tmp_path, seen=seen, batch_size=batch)
    assert seen == order_of_epoch_0()


@pytest.mark.parametrize("saved_world, resumed_world", [(1, 2), (2, 1), (1, 3)])
def test_world_size_change_continues_at_the_saved_global_sample(tmp_path, saved_world, resumed_world):
    """The cursor counts global samples and positions are global, so any number of ranks continues the epoch.

    Without torch.distributed, rank r of a world of W is a run on its own copy of
    the save_dir whose sampler is ResumableSampler(num_replicas=W, rank=r). The
    per-rank batch keeps 8 samples per global step where it divides (24 with 3 ranks:
    the batch-size path then continues at the same sample).
    """
    per_rank = {1: 8, 2: 4, 3: 8}

    def sampler(world: int, rank: int) -> ResumableSampler:
        return ResumableSampler(N, seed=3, num_replicas=world, rank=rank)

    first: list[int] = []
    with pytest.raises(Preempted):
        train(
            tmp_path / "run",
            seen=first,
            stop_after=2,
            batch_size=per_rank[saved_world],
            sampler=sampler(saved_world, 0),
        )
    done = json.loads((tmp_path / "run" / STEP2 / "manifest.json").read_text())["cursor"]["sample"]
    assert done == 2 * per_rank[saved_world] * saved_world == 16
    assert first == sampler(saved_world, 0).order(0).tolist()[:done:saved_world]  # what rank 0 of that world saw
    seen: list[list[int]] = []
    for rank in range(resumed_world):
        d = tmp_path / f"rank{rank}"
        shutil.copytree(tmp_path / "run", d)
        seen.append([])
        train(d, seen=seen[-1], batch_size=per_rank[resumed_world], sampler=sampler(resumed_world, rank))
    rest = sampler(resumed_world, 0).order(0).tolist()[done:]  # padded to a multiple of the world size
    for rank, s in enumerate(seen):
        assert s == rest[rank::resumed_world]
    # Nothing skipped or repeated; with 3 ranks, 2 positions of padding repeat the first samples (as DistributedSampler)
    order = sampler(1, 0).order(0).tolist()
    assert rest == order[done:] + order[: len(rest) - (N - done)]
