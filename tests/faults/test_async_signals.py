"""Real signals while the background writer of ``async_save`` has a checkpoint in flight."""

from __future__ import annotations

import os

from helpers import Spawned, assert_same_final, direct_io_supported, train_cmd

from preempt.checkpoint.manager import CheckpointManager
from preempt.checkpoint.names import checkpoint_name

MODEL = ["--epochs", "3", "--samples", "256", "--dim", "1024", "--width", "1024"]  # 48 steps, 12 MB per checkpoint


def bypassed(p: Spawned, step: int | None = None) -> bool:
    """A ``model.safetensors`` (of 4 MB, from the staging buffers; of checkpoint ``step``) went to the disk without
    the page cache."""
    where = "" if step is None else f"{checkpoint_name(step)}-"
    writes = p.events_of("direct_write", path=lambda path: path.endswith("/model.safetensors") and where in path)
    return bool(writes)


def stopped_with_a_write_in_flight(tmp_path, signal_at: str) -> tuple[Spawned, int, int, CheckpointManager]:
    """Runs until the writer of the second periodic save sends SIGTERM (``signal_at``); returns the process, the
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
    held = first.events_of("saving", reason="steps")[1]["step"]  # the save in flight when SIGTERM came
    assert held == 12 and "settled at saved 1: step_000000006 durable" in out, out
    stop = first.events_of("checkpoint", reason="preempt")
    assert stop, first.events
    return first, held, stop[0]["step"], CheckpointManager(save_dir, owner=False)


def order(p: Spawned, *kinds: tuple[str, dict]) -> list[int]:
    """The place in ``p``'s events of the first event of each (kind, fields); -1 where there is none."""
    return [
        next((i for i, e in enumerate(p.events) if e.get("event") == k and f.items() <= e.items()), -1)
        for k, f in kinds
    ]


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
    p, held, stopped_at, manager = stopped_with_a_write_in_flight(tmp_path, "before_manifest:2:TERM:until_cancelled")
    out = p.output
    assert p.events_of("signal_at", point="before_manifest", n=2, signal="SIGTERM"), p.events
    cancelled, stop = order(p, ("cancelled", {"step": held, "reason": "steps"}), ("checkpoint", {"reason": "preempt"}))
    assert 0 <= cancelled < stop, p.events
    assert stopped_at == held + 1, out
    # the stop's save copied the state into the staging buffers and wrote them without the page cache
    assert bypassed(p, stopped_at) == direct_io_supported(tmp_path), p.events
    infos = manager.list()
    assert [c.step for c in infos] == [stopped_at, 6], [c.step for c in infos]
    assert all(c.status == "valid" and not manager.verify(c) for c in infos)
    rerun_is_exact(tmp_path, reference, stopped_at)


def test_sigterm_after_a_writes_rename_finishes_it_then_saves_the_current_state(tmp_path, reference):
    """SIGTERM from the writer thread after the second save's rename, before save_dir's fsync: that write can no
    longer be cancelled, so the stop waits for it, then saves the current state; both checkpoints are whole."""
    p, held, stopped_at, manager = stopped_with_a_write_in_flight(tmp_path, "before_dir_fsync:2:TERM")
    out = p.output
    assert p.events_of("signal_at", point="before_dir_fsync", n=2, signal="SIGTERM"), p.events
    written = {"step": held, "reason": "steps", "background": True}
    in_flight, stop = order(p, ("checkpoint", written), ("checkpoint", {"reason": "preempt"}))
    assert 0 <= in_flight < stop, p.events
    assert not p.events_of("cancelled"), p.events
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
    second = first.events_of("checkpoint", reason="steps", background=True)[1]["step"]
    # the staged checkpoints went to the disk without the page cache where the filesystem allows it
    assert bypassed(first) == direct_io_supported(tmp_path), first.events
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
    lazy = first.events_of("saving", reason="steps")[0]["step"]
    stop = first.events_of("stop", cause="SIGTERM")[0]["step"]
    assert (lazy, stop) == (8, 9), first.events
    assert first.events_of("cancelled", step=lazy, reason="steps"), first.events
    assert first.events_of("checkpoint", step=stop, reason="preempt"), first.events
    manager = CheckpointManager(save_dir, owner=False)
    assert [c.step for c in manager.list()] == [stop] and not manager.verify(manager.list()[0])

    rerun = Spawned(train_cmd(save_dir, final, [*MODEL, "--every_steps", "8"]))
    assert rerun.finish() == 0, rerun.output
    assert rerun.events_of("resume", step=stop), rerun.events
    assert_same_final(reference(MODEL), final)
