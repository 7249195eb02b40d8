"""``preempt report DIR``: the run's timeline across its processes, its goodput, and a picture of it.

Reads ``DIR/history.jsonl`` (:mod:`preempt.health.history`; every line, through the
same safe reader as the other commands, in bounded memory: a line over 1 MiB is
skipped with a note on stderr) and computes with :mod:`preempt.cli.timeline`.
``--plot FILE.png`` draws a metric against the global step and against wall
time, each process in its own colour, with its stops and restarts marked; it
needs matplotlib (``pip install 'preempt[plot]'``), and says so when it is
missing. No torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from ..checkpoint import safe_io
from ..health.history import HISTORY_FILE, iter_history
from . import timeline
from .output import EXIT_OK, EXIT_USAGE, CommandFailed, emit

PLOT_LIMIT = 1e100  # metric values past it are marked, not drawn: matplotlib's ticks fail on a span near 1e308


def cmd_report(args: argparse.Namespace) -> int:
    save_dir: Path = args.dir
    if args.metric is not None and args.plot is None:
        raise CommandFailed(EXIT_USAGE, f"--metric {args.metric}: it chooses what --plot draws; give --plot FILE.png")
    path = save_dir / HISTORY_FILE
    notes: list[str] = []  # lines of the file skipped for their length: said on stderr, and kept in --json
    try:
        report = timeline.build(iter_history(path, note=notes.append))
    except FileNotFoundError:
        raise CommandFailed(
            EXIT_USAGE, f"{path}: no such file; expected the history a run keeps (PreemptibleRun(log_file=True))"
        ) from None
    except OSError as e:  # no permission, a directory or a FIFO in its place, a read error
        why = f"expected {e.expected}, found {e.found}" if isinstance(e, safe_io.UnsafeFileError) else e.strerror or e
        raise CommandFailed(EXIT_USAGE, f"{safe_io.path_text(path)}: cannot be read: {why}") from None
    for note in notes:
        print(f"preempt report: note: {note}", file=sys.stderr)
    drawn = None
    if args.plot is not None:
        if safe_io.within(args.plot, save_dir):
            raise CommandFailed(
                EXIT_USAGE,
                f"--plot {args.plot}: is inside the save_dir {save_dir}, where every file belongs to the run;"
                " nothing written. Give a path outside it",
            )
        drawn = plot(report, args.plot, args.metric, title=str(save_dir))
    if args.json:
        doc = {"dir": str(save_dir), **report.to_json()}
        doc["notes"] = notes + doc["notes"]
        if drawn is not None:
            doc["plot"] = drawn
        emit(doc)
        return EXIT_OK
    for line in timeline.render(report, str(save_dir)):
        print(line)
    if drawn is not None:
        print(
            f"plot of {drawn['metric']} ({drawn['points']} points, {drawn['off_scale']} off the scale,"
            f" {len(drawn['restarts'])} restart(s),"
            f" {len(drawn['stops'])} stop(s) marked) written to {drawn['path']}"
        )
    return EXIT_OK


def _pick_metric(report: timeline.Report, wanted: str | None) -> str:
    recorded = set(report.metrics) | set(report.nonfinite)
    if wanted is not None:
        if wanted not in recorded:
            have = ", ".join(sorted(recorded)) or "none"
            raise CommandFailed(EXIT_USAGE, f"--metric {wanted}: not in the history (metrics recorded: {have})")
        return wanted
    if not recorded:
        raise CommandFailed(
            EXIT_USAGE,
            "nothing to plot: the history has no metric records (give run.step(metrics=...), and let the run"
            " reach a progress report: progress_every_s)",
        )
    return "loss" if "loss" in recorded else sorted(recorded)[0]


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


def plot(report: timeline.Report, out: Path, wanted: str | None, *, title: str) -> dict[str, Any]:
    """Writes the picture to ``out``; returns what it drew (metric, points, the steps of restarts and stops)."""
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise CommandFailed(EXIT_USAGE, f"--plot {out}: expected a .png, .svg or .pdf file name")
    if not out.parent.is_dir():
        raise CommandFailed(EXIT_USAGE, f"--plot {out}: no such directory {out.parent}")
    name = _pick_metric(report, wanted)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CommandFailed(
            EXIT_USAGE, "--plot needs matplotlib, which is not installed: pip install 'preempt[plot]'"
        ) from None
    # Values matplotlib cannot scale (a span past the float range breaks its ticks) or cannot draw (NaN, inf) are
    # marked at the top edge of each panel instead.
    values = report.metrics.get(name, [])
    points = [x for x in values if abs(x[2]) <= PLOT_LIMIT]
    off = [(t, s, i) for t, s, v, i in values if abs(v) > PLOT_LIMIT]
    off += [(t, s, i) for t, s, _, i in report.nonfinite.get(name, [])]
    t0 = report.processes[0].started  # a metric has a process: lines before the first start are left out
    drawn: dict[str, Any] = {
        "path": str(out),
        "metric": name,
        "points": 0,
        "off_scale": len(off),
        "restarts": [],
        "stops": [],
    }
    fig, (by_step, by_time) = plt.subplots(2, 1, figsize=(9, 7), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    off_label: str | None = f"non-finite or beyond ±{PLOT_LIMIT:g}"
    for p in report.processes:
        mine = [(t, s, v) for t, s, v, i in points if i == p.index]
        colour = colours[(p.index - 1) % len(colours)]
        label = safe_io.printable(f"process {p.index}: {p.stop_text().split(' (')[0]}")
        drawn["points"] += len(mine)
        if mine:
            by_step.plot([s for _, s, _ in mine], [v for *_, v in mine], ".-", color=colour, label=label)
            by_time.plot([t - t0 for t, _, _ in mine], [v for *_, v in mine], ".-", color=colour, label=label)
        if mine_off := [(t, s) for t, s, i in off if i == p.index]:
            how, off_label = off_label, None  # in the legend once
            for ax, xs in ((by_step, [s for _, s in mine_off]), (by_time, [t - t0 for t, _ in mine_off])):
                ax.plot(xs, [0.97] * len(xs), "x", color="red", transform=ax.get_xaxis_transform(), label=how)
        if p.index > 1:  # a restart: where the process took up the run
            drawn["restarts"].append(p.start_step)
            _mark(by_step, p.start_step, f"start {p.index}", colour, "--", 0.02)
            _mark(by_time, p.started - t0, f"start {p.index}", colour, "--", 0.02)
        if p.how != "complete":  # where it stopped
            colour, what = ("black", p.cause or "stop") if p.how == "stop" else ("red", p.how)
            drawn["stops"].append({"step": p.end_step, "how": p.how})
            _mark(by_step, p.end_step, what, colour, ":", 0.92)
            _mark(by_time, p.end - t0, what, colour, ":", 0.92)
    by_step.set_xlabel("global step")
    by_time.set_xlabel("wall time since the first start (s)")
    for ax in (by_step, by_time):
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    by_step.legend(fontsize="small")
    g = report.goodput
    fig.suptitle(
        f"{title}: {name}; dashed: a process starts, dotted: it stops (black) or dies (red);"
        f" goodput {'-' if g is None else f'{g:.1%}'}",
        fontsize="medium",
    )
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


def add_parser(add: Any) -> None:
    """The ``report`` subcommand, given cli.build_parser's ``add``."""
    p = add(
        "report",
        "the run's timeline across its processes, its goodput, and where the rest of the time went",
        "Reads DIR/history.jsonl (kept by the run unless log_file=False). Goodput: productive step time over the\n"
        "processes' wall time; the rest is start-up and restore, checkpoint stalls, and steps recomputed after a\n"
        "crash or a NaN rollback. --json keys: goodput, wall_s, productive_s, startup_s, checkpoint_stall_s,\n"
        "lost_s, lost_steps, restarts, stops (each with its cause), timeline (one entry per process),\n"
        "nonfinite_metrics (per metric: count, first steps, values), notes (what was set aside: a line over 1 MiB,\n"
        "a time that is not a date between 1970 and 2200, a negative or absurd duration or count). Non-finite\n"
        'numbers are the strings "nan", "inf", "-inf" (strict JSON). --plot marks non-finite values and values\n'
        f"beyond ±{PLOT_LIMIT:g} with a red x at the top of the plot.",
    )
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="draw a metric against step and wall time")
    p.add_argument("--metric", help="the metric to draw (default: loss, else the first recorded)")
