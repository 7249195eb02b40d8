"""PreemptibleRun's health features in one process: emergency checkpoints, non-finite and OOM guards, logs."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from preempt import CheckpointManager, PreemptibleRun
from preempt.errors import NONFINITE_EXIT_CODE, OOM_EXIT_CODE
from preempt.health.guards import NonFiniteStreak, OutOfMemoryStreak


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    return model, opt, sched, data


class Boom(RuntimeError):
    pass


def loop(run, model, opt, sched, data, *, fail=None, loss_at=None, oom_at=(), epochs=1):
    """8 steps per epoch; fail(step) may raise; loss_at(step) may replace the loss; oom_at raise OOM there."""
    loader = DataLoader(data, batch_size=8, sampler=run.sampler(data, seed=0))
    for _ in run.epochs(epochs):
        for x, y in run.batches(loader):
            step = run.global_step + 1
            with run.oom_guard() as guard:
                if run.batch in oom_at:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                loss = torch.nn.functional.cross_entropy(model(x), y)
                if loss_at is not None and loss_at(step) is not None:
                    loss = loss * loss_at(step)
                if fail is not None:
                    fail(step, "forward")
                if not run.check_loss(loss):
                    opt.zero_grad(set_to_none=True)
                    continue
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
            if guard.skipped:
                opt.zero_grad(set_to_none=True)
                continue
            run.step({"loss": loss.item()})


def test_an_exception_in_the_forward_pass_saves_the_last_step_boundary(tmp_path, caplog):
    model, opt, sched, data = build()

    def fail(step, where):
        if step == 5:
            raise Boom("bad batch")

    with pytest.raises(Boom), PreemptibleRun(tmp_path, model=model, optimizer=opt, scheduler=sched) as run:
        loop(run, model, opt, sched, data, fail=fail)
    info = CheckpointManager(tmp_path, owner=False).list()[0]
    assert (info.step, info.manifest.reason, info.manifest.cursor.batch) == (4, "emergency", 4)
    assert "Boom escaped the training loop at step 4: emergency checkpoint" in caplog.text
    saved = CheckpointManager(tmp_path, owner=False).read(info).model
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())  # untouched by the failed step

    model, opt, sched, data = build()
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, scheduler=sched) as run:
        assert (run.global_step, run.batch) == (4, 4)
        loop(run, model, opt, sched, data)  # the failed batch (the 5th) is trained now
        assert run.global_step == 8


def test_an_exception_inside_the_optimizer_step_writes_no_emergency_checkpoint(tmp_path, caplog):
    model, opt, sched, data = build()

    def explode(*_):
        if run.global_step + 1 == 3:
            raise Boom("in the middle of the update")

    opt.register_step_post_hook(explode)  # after the pre-hook: the state may be half-updated
    with pytest.raises(Boom), PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_interval=None) as run:
        loop(run, model, opt, sched, data)
    assert CheckpointManager(tmp_path, owner=False).list() == []
    assert "during an optimizer step (the state may be half-updated): no emergency checkpoint" in caplog.text


def test_non_finite_losses_are_skipped_then_roll_back_with_a_lower_lr(tmp_path, caplog):
    model, opt, sched, data = build()
    nan_steps = set(range(6, 9))  # three NaN losses in a row at steps 6, 7, 8 (no step counted for them)
    kw = dict(checkpoint_every_steps=3, max_nonfinite=3, async_save=False)
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, scheduler=sched, **kw) as run:
        at_step3: dict = {}  # the state the checkpoint of step 3 holds
        after: dict = {}  # the state right after the rollback

        def loss_at(step):
            if step == 4 and not at_step3:
                at_step3.update({k: v.clone() for k, v in model.state_dict().items()}, lr=opt.param_groups[0]["lr"])
            if run.rollbacks == 1 and not after:
                after.update({k: v.clone() for k, v in model.state_dict().items()}, lr=opt.param_groups[0]["lr"])
            return float("nan") if step in nan_steps and run.rollbacks == 0 else None

        loop(run, model, opt, sched, data, loss_at=loss_at, epochs=2)
        assert run.rollbacks == 1 and run.nonfinite.total == 3
    assert math.isclose(after["lr"], at_step3["lr"] / 1.5, rel_tol=1e-12)
    assert all(torch.equal(after[k], at_step3[k]) for k in model.state_dict()), "not rolled back to step 3"
    text = caplog.text
    assert "non-finite loss (nan) at step 6: update skipped (1 in a row, 1 in all)" in text
    assert "3 non-finite losses in a row: rolled back to" in text and "step_000000003 (step 3)" in text
    assert "learning rates / 1.5" in text
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert any(h.get("event") == "rollback" and h.get("step") == 3 for h in history), history


def test_non_finite_losses_without_a_checkpoint_exit_78(tmp_path, caplog):
    model, opt, sched, data = build()
    kw = dict(checkpoint_interval=None, max_nonfinite=2)
    with pytest.raises(NonFiniteStreak) as e, PreemptibleRun(tmp_path, model=model, optimizer=opt, **kw) as run:
        loop(run, model, opt, sched, data, loss_at=lambda step: float("inf") if step >= 2 else None)
    assert e.value.code == NONFINITE_EXIT_CODE
    assert "not finite" not in str(e.value) and "inf 2 steps in a row" in str(e.value), str(e.value)
    assert "there is no checkpoint to roll back to" in caplog.text
    assert CheckpointManager(tmp_path, owner=False).list() == []  # a diverged state is not saved


def test_out_of_memory_batches_are_skipped_then_exit_79(tmp_path, caplog):
    model, opt, sched, data = build()
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_interval=None, max_oom=3) as run:
        loop(run, model, opt, sched, data, oom_at={3})
        assert run.oom.total == 1 and run.global_step == 7  # the batch of step 3 skipped, the epoch went on
    assert "out of memory at step 3: batch skipped (1 in a row, 1 in all)" in caplog.text
    model, opt, sched, data = build()
    with pytest.raises(OutOfMemoryStreak) as e:
        with PreemptibleRun(tmp_path / "b", model=model, optimizer=opt, checkpoint_interval=None, max_oom=2) as run:
            loop(run, model, opt, sched, data, oom_at={2, 3, 4, 5})
    assert e.value.code == OOM_EXIT_CODE and "Lower the batch size" in str(e.value)


def test_train_log_and_history_append_across_restarts(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="preempt")  # the file follows the logger's level (pytest's is WARNING)
    for _ in range(2):
        model, opt, sched, data = build()
        with PreemptibleRun(tmp_path, model=model, optimizer=opt, progress_every_s=1e-9, exit_if_complete=False) as run:
            loop(run, model, opt, sched, data, epochs=run.epoch + 1)
    log = (tmp_path / "train.log").read_text()
    assert log.count("==== start (fresh)") == 1 and log.count("==== start (resumed from") == 1
    assert "steps/s" in log and "run complete" in log
    lines = [json.loads(x) for x in (tmp_path / "history.jsonl").read_text().splitlines()]
    events = [h["event"] for h in lines if "event" in h]
    want = ["restoring", "start", "first_step", "checkpoint", "complete"]
    want += ["restoring", "resume", "first_step", "checkpoint", "complete"]
    assert events == want, events
    records = [h for h in lines if "metrics" in h and h["step"] > 0]
    assert records and all(h["lr"] for h in records)
    # each step's loss once, at its step (a point holds only what was measured since the one before it)
    measured = [h["step"] for h in records if "loss" in h["metrics"]]
    assert measured == list(range(1, 17)), measured
    assert all(h["metrics"] in ({}, {"loss": h["metrics"].get("loss")}) for h in records)


def test_health_options_are_checked(tmp_path):
    for bad in (dict(max_nonfinite=0), dict(max_oom=-1), dict(nonfinite_lr_factor=1.0), dict(progress_every_s=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PreemptibleRun(tmp_path, **bad)


def test_no_logging_files_when_turned_off(tmp_path, caplog):
    model, opt, sched, data = build()
    with caplog.at_level(logging.INFO, logger="preempt"):
        with PreemptibleRun(tmp_path, model=model, optimizer=opt, log_file=False, progress_every_s=None) as run:
            loop(run, model, opt, sched, data)
    assert not (tmp_path / "train.log").exists() and not (tmp_path / "history.jsonl").exists()
    assert "epoch 0" in caplog.text  # the epoch summary is logged either way


def test_progress_lines_have_an_eta_and_monitor_gpu_true_is_quiet_without_a_gpu(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="preempt")
    model, opt, sched, data = build()
    kw = dict(progress_every_s=1e-9, monitor_gpu=True)
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_interval=None, **kw) as run:
        loop(run, model, opt, sched, data, epochs=2)
        assert run.config.monitor_gpu == 10.0
    assert "ETA" in caplog.text and "/16 |" in caplog.text  # 2 epochs of 8 steps
    if not torch.cuda.is_available():
        assert "GPU monitor" in caplog.text or "NVML" in caplog.text
        assert not (tmp_path / "gpu_stats.jsonl").exists()


def test_a_plain_list_is_a_loader_and_a_failure_before_any_step_saves_nothing(tmp_path, caplog):
    model, opt, _, _ = build()
    with pytest.raises(Boom), PreemptibleRun(tmp_path, model=model, optimizer=opt) as run:
        for _ in run.epochs(1):
            for _batch in run.batches([1, 2, 3]):  # not weak-referenceable: used to raise TypeError
                raise Boom("before the first step")
    assert CheckpointManager(tmp_path, owner=False).list() == []
    assert "nothing changed since the start: no emergency checkpoint" in caplog.text
