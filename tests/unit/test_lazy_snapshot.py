"""Lazy snapshots (``lazy_snapshot=True``): parameters and optimizer state copied while the loop runs its next step.

The writer's copies are made slow here (``slow_copies``: the writer thread sleeps before copying), so the
next ``optimizer.step()`` always comes while they are still to be made: the optimizer's pre-step hook must
wait for them, or the checkpoint would hold a later step's values (a torn snapshot).
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from test_async_save import build, loaded, snapshot, stepper

from preempt import Preempted, PreemptibleRun
from preempt.checkpoint.staging import LazyCopy
from preempt.run.save_scheduler import SaveScheduler

DELAY = 0.3
LAZY = dict(checkpoint_every_steps=2, keep_last=None, lazy_snapshot=True)


@pytest.fixture
def slow_copies(monkeypatch):
    """Each lazy copy starts DELAY seconds late; yields the list of copies made (each a LazyCopy)."""
    made: list[LazyCopy] = []
    run = LazyCopy.run

    def slow(self):
        made.append(self)
        threading.Event().wait(DELAY)
        run(self)

    monkeypatch.setattr(LazyCopy, "run", slow)
    return made


def test_the_optimizer_waits_for_the_lazy_copies_so_the_checkpoint_holds_its_own_step(tmp_path, slow_copies):
    """Fails without the optimizer's hook: the copies would be of step 3, or the snapshot dropped as torn."""
    model, opt, data = build()
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, **LAZY) as run:
        next(run.epochs(1))
        step = stepper(run, model, opt, data)
        step(2)  # step 2 is snapshotted: the parameters and moments are left to the writer
        want = snapshot(model, opt)
        assert run.last_save.step == 2 and not run.last_save.durable
        step()  # step 3's optimizer.step() waits for the copies
        assert slow_copies and slow_copies[0].done.is_set() and slow_copies[0].waited > 0
        path = run.wait_for_checkpoint(timeout=30)
        assert path == tmp_path / "step_000000002"
        assert run.last_save.stall_s >= slow_copies[0].waited  # the loop's wait is counted as the save's stall
        lazy = {name.split(":")[1] for name, *_ in slow_copies[0].pairs}
    got = loaded(path)
    assert want.keys() == got.keys() and [k for k in want if not torch.equal(want[k], got[k])] == []
    assert len(lazy) == 4 + 4 * 3  # the 4 parameters, and for each AdamW's exp_avg, exp_avg_sq and step


def test_without_the_optimizers_hook_the_torn_snapshot_is_caught_and_not_written(tmp_path, slow_copies, caplog):
    """What the hook prevents: optimizer.step() changes the parameters before their copies are made. The version
    counters show it, the checkpoint is not written, and the run copies at the step from then on."""
    original = SaveScheduler._optimizer_stepping
    SaveScheduler._optimizer_stepping = lambda self, *a: None
    model, opt, data = build()
    try:
        with PreemptibleRun(tmp_path, model=model, optimizer=opt, **LAZY) as run:
            next(run.epochs(1))
            step = stepper(run, model, opt, data)
            step(3)  # step 2's copies are still to be made when step 3's optimizer changes the parameters
            assert run.wait_for_checkpoint(timeout=30) is None
            assert "the checkpoint of step 2 is not written" in caplog.text and "changed in place" in caplog.text
            step()  # step 4: a checkpoint again, copied at the step
            want = snapshot(model, opt)
            path = run.wait_for_checkpoint(timeout=30)
            assert path == tmp_path / "step_000000004" and len(slow_copies) == 1
    finally:
        SaveScheduler._optimizer_stepping = original
    got = loaded(path)
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


def test_a_parameter_changed_outside_the_optimizer_drops_that_snapshot_not_a_later_one(tmp_path, slow_copies, caplog):
    caplog.set_level(logging.WARNING, logger="preempt")
    model, opt, data = build()
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, **LAZY) as run:
        next(run.epochs(1))
        step = stepper(run, model, opt, data)
        step(2)
        with torch.no_grad():
            model[0].weight.mul_(0.5)  # the user's own in-place change, before the copies are made
        step(2)  # steps 3 and 4: step 4 is saved again, copied at the step
        want = snapshot(model, opt)
        path = run.wait_for_checkpoint(timeout=30)
    assert "0.weight was changed in place before its copy was made" in caplog.text
    assert path == tmp_path / "step_000000004" and not (tmp_path / "step_000000002").exists()
    got = loaded(path)
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


def test_a_stop_while_the_lazy_copies_are_made_saves_the_stop_step_bit_exact(tmp_path, slow_copies):
    model, opt, data = build()
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, **LAZY) as run:
        next(run.epochs(1))
        step = stepper(run, model, opt, data)
        step(2)
        run.request_stop()
        with pytest.raises(Preempted):
            step()  # step 3's optimizer waits for step 2's copies; then the stop saves step 3
        want = snapshot(model, opt)
    assert run.last_checkpoint == tmp_path / "step_000000003"
    got = loaded(tmp_path / "step_000000003")
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


def test_lazy_snapshot_false_copies_everything_at_the_step(tmp_path, slow_copies):
    model, opt, data = build()
    kw = dict(checkpoint_every_steps=2, keep_last=None, lazy_snapshot=False)
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, **kw) as run:
        next(run.epochs(1))
        step = stepper(run, model, opt, data)
        step(2)
        want = snapshot(model, opt)
        step()
        path = run.wait_for_checkpoint(timeout=30)
    assert slow_copies == [] and path == tmp_path / "step_000000002"
    got = loaded(path)
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
