"""What a user sees on the console: the start line, progress at a cadence short runs see too, an ETA right under
gradient accumulation, epoch means, routine checkpoints at DEBUG, and the log level."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import pytest
import torch
from helpers import FakeClock

from preempt import PreemptibleRun
from preempt.run.config import ReportOptions, RunConfig, SaveOptions
from preempt.run.loop_state import LoopState
from preempt.run.reporting import Reporter, point_interval, start_line, total_steps


def test_the_total_counts_optimizer_steps_under_gradient_accumulation():
    loop = LoopState()
    loop.epoch, loop.batch, loop.global_step = 0, 40, 10  # 4 batches per optimizer step
    assert total_steps((0, 0, 0), loop, batches_per_epoch=100, epochs=2) == 50  # 200 batches / 4, not 170
    loop.epoch, loop.batch, loop.global_step = 1, 60, 40  # this process started at step 25, epoch 0, batch 100
    assert total_steps((25, 0, 100), loop, batches_per_epoch=100, epochs=2) == 50
    assert total_steps((40, 1, 60), loop, batches_per_epoch=100, epochs=2) is None  # no batch seen yet


def test_progress_comes_early_then_every_progress_every_s(tmp_path):
    clock = FakeClock()
    loop = LoopState()
    reporter = Reporter(ReportOptions(progress_every_s=60.0, log_file=False), SaveOptions(), tmp_path, loop, clock)
    reporter.start(None)
    waits = []
    for _ in range(6):
        waits.append(reporter.next_at - clock.t)
        clock.t = reporter.next_at
        loop.global_step += 10
        reporter.report(None, None)
    assert waits == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0]
    quick = Reporter(ReportOptions(progress_every_s=2.0, log_file=False), SaveOptions(), tmp_path, LoopState(), clock)
    quick.start(None)
    assert quick.next_at - clock.t == 2.0  # an explicit shorter period is kept from the start


def test_history_gets_metric_points_denser_than_the_progress_lines(tmp_path, caplog):
    """Each second for the first 100 s, then a hundredth of the process's age, never sparser than the lines."""
    assert [point_interval(a, 60.0) for a in (0.0, 99.0, 500.0, 5000.0, 1e5)] == [1.0, 1.0, 5.0, 50.0, 60.0]
    assert point_interval(500.0, 2.0) == 2.0
    clock = FakeClock()
    loop = LoopState()
    reporter = Reporter(ReportOptions(progress_every_s=60.0), SaveOptions(), tmp_path, loop, clock)
    reporter.start(None)
    points, lines = [], []
    with caplog.at_level(logging.INFO, logger="preempt"):
        while clock.t < 1000.0 + 300.0:
            clock.t = reporter.next_at
            loop.global_step += 1
            loop.metrics = {"loss": 1.0 / loop.global_step}
            caplog.clear()
            reporter.report(None, None)
            lines += [clock.t - 1000.0 for r in caplog.records if r.getMessage().startswith("step ")]
    reporter.stop()
    for line in (tmp_path / "history.jsonl").read_text().splitlines():
        doc = json.loads(line)
        if "metrics" in doc:
            points.append(doc["step"])
    assert lines == [5.0, 15.0, 35.0, 75.0, 135.0, 195.0, 255.0]  # the console: as before
    # 100 in the first 100 s, then about 100 * ln(300 / 100) = 110 up to 300 s
    assert abs(len(points) - (100 + 100 * math.log(3))) <= 3, len(points)
    assert points == sorted(points) and len(points) > 10 * len(lines)


def test_the_epoch_summary_shows_epoch_means(tmp_path, caplog):
    clock = FakeClock()
    loop = LoopState()
    cfg = RunConfig(log_file=False)
    reporter = Reporter(cfg.report, cfg.save, tmp_path, loop, clock)
    reporter.start(None)
    loop.epoch_began(clock())
    for v in (1.0, 2.0, 6.0, float("nan")):
        loop.record({"loss": v}, cfg.retention())
    with caplog.at_level(logging.INFO, logger="preempt"):
        reporter.epoch_summary()
    assert "| loss 3" in caplog.text and "nan" not in caplog.text  # (1+2+6)/3, not the last value (nan)
    loop.epoch_ended()
    assert loop.epoch_means() == {}


def test_the_start_line_says_where_and_what_is_saved(tmp_path):
    cfg = RunConfig(checkpoint_interval=300, checkpoint_every_steps=100, keep_last=3, keep_best=1, best_metric="val")
    fresh = start_line(cfg, tmp_path, None, 0)
    assert fresh.startswith(f"{tmp_path}: fresh start; checkpoints every 5m") and "every 100 steps" in fresh
    assert "when val improves" in fresh and "keeping the last 3, the best 1 by val (min)" in fresh
    assert "(in the background)" in fresh
    resumed = start_line(RunConfig(async_save=False, checkpoint_interval=None), tmp_path, tmp_path / "s", 7)
    assert "resumed at step 7" in resumed and "(synchronously)" in resumed
    said = start_line(RunConfig(checkpoint_interval=None), tmp_path, tmp_path / "s", 7, "resumed from s: step 7")
    assert said.startswith("resumed from s: step 7; checkpoints at a stop") and str(tmp_path) not in said
    other = start_line(RunConfig(), tmp_path, tmp_path / "b" / "s", 7, "resumed from b/s: step 7")  # a request's
    assert other.startswith(f"{tmp_path}: resumed from b/s: step 7; checkpoints")


def tiny_run(save_dir: Path, **kw) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with PreemptibleRun(save_dir, model=model, optimizer=opt, checkpoint_interval=None, **kw) as run:
        for _ in run.epochs(1):
            for x in run.batches([torch.randn(3, 4) for _ in range(6)]):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
                run.step(metrics={"loss": 1.0})
                run.wait_for_checkpoint()


def test_routine_background_checkpoints_are_debug_lines(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("PREEMPT_LOG_LEVEL", raising=False)
    with caplog.at_level(logging.DEBUG, logger="preempt"):
        tiny_run(tmp_path / "a", checkpoint_every_steps=2)
    background = [r for r in caplog.records if "in the background; the loop waited" in r.getMessage()]
    assert len(background) >= 2 and all(r.levelno == logging.DEBUG for r in background)
    final = [r for r in caplog.records if "(final) written" in r.getMessage()]
    assert final and final[0].levelno == logging.INFO
    starts = [r.getMessage() for r in caplog.records if "fresh start; checkpoints" in r.getMessage()]
    assert starts == [
        f"{tmp_path / 'a'}: fresh start; checkpoints every 2 steps, at a stop and at the end"
        " (in the background); keeping the last 2"
    ]


def test_log_level_on_the_run_and_the_environment_variable_wins(tmp_path, monkeypatch):
    logger = logging.getLogger("preempt")
    before = logger.level
    try:
        monkeypatch.delenv("PREEMPT_LOG_LEVEL", raising=False)
        tiny_run(tmp_path / "a", log_level="warning")
        assert logger.level == logging.WARNING
        monkeypatch.setenv("PREEMPT_LOG_LEVEL", "DEBUG")
        tiny_run(tmp_path / "b", log_level="warning")
        assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(before)
    with pytest.raises(ValueError, match="log_level: expected one of DEBUG, INFO"):
        RunConfig(log_level="LOUD")


def test_metrics_keep_the_loops_order_after_a_resume():
    from preempt.checkpoint.manifest import Cursor

    cfg = RunConfig()
    loop = LoopState()
    loop.restored(10, Cursor(), {"acc": 0.5, "loss": 2.0, "val": 1.0}, None)  # as a checkpoint stores them: sorted
    loop.record({"loss": 1.5, "acc": 0.6}, cfg.retention())
    assert list(loop.metrics) == ["loss", "acc", "val"]
    loop.record({"acc": 0.7}, cfg.retention())  # from here on, as any dict: the order stays
    assert list(loop.metrics) == ["loss", "acc", "val"] and loop.metrics["acc"] == 0.7


def test_a_resumed_start_says_what_it_loaded_in_one_line(tmp_path, caplog, monkeypatch):
    """One line per start: what was loaded, from where, and what will be saved and kept."""
    monkeypatch.delenv("PREEMPT_LOG_LEVEL", raising=False)
    tiny_run(tmp_path / "a")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="preempt"):
        tiny_run(tmp_path / "a", exit_if_complete=False)  # resumes from the final checkpoint, step 6
    said = [r.getMessage() for r in caplog.records if re.search(r"(?:^|: )resumed (?:from|at) ", r.getMessage())]
    assert len(said) == 1, said
    ckpt = re.escape(str(tmp_path / "a" / "step_000000006"))
    assert re.fullmatch(
        rf"resumed from {ckpt}: step 6, epoch 1, batch 0/6, saved \S+ s ago; checkpoints at a stop and at the end"
        r" \(in the background\); keeping the last 2",
        said[0],
    ), said
