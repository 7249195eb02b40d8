"""``preempt report DIR``: the run's timeline across its processes, its goodput, and a picture of it.

Reads ``DIR/history.jsonl`` (:mod:`preempt.health.history`; every line, through the
same safe reader as the other commands, in bounded memory: a line over 1 MiB is
skipped with a note on stderr) and computes with :mod:`preempt.cli.timeline`.
``--plot FILE.png`` draws the run's timeline (steps against wall time, its
stops, restarts and recomputed steps) and a panel per recorded metric
(:mod:`preempt.cli.plot`); it needs matplotlib (``pip install
'preempt-torch[plot]'``), and says so when it is missing. No torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..checkpoint import safe_io
from ..health.history import HISTORY_FILE, iter_history
from . import plot, timeline
from .output import EXIT_OK, EXIT_USAGE, CommandFailed, emit


def cmd_report(args: argparse.Namespace, where: str | None = None) -> int:
    """``where``: the run as shown (a mirror's URL, whose history was copied into ``args.dir``); default DIR."""
    save_dir: Path = args.dir
    shown = str(save_dir) if where is None else where
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
        drawn = plot.plot(report, args.plot, args.metric, title=shown)
    if args.json:
        doc = {"dir": shown, **report.to_json()}
        doc["notes"] = notes + doc["notes"]
        if drawn is not None:
            doc["plot"] = drawn
        emit(doc)
        return EXIT_OK
    for line in timeline.render(report, shown):
        print(line)
    if drawn is not None:
        names = [m["name"] for m in drawn["metrics"]]
        what = f"the timeline and {', '.join(names)}" if names else "the timeline (the history records no metric)"
        more = f"; not drawn: {', '.join(drawn['left_out'])} (--metric NAME draws one)" if drawn["left_out"] else ""
        print(
            f"plot of {what} ({drawn['points']} metric points, {drawn['off_scale']} off the scale,"
            f" {len(drawn['restarts'])} restart(s), {len(drawn['stops'])} stop(s) marked) written to"
            f" {drawn['path']}{more}"
        )
    return EXIT_OK


def add_parser(add: Any) -> None:
    """The ``report`` subcommand, given cli.build_parser's ``add``."""
    p = add(
        "report",
        "the run's timeline across its processes, its goodput, and where the rest of the time went",
        "Reads DIR/history.jsonl (kept by the run unless log_file=False). Goodput: productive step time over the\n"
        "processes' wall time; the rest is start-up and restore, checkpoint stalls, and steps recomputed after a\n"
        "crash or a NaN rollback. --json keys: goodput, wall_s, productive_s, startup_s, checkpoint_stall_s,\n"
        "lost_s, lost_steps, restarts, stops (each with its cause; durable_s, grace_s and margin_s: its time to a\n"
        "durable checkpoint, the grace and the margin, where known), timeline (one entry per process; its\n"
        "startup: before_run_s, restore_s, first_steps, first_steps_s, step_s, warmup_s: the start-up split where\n"
        "the run was made, and its first steps against steady ones),\n"
        "nonfinite_metrics (per metric: count, first steps, values), notes (what was set aside: a line over 1 MiB,\n"
        "a time that is not a date between 1970 and 2200, a negative or absurd duration or count). Non-finite\n"
        'numbers are the strings "nan", "inf", "-inf" (strict JSON). --plot draws the run\'s timeline (steps\n'
        "against wall time, its stops, restarts and recomputed steps) and a panel per recorded metric: a sparse one\n"
        "(an evaluation) as points, the others as points with a smoothed line; non-finite values and values\n"
        f"beyond ±{plot.PLOT_LIMIT:g} are marked with a red x at the top of their panel.",
    )
    p.add_argument(
        "--plot", type=Path, metavar="FILE.png", help="draw the run's timeline, and each metric against the step"
    )
    p.add_argument("--metric", help=f"draw only this metric (default: every recorded one, up to {plot.MAX_PANELS})")
