"""Hostile files, round 2: hard links, outputs inside the save_dir, resource errors taken for damage.

Each case builds a hostile save_dir from a real run's (test_bad_input's: checkpoints of steps 1 and 2) and hands it to
:func:`sweep`, which runs every command of the command line and a resume (``tests/scripts/every_command.py``) in a
real process twice, in parallel: as root, and with privileges dropped (uid 0 without capabilities, ``setpriv
--inh-caps=-all --bounding-set=-all``, so that permission bits hold as for any user). In both: no traceback, no
hang (a timeout), exit codes from the documented set, nothing outside the save_dir changed, and no checkpoint that
verified before the sweep moved or deleted. Then each case asserts what it is about.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import test_bad_input
import torch
from helpers import run_python
from test_bad_input import STEP1, STEP2, build, tree_of
from torch.utils.data import DataLoader

from preempt import CheckpointManager, PreemptibleRun
from preempt.checkpoint import safe_io
from preempt.checkpoint.lock import DirLock, LockedError, LockLostError
from preempt.cli import main as cli
from preempt.health.history import History

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "every_command.py"
DROP = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"]  # uid 0 without capabilities: permission bits hold
EXIT_UNREADABLE = 4  # preempt.cli.output.EXIT_UNREADABLE (main has no such code: taken by value)
CODES = {0, 1, 2, 3, EXIT_UNREADABLE}
PRECIOUS = "someone else's data\n"

pytestmark = pytest.mark.timeout(240)

# test_bad_input's save_dir (checkpoints of steps 1 and 2), registered here under its own names
template, save_dir = test_bad_input.template, test_bad_input.save_dir


@functools.cache
def _setpriv_works() -> str | None:
    """Why privileges cannot be dropped here, or None."""
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    r = subprocess.run([*DROP, "true"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"setpriv cannot drop capabilities here: {r.stderr.strip()}"


needs_setpriv = pytest.mark.skipif(_setpriv_works() is not None, reason=str(_setpriv_works()))


def verified(save_dir: Path) -> set[str]:
    """The checkpoints whose every file verifies (read as root, in this process)."""
    m = CheckpointManager(save_dir, owner=False)
    return {c.name for c in m.list() if c.status == "valid" and not m.verify(c)}


def outside_of(root: Path, *inside: Path) -> dict[str, Any]:
    """Everything under ``root`` except the trees ``inside`` (kind, content, mtime)."""
    skip = [str(p.relative_to(root)) for p in inside]
    return {k: v for k, v in tree_of(root).items() if not any(k == s or k.startswith(s + "/") for s in skip)}


def sweep(
    make: Callable[[Path], Path],
    tmp_path: Path,
    *,
    modes: tuple[str, ...] = ("root", "dropped"),
    set_aside: frozenset[str] = frozenset(),
    env: dict[str, str] | None = None,
) -> dict:
    """Builds the case once per mode (``make(root) -> save_dir``) and runs every command and the resume on it.

    ``set_aside``: checkpoints whose files verify but whose content the resume refuses (forged state): they may be
    quarantined; any other checkpoint that verified must stay where it was. ``env``: variables set for the commands
    and the resume (on top of this process's environment).

    Returns ``{mode: {"doc": what every_command.py printed, "dir": the save_dir, "cmd": {name: result}}}``.
    """
    if "dropped" in modes and (why := _setpriv_works()) is not None:
        pytest.skip(why)
    cases = {}
    for mode in modes:
        root = tmp_path / mode
        root.mkdir()
        d = make(root)
        out = root / "out"
        out.mkdir()
        cases[mode] = (root, d, out, outside_of(root, d, out), verified(d))
    commands = {
        mode: [*(DROP if mode == "dropped" else []), sys.executable, str(SCRIPT), str(d), str(out)]
        for mode, (_, d, out, _, _) in cases.items()
    }
    run_env = None if env is None else {**os.environ, **env}
    # Both modes at once; as root the process is forked from a server that has torch (helpers.run_python), dropped
    # it starts fresh under setpriv.
    with ThreadPoolExecutor(len(modes)) as pool:
        futures = {
            mode: pool.submit(run_python, argv, env=run_env, timeout=180, errors="replace")
            for mode, argv in commands.items()
        }
    results = {}
    for mode, (root, d, out, before, good) in cases.items():
        try:
            r = futures[mode].result()
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{mode}: hung; its last lines: {str(e.stderr or '')[-2000:]}")
        stdout, stderr = r.stdout, r.stderr
        assert r.returncode == 0 and "Traceback" not in stderr + stdout, (mode, stderr[-4000:])
        doc = json.loads(stdout.strip().splitlines()[-1])
        for c in doc["commands"]:
            assert "traceback" not in c, (mode, c["argv"], c["traceback"])
            assert c["rc"] in CODES, (mode, c)
        assert "traceback" not in doc.get("resume", {}), (mode, doc["resume"]["traceback"])
        assert outside_of(root, d, out) == before, f"{mode}: something outside the save_dir changed"
        still = {name for name in good if (d / name / "manifest.json").is_file()}
        gone = good - still - set_aside
        assert not gone, f"{mode}: checkpoints that verified were moved or deleted: {sorted(gone)}"
        key = [" ".join(c["argv"][:1] + [a for a in c["argv"][2:] if a.startswith("--")]) for c in doc["commands"]]
        results[mode] = {"doc": doc, "dir": d, "cmd": dict(zip(key, doc["commands"], strict=True)), "root": root}
    return results


def copy_of(template: Path, root: Path, name: str = "run") -> Path:
    d = root / name
    shutil.copytree(template, d, symlinks=True)
    return d


def precious(root: Path) -> Path:
    """A file of someone else's, outside the save_dir."""
    f = root / "elsewhere" / "precious.txt"
    f.parent.mkdir()
    f.write_text(PRECIOUS)
    return f


def resumed(result: dict, step: str = STEP2) -> None:
    r = result["doc"]["resume"]
    assert r.get("resumed_from") == str(result["dir"] / step), r


# ---------------------------------------------------------------- hard links: nothing written through them


@pytest.mark.parametrize(
    "name",  # the lock and one appended log in the default suite; the others are the same path, under -m slow
    ["lock", *(pytest.param(n, marks=pytest.mark.slow) for n in ("lock.step", "history.jsonl", "supervise.log")),
     "train.log"],
)  # fmt: skip
def test_a_file_of_the_run_hard_linked_to_a_file_elsewhere_is_never_written_through(template, tmp_path, name):
    """O_NOFOLLOW stops symlinks, not hard links: the file gets a copy of its own, the other name stays as it was."""

    def make(root: Path) -> Path:
        d = copy_of(template, root)
        (d / name).unlink(missing_ok=True)
        os.link(precious(root), d / name)
        return d

    for mode, r in sweep(make, tmp_path).items():
        assert (r["root"] / "elsewhere" / "precious.txt").read_text() == PRECIOUS  # (sweep checked it too)
        assert os.stat(r["dir"] / name).st_nlink == 1, mode
        resumed(r)
        if name in ("train.log", "history.jsonl", "supervise.log"):  # the old lines kept, the new ones added
            text = (r["dir"] / name).read_text(errors="replace")
            assert text.startswith(PRECIOUS) and len(text) > len(PRECIOUS), (mode, text[:300])


def test_a_cp_al_copy_of_a_run_directory_leaves_the_original_untouched(template, tmp_path):
    """``cp -al run1 run2``: every file of run2 is a hard link to run1's; a run in run2 writes none of run1's."""

    def make(root: Path) -> Path:
        original = copy_of(template, root, "run1")
        (original / "supervise.log").write_text("run1's supervisor\n")
        subprocess.run(["cp", "-al", str(original), str(root / "run2")], check=True)
        return root / "run2"

    for mode, r in sweep(make, tmp_path).items():
        resumed(r)  # run1 is outside the save_dir: sweep checked that not a byte or an mtime of it changed
        for name in ("lock", "lock.step", "train.log", "history.jsonl", "supervise.log"):
            assert os.stat(r["dir"] / name).st_nlink == 1, (mode, name)


def test_a_cp_al_copy_of_a_running_run_is_recognised_not_taken_for_a_run_in_use(template, tmp_path):
    """While run1's training holds its lock, run2's lock file is the same file: run2 is refused with what to do
    (remove the lock file), not told it is in use; once removed, run2 resumes and run1's lock is still held."""
    holders = []

    def make(root: Path) -> Path:
        original = copy_of(template, root, "run1")
        code = (
            "import sys; from preempt.checkpoint.lock import DirLock; "
            f"DirLock({str(original)!r}, purpose='run1 training').acquire(); print('held', flush=True)\n"
            "sys.stdin.read()  # held until the test closes stdin"
        )
        holder = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        holders.append(holder)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        subprocess.run(["cp", "-al", str(original), str(root / "run2")], check=True)
        return root / "run2"

    try:
        for mode, r in sweep(make, tmp_path).items():
            hint = "is a hard link to the lock file of another directory"
            assert r["doc"]["resume"]["error"] == "LockedError" and hint in r["doc"]["resume"]["message"], mode
            prune = r["cmd"]["prune --keep-last --yes"]
            assert prune["rc"] == cli.EXIT_LOCKED and hint in prune["err"], (mode, prune)
            (r["dir"] / "lock").unlink()
            with PreemptibleRun(r["dir"], model=build(seed=7)[0], checkpoint_interval=None) as run:
                assert run.resumed_from == r["dir"] / STEP2
            with pytest.raises(LockedError, match="run1 training"):  # the original is still locked by its run
                DirLock(r["root"] / "run1").acquire()
    finally:
        for h in holders:
            h.communicate("")


def test_a_copied_lock_names_its_directory_so_a_copy_is_neither_a_crash_here_nor_held(tmp_path):
    """``cp -a`` of a run directory whose run is alive: its lock content names the holder. With record locks the
    copy's run does not report a holder that died here; without them (Lustre), it is not refused as held."""
    (tmp_path / "run1").mkdir()
    original = DirLock(tmp_path / "run1", use_record_locks=False)
    original.acquire()
    try:
        before = (tmp_path / "run1" / "lock").read_bytes()
        for name in ("run2", "run3"):
            shutil.copytree(tmp_path / "run1", tmp_path / name)
        with DirLock(tmp_path / "run2", use_record_locks=False) as copy:  # on main: LockedError, the pid is alive
            assert copy.previous == {}
        with DirLock(tmp_path / "run3") as copy:
            assert copy.previous == {}  # on main: run1's live holder, taken for one that died holding run3
        assert (tmp_path / "run1" / "lock").read_bytes() == before
    finally:
        original.release()


def test_a_save_dir_replaced_under_a_running_run_gets_no_checkpoint_from_it(template, tmp_path):
    """``mv run run.old; cp -a run.old run`` while a run trains in ``run``: its lock is in run.old now and another
    run may lock ``run``; the stop's checkpoint is refused (LockLostError, saying why) instead of written into
    ``run``, and nothing is written there (not exit 74 after a temporary directory was written)."""
    d = copy_of(template, tmp_path)
    model, opt, sched, data = build()
    with pytest.raises(LockLostError) as stop:
        with PreemptibleRun(d, model=model, optimizer=opt, scheduler=sched, checkpoint_interval=None) as run:
            sampler = run.sampler(data, seed=3)
            for _ in run.epochs(1):
                for x, y in run.batches(DataLoader(data, batch_size=8, sampler=sampler)):
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                    if run.global_step == 3:
                        os.rename(d, d.with_name("run.old"))
                        shutil.copytree(d.with_name("run.old"), d, symlinks=True)
                        os.kill(os.getpid(), signal.SIGTERM)  # a real signal: the stop saves at this boundary
                    run.step()
    assert sorted(p.name for p in d.glob("step_*")) == [STEP1, STEP2]  # before: step_000000004 committed here
    assert f"{d} was replaced under this run (it locked directory inode" in str(stop.value)
    assert "is a copy of this run's own lock file (the directory was copied)" in str(stop.value)
    assert stop.value.expected["dir"] != stop.value.found["dir"], (stop.value.expected, stop.value.found)
    assert not [p.name for p in d.iterdir() if p.name.startswith(".")], "nothing of the stop's save was written"


# ---------------------------------------------------------------- outputs inside the save_dir


@pytest.mark.parametrize(
    "argv",
    [
        ["export", "{d}", "--out", "{d}/step_000000002/model.safetensors", "--force"],
        ["export", "{d}", "--out", "{d}/lock", "--force"],
        ["export", "{d}", "--out", "{alias}/new.safetensors"],
        ["report", "{d}", "--plot", "{d}/timeline.png"],
        ["supervise", "--save-dir", "{d}", "--log", "{d}/train.log", "--", "true"],
    ],
    ids=["export-over-a-checkpoint-file", "export-over-the-lock", "export-through-a-symlink", "report-plot", "log"],
)
def test_an_output_inside_the_save_dir_is_refused(save_dir, tmp_path, argv):
    """A checkpoint's file or the lock written over (``--force`` renames over it) would be lost: exit 2, nothing
    written, for root and with privileges dropped."""
    with History(save_dir) as history:  # metrics to plot: without them, report --plot has nothing to write
        history.record(2, 0, {"loss": 0.5})
    alias = tmp_path / "alias"
    alias.symlink_to(save_dir)
    args = [a.format(d=save_dir, alias=alias) for a in argv]
    (save_dir / "lock").touch()
    before = tree_of(save_dir)
    for prefix in [[]] + ([DROP] if _setpriv_works() is None else []):
        r = subprocess.run([*prefix, sys.executable, "-m", "preempt", *args], capture_output=True, text=True)
        assert r.returncode == cli.EXIT_USAGE and "Traceback" not in r.stderr, (prefix, r.stderr)
        assert re.search(r"is inside (the save_dir|--save-dir)", r.stderr), r.stderr  # the refusal the user reads
        assert tree_of(save_dir) == before  # on main: the file replaced, the checkpoint damaged, a plot added
    assert verified(save_dir) == {STEP1, STEP2}


# ---------------------------------------------------------------- resource errors are not damage


@pytest.mark.parametrize(
    "target",  # a tensor file in the default suite; the manifest and the directory under -m slow
    [f"{STEP2}/model.safetensors", *(pytest.param(t, marks=pytest.mark.slow) for t in (f"{STEP2}/manifest.json",
                                                                                       STEP2))],
)  # fmt: skip
@needs_setpriv
def test_a_checkpoint_that_may_not_be_read_is_unreadable_not_damaged(template, tmp_path, target):
    """chmod 000 on a file (or the directory) of the newest checkpoint. Root reads it: all as usual. Without
    privileges: verify says UNREADABLE (exit 4), not DAMAGED; the resume stops with an error naming the path
    (exit 1) instead of quarantining step 2 and going back to step 1; nothing is moved."""

    def make(root: Path) -> Path:
        d = copy_of(template, root)
        os.chmod(d / target, 0)
        return d

    if os.geteuid() != 0:
        pytest.skip("compares root, who may read a file of mode 000, with dropped privileges: run as root")
    results = sweep(make, tmp_path)
    root, dropped = results["root"], results["dropped"]
    resumed(root)
    assert root["cmd"]["verify"]["rc"] == cli.EXIT_OK
    assert dropped["cmd"]["verify"]["rc"] == EXIT_UNREADABLE, dropped["cmd"]["verify"]
    assert "UNREADABLE" in dropped["cmd"]["verify"]["out"] and "Permission denied" in dropped["cmd"]["verify"]["out"]
    checked = json.loads(dropped["cmd"]["verify --json"]["out"])
    assert {c["name"]: c["status"] for c in checked["checkpoints"]} == {STEP2: "unreadable", STEP1: "valid"}
    for name in ("inspect", "export --out"):  # latest: step 2, which cannot be read; never step 1 in its place
        assert dropped["cmd"][name]["rc"] == EXIT_UNREADABLE, (name, dropped["cmd"][name])
    r = dropped["doc"]["resume"]
    assert r.get("error") == "CheckpointUnreadableError", r
    assert str(dropped["dir"] / STEP2) in r["message"] and "Permission denied" in r["message"], r
    assert not (dropped["dir"] / "quarantine").exists()


def test_a_file_larger_than_the_address_space_left_verifies_streamed_and_is_never_quarantined(tmp_path):
    """RLIMIT_AS below the size of model.safetensors: the private mapping is refused (ENOMEM). verify hashes it
    streamed and says ok; the resume, which needs it in memory, stops with an error (exit 1) and moves nothing."""
    d = tmp_path / "big"
    torch.manual_seed(0)
    model = torch.nn.Linear(8192, 8192, bias=False)  # 256 MiB
    CheckpointManager(d).save_state(step=1, model=model)
    del model
    # One malloc arena: glibc reserves 64 MiB of address space for each arena a new thread may open, a number that
    # depends on how the threads met, so a loaded machine could leave the run no room for its threads' stacks.
    limit = (
        "import ctypes, resource\n"
        "ctypes.CDLL(None).mallopt(-8, 1)  # M_ARENA_MAX\n"
        "vm = next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmSize:')) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (192 << 20),) * 2)  # 192 MiB more than now: less than the file\n"
    )
    verify = (
        "import sys\nfrom preempt.cli.main import main\nimport preempt.cli.checkpoints, preempt.checkpoint.tensorfile\n"
        f"{limit}sys.exit(main(['verify', {str(d)!r}]))\n"
    )
    r = subprocess.run([sys.executable, "-c", verify], capture_output=True, text=True, timeout=120)
    assert r.returncode == cli.EXIT_OK and "ok (3 files, 256.0 MiB)" in r.stdout, (r.stdout, r.stderr)
    resume = (
        "import sys, torch\nfrom preempt import PreemptibleRun\nfrom preempt.errors import PreemptError\n"
        "model = torch.nn.Linear(8192, 8192, bias=False)\n"
        f"{limit}"
        "try:\n"
        f"    with PreemptibleRun({str(d)!r}, model=model, checkpoint_interval=None, async_save=False):\n"
        "        pass\n"
        "except PreemptError as e:\n"
        "    print(f'{type(e).__name__}: {e}')\n"
        "    sys.exit(1)\n"
    )
    r = run_python([sys.executable, "-c", resume], timeout=180)
    assert r.returncode == 1 and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    assert r.stdout.startswith("CheckpointUnreadableError: ") and "model.safetensors" in r.stdout, r.stdout
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("step_")) == ["step_000000001"]
    assert not (d / "quarantine").exists()  # on main: quarantined, and the run started fresh


def test_too_many_open_files_is_said_as_such_not_a_traceback(save_dir):
    """The descriptor table full (EMFILE) when ``verify`` starts: exit 4 naming the cause."""
    code = (
        "import os, sys\nfrom preempt.cli.main import main\nimport preempt.cli.checkpoints\nfds = []\n"
        "try:\n    while True:\n        fds.append(os.open('/dev/null', os.O_RDONLY))\nexcept OSError:\n    pass\n"
        f"sys.exit(main(['verify', {str(save_dir)!r}]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_UNREADABLE and "Traceback" not in r.stderr, r.stderr
    assert "Too many open files" in r.stderr and str(save_dir) in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("error", "resource"),
    [
        (PermissionError(errno.EACCES, "Permission denied"), True),
        (OSError(errno.EPERM, "Operation not permitted"), True),
        (OSError(errno.ENOMEM, "Cannot allocate memory"), True),
        (MemoryError(), True),
        (OSError(errno.EMFILE, "Too many open files"), True),
        (OSError(errno.ENFILE, "Too many open files in system"), True),
        (OSError(errno.EIO, "Input/output error"), True),
        (OSError(errno.EAGAIN, "Resource temporarily unavailable"), True),
        (OSError(errno.ESTALE, "Stale file handle"), True),
        (FileNotFoundError(errno.ENOENT, "No such file or directory"), False),
        (OSError(errno.ELOOP, "Too many levels of symbolic links"), False),
        (OSError(errno.EISDIR, "Is a directory"), False),
        (safe_io.UnsafeFileError("x", "a regular file", "a FIFO"), False),
        (ValueError("xxh3 mismatch"), False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_resource_errors_are_told_apart_from_damage_in_one_place(error, resource):
    assert safe_io.resource_error(error) is resource


# ---------------------------------------------------------------- quarantine: never deleted


def test_a_damaged_checkpoint_that_cannot_go_to_quarantine_is_set_aside_never_deleted(template, tmp_path):
    """``quarantine`` is a file, so the damaged step 2 cannot be moved there. It is renamed in place (out of
    discovery's sight), and the save of step 2 that follows the fallback to step 1 never deletes it."""

    def damage(d: Path) -> bytes:
        f = d / STEP2 / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
        (d / "quarantine").write_text("not a directory\n")
        return bytes(data)

    def make(root: Path) -> Path:
        d = copy_of(template, root)
        damage(d)
        return d

    for mode, r in sweep(make, tmp_path).items():
        resumed(r, STEP1)
        aside = [p for p in r["dir"].iterdir() if p.name.startswith(f"quarantined-{STEP2}-")]
        assert len(aside) == 1, (mode, sorted(p.name for p in r["dir"].iterdir()))

    d = copy_of(template, tmp_path, "train")
    bad = damage(d)
    test_bad_input.train(d, checkpoint_every_steps=1, keep_last=None, async_save=False)  # saves steps 2, 3, ...
    aside = [p for p in d.iterdir() if p.name.startswith(f"quarantined-{STEP2}-")]
    assert len(aside) == 1 and (aside[0] / "model.safetensors").read_bytes() == bad  # on main: deleted
    assert (d / "quarantine").read_text() == "not a directory\n"


def test_a_replaced_checkpoint_that_was_not_a_valid_one_is_set_aside_not_deleted(template, tmp_path):
    """A step_N that is not a valid checkpoint (its manifest broken) and still in place, because nothing has loaded
    yet or it could not be moved, is set aside by a save of step N that replaces it, never deleted as a replaced
    copy: only a checkpoint the manager knows valid is."""
    d = copy_of(template, tmp_path)
    (d / STEP2 / "manifest.json").write_text("{broken")
    m = CheckpointManager(d, keep_last=None)
    info = m.save_state(step=2, model=build()[0])
    m.close()
    assert info.path == d / STEP2 and verified(d) == {STEP1, STEP2}
    aside = list((d / "quarantine").iterdir()) if (d / "quarantine").is_dir() else []
    assert [p.name for p in aside] == [STEP2] and (aside[0] / "manifest.json").read_text() == "{broken"


def test_verify_of_a_damaged_and_an_unreadable_checkpoint_says_each(template, tmp_path):
    """Damage wins the exit code (1); the unreadable one is still named as unreadable, not damaged."""
    d = copy_of(template, tmp_path)
    f = d / STEP1 / "state.json"
    f.write_bytes(f.read_bytes()[:-1] + b" ")
    os.chmod(d / STEP2 / "model.safetensors", 0)
    if _setpriv_works() is not None:
        pytest.skip(str(_setpriv_works()))
    r = subprocess.run([*DROP, sys.executable, "-m", "preempt", "verify", str(d)], capture_output=True, text=True)
    assert r.returncode == cli.EXIT_DAMAGED and "Traceback" not in r.stderr, r.stderr
    assert f"{STEP2}: UNREADABLE" in r.stdout and f"{STEP1}: DAMAGED" in r.stdout, r.stdout  # what verify says
