"""Metrics recorded at the step they belong to: run.report() after run.step(), history points, the best checkpoint,
and the epoch summary across processes.

The pure decisions (what step a report belongs to, what a history point holds, the summary of an epoch that several
processes ran) are called with made-up facts; the run-level tests train a few steps in this process.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import FakeClock
from safetensors.torch import load_file

from preempt import CheckpointManager, PreemptibleRun
from preempt.checkpoint.manifest import Cursor
from preempt.checkpoint.retention import RetentionPolicy, best_note
from preempt.errors import CorruptCheckpointError
from preempt.health.history import read_history
from preempt.health.progress import Progress
from preempt.run.config import ReportOptions, SaveOptions
from preempt.run.loop_state import LoopState, epoch_so_far, report_step
from preempt.run.reporting import Reporter, epoch_line, point_metrics

RETENTION = RetentionPolicy(keep_last=2, keep_best=1, metric="val_loss", mode="min")


def stepped(loop: LoopState, n: int = 1) -> None:
    """``n`` batches of the loop, each followed by run.step()."""
    for _ in range(n):
        loop.took_batch()
        loop.stepped()


# ---------------------------------------------------------------------------- what step a report belongs to


def test_a_report_belongs_to_the_last_step_counted_or_to_an_earlier_step_given():
    assert report_step(None, 7) == 7
    assert report_step(3, 7) == 3 and report_step(0, 0) == 0
    with pytest.raises(ValueError, match=r"run.report\(step=8\): expected a step from 0 to 7 \(run.global_step"):
        report_step(8, 7)
    with pytest.raises(ValueError, match=r"expected a step from 0 to 7"):
        report_step(-1, 7)
    for bad in (True, 3.0, "3"):
        with pytest.raises(TypeError, match=rf"run.report\(step=\.\.\.\): expected an integer step, got {bad!r}"):
            report_step(bad, 7)


def test_an_evaluation_after_run_step_is_at_that_step_and_a_safe_point():
    loop = LoopState()
    loop.at_batch(0)
    stepped(loop, 5)
    loop.taken(5, Cursor(batch=5), now=1.0)  # run.step() of step 5 saved
    m = loop.report({"val_loss": torch.tensor(0.5)}, RETENTION)
    assert (m.step, m.values, m.at_step, m.best, m.inside_step) == (5, {"val_loss": 0.5}, True, True, False)
    assert loop.best == {"metric": "val_loss", "mode": "min", "value": 0.5, "step": 5} and loop.holds_best
    assert loop.dirty  # the evaluation may have drawn random numbers: a stop here saves again
    assert loop.evaluated == {"val_loss"} and "val_loss" not in loop.sampled  # its own history point, at once
    worse = loop.report({"val_loss": 0.7}, RETENTION)
    assert worse.at_step and not worse.best and loop.best["value"] == 0.5


def test_where_a_report_is_not_a_safe_point():
    loop = LoopState()
    loop.at_batch(0)
    stepped(loop, 3)
    loop.took_batch()  # inside step 4: a batch, no run.step() yet
    m = loop.report({"val_loss": 1.0}, RETENTION)
    assert (m.step, m.at_step, m.inside_step, m.best) == (3, False, True, True)
    loop.stepped()
    older = loop.report({"val_loss": 0.5}, RETENTION, step=2)  # measured on an earlier step's state
    assert (older.step, older.at_step, older.best) == (2, False, True) and loop.best["step"] == 2
    loop.batches_closed(epoch=0)  # the batches ran out: end-of-epoch code, whose best waits for the boundary
    end = loop.report({"val_loss": 0.1}, RETENTION)
    assert (end.step, end.at_step, end.best) == (4, False, True) and loop.best_pending
    loop.at_batch(0)
    loop.batches_closed(epoch=1)  # a generator of another epoch closed late: this epoch's batches stay open
    assert loop.batches_open


def test_a_bad_report_records_nothing():
    loop = LoopState(global_step=4)
    with pytest.raises(TypeError, match=r"metrics\['acc'\]: expected a number, got 'high'"):
        loop.report({"val_loss": 0.1, "acc": "high"}, RETENTION)
    with pytest.raises(ValueError, match="expected a step from 0 to 4"):
        loop.report({"val_loss": 0.1}, RETENTION, step=5)
    assert loop.metrics == {} and loop.best is None and loop.epoch_totals == {}


# ---------------------------------------------------------------------------- history points


def test_a_history_point_holds_the_metrics_measured_at_its_step():
    sampled = {"loss": (12, 1, 0.5), "acc": (10, 0, 0.9), "lr_probe": (3, 0, 1.0)}
    assert point_metrics(sampled, after=9, step=12) == {10: (0, {"acc": 0.9}), 12: (1, {"loss": 0.5})}
    assert point_metrics(sampled, after=10, step=12) == {12: (1, {"loss": 0.5})}
    assert point_metrics(sampled, after=12, step=12) == {}
    assert point_metrics(sampled, after=-1, step=11) == {3: (0, {"lr_probe": 1.0}), 10: (0, {"acc": 0.9})}


def test_the_history_has_an_evaluation_once_at_its_step_not_at_every_point(tmp_path):
    clock = FakeClock()
    loop = LoopState()
    reporter = Reporter(ReportOptions(progress_every_s=60.0), SaveOptions(), tmp_path, loop, clock)
    reporter.start(None)
    loop.at_batch(0)
    for step in range(1, 21):
        clock.t += 0.5  # a point every second: at every other step
        loop.took_batch()
        loop.stepped()
        if step % 3 == 0:
            loop.record({"loss": 1.0 / step}, RETENTION)  # a training loss every third step
        if step == 5:
            reporter.measured(loop.report({"val_loss": 0.25}, RETENTION))
        if clock.t >= reporter.next_at:
            reporter.report(None, None)
    reporter.stop()
    records = [d for d in read_history(tmp_path) if "event" not in d]
    val = [(d["step"], d["metrics"]["val_loss"]) for d in records if "val_loss" in d["metrics"]]
    assert val == [(5, 0.25)]  # once, where it was measured: no staircase of its last value
    loss = [(d["step"], d["metrics"]["loss"]) for d in records if "loss" in d["metrics"]]
    assert loss == [(s, 1.0 / s) for s in range(3, 21, 3)]  # each at its own step, each once
    assert all(set(d["metrics"]) <= {"loss", "val_loss"} for d in records)
    assert any(d["metrics"] == {} and "step_time_s" in d for d in records)  # points between: no metric, no copy


def test_a_report_inside_a_step_is_said_once(tmp_path, caplog):
    loop = LoopState()
    reporter = Reporter(ReportOptions(log_file=False), SaveOptions(), tmp_path, loop, FakeClock())
    reporter.start(None)
    loop.at_batch(0)
    stepped(loop, 49)
    loop.took_batch()
    with caplog.at_level(logging.WARNING, logger="preempt"):
        reporter.measured(loop.report({"val_loss": 1.0}, RETENTION))
        reporter.measured(loop.report({"val_loss": 0.9}, RETENTION))
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]  # (the start line is INFO)
    assert len(said) == 1 and "run.report() was called inside step 50" in said[0]
    assert "recorded at step 49" in said[0] and "call run.report() after run.step()" in said[0]
    reporter.stop()


# ---------------------------------------------------------------------------- the epoch across processes


def test_the_summary_of_an_epoch_two_processes_ran():
    p = Progress(None)
    line = p.epoch_summary(0, {"loss": 4.4151}, 1.24, None, evaluated={"val_loss": 3.8679}, processes=2, seconds=9.61)
    assert line == "epoch 0 done: 9.61 s over 2 processes (this one 1.24 s) | loss 4.415 | val_loss 3.868"
    assert p.epoch_summary(0, {"loss": 4.4151}, 9.61, None) == "epoch 0 done in 9.61 s | loss 4.415"
    unknown = p.epoch_summary(0, {"loss": 3.746}, 1.24, None, known=False)
    assert unknown == "epoch 0 done: 1.24 s in this process (its checkpoint has no record of the rest) | loss 3.746"


def test_the_epoch_so_far_travels_in_the_checkpoint_and_the_summary_covers_it():
    first = LoopState()
    first.at_batch(0)
    first.epoch_began(100.0)
    for v in (1.0, 2.0, float("nan")):
        first.took_batch()
        first.stepped()
        first.record({"loss": v}, RETENTION)
    first.report({"val_loss": 0.5}, RETENTION)
    saved = json.loads(json.dumps(first.epoch_record(106.0)))  # as state.json keeps it
    assert saved == {
        "epoch": 0, "seconds": 6.0, "processes": 1, "totals": {"loss": [3.0, 2.0], "val_loss": [0.5, 1.0]},
        "evaluated": ["val_loss"], "known": True,
    }  # fmt: skip
    so_far = epoch_so_far(saved, "step_000000003/state.json")
    second = LoopState()
    second.restored(3, Cursor(epoch=0, batch=3), {"loss": 2.0}, None, so_far)
    second.at_batch(3)
    second.epoch_began(500.0)
    second.took_batch()
    second.stepped()
    second.record({"loss": 6.0}, RETENTION)
    line = epoch_line(Progress(None), second, 501.5, None, None)
    assert line == "epoch 0 done: 7.50 s over 2 processes (this one 1.50 s) | loss 3 | val_loss 0.5"
    second.epoch_ended()
    assert second.epoch_record(502.0) == {
        "epoch": 1, "seconds": 0.0, "processes": 0, "totals": {}, "evaluated": [], "known": True,
    }  # fmt: skip


def test_a_checkpoint_of_an_earlier_version_inside_an_epoch_says_its_part_is_unknown():
    loop = LoopState()
    loop.restored(3, Cursor(epoch=0, batch=3), {}, None, epoch_so_far(None, "x"))
    assert not loop.epoch_known and "no record of the rest" in epoch_line(Progress(None), loop, 0.0, None, None)
    at_boundary = LoopState()
    at_boundary.restored(16, Cursor(epoch=1, batch=0, point="epoch"), {}, None, None)
    assert at_boundary.epoch_known


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seconds": -1.0}, "epoch.seconds: expected a finite number >= 0, found -1.0"),
        ({"processes": "2"}, "epoch.processes: expected an integer >= 0, found '2'"),
        ({"totals": {"loss": [1.0]}}, r"epoch.totals\['loss'\]: expected \[sum, count\], two finite numbers"),
        ({"totals": {"loss": [1.0, -2]}}, r"epoch.totals\['loss'\]: expected a count >= 0"),
        ({"evaluated": [3]}, "epoch.evaluated: expected a list of metric names"),
    ],
)
def test_a_forged_epoch_record_is_refused_at_the_boundary_naming_the_field(change, message):
    good = {"epoch": 0, "seconds": 1.0, "processes": 1, "totals": {}, "evaluated": [], "known": True}
    assert epoch_so_far(good, "w") is not None
    with pytest.raises(CorruptCheckpointError, match=message):  # (check_restored calls it: test_restored_values.py)
        epoch_so_far({**good, **change}, "w")


# ---------------------------------------------------------------------------- the best checkpoint and inspect


def test_how_inspect_says_the_best():
    best = {"metric": "val_loss", "mode": "min", "value": 0.5, "step": 50}
    assert best_note(best, True, 50) == "val_loss min = 0.5 at step 50 (this checkpoint holds it)"
    assert best_note(best, False, 60) == "val_loss min = 0.5 at step 50 (not this checkpoint)"
    assert (
        best_note(best, True, 51)
        == "val_loss min = 0.5 at step 50 (this checkpoint, 1 step(s) later, is the first saved after it)"
    )


def steps(run: PreemptibleRun, model: torch.nn.Module, opt: torch.optim.Optimizer, after_step) -> None:
    batches = [torch.randn(2, 4) for _ in range(6)]
    for _ in run.epochs(1):
        for x in run.batches(batches):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            run.step()
            after_step(run)


def test_an_evaluation_after_run_step_is_saved_as_that_steps_best(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(checkpoint_interval=None, best_metric="val_loss", keep_best=1, keep_last=1, log_file=False)
    weights = {}

    def evaluate(run: PreemptibleRun) -> None:
        if run.global_step == 3:
            weights[3] = model.weight.detach().clone()
            run.report({"val_loss": 0.5})
            assert run.last_save.step == 3 and run.last_save.reason == "best"  # at once, not at the next step

    with PreemptibleRun(tmp_path, model=model, optimizer=opt, **kw) as run:
        steps(run, model, opt, evaluate)
        with pytest.raises(ValueError, match=r"run.report\(step=7\): expected a step from 0 to 6"):
            run.report({"val_loss": 0.1}, step=7)
    best = CheckpointManager(tmp_path, owner=False).candidates("best")[0]
    assert best.step == 3 and best.manifest.best["step"] == 3 and best.manifest.is_best
    assert torch.equal(load_file(str(best.path / "model.safetensors"))["weight"], weights[3])
