"""``preempt report DIR``: the run's timeline across its processes, its goodput, and a picture of it.

Reads ``DIR/history.jsonl`` (:mod:`preempt.health.history`; every line, through the
same safe reader as the other commands) and computes with
:mod:`preempt.cli.timeline`. ``--plot FILE.png`` draws a metric against the
global step and against wall time, each process in its own colour, with its
stops and restarts marked; it needs matplotlib (``pip install
'preempt[plot]'``), and says so when it is missing. No torch.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..checkpoint import safe_io
from ..health.history import HISTORY_FILE, read_history
from . import timeline
from .output import EXIT_OK, EXIT_USAGE, CommandFailed, emit


def cmd_report(args: argparse.Namespace) -> int:
    save_dir: Path = args.dir
    if args.metric is not None and args.plot is None:
        raise CommandFailed(EXIT_USAGE, f"--metric {args.metric}: it chooses what --plot draws; give --plot FILE.png")
    path = save_dir / HISTORY_FILE
    try:
        lines = read_history(path, timeline=False)
    except FileNotFoundError:
        raise CommandFailed(
            EXIT_USAGE, f"{path}: no such file; expected the history a run keeps (PreemptibleRun(log_file=True))"
        ) from None
    except (OSError, ValueError) as e:
        text = safe_io.describe_error(path, e) if isinstance(e, OSError) else str(e)
        raise CommandFailed(EXIT_USAGE, f"cannot read the history: {text}") from None
    report = timeline.build(lines)
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
        if drawn is not None:
            doc["plot"] = drawn
        emit(doc)
        return EXIT_OK
    for line in timeline.render(report, str(save_dir)):
        print(line)
    if drawn is not None:
        print(
            f"plot of {drawn['metric']} ({drawn['points']} points, {len(drawn['restarts'])} restart(s),"
            f" {len(drawn['stops'])} stop(s) marked) written to {drawn['path']}"
        )
    return EXIT_OK


def _pick_metric(report: timeline.Report, wanted: str | None) -> str:
    if wanted is not None:
        if wanted not in report.metrics:
            have = ", ".join(sorted(report.metrics)) or "none"
            raise CommandFailed(EXIT_USAGE, f"--metric {wanted}: not in the history (metrics recorded: {have})")
        return wanted
    if not report.metrics:
        raise CommandFailed(
            EXIT_USAGE,
            "nothing to plot: the history has no metric records (give run.step(metrics=...), and let the run"
            " reach a progress report: progress_every_s)",
        )
    return "loss" if "loss" in report.metrics else sorted(report.metrics)[0]


def _mark(ax: Any, x: float, text: str, colour: str, style: str, height: float) -> None:
    ax.axvline(x, color=colour, linestyle=style, linewidth=1.2)
    ax.annotate(
        text,
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
    points = report.metrics[name]
    t0 = report.processes[0].started if report.processes else min(t for t, *_ in points)
    drawn: dict[str, Any] = {"path": str(out), "metric": name, "points": 0, "restarts": [], "stops": []}
    fig, (by_step, by_time) = plt.subplots(2, 1, figsize=(9, 7), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for p in report.processes:
        mine = [(t, s, v) for t, s, v, i in points if i == p.index]
        colour = colours[(p.index - 1) % len(colours)]
        label = f"process {p.index}: {p.stop_text().split(' (')[0]}"
        drawn["points"] += len(mine)
        if mine:
            by_step.plot([s for _, s, _ in mine], [v for *_, v in mine], ".-", color=colour, label=label)
            by_time.plot([t - t0 for t, _, _ in mine], [v for *_, v in mine], ".-", color=colour, label=label)
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
        "lost_s, lost_steps, restarts, stops (each with its cause), timeline (one entry per process).",
    )
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="draw a metric against step and wall time")
    p.add_argument("--metric", help="the metric to draw (default: loss, else the first recorded)")
