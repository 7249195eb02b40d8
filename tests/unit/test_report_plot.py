"""``preempt report --plot``: the run's timeline drawn for every run, metrics as panels, sparse ones as points.

Fed hand-written history lines (no processes, no clock); the figure's artists are read back through their gids.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from preempt.cli import plot
from preempt.cli.main import main
from preempt.cli.timeline import build

matplotlib = pytest.importorskip("matplotlib")  # an extra ([plot]); installed with [test], so CI runs these
matplotlib.use("Agg")

T0 = 1.7e9  # a time the report takes for a date


def no_metrics() -> list[dict]:
    """A run stopped by SIGTERM at step 40 and finished by its second process; no metric recorded anywhere."""
    return [
        {"t": T0 + 2, "event": "start", "step": 0, "pid": 1, "proc_start": T0},
        {"t": T0 + 6, "event": "checkpoint", "step": 40, "reason": "preempt", "stall_s": 0.1, "write_s": 0.1},
        {"t": T0 + 6, "event": "stop", "step": 40, "cause": "SIGTERM"},
        {"t": T0 + 6.1, "event": "exit", "pid": 1},
        {"t": T0 + 10, "event": "resume", "step": 40, "pid": 2, "proc_start": T0 + 8},
        {"t": T0 + 14, "event": "complete", "step": 80},
        {"t": T0 + 14.1, "event": "exit", "pid": 2},
    ]


def with_evaluations() -> list[dict]:
    """A loss at every point (steps 1-60) and a val_loss measured at steps 25 and 50 only."""
    lines: list[dict] = [{"t": T0 + 1, "event": "start", "step": 0, "pid": 1, "proc_start": T0}]
    for step in range(1, 61):
        metrics = {"loss": 2.0 * math.exp(-step / 30) + (0.2 if step % 2 else 0.0)}  # noisy: smoothing shows
        if step % 25 == 0:
            metrics["val_loss"] = 1.0 / step
        lines.append({"t": T0 + 1 + step * 0.1, "step": step, "epoch": 0, "metrics": metrics})
    lines.append({"t": T0 + 8, "event": "complete", "step": 60})
    return lines


def write(d: Path, lines: list[dict]) -> Path:
    d.mkdir()
    (d / "history.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


def test_a_run_without_metrics_still_gets_its_timeline_drawn(tmp_path, capsys):
    d = write(tmp_path / "run", no_metrics())
    png = tmp_path / "run.png"
    assert main(["report", str(d), "--plot", str(png), "--json"]) == 0
    drawn = json.loads(capsys.readouterr().out)["plot"]
    assert png.stat().st_size > 0
    assert drawn["metrics"] == [] and drawn["metric"] is None and drawn["points"] == 0
    assert drawn["timeline_points"] == 5  # each line with a step: start, checkpoint, stop; resume, complete
    assert drawn["restarts"] == [40] and drawn["stops"] == [{"step": 40, "how": "stop"}]
    assert main(["report", str(d), "--plot", str(png)]) == 0
    assert "plot of the timeline (the history records no metric)" in capsys.readouterr().out


def lines_of(fig, gid: str):
    found = [line for ax in fig.axes for line in ax.get_lines() if line.get_gid() == gid]
    assert len(found) == 1, (gid, [line.get_gid() for ax in fig.axes for line in ax.get_lines()])
    return found[0]


def test_a_sparse_metric_is_drawn_as_points_and_the_loss_as_points_with_a_smoothed_line():
    report = build(with_evaluations())
    assert plot.pick(report, None) == ["loss", "val_loss"]
    assert plot.is_sparse(report, "val_loss") and not plot.is_sparse(report, "loss")
    fig, drawn = plot.figure(report, ["loss", "val_loss"], title="run")
    try:
        assert len(fig.axes) == 3  # the timeline, then one panel per metric
        assert [(m["name"], m["points"], m["drawn_as"]) for m in drawn["metrics"]] == [
            ("loss", 60, "smoothed"),
            ("val_loss", 2, "points"),
        ]
        evals = lines_of(fig, "val_loss 1")  # two markers, no segment joining them
        assert list(evals.get_xdata()) == [25, 50] and evals.get_marker() == "o" and evals.get_linestyle() == "None"
        raw, smoothed = lines_of(fig, "loss 1"), lines_of(fig, "loss 1 smoothed")
        assert raw.get_linestyle() == "None" and len(raw.get_xdata()) == 60
        assert smoothed.get_linestyle() == "-" and list(smoothed.get_xdata()) == list(range(1, 61))
        values = list(raw.get_ydata())
        assert list(smoothed.get_ydata()) == pytest.approx(plot.smooth(values))
        assert max(map(abs, smoothed.get_ydata()[1:] - smoothed.get_ydata()[:-1])) < 0.2  # the noise is smoothed
        timeline = lines_of(fig, "timeline 1")
        assert list(timeline.get_ydata()) == [0, *range(1, 61), 60]  # start line, points, complete line
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_smoothing_follows_the_values_and_keeps_a_short_series():
    assert plot.smooth([3.0, 3.0, 3.0]) == [3.0, 3.0, 3.0]
    assert plot.smooth([1.0, 5.0]) == [1.0, 5.0]  # a span of 1 point: the values themselves
    steps = plot.smooth([0.0] * 50 + [1.0] * 50)
    assert steps[0] == 0.0 and 0.0 < steps[50] < 1.0 and steps[-1] == pytest.approx(1.0, abs=1e-3)
