"""Signals at awkward moments: before the first step, during the resume load, during the stop's own save,
during the final save, and Ctrl+C twice (inside and outside a save).

The in-save and in-load moments are hit exactly: the training script sends
itself the real signal from inside the commit (``--signal_at``, a hook at the
named stage), so the test does not depend on timing.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from helpers import PREEMPTED, Spawned, assert_same_final, select, train_cmd

from preempt import Preempted, PreemptibleRun
from preempt.checkpoint.manager import CheckpointManager

MODEL = ["--epochs", "3", "--samples", "256", "--dropout", "0.3"]  # 48 steps


def steps_on_disk(save_dir) -> list[int]:
    return [c.step for c in CheckpointManager(save_dir, owner=False).list()]


# ------------------------------------------------------------------ in one process


def loop_after(save_dir, before_loop) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with PreemptibleRun(save_dir, model=model, optimizer=opt, checkpoint_interval=None) as run:
        before_loop(run)
        for _ in run.epochs(3):
            for _ in range(4):
                opt.step()
                run.step()


def written_after(p: Spawned, point: str, sig: str, reason: str) -> bool:
    """The save in progress when ``sig`` came (sent by the process itself at the commit stage ``point`` of its first
    save) was not interrupted: the checkpoint for ``reason`` was written after it."""
    events = p.events
    (signalled,) = select(events, "signal_at", point=point, n=1, signal=sig)
    return bool(select(events[events.index(signalled) + 1 :], "checkpoint", reason=reason))


def test_signal_before_the_first_step_exits_75_without_writing(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    body = []
    with pytest.raises(Preempted) as e:
        loop_after(tmp_path, lambda run: (os.kill(os.getpid(), signal.SIGTERM), body.append(run.global_step)))
    assert e.value.code == PREEMPTED and e.value.checkpoint is None, "nothing had changed: nothing to write"
    assert steps_on_disk(tmp_path) == [] and body == [0]
    assert signal.getsignal(signal.SIGTERM) is previous
    assert (tmp_path / "lock").read_bytes() == b""


def test_signal_before_the_first_step_of_a_resumed_run_writes_nothing_new(tmp_path):
    with pytest.raises(Preempted):
        loop_after(tmp_path, lambda run: None if run.global_step else _stop_later(run))
    assert steps_on_disk(tmp_path) == [6]
    stamp = os.stat(tmp_path / "step_000000006" / "manifest.json").st_mtime_ns
    with pytest.raises(Preempted) as e:
        loop_after(tmp_path, lambda run: os.kill(os.getpid(), signal.SIGTERM))
    assert e.value.checkpoint is not None and e.value.checkpoint.endswith("step_000000006")
    assert steps_on_disk(tmp_path) == [6]
    assert os.stat(tmp_path / "step_000000006" / "manifest.json").st_mtime_ns == stamp


def _stop_later(run) -> None:
    """Requests a stop once step 6 is done (the loop's 2nd epoch, 2nd step)."""
    original = run.step

    def step(*a, **k):
        if run.global_step + 1 == 6:
            run.request_stop()
        original(*a, **k)

    run.step = step


# ------------------------------------------------------------------ real processes


def test_sigterm_during_the_resume_load(tmp_path, reference):
    """The load finishes, nothing new is written (nothing changed), exit 75; the next rerun goes on exactly."""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    first = Spawned(train_cmd(save_dir, final, [*MODEL, "--hold_at", "step:10"]))
    assert first.wait_event("holding", point="step", n=10), first.output
    first.signal(signal.SIGTERM)
    assert first.finish() == PREEMPTED, first.output
    saved = steps_on_disk(save_dir)
    loading = Spawned(train_cmd(save_dir, final, [*MODEL, "--signal_at", "load:1:TERM"]))
    assert loading.finish() == PREEMPTED, loading.output
    out = loading.output
    assert out.index("signal_at load 1 SIGTERM") < out.index("resumed from"), out
    assert loading.events_of("stop", cause="SIGTERM", step=saved[0]), loading.events
    assert " written " not in out and steps_on_disk(save_dir) == saved
    last = Spawned(train_cmd(save_dir, final, MODEL))
    assert last.finish() == 0, last.output
    assert_same_final(reference(MODEL), final)


def test_second_sigterm_during_the_stops_save_does_not_interrupt_it(tmp_path, reference):
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = Spawned(train_cmd(save_dir, final, [*MODEL, "--signal_at", "before_manifest:1:TERM", "--hold_at", "step:10"]))
    assert p.wait_event("holding", point="step", n=10), p.output
    p.signal(signal.SIGTERM)
    assert p.finish() == PREEMPTED, p.output
    assert written_after(p, "before_manifest", "SIGTERM", "preempt"), p.events
    rerun = Spawned(train_cmd(save_dir, final, MODEL))
    assert rerun.finish() == 0, rerun.output
    assert_same_final(reference(MODEL), final)


def test_sigterm_during_the_final_save_still_completes(tmp_path, reference):
    """No periodic saves: the first save is the final one, and a SIGTERM lands in the middle of it."""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = Spawned(train_cmd(save_dir, final, [*MODEL, "--signal_at", "before_rename:1:TERM"]))
    assert p.finish() == 0, p.output
    assert written_after(p, "before_rename", "SIGTERM", "final"), p.events
    assert p.events_of("complete") and (save_dir / "complete.json").is_file()
    assert_same_final(reference(MODEL), final)


@pytest.mark.usefixtures("sigint_handled")
def test_two_sigints_during_the_stops_save(tmp_path, reference):
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = Spawned(train_cmd(save_dir, final, [*MODEL, "--signal_at", "after_tensor_files:1:INT", "--hold_at", "step:10"]))
    assert p.wait_event("holding", point="step", n=10), p.output
    p.signal(signal.SIGINT)
    assert p.finish() == PREEMPTED, p.output
    assert "KeyboardInterrupt" not in p.output
    assert written_after(p, "after_tensor_files", "SIGINT", "preempt"), p.events
    rerun = Spawned(train_cmd(save_dir, final, MODEL))
    assert rerun.finish() == 0, rerun.output
    assert_same_final(reference(MODEL), final)


@pytest.mark.usefixtures("sigint_handled")
def test_two_sigints_outside_a_save_leave_at_once(tmp_path, reference):
    """A person pressing Ctrl+C twice wants out now: KeyboardInterrupt, no save; the rerun uses the last one."""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    # both presses come after step 6's safe point, before step 7's; the first one's handler has run before the
    # second is sent (signals sent at once would coalesce into one)
    p = Spawned(train_cmd(save_dir, final, [*MODEL, "--every_steps", "4", "--kill_at_step", "6:INT,6:INT"]))
    rc = p.finish()
    assert rc in (-signal.SIGINT, 130), (rc, p.output)
    assert "KeyboardInterrupt" in p.output and "(preempt) written" not in p.output
    assert steps_on_disk(save_dir)[0] == 4
    rerun = Spawned(train_cmd(save_dir, final, MODEL))
    assert rerun.finish() == 0, rerun.output
    assert rerun.events_of("resume", step=4), rerun.events
    assert_same_final(reference(MODEL), final)
