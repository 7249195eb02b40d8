"""Real signals while the background writer of ``async_save`` has a checkpoint in flight."""

from __future__ import annotations

import os
import re

from helpers import Spawned, assert_same_final, direct_io_supported, train_cmd

from preempt.checkpoint.manager import CheckpointManager

MODEL = ["--epochs", "3", "--samples", "256", "--dim", "1024", "--width", "1024"]  # 48 steps, 12 MB per checkpoint
BYPASSED = r"model\.safetensors: \d+ of \d+ bytes bypassed the page cache"  # a file of 4 MB, from the buffers


def stopped_with_a_write_in_flight(tmp_path, signal_at: str) -> tuple[str, int, int, CheckpointManager]:
    """Runs until the writer of the second periodic save sends SIGTERM (``signal_at``); returns the output, the
    step of the save in flight, the step of the stop's checkpoint and the manager of the save_dir.

    The loop holds right after it took that save until the signal has come: a fast loop would otherwise reach the
    run's end, whose final save waits for the write, before the writer sends it. After the first save it waits
    until that write is durable: on a busy machine the write of step 6 outlasted steps 7-16, the save due at 12 was
    postponed to step 16, the epoch's last, and the stop's safe point became the epoch's end at that same step."""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    # checkpoints at steps 6 and 12, inside epoch 0: the stop's safe point is step 13's (at step 16, the last of the
    # epoch, it would be the epoch's end, where the state of the save in flight would be the stop's)
    args = [*MODEL, "--every_steps", "6", "--signal_at", signal_at, "--settle_at", "saved:1", "--hold_at", "saved:2"]
    first = Spawned(train_cmd(save_dir, final, args), {"PREEMPT_LOG_LEVEL": "DEBUG"})
    assert first.finish() == 75, first.output
    out = first.output
    held = int(re.findall(r"saving \S*step_(\d+) \(steps\)", out)[1])  # the save in flight when SIGTERM came
    assert held == 12 and "settled at saved 1: step_000000006 durable" in out, out
    stop = re.search(r"checkpoint \S*step_(\d+) \(preempt\) written", out)
    assert stop, out
    return out, held, int(stop.group(1)), CheckpointManager(save_dir, owner=False)


def rerun_is_exact(tmp_path, reference, stopped_at: int) -> None:
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    rerun = Spawned(train_cmd(save_dir, final, [*MODEL, "--every_steps", "8"]))
    assert rerun.finish() == 0, rerun.output
    assert rerun.events_of("resume", step=stopped_at), rerun.events
    assert_same_final(reference(MODEL), final)
    assert not [e for e in os.listdir(save_dir) if e.startswith(".tmp-")], os.listdir(save_dir)


def test_sigterm_before_a_writes_manifest_cancels_it_and_the_stop_saves_the_current_state(tmp_path, reference):
    """SIGTERM from the writer thread just before the second save's manifest; the writer then waits there until
    the run decides (``until_cancelled``). The loop has moved past that save's state, so its stop cancels the
    write (its files removed) and saves the current state; the cancelled step is not on disk."""
    out, held, stopped_at, manager = stopped_with_a_write_in_flight(tmp_path, "before_manifest:2:TERM:until_cancelled")
    assert "signal_at before_manifest 2 SIGTERM" in out, out
    cancelled = re.search(rf"the background write of step {held} \(steps\) was cancelled", out)
    stop = re.search(r"checkpoint \S*step_\d+ \(preempt\) written", out)
    assert cancelled and cancelled.start() < stop.start(), out
    assert stopped_at == held + 1, out
    # the stop's save copied the state into the staging buffers and wrote them without the page cache
    assert bool(re.search(rf"step_0*{stopped_at}-\S*/{BYPASSED}", out)) == direct_io_supported(tmp_path), out
    infos = manager.list()
    assert [c.step for c in infos] == [stopped_at, 6], [c.step for c in infos]
    assert all(c.status == "valid" and not manager.verify(c) for c in infos)
    rerun_is_exact(tmp_path, reference, stopped_at)


def test_sigterm_after_a_writes_rename_finishes_it_then_saves_the_current_state(tmp_path, reference):
    """SIGTERM from the writer thread after the second save's rename, before save_dir's fsync: that write can no
    longer be cancelled, so the stop waits for it, then saves the current state; both checkpoints are whole."""
    out, held, stopped_at, manager = stopped_with_a_write_in_flight(tmp_path, "before_dir_fsync:2:TERM")
    assert "signal_at before_dir_fsync 2 SIGTERM" in out, out
    in_flight = re.search(rf"checkpoint \S*step_0*{held} \(steps\) written in .* in the background", out)
    stop = re.search(r"checkpoint \S*step_\d+ \(preempt\) written", out)
    assert in_flight and in_flight.start() < stop.start(), out
    assert "was cancelled" not in out, out
    assert stopped_at == held + 1, out
    infos = manager.list()
    assert [c.step for c in infos] == [stopped_at, held], [c.step for c in infos]
    assert all(c.status == "valid" and not manager.verify(c) for c in infos)
    rerun_is_exact(tmp_path, reference, stopped_at)


def test_resume_from_a_checkpoint_the_background_writer_wrote_is_exact(tmp_path, reference):
    """SIGKILL once a second background checkpoint is durable: the rerun starts from the newest, bit for bit."""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    args = [*MODEL, "--every_steps", "8", "--step_sleep", "0.01"]
    first = Spawned(train_cmd(save_dir, final, args), {"PREEMPT_LOG_LEVEL": "DEBUG"})
    assert first.wait_event("checkpoint", reason="steps", background=True, count=2), first.output
    first.signal(9)
    assert first.finish() == -9, first.output
    second = int(re.findall(r"step_(\d+) \(steps\) written in .* in the background", first.output)[1])
    # the staged checkpoints went to the disk without the page cache where the filesystem allows it
    assert bool(re.search(BYPASSED, first.output)) == direct_io_supported(tmp_path), first.output
    steps = [c.step for c in CheckpointManager(save_dir, owner=False).list()]
    assert steps and steps[0] >= second, steps
    newest = steps[0]
    rerun = Spawned(train_cmd(save_dir, final, args))
    assert rerun.finish() == 0, rerun.output
    assert rerun.events_of("resume", step=newest), rerun.events
    assert_same_final(reference(MODEL), final)


def test_sigterm_while_a_lazy_snapshot_waits_for_its_copies_cancels_it_and_saves_the_next_step(tmp_path, reference):
    """A lazy snapshot (step 8) whose copies the writer has not made yet when SIGTERM comes: the loop has left that
    step, and its next optimizer.step() waits for the copies, so the state of step 8 is intact in the live tensors
    until they are made. The writer sends the signal itself once the loop has left step 8, then makes the copies;
    the stop at step 9 cancels the periodic write (the loop moved past its state) and saves step 9; the rerun ends
    bit-exact."""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    args = [*MODEL, "--every_steps", "8", "--lazy_copy_at_stop"]
    first = Spawned(train_cmd(save_dir, final, args), {"PREEMPT_LOG_LEVEL": "DEBUG"})
    assert first.finish() == 75, first.output
    out = first.output
    assert "lazy_copy_signals SIGTERM" in out, out
    lazy = int(re.search(r"saving \S*step_0*(\d+) \(steps\)", out).group(1))
    stop = int(re.search(r"stopping on SIGTERM .* at step (\d+) ", out).group(1))
    assert (lazy, stop) == (8, 9), out
    assert re.search(rf"background write of step {lazy} \(steps\) was cancelled", out), out
    assert re.search(rf"step_0*{stop} \(preempt\) written", out), out
    manager = CheckpointManager(save_dir, owner=False)
    assert [c.step for c in manager.list()] == [stop] and not manager.verify(manager.list()[0])

    rerun = Spawned(train_cmd(save_dir, final, [*MODEL, "--every_steps", "8"]))
    assert rerun.finish() == 0, rerun.output
    assert rerun.events_of("resume", step=stop), rerun.events
    assert_same_final(reference(MODEL), final)
