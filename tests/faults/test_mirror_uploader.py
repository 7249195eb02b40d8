"""The mirror's uploader, one pass at a time (``run_once``, no thread) against an in-memory store that records every
operation and can be made to fail: the order of a checkpoint's objects, a local file damaged since its commit, a
mirror that fails many passes (one warning, then "reachable again"), retention and debris, the run records
."""

from __future__ import annotations

import dataclasses
import errno
import logging
import shutil
from pathlib import Path

import torch

from preempt import _testing
from preempt.checkpoint.manager import CheckpointManager
from preempt.checkpoint.names import MANIFEST, checkpoint_name
from preempt.checkpoint.retention import RetentionPolicy
from preempt.errors import MirrorError
from preempt.mirror.uploader import Uploader


class MemoryStore:
    """MirrorStore's surface over a dict; ``down`` makes every operation fail as an unreachable server does."""

    display = "mem://bucket/run"

    def __init__(self) -> None:
        self.objects: dict[tuple[int | None, str], bytes] = {}
        self.ops: list[tuple[str, int | None, str]] = []
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise MirrorError(f"mirror: cannot reach {self.display}: ConnectTimeoutError")

    def where(self, step: int | None, name: str = "") -> str:
        return f"{self.display}/{'' if step is None else checkpoint_name(step) + '/'}{name}"

    def steps(self) -> dict[int, dict[str, int]]:
        self._check()
        out: dict[int, dict[str, int]] = {}
        for (step, name), data in self.objects.items():
            if step is not None:
                out.setdefault(step, {})[name] = len(data)
        return out

    def read(self, step: int | None, name: str, limit: int) -> bytes:
        self._check()
        if (step, name) not in self.objects:
            e = MirrorError("missing")
            e.errno = errno.ENOENT
            raise e
        return self.objects[(step, name)][: limit + 1]

    def put(self, local_path: Path, step: int, name: str) -> int:
        self._check()
        self.ops.append(("put", step, name))
        self.objects[(step, name)] = Path(local_path).read_bytes()
        return len(self.objects[(step, name)])

    def put_bytes(self, step: int | None, name: str, data: bytes) -> int:
        self._check()
        self.ops.append(("put", step, name))
        self.objects[(step, name)] = bytes(data)
        return len(data)

    def copy(self, src_step: int, name: str, dst_step: int, size: int = 0) -> None:
        self._check()
        self.ops.append(("copy", dst_step, name))
        self.objects[(dst_step, name)] = self.objects[(src_step, name)]

    def delete(self, step: int, name: str) -> None:
        self._check()
        self.ops.append(("delete", step, name))
        self.objects.pop((step, name), None)

    def delete_step(self, step: int) -> None:
        self._check()
        self.ops.append(("delete_step", step, ""))
        for key in [k for k in self.objects if k[0] == step]:
            del self.objects[key]

    def delete_steps(self, listing: dict[int, dict[str, int]]) -> None:
        for step in listing:
            self.delete_step(step)

    def put_text(self, name: str, data: bytes) -> int:
        return self.put_bytes(None, name, data)


def save(save_dir: Path, steps: list[int], keep_last: int | None = None) -> None:
    """Checkpoints of a small model whose first layer is frozen (base.safetensors, carried after the first)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)  # what trains: without an optimizer nothing is frozen
    manager = CheckpointManager(save_dir, keep_last=keep_last)
    manager.prepare()
    for step in steps:
        with torch.no_grad():
            model[1].weight.add_(1)
        manager.save_state(step=step, model=model, optimizer=opt)
    manager.close()


def uploader(save_dir: Path, store: MemoryStore, keep_last: int | None = None, **kw) -> tuple[Uploader, list]:
    events: list = []
    up = Uploader(
        store,  # type: ignore[arg-type]
        save_dir,
        RetentionPolicy(keep_last=keep_last),
        records=("train.log",),
        on_event=lambda kind, **f: events.append((kind, f)),
        **kw,
    )
    return up, events


def test_data_first_manifest_last_carried_files_copied_records_after(tmp_path):
    save_dir = tmp_path / "run"
    save(save_dir, [2, 4])
    (save_dir / "train.log").write_text("a log\n")
    store = MemoryStore()
    up, events = uploader(save_dir, store)
    up.submit(4)
    assert up.run_once(4)
    ops = store.ops
    for step in (2, 4):
        mine = [op for op in ops if op[1] == step]
        assert mine[-1] == ("put", step, MANIFEST) and len(mine) == 5, mine  # 4 files, the manifest after them
    assert ops.index(("put", 2, MANIFEST)) < ops.index(("put", 4, "model.safetensors"))  # oldest first
    assert ("copy", 4, "base.safetensors") in ops and ("put", 4, "base.safetensors") not in ops
    assert ops[-1] == ("put", None, "train.log")
    assert up.holds() == 4 and up.wait_for(4, 0.0)
    assert [(k, f["uploaded"]) for k, f in events] == [("mirror", 2), ("mirror", 4)]
    assert events[0][1]["copied"] == [] and "base.safetensors" in events[1][1]["copied"]  # (and any identical file)
    assert store.objects[(4, MANIFEST)] == (save_dir / checkpoint_name(4) / MANIFEST).read_bytes()

    # A later save of the same step (another manifest): the mirror's old manifest goes before any new data.
    save(save_dir, [4])
    store.ops.clear()
    up.submit(4)
    assert up.run_once(4)
    assert store.ops[0] == ("delete", 4, MANIFEST) and store.ops[-2] == ("put", 4, MANIFEST), store.ops


def test_a_local_file_damaged_since_its_commit_is_not_uploaded_nor_its_manifest(tmp_path, caplog):
    save_dir = tmp_path / "run"
    save(save_dir, [2])
    path = save_dir / checkpoint_name(2) / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    store = MemoryStore()
    up, _ = uploader(save_dir, store)
    up.submit(2)
    with caplog.at_level(logging.WARNING, logger="preempt"):
        assert up.run_once(2)
        assert up.run_once(2)  # said once; not retried
    assert (2, MANIFEST) not in store.objects and ("put", 2, "model.safetensors") not in store.ops
    said = [r.getMessage() for r in caplog.records if "damaged since its commit" in r.getMessage()]
    assert len(said) == 1 and "model.safetensors: size" in said[0] and "step 2 is not uploaded" in said[0], said
    assert up.holds() is None


def test_unreachable_one_warning_then_caught_up(tmp_path, caplog):
    save_dir = tmp_path / "run"
    save(save_dir, [2, 4, 6], keep_last=2)
    store = MemoryStore()
    now = [100.0]
    up, events = uploader(save_dir, store, keep_last=2, clock=lambda: now[0])
    store.down = True
    with caplog.at_level(logging.INFO, logger="preempt"):
        for step in (2, 4, 6):
            up.submit(step)
            now[0] += 10
            assert not up.run_once(step)
        assert up.failures == 3 and up.behind() == (6, 30.0)
        store.down = False
        now[0] += 5
        assert up.run_once(6)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "training goes on, uploads are retried" in warned[0].getMessage()
    back = [r.getMessage() for r in caplog.records if "reachable again" in r.getMessage()]
    assert back == [
        "mirror mem://bucket/run reachable again after 25 s, 2 checkpoint(s) behind, caught up (it holds step 6)"
    ]
    assert [k for k, _ in events] == ["mirror_down", "mirror", "mirror", "mirror_up"]
    assert up.failures == 0 and up.behind() == (0, 0.0)
    assert up.counts.max_behind_steps == 6 and up.counts.max_behind_s == 35.0  # step 2 waited from t=100 to 135


def test_retention_on_the_mirror_and_debris(tmp_path):
    save_dir = tmp_path / "run"
    save(save_dir, [2, 4, 6, 8], keep_last=None)
    store = MemoryStore()
    store.objects[(3, "model.safetensors")] = b"a dead upload's object"
    up, _ = uploader(save_dir, store, keep_last=2)
    up.submit(8)
    assert up.run_once(8)
    assert sorted(store.steps()) == [6, 8]  # retention keep_last=2; step 3 (no manifest, older) deleted as debris
    assert ("delete_step", 3, "") in store.ops


def test_copy_source_gone_falls_back_to_upload(tmp_path):
    save_dir = tmp_path / "run"
    save(save_dir, [2, 4])
    store = MemoryStore()
    up, _ = uploader(save_dir, store)
    up.submit(2)
    assert up.run_once(2)
    real_copy = store.copy

    def copy_gone(src_step: int, name: str, dst_step: int, size: int = 0) -> None:
        store.objects.pop((src_step, name), None)  # deleted by someone else between the listing and the copy
        e = MirrorError("gone")
        e.errno = errno.ENOENT
        raise e

    store.copy = copy_gone  # type: ignore[method-assign]
    up.submit(4)
    assert up.run_once(4)
    store.copy = real_copy  # type: ignore[method-assign]
    assert ("put", 4, "base.safetensors") in store.ops and up.holds() == 4


def test_a_step_saved_again_during_its_upload_is_uploaded_again_not_called_damaged(tmp_path, caplog):
    """The final save replacing the periodic one of its step while that one is being uploaded (a run whose last step
    is a multiple of checkpoint_every_steps): its files no longer match the manifest being uploaded, which is no
    damage; the new save, submitted when durable, gets a pass of its own and is what the mirror ends up holding."""
    save_dir = tmp_path / "run"
    save(save_dir, [2, 4])
    store = MemoryStore()
    up, _ = uploader(save_dir, store)

    def replace_step_4(stage: str, step: int) -> None:
        if stage == "after_first_object" and step == 4 and not replaced:
            replaced.append(step)
            save(save_dir, [4])  # a new save of step 4 (other tensors), committed over the one being uploaded
            up.submit(4)  # as the run does once it is durable

    replaced: list[int] = []
    _testing.install("upload", replace_step_4)
    try:
        with caplog.at_level(logging.WARNING, logger="preempt"):
            up.start()
            up.submit(4)
            assert up.wait_idle(60.0)
            assert up.wait_for(4, 0.0)  # the save of step 4 that save_dir holds now
    finally:
        _testing.install("upload", None)
        up.close()
    assert replaced == [4]
    assert not [r for r in caplog.records if "damaged" in r.getMessage()], caplog.text
    assert store.objects[(4, MANIFEST)] == (save_dir / checkpoint_name(4) / MANIFEST).read_bytes()
    model = (save_dir / checkpoint_name(4) / "model.safetensors").read_bytes()
    assert store.objects[(4, "model.safetensors")] == model


def test_a_checkpoint_pruned_between_its_check_and_its_upload_is_skipped_and_the_pass_goes_on(tmp_path):
    """keep_last prunes an older checkpoint while the uploader works on it (seen under load: the thread ended with
    FileNotFoundError and the mirror received nothing more): that checkpoint is skipped, the newer one uploaded."""
    save_dir = tmp_path / "run"
    save(save_dir, [2, 4])
    store = MemoryStore()
    real_put = store.put

    def put_after_prune(local_path: Path, step: int, name: str) -> int:
        if step == 2:
            shutil.rmtree(save_dir / checkpoint_name(2))  # pruned by the run meanwhile
        return real_put(local_path, step, name)

    store.put = put_after_prune  # type: ignore[method-assign]
    up, _ = uploader(save_dir, store)
    up.submit(4)
    assert up.run_once(4)
    assert (2, MANIFEST) not in store.objects and up.holds() == 4


# ---------------------------------------------------------------- nodes without a shared save_dir


def split(save_dir: Path, node1: set[str], dirs: list[Path]) -> None:
    """Every checkpoint of ``save_dir`` as two nodes' parts (``node1``'s files on node 1, the rest on node 0), with
    the manifests a distributed commit of nodes apart writes."""
    import dataclasses

    from preempt.checkpoint.files import read_manifest
    from preempt.checkpoint.manifest import Part

    for ckpt in sorted(save_dir.glob("step_*")):
        whole = read_manifest(ckpt / MANIFEST)
        mine = [{n: d for n, d in whole.files.items() if (n in node1) == (k == 1)} for k in (0, 1)]
        parts = [
            dataclasses.replace(whole, files=mine[0], part=Part(0, 2, {n: (1, d) for n, d in mine[1].items()})),
            dataclasses.replace(whole, files=mine[1], part=Part(1, 2)),
        ]
        for d, files, part in zip(dirs, mine, parts, strict=True):
            (d / ckpt.name).mkdir(parents=True)
            for name in files:
                shutil.copy(ckpt / name, d / ckpt.name / name)
            (d / ckpt.name / MANIFEST).write_bytes(part.to_json())


def test_nodes_apart_each_uploads_its_part_and_node_0_the_whole_manifest_once_all_are_up(tmp_path):
    from preempt.mirror.survey import Surveyor

    save(tmp_path / "whole", [2, 4])
    dirs = [tmp_path / "n0", tmp_path / "n1"]
    split(tmp_path / "whole", {"model.safetensors"}, dirs)
    store = MemoryStore()
    (up0, _), (up1, events1) = uploader(dirs[0], store, node=0), uploader(dirs[1], store, node=1)

    # Node 0 first: its files go up, not the manifest, and it says which node's files are missing.
    up0.submit(4)
    assert up0.run_once(4)
    assert (2, MANIFEST) not in store.objects and (4, MANIFEST) not in store.objects
    assert up0.lagging(4) == "node 1 has not uploaded model.safetensors" and not up0.wait_for(4, 0.0)
    assert not any(name == "model.safetensors" for _, _, name in store.ops)

    # Node 1: its part's files only (never a manifest, never a record), then node 0 completes both steps.
    store.ops.clear()
    up1.submit(4)
    assert up1.run_once(4)
    note = "node_00001.part.json"  # after each step's files: the note that this save's part is up
    assert store.ops == [(k, s, n) for s in (2, 4) for k, n in (("put", "model.safetensors"), ("put", note))]
    assert up1.wait_for(4, 0.0) and [k for k, _ in events1] == ["mirror_part", "mirror_part"]
    store.ops.clear()
    assert up0.run_once(4)
    assert ("put", 4, MANIFEST) in store.ops and not any(n == "model.safetensors" for _, _, n in store.ops)
    assert up0.lagging(4) == "" and up0.wait_for(4, 0.0)
    whole = Surveyor(store).survey().manifests[4]  # type: ignore[arg-type]
    assert whole.part is None and whole.files == CheckpointManager(tmp_path / "whole").list()[0].valid.files


def test_a_part_an_earlier_process_wrote_is_not_uploaded(tmp_path):
    """A part whose save the mirror never completed belongs to a timeline the resumed run left: a node uploads only
    the parts written since it started (its own process's)."""
    save(tmp_path / "whole", [2])
    dirs = [tmp_path / "n0", tmp_path / "n1"]
    split(tmp_path / "whole", {"model.safetensors"}, dirs)
    store = MemoryStore()
    up1, _ = uploader(dirs[1], store, node=1)
    up1.since = 1e11  # started after every save
    up1.submit(2)
    assert up1.run_once(2) and store.ops == []


def test_a_step_saved_again_is_not_made_whole_from_the_other_node_objects_of_the_earlier_save(tmp_path):
    """The final save of a step that a periodic save wrote too: the other node's objects of the earlier save have the
    same names and sizes; node 0 publishes the new save's manifest only once that node's note names the new save."""
    from preempt.mirror.survey import Surveyor

    dirs = [tmp_path / "n0", tmp_path / "n1"]
    store = MemoryStore()
    (up0, _), (up1, _) = uploader(dirs[0], store, node=0), uploader(dirs[1], store, node=1)
    save(tmp_path / "whole", [2])
    split(tmp_path / "whole", {"model.safetensors"}, dirs)
    for up in (up0, up1, up0):
        up.submit(2)
        assert up.run_once(2)
    first = Surveyor(store).survey().manifests[2]  # type: ignore[arg-type]

    for d in [tmp_path / "whole", *dirs]:  # the step saved again (another time, the same names and sizes)
        shutil.rmtree(d)
    save(tmp_path / "whole", [2])
    split(tmp_path / "whole", {"model.safetensors"}, dirs)
    up0.submit(2)
    assert up0.run_once(2)
    assert Surveyor(store).survey().manifests.get(2) is None  # the old manifest deleted first, no new one yet
    assert up0.lagging(2) == "node 1 has not uploaded node_00001.part.json"
    up1.submit(2)
    assert up1.run_once(2) and up0.run_once(2)
    second = Surveyor(store).survey().manifests[2]  # type: ignore[arg-type]
    assert (
        second.created != first.created and second.files == CheckpointManager(tmp_path / "whole").list()[0].valid.files
    )
    assert (
        store.objects[(2, "model.safetensors")]
        == (tmp_path / "whole" / checkpoint_name(2) / "model.safetensors").read_bytes()
    )


def test_a_local_error_fails_one_pass_said_once_and_the_next_pass_uploads(tmp_path, caplog, monkeypatch):
    """The uploader's thread ended on any unexpected local error, and the mirror received nothing more in that
    process. A local error now fails the pass, said once with its type, and the next pass retries."""
    save_dir = tmp_path / "run"
    save(save_dir, [2])
    store = MemoryStore()
    up, _ = uploader(save_dir, store)
    real, calls = up._local, []

    def failing(target):
        calls.append(target)
        if len(calls) <= 2:
            raise MemoryError("cannot allocate the manifest")
        return real(target)

    monkeypatch.setattr(up, "_local", failing)
    up.submit(2)
    with caplog.at_level(logging.WARNING, logger="preempt"):
        assert not up.run_once(2) and not up.run_once(2)
        assert up.run_once(2)
    said = [r.getMessage() for r in caplog.records if "local error" in r.getMessage()]
    assert said == [
        "the mirror's uploader met a local error (MemoryError: cannot allocate the manifest); training goes on,"
        " the upload is retried"
    ]
    assert (2, MANIFEST) in store.objects and up.local_error is None


def test_a_forged_step_claiming_the_bytes_the_run_will_write_is_never_a_copy_source(tmp_path):
    """A forged step listing model.safetensors with the size and digest the run's next checkpoint will have made the
    uploader copy the forged object server-side instead of uploading: the mirror held junk under a manifest that said
    otherwise. Only steps this process uploaded (or pulled and checked) are copy sources."""
    from preempt.checkpoint.files import read_manifest

    save_dir = tmp_path / "run"
    save(save_dir, [2, 4])
    store = MemoryStore()
    genuine = read_manifest(save_dir / checkpoint_name(4) / MANIFEST)
    for name, digest in genuine.files.items():  # step 3: every file claimed with step 4's digests, junk bytes
        store.objects[(3, name)] = b"\0" * digest.size
    forged = dataclasses.replace(genuine, step=3)
    store.objects[(3, MANIFEST)] = forged.to_json()
    shutil.rmtree(save_dir / checkpoint_name(2))  # (only step 4 to upload: no step of this process to copy from)
    up, _ = uploader(save_dir, store)
    up.submit(4)
    assert up.run_once(4)
    assert not [op for op in store.ops if op[0] == "copy"], store.ops
    for name in genuine.files:
        assert store.objects[(4, name)] == (save_dir / checkpoint_name(4) / name).read_bytes(), name


def test_a_part_another_node_wrote_in_this_save_dir_is_left_alone(tmp_path):
    """Which node a machine is, is the rendezvous's to say: a requeued job may make rank 0 of the machine that was
    node 1, whose save_dir holds node 1's parts. Node 0's uploader read every local part as its own, its whole
    manifest raised, and every pass failed; now a part of another node is not this uploader's."""
    save(tmp_path / "whole", [2, 4])
    dirs = [tmp_path / "n0", tmp_path / "n1"]
    split(tmp_path / "whole", {"model.safetensors"}, dirs)
    shutil.rmtree(dirs[0] / checkpoint_name(4))
    shutil.copytree(dirs[1] / checkpoint_name(4), dirs[0] / checkpoint_name(4))  # node 1's part, on this disk
    store = MemoryStore()
    up0, _ = uploader(dirs[0], store, node=0)
    up0.submit(4)
    assert up0.run_once(4) and up0.local_error is None
    assert ("put", 2, "base.safetensors") in store.ops and not [op for op in store.ops if op[1] == 4], store.ops
