"""Checkpoints that share files, with real processes and real signals: pruning, recycling and quarantine
must each leave every kept checkpoint whole although its frozen base is one inode with other checkpoints'.

The training: train.py --lora (a frozen base of ~1.1 MiB with adapters inside it), a synchronous checkpoint at every
step, ``keep_last=2`` and ``carry_limit=3``. Within one process the base is then written at the first save and at
every third one after it, and linked by the two between, so that the checkpoints go, step by step (seen on disk):

    after step 6:  kept 6, 5 (the base of step 4, pruned) and 3 (the base of step 1, pruned), the one that shares
                   nothing with the newest; step 4's files wait in a pool to be written over, its base linked by 5, 6
    after step 7:  step 7 writes its base afresh, into step 4's pool; kept 7, 6

Every test reaches its state by step-based holds (``--hold_at``), never by timing.
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import PREEMPTED, Spawned, assert_same_final, flip_bit, in_step, run_interrupted, train_cmd
from helpers.kept import assert_kept_equal_live

from preempt.checkpoint.recycle import PREFIX as POOL
from preempt.cli.main import main as cli

MODEL = ["--lora", "--width", "512", "--epochs", "2", "--samples", "128"]  # 16 steps, a base of ~1.1 MiB
ARGS = [*MODEL, "--every_steps", "1", "--keep_last", "2", "--carry_limit", "3", "--sync_save"]
BASE, STATE, MODEL_FILE = "base.safetensors", "state.safetensors", "model.safetensors"


def kept(save_dir: Path) -> list[Path]:
    """The checkpoints in save_dir, newest first."""
    return sorted(save_dir.glob("step_*"), reverse=True)


def step_of(ckpt: Path) -> int:
    return int(ckpt.name.split("_")[1])


def manifest_files(ckpt: Path) -> dict[str, dict]:
    return json.loads((ckpt / "manifest.json").read_text())["files"]


def origin(ckpt: Path, name: str) -> int:
    """The step whose save wrote the bytes of ``ckpt/name``, as its manifest says (what retention decides by)."""
    carried_from = manifest_files(ckpt)[name].get("carried_from")
    return step_of(ckpt) if carried_from is None else carried_from


def inode(path: Path) -> int:
    return os.stat(path).st_ino


def names_in(save_dir: Path) -> Counter[int]:
    """How many names every inode has under save_dir (checkpoints, pools, quarantine, leftovers)."""
    return Counter(os.stat(p).st_ino for p in save_dir.rglob("*") if p.is_file() and not p.is_symlink())


def assert_sound(save_dir: Path, *, settled: bool = True) -> list[Path]:
    """Every kept checkpoint is whole and the shared files are booked as they lie on disk; returns them, newest first.

    * ``preempt verify``: every file of every kept checkpoint has its manifest's size and xxh3 (a pruned, recycled
      or quarantined checkpoint that wrote into, truncated or deleted a file it shared fails here);
    * two kept checkpoints hold one inode under a name exactly when their manifests give that file one origin
      (``carried_from``): retention's "shares nothing" is decided from the manifests, so a wrong origin would
      keep, as the one to fall back to, a checkpoint that shares the damaged inode;
    * each file's link count is the number of its names under save_dir: no name of it elsewhere (a staging or
      temporary link) that a later write through that name could reach. Only once no process runs (``settled``):
      a running one's background deleter may be unlinking a pruned checkpoint's names meanwhile.
    """
    assert cli(["verify", str(save_dir)]) == 0, f"a kept checkpoint of {save_dir} does not verify"
    ckpts = kept(save_dir)
    names = names_in(save_dir) if settled else None
    for i, a in enumerate(ckpts):
        for name in manifest_files(a):
            st = os.stat(a / name)
            if names is not None:
                assert st.st_nlink == names[st.st_ino], (a / name, st.st_nlink, names[st.st_ino])
            for b in ckpts[i + 1 :]:
                if name in manifest_files(b):
                    same_inode = inode(a / name) == inode(b / name)
                    origins = origin(a, name), origin(b, name)
                    assert same_inode == (origins[0] == origins[1]), (a.name, b.name, name, same_inode, origins)
    return ckpts


def shares(a: Path, b: Path) -> bool:
    """``a`` and ``b`` hold one inode under some name."""
    return bool({inode(f) for f in a.iterdir()} & {inode(f) for f in b.iterdir()})


@pytest.fixture
def held(tmp_path: Path) -> Iterator[Callable[[int], Spawned]]:
    """``held(k)``: the training (on tmp_path/run), holding inside its own k-th step (helpers.in_step) until the
    test signals it. A process still running when the test ends (a failed assert) is killed."""
    procs: list[Spawned] = []

    def start(step: int) -> Spawned:
        it = in_step(step)
        p = Spawned(train_cmd(tmp_path / "run", tmp_path / "final.safetensors", [*ARGS, *it.args]))
        procs.append(p)
        assert p.wait_event(it.after.kind, **it.after.fields), p.output
        return p

    yield start
    for p in procs:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()


def stop(p: Spawned) -> str:
    p.signal(signal.SIGTERM)
    assert p.finish() == PREEMPTED, p.output
    return p.output


def test_pruning_never_breaks_a_kept_checkpoint_and_keeps_one_sharing_nothing(tmp_path, reference):
    """Three SIGTERMs (steps 7, 11, 14) and the rerun; after each process every kept checkpoint verifies, including
    those whose base was linked from a checkpoint pruned since, and one of them shares no inode with the newest.

    Would catch: pruning that deletes or truncates a file instead of unlinking its name (the kept links break), and
    retention that keeps only the newest ``keep_last`` when they all share the newest's base (nothing to fall back
    to when that one inode is damaged)."""
    save_dir = tmp_path / "run"
    seen = Counter()
    live = reference.recorded(MODEL)  # the live state at each step (the resumes are bit-exact: asserted below)

    def check(_: int) -> None:
        ckpts = assert_sound(save_dir)
        assert_kept_equal_live(save_dir, live, at_least=len(ckpts))  # each kept one holds its step's tensors
        newest, older = ckpts[0], ckpts[1:]
        assert any(not shares(newest, c) for c in older), ([c.name for c in ckpts], "all share with the newest")
        steps = {step_of(c) for c in ckpts}
        # a kept base linked from a checkpoint pruned meanwhile (verified whole above)
        seen["source pruned"] += any(origin(c, BASE) not in steps for c in ckpts)
        # the newest carries its base and every one of the keep_last newest shares it: retention had to keep more
        seen["kept apart"] += origin(newest, BASE) != step_of(newest) and shares(newest, older[0])

    h = run_interrupted(
        save_dir, tmp_path / "final.safetensors", ARGS, [in_step(7), in_step(4), in_step(3)], between=check
    )
    assert h.codes == [PREEMPTED, PREEMPTED, PREEMPTED, 0], h.text
    assert [e["step"] for e in h.events_of("stop", cause="SIGTERM")] == [7, 11, 14], h.events
    check(3)
    assert seen["source pruned"] >= 3 and seen["kept apart"] >= 2, seen  # the cases above did happen
    assert not (save_dir / "quarantine").exists()
    assert_same_final(reference(MODEL), tmp_path / "final.safetensors")
    assert_kept_equal_live(save_dir, live, at_least=2)


def test_recycling_never_writes_into_a_file_a_kept_checkpoint_links(tmp_path, reference, held):
    """Step 7 writes its base afresh while the pool it takes (step 4's files) holds step 4's base, one inode with
    the kept steps 5 and 6: the pool's other files are written over in place, that one is replaced. Then 9 more
    saves (that cycle three more times) and the rerun; every kept file still matches its manifest.

    Would catch: a recycled file written over although another checkpoint links it (st_nlink > 1). The frozen base
    has the same bytes in every copy, so such a write changes no digest here (it would, were the base changed):
    what shows it is the inode, shared then by checkpoints whose manifests give the base different origins
    (assert_sound) and by step 7's "fresh" copy. Checked: with commit._open_for_write writing into a file of any
    link count, this test fails."""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = held(7)
    # save 4 already wrote its fresh base with a pool taken whose base steps 2 and 3 linked
    assert_sound(save_dir, settled=False)
    (pool,) = [d for d in save_dir.iterdir() if d.name.startswith(POOL)]
    shared = inode(pool / BASE)
    assert {c.name for c in kept(save_dir) if inode(c / BASE) == shared} == {"step_000000006", "step_000000005"}
    assert os.stat(pool / BASE).st_nlink == 3
    pool_model = inode(pool / MODEL_FILE)
    assert os.stat(pool / MODEL_FILE).st_nlink == 1
    stop(p)

    seven = save_dir / "step_000000007"
    assert inode(seven / MODEL_FILE) == pool_model  # the pool was taken and its own file written over in place
    assert "carried_from" not in manifest_files(seven)[BASE] and inode(seven / BASE) != shared  # a new file
    assert inode(save_dir / "step_000000006" / BASE) == shared
    assert [c.name for c in assert_sound(save_dir)] == ["step_000000007", "step_000000006"]

    h = run_interrupted(save_dir, final, ARGS, [])
    assert h.codes == [0], h.text
    assert_sound(save_dir)
    assert_same_final(reference(MODEL), final)
    assert_kept_equal_live(save_dir, reference.recorded(MODEL), at_least=2)  # each kept one holds its step's tensors


def test_quarantine_of_a_damaged_own_file_or_shared_base(tmp_path, reference, held):
    """A bit flipped in the shared base of the newest (steps 6 and 5 hold that inode): the resume quarantines both
    and falls back to step 3, which shares nothing with them (kept for that by retention). Later a bit flipped in
    the newest's own state file (step 8, its base linked by step 7): only step 8 is quarantined, step 7 and the
    others stay in place and whole, the resume takes step 7. The run still ends bit for bit.

    Would catch: a checkpoint kept for falling back that shares the damaged inode (the resume would start from
    scratch: step 0, not 3), a quarantine that takes the checkpoints sharing a base with the damaged one along (or
    that damages their shared file in moving it), and a fallback that does not restore exactly."""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    quarantine = save_dir / "quarantine"

    stop(held(6))
    six, five, three = kept(save_dir)
    assert [step_of(c) for c in (six, five, three)] == [6, 5, 3]
    damaged = inode(six / BASE)
    holding = {c.name for c in kept(save_dir) if inode(c / BASE) == damaged}
    assert holding == {six.name, five.name} and not shares(three, six)
    flip_bit(six / BASE)  # through every name of the inode

    p = held(5)  # resumed from 3: its steps are 4 to 8
    out = p.output
    assert p.events_of("resume", step=3), p.events
    for name in holding:
        assert p.events_of("quarantined", name=name, problem=lambda m, n=name: f"{n}/{BASE}: xxh3 mismatch" in m), out
    assert sorted(os.listdir(quarantine)) == sorted(holding)
    assert inode(quarantine / six.name / BASE) == damaged
    stop(p)

    eight, seven, *others = assert_sound(save_dir)
    assert (step_of(eight), step_of(seven)) == (8, 7)
    assert inode(eight / BASE) == inode(seven / BASE) and os.stat(eight / STATE).st_nlink == 1
    flip_bit(eight / STATE)  # its own file: shared with no other checkpoint

    p = held(1)  # holds before its first save: nothing pruned yet
    mismatch = f"{eight.name}/{STATE}: xxh3 mismatch"
    assert p.events_of("quarantined", name=eight.name, problem=lambda m: mismatch in m), p.events
    assert p.events_of("resume", step=7), p.events
    assert sorted(os.listdir(quarantine)) == sorted([*holding, eight.name])
    assert kept(save_dir) == [seven, *others] and others  # in place; verified below with the shared base
    assert inode(seven / BASE) == inode(quarantine / eight.name / BASE)
    assert_sound(save_dir, settled=False)
    stop(p)

    h = run_interrupted(save_dir, final, ARGS, [])
    assert h.codes == [0], h.text
    assert_sound(save_dir)
    assert_same_final(reference(MODEL), final)
    # the checkpoints kept in place beside the quarantined ones, and those after, hold their steps' tensors
    assert_kept_equal_live(save_dir, reference.recorded(MODEL), at_least=2)
