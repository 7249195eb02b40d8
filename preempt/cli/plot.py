"""The picture of ``preempt report --plot``: the run's timeline, then one panel per recorded metric.

The top panel is drawn for every run, whether it recorded metrics or not: the global step against wall time since
the first start, one colour per process, its start-up shaded in its colour, each restart (dashed) and stop (dotted:
black for a stop, red for a death or an error) marked, the time between processes shaded grey, its checkpoints as
ticks, and the steps that were done again (after a crash or a NaN rollback went back to an older checkpoint) drawn
over in red.

Below it, one panel per metric (the one ``--metric`` names, else every recorded one up to :data:`MAX_PANELS`, loss
first), against the global step. A metric recorded at most of the history's metric points (the training loss) is
drawn as its raw points with a smoothed line over them (:func:`smooth`, per process); a sparse one (an evaluation
every N steps: recorded at fewer than half of them, :func:`is_sparse`) as points only, never joined by a line.
Values matplotlib cannot scale or draw (NaN, inf, beyond ±:data:`PLOT_LIMIT`) are marked with a red x at the top
edge of their panel instead.

matplotlib is an optional extra (``pip install 'preempt-torch[plot]'``), imported only here and only when drawing.
No torch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..checkpoint import safe_io
from . import timeline
from .output import EXIT_USAGE, CommandFailed

PLOT_LIMIT = 1e100  # metric values past it are marked, not drawn: matplotlib's ticks fail on a span near 1e308
MAX_PANELS = 4  # metric panels drawn without --metric; the others are named in what plot() returns
SPARSE_FRACTION = 0.5  # a metric recorded at fewer than this fraction of the history's metric points is drawn as points
MAX_LEGEND = 8  # processes named in a legend; a run of more restarts is told by its marks
SMOOTH_FRACTION = 0.05  # the smoothing's span: this fraction of a process's points (at least 1: no smoothing)


def recorded(report: timeline.Report) -> list[str]:
    """The metrics the history records (finite or not): loss first, then by name."""
    names = set(report.metrics) | set(report.nonfinite)
    return sorted(names, key=lambda n: (n != "loss", n))


def pick(report: timeline.Report, wanted: str | None) -> list[str]:
    """The metrics to draw a panel for: ``wanted`` alone, else every recorded one (none is fine: the timeline is
    drawn anyway), at most :data:`MAX_PANELS`.

    Raises:
        CommandFailed: ``wanted`` is not in the history.
    """
    names = recorded(report)
    if wanted is None:
        return names[:MAX_PANELS]
    if wanted not in names:
        raise CommandFailed(
            EXIT_USAGE, f"--metric {wanted}: not in the history (metrics recorded: {', '.join(names) or 'none'})"
        )
    return [wanted]


def is_sparse(report: timeline.Report, name: str) -> bool:
    """Whether ``name`` was recorded at fewer than :data:`SPARSE_FRACTION` of the points that carry any metric."""
    everywhere = {(t, s, i) for pts in report.metrics.values() for t, s, _, i in pts}
    everywhere |= {(t, s, i) for pts in report.nonfinite.values() for t, s, _, i in pts}
    mine = {(t, s, i) for t, s, _, i in report.metrics.get(name, [])}
    mine |= {(t, s, i) for t, s, _, i in report.nonfinite.get(name, [])}
    return len(mine) < SPARSE_FRACTION * len(everywhere)


def smooth(values: Sequence[float], fraction: float = SMOOTH_FRACTION) -> list[float]:
    """A debiased exponential moving average (TensorBoard's smoothing) whose span is ``fraction`` of the points."""
    span = max(1.0, fraction * len(values))
    weight = 1.0 - 2.0 / (span + 1.0)  # 0 for a span of 1: the values themselves
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        avg = weight * avg + (1.0 - weight) * v
        norm = weight * norm + (1.0 - weight)
        out.append(avg / norm)
    return out


def _mark(ax: Any, x: float, text: str, colour: str, style: str, height: float) -> None:
    ax.axvline(x, color=colour, linestyle=style, linewidth=1.2)
    ax.annotate(
        safe_io.printable(text),  # a stop's cause is the file's text: no control character reaches the font
        (x, height),
        xycoords=("data", "axes fraction"),
        rotation=90,
        fontsize="x-small",
        color=colour,
        xytext=(2, 0),
        textcoords="offset points",
        va="top" if height > 0.5 else "bottom",
    )


def _stop(p: timeline.Process) -> tuple[str, str]:
    """The colour and the words of a process's end mark."""
    return ("black", p.cause or "stop") if p.how == "stop" else ("red", p.how)


def _timeline_panel(ax: Any, report: timeline.Report, colours: list[str], drawn: dict[str, Any]) -> None:
    ps = report.processes
    t0 = ps[0].started
    labelled: set[str] = set()

    def once(label: str) -> str | None:  # each kind of mark in the legend once
        if label in labelled:
            return None
        labelled.add(label)
        return label

    for prev, nxt in zip(ps, ps[1:], strict=False):
        if nxt.started > prev.end:
            ax.axvspan(prev.end - t0, nxt.started - t0, color="grey", alpha=0.15, label=once("between processes"))
    for p in ps:
        colour = colours[(p.index - 1) % len(colours)]
        if p.entered > p.started:
            ax.axvspan(p.started - t0, p.entered - t0, color=colour, alpha=0.12, label=once("start-up"))
        seen = sorted(p.steps_seen)
        xs, ys = [t - t0 for t, _ in seen], [s for _, s in seen]
        drawn["timeline_points"] += len(xs)
        text = safe_io.printable(f"process {p.index}: {p.stop_text().split(' (')[0]}")
        label = text if len(ps) <= MAX_LEGEND else None  # beyond, the marks and the colours tell the processes apart
        ax.plot(xs, ys, "-", color=colour, label=label, gid=f"timeline {p.index}")
        if p.end_estimated and seen:  # a killed process: to the step it reached, at its own pace
            ax.plot([xs[-1], p.end - t0], [ys[-1], p.end_step], ":", color=colour)
        if p.checkpoints:
            ax.plot(
                [c.t - t0 for c in p.checkpoints],
                [c.step for c in p.checkpoints],
                "|",
                color="black",
                markersize=8,
                linestyle="none",
                label=once("checkpoint"),
            )
        for t_from, s_from, t_to, s_to in p.recomputed:
            seg = [(t_from, s_from), *[(t, s) for t, s in seen if t_from < t < t_to], (t_to, s_to)]
            ax.plot(
                [t - t0 for t, _ in seg],
                [s for _, s in seg],
                "-",
                color="red",
                linewidth=5,
                alpha=0.3,
                label=once("recomputed later"),
                gid=f"recomputed {p.index}",
            )
        if p.index > 1:
            _mark(ax, p.started - t0, f"start {p.index}", colour, "--", 0.02)
        if p.how != "complete":
            colour, what = _stop(p)
            _mark(ax, p.work_end - t0, what, colour, ":", 0.92)
    ax.set_xlabel("wall time since the first start (s)")
    ax.set_ylabel("global step")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="x-small", loc="upper left")


def _metric_panel(ax: Any, report: timeline.Report, name: str, colours: list[str]) -> dict[str, Any]:
    values = report.metrics.get(name, [])
    points = [x for x in values if abs(x[2]) <= PLOT_LIMIT]
    off = [(s, i) for _, s, v, i in values if abs(v) > PLOT_LIMIT]
    off += [(s, i) for _, s, _, i in report.nonfinite.get(name, [])]
    sparse = is_sparse(report, name)
    out = {"name": name, "points": len(points), "off_scale": len(off), "drawn_as": "points" if sparse else "smoothed"}
    off_label: str | None = f"non-finite or beyond ±{PLOT_LIMIT:g}"
    for p in report.processes:
        colour = colours[(p.index - 1) % len(colours)]
        mine = sorted((s, v) for _, s, v, i in points if i == p.index)
        xs, ys = [s for s, _ in mine], [v for _, v in mine]
        label = f"process {p.index}" if len(report.processes) <= MAX_LEGEND else None
        if mine and sparse:
            ax.plot(xs, ys, "o", linestyle="none", color=colour, label=label, gid=f"{name} {p.index}")
        elif mine:
            ax.plot(xs, ys, ".", linestyle="none", color=colour, alpha=0.5, markersize=5, gid=f"{name} {p.index}")
            ax.plot(xs, smooth(ys), "-", color=colour, label=label, gid=f"{name} {p.index} smoothed")
        if mine_off := [s for s, i in off if i == p.index]:
            how, off_label = off_label, None  # in the legend once
            ax.plot(mine_off, [0.97] * len(mine_off), "x", color="red", transform=ax.get_xaxis_transform(), label=how)
        if p.index > 1:
            _mark(ax, p.start_step, f"start {p.index}", colour, "--", 0.02)
        if p.how != "complete":
            colour, what = _stop(p)
            _mark(ax, p.end_step, what, colour, ":", 0.92)
    ax.set_xlabel("global step")
    ax.set_ylabel(name)
    ax.set_title(
        f"{name}: {'points where it was measured' if sparse else 'raw points, and a smoothed line over them'}",
        fontsize="small",
    )
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="x-small")
    return out


def figure(report: timeline.Report, names: Sequence[str], *, title: str) -> tuple[Any, dict[str, Any]]:
    """The figure (matplotlib imported by the caller) and what it drew; ``report`` has at least one process."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1 + len(names), 1, figsize=(9, 3.4 * (1 + len(names)) + 0.6), constrained_layout=True)
    axes = [axes] if len(names) == 0 else list(axes)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn: dict[str, Any] = {"timeline_points": 0}
    _timeline_panel(axes[0], report, colours, drawn)
    drawn["metrics"] = [_metric_panel(ax, report, name, colours) for ax, name in zip(axes[1:], names, strict=True)]
    for ax in axes:
        ax.grid(alpha=0.3)
    g = report.goodput
    fig.suptitle(
        f"{title}: goodput {'-' if g is None else f'{g:.1%}'}; dashed: a process starts, dotted: it stops (black)"
        " or dies (red)",
        fontsize="medium",
    )
    return fig, drawn


def plot(report: timeline.Report, out: Path, wanted: str | None, *, title: str) -> dict[str, Any]:
    """Writes the picture to ``out`` (atomically); returns what it drew.

    Raises:
        CommandFailed: ``out`` is no .png/.svg/.pdf in an existing directory, ``wanted`` is not recorded, the
            history has no process, matplotlib is missing, or the file cannot be written.
    """
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise CommandFailed(EXIT_USAGE, f"--plot {out}: expected a .png, .svg or .pdf file name")
    if not out.parent.is_dir():
        raise CommandFailed(EXIT_USAGE, f"--plot {out}: no such directory {out.parent}")
    names = pick(report, wanted)
    if not report.processes:
        raise CommandFailed(EXIT_USAGE, "nothing to plot: the history has no start line (no process of the run wrote)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CommandFailed(
            EXIT_USAGE, "--plot needs matplotlib, which is not installed: pip install 'preempt-torch[plot]'"
        ) from None
    fig, drawn = figure(report, names, title=title)
    ps = report.processes
    drawn = {
        "path": str(out),
        "metric": names[0] if names else None,
        **drawn,
        "points": sum(m["points"] for m in drawn["metrics"]),
        "off_scale": sum(m["off_scale"] for m in drawn["metrics"]),
        "left_out": [n for n in recorded(report) if n not in names] if wanted is None else [],
        "restarts": [p.start_step for p in ps[1:]],
        "stops": [{"step": p.end_step, "how": p.how} for p in ps if p.how != "complete"],
    }
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}{out.suffix}")
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, out)
    except OSError as e:
        raise CommandFailed(EXIT_USAGE, f"--plot {out}: cannot be written ({e.strerror or e})") from None
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return drawn
