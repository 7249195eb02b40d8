"""A full disk (ENOSPC) under a real training: a small tmpfs mounted for the test, filled by the test.

A periodic checkpoint that fails must cost nothing but itself: the error is
logged, its partial files are freed, older checkpoints stay (none is deleted
to make room), and training goes on and tries again at the next interval. The
checkpoint a stop signal asks for cannot be skipped: when it fails the process
exits 74 naming the last good checkpoint, and a rerun continues from there.
Those two run with recycling off (every save needs new space). With recycling
on (the default), a save writes over the last pruned checkpoint's files, so a
disk that filled up after it does not stop the checkpoints at all.

The checkpoint lines these tests wait for are DEBUG lines (routine, in the background). The training waits at
named points (--wait_file_at, --hold_at) until the test has filled or freed the disk or signalled it, so that a
busy machine never lets the run end before the test has done its part.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import Spawned, assert_same_final, train_cmd

from preempt.checkpoint.manager import CheckpointManager

# ~3 MB per checkpoint; 48 steps of ~0.1 s, a checkpoint every 0.3 s.
MODEL = ["--epochs", "3", "--samples", "256", "--dim", "256", "--width", "1024"]
PACE = ["--step_sleep", "0.1", "--interval", "0.3", "--keep_last", "2"]
DEBUG = {"PREEMPT_LOG_LEVEL": "DEBUG"}
SIZE_MB = 24


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A fresh tmpfs of SIZE_MB MiB (needs root, as on our machines and in CI)."""
    where = tmp_path / "fs"
    where.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE_MB}m", "tmpfs", str(where)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(fs: Path, leave: int = 16 << 10) -> Path:
    """Writes a file until the filesystem is full, then frees ``leave`` bytes (room for small files only)."""
    filler = fs / "filler"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        f.truncate(max(0, f.tell() - leave))
    return filler


def checkpoints(save_dir: Path) -> dict[int, str]:
    """Step -> status of each checkpoint, after asserting that the valid ones verify."""
    manager = CheckpointManager(save_dir, owner=False)
    found = {}
    for info in manager.list():
        if info.status == "valid":
            assert not manager.verify(info), manager.verify(info)
        found[info.step] = info.status
    return found


def partial(save_dir: Path) -> list[str]:
    return [e for e in os.listdir(save_dir) if e.startswith(".tmp-")]


def test_periodic_saves_fail_on_a_full_disk_and_training_goes_on(small_fs, tmp_path, reference):
    save_dir, final = small_fs / "run", tmp_path / "final.safetensors"
    filled, freed = tmp_path / "filled", tmp_path / "freed"
    # the loop waits after its first checkpoint (durable) until the disk is full, and at step 40 (3.8 s of step
    # sleeps later, a dozen intervals) until it has room again
    waits = ["--settle_at", "saved:1", "--wait_file_at", f"saved:1:{filled},step:40:{freed}"]
    p = Spawned(train_cmd(save_dir, final, [*MODEL, *PACE, "--no_recycle", *waits]), DEBUG)
    assert p.wait_event("checkpoint", reason="interval"), p.output
    filler = fill(small_fs)
    filled.touch()
    before = checkpoints(save_dir)
    # Training goes on through more than one failed interval.
    assert p.wait_event("checkpoint_failed", errno=errno.ENOSPC, count=2), p.output
    after = checkpoints(save_dir)
    assert after == before, "a failed save must leave the older checkpoints as they were (none deleted for room)"
    assert partial(save_dir) == [], "the partial files of a failed save must be freed at once"
    failures = [e["step"] for e in p.events_of("checkpoint_failed", reason="interval")]
    assert all(b > a + 1 for a, b in zip(failures, failures[1:], strict=False)), f"retried every step: {failures}"
    last_good = max(before)
    assert all(e["last_good"] == last_good for e in p.events_of("checkpoint_failed")), p.events
    filler.unlink()  # space again: the next interval's save succeeds
    freed.touch()
    n_written = len(p.events_of("checkpoint", reason="interval"))
    assert p.wait_event("checkpoint", reason="interval", count=n_written + 1), p.output
    assert p.finish() == 0, p.output
    assert_same_final(reference(MODEL), final)


def test_a_stop_whose_save_fails_exits_74_and_the_rerun_continues(small_fs, tmp_path, reference):
    save_dir, final = small_fs / "run", tmp_path / "final.safetensors"
    # the loop holds after its first checkpoint (durable) until the test's signal
    hold = ["--settle_at", "saved:1", "--hold_at", "saved:1"]
    p = Spawned(train_cmd(save_dir, final, [*MODEL, *PACE, "--no_recycle", *hold]), DEBUG)
    assert p.wait_event("checkpoint", reason="interval"), p.output
    filler = fill(small_fs)
    before = checkpoints(save_dir)
    p.signal(signal.SIGTERM)
    assert p.finish() == 74, p.output
    last_good = max(before)
    assert p.events_of("checkpoint_failed", reason="preempt", errno=errno.ENOSPC, last_good=last_good), p.events
    assert checkpoints(save_dir) == before and partial(save_dir) == []
    filler.unlink()
    rerun = Spawned(train_cmd(save_dir, final, [*MODEL, *PACE]))
    assert rerun.finish() == 0, rerun.output
    assert rerun.events_of("resume", step=last_good), rerun.events
    assert_same_final(reference(MODEL), final)


def test_with_recycling_a_full_disk_does_not_stop_the_checkpoints(small_fs, tmp_path, reference):
    save_dir, final = small_fs / "run", tmp_path / "final.safetensors"
    filled = tmp_path / "filled"
    # the loop waits after its third checkpoint (durable) until the disk is full, and holds at step 44 (3 s of step
    # sleeps later, about ten intervals) until the test's signal
    waits = ["--settle_at", "saved:3", "--wait_file_at", f"saved:3:{filled}", "--hold_at", "step:44"]
    p = Spawned(train_cmd(save_dir, final, [*MODEL, *PACE, *waits]), DEBUG)
    assert p.wait_event("checkpoint", reason="interval", count=3), p.output  # one pruned: the pool
    assert [e for e in os.listdir(save_dir) if e.startswith(".recycle-")], os.listdir(save_dir)
    fill(small_fs)
    filled.touch()
    n_written = len(p.events_of("checkpoint", reason="interval"))
    # written over the pool, in place
    assert p.wait_event("checkpoint", reason="interval", count=n_written + 2), p.output
    p.signal(signal.SIGTERM)
    assert p.finish() == 75, p.output  # the stop's save too
    assert not p.events_of("checkpoint_failed"), p.events
    stopped = max(checkpoints(save_dir))
    rerun = Spawned(train_cmd(save_dir, final, [*MODEL, *PACE]))  # the disk is still full
    assert rerun.finish() == 0, rerun.output
    assert rerun.events_of("resume", step=stopped), rerun.events
    assert_same_final(reference(MODEL), final)


def test_a_run_that_completes_on_a_full_disk_exits_0_without_its_completion_marker(small_fs, tmp_path, reference):
    """Found by the chaos campaign (``python bench/chaos.py --seed 70 --faults 140 --jobs quickstart``, fault #139):
    the final checkpoint fitted (written over recycled files), complete.json did not; the process once ended with
    ENOSPC's traceback and exit 1 after a whole run. The marker is what lets a rerun exit at once: without it, a rerun
    resumes from the final checkpoint and finds nothing left to train.

    Here the final checkpoint is the run's only one (no periodic saves), so nothing is pruned or replaced after it:
    the disk, filled once that checkpoint is committed, stays full for complete.json."""
    save_dir, final = small_fs / "run", tmp_path / "final.safetensors"
    gate = tmp_path / "filled"
    p = Spawned(train_cmd(save_dir, final, ["--wait_file_at", f"committed:1:{gate}"]), DEBUG)
    assert p.wait_event("waiting", point="committed", n=1), p.output
    filler = fill(small_fs, leave=0)
    gate.touch()
    assert p.finish() == 0, p.output
    assert "could not write" in p.output and "complete.json" in p.output, p.output
    assert not (save_dir / "complete.json").exists() and list(checkpoints(save_dir)) == [48]
    assert_same_final(reference([]), final)
    filler.unlink()
    rerun = Spawned(train_cmd(save_dir, final, []))
    assert rerun.finish() == 0, rerun.output
    assert rerun.events_of("resume", step=48), rerun.events
    assert (save_dir / "complete.json").exists()
    assert_same_final(reference([]), final)
