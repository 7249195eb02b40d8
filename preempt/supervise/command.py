r"""``preempt supervise``: rerun a training command until it completes.

::

    preempt supervise --lr 3e-4 --batch-size 64 -- python train.py --lr {lr} --batch-size {batch_size}

The supervisor runs the command (CMD) as a child in a process group of its
own, streams the child's output to its own as it comes, scans it for the
patterns below, and decides from the child's exit code (and the last pattern
seen) whether to run it again and with which values. Each run of CMD is an
*attempt*. Imports no torch: it starts at once.

What each exit of the child leads to:

=========================================  =====================================================================
the child ...                              the supervisor ...
=========================================  =====================================================================
exits 0                                    exits 0
exits 75 (preempted; the supervisor was    restarts it unchanged, at most ``--max-preemptions`` times (default 3;
not signalled)                             then exits 75). A child told to stop by someone else (a ``kill`` of its
                                           pid, the walltime keeper) left its state saved, so a restart continues.
exits 78, or fails after a non-finite      divides the learning rate by ``--factor`` and restarts (needs ``--lr``)
loss pattern
exits 79, or fails after an OOM pattern    sets batch_size to ``int(batch_size / factor)`` and restarts (needs
                                           ``--batch-size``): 32 -> 21 -> 14 -> 9 -> 6 -> 4 -> 2 -> 1
anything else                              exits with the child's code: a plain bug fails again, so it is not
                                           retried. So do 74, 76 and 77, preempt's own codes with their own
                                           meaning (:mod:`preempt.errors`), whatever the output said.
=========================================  =====================================================================

"Fails after a pattern" means: a non-zero exit (or death by a signal) and a
pattern in the output; the *last* pattern seen decides between non-finite and
OOM (a run that logged a NaN early on and then ran out of memory is an OOM).
A pattern in the output of a child that exits 0 or 75 changes nothing, and a
child that prints a pattern and keeps running is left alone: preempt's runtime
guard skips a bad step, logs it and goes on, and only its exit code (78,
79) says that it gave up.

The supervisor stops retrying when the next learning rate would go below
``--min-lr``, the next batch size below ``--min-batch-size``, or after
``--max-retries`` retries (non-finite and OOM together; preemption restarts
are counted apart, by ``--max-preemptions``). It then exits with the last
child's code. Every attempt (command, exit code, cause, duration, values) is
summarised on stderr and in the log at the end.

Patterns (:data:`PATTERNS`; bytes regexes, case-insensitive, matched within
one line, where ``\r`` and ``\n`` both end a line):

=============  =====================================  ============================================================
cause          regex                                  matches, e.g.
=============  =====================================  ============================================================
``nonfinite``  ``loss\s+is\s+(nan|[+-]?inf)\b``       ``Loss is NaN at epoch 3``, ``loss is nan``, ``loss is inf``
``nonfinite``  ``loss\s*[=:]\s*(nan|[+-]?inf)\b``     ``Loss=nan``, ``loss: nan``, ``training/loss: nan``,
                                                      ``hard_loss: nan``, ``val_loss=-inf``
``oom``        ``CUDA( error:)? out of memory``       ``torch.OutOfMemoryError: CUDA out of memory. Tried to ...``
``oom``        ``Resource exhausted``                 ``Resource exhausted: OOM when allocating tensor`` (TF/XLA)
``oom``        ``XLA memory error``
``oom``        ``Device memory exhausted``
``oom``        ``OutOfMemoryError``                   ``torch.cuda.OutOfMemoryError``
=============  =====================================  ============================================================

Placeholders and environment. ``{lr}`` and ``{batch_size}`` anywhere inside an
argument of CMD (``--lr={lr}``, ``training.learning_rate={lr}``) are replaced
by the attempt's values; no other text is touched (CMD is never passed through
``str.format``, so JSON arguments stay intact). ``{lr}`` without ``--lr``, or
``{batch_size}`` without ``--batch-size``, is a usage error. So is ``--lr``
without ``{lr}`` in CMD (and ``--batch-size`` without ``{batch_size}``): the
child would never see the lowered value and fail the same way again. A child
that reads the value from elsewhere can still take it, e.g.
``-- env LR={lr} python train.py``. Each attempt's environment is the
supervisor's plus:

* ``PREEMPT_SUPERVISE_ATTEMPT``: ``1``, ``2``, ... (restarts after preemption count too).
* ``PREEMPT_SUPERVISE_CAUSE``: why this attempt was started: the previous
  attempt's cause, ``preempted``, ``nonfinite`` or ``oom``; absent on attempt 1.
* ``PREEMPT_LR`` (with ``--lr``): the learning rate, as in ``{lr}``.
* ``PREEMPT_LR_SCALE`` (with ``--lr``): the learning rate divided by the
  original ``--lr``, e.g. ``0.666667`` after one retry: the factor a resumed
  run applies to the learning rates its optimizer restored from a checkpoint
  (those were saved before the lowering).
* ``PREEMPT_BATCH_SIZE`` (with ``--batch-size``): the batch size, as in ``{batch_size}``.
* ``PYTHONUNBUFFERED=1`` unless already set: a Python child writes its output
  at once into the pipe instead of in 8 KiB blocks.

The supervisor removes inherited values of the ``PREEMPT_LR*`` and
``PREEMPT_BATCH_SIZE`` variables it does not set. Values are written with 6
significant digits (``0.000666667``); ``{lr}`` and ``PREEMPT_LR`` are the same
text. :meth:`preempt.cluster.supervised.Supervised.from_env` reads them back (the runtime's side).

Output. The child's stdout and stderr are two pipes, copied to the
supervisor's stdout and stderr with ``os.read``/``os.write`` of whatever
arrived (no line buffering, no decoding): ``\r`` progress bars, partial lines
and invalid UTF-8 pass through byte for byte, and stdout and stderr stay
apart (SLURM's ``--output``/``--error``). Not a pty: a pty would merge the two
streams, turn ``\n`` into ``\r\n``, and make the child believe that a person
watches a terminal (colour codes and interactive redraws in batch logs) where
the job's output is a file. The price: a program that buffers when not on a
terminal shows its output late (Python does not, given ``PYTHONUNBUFFERED``).

Signals and processes. The child runs in a new session (``setsid``), so its
process group is its pid and Ctrl+C in a terminal reaches only the supervisor.
SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 (the runtime's stop signals) received by
the supervisor are forwarded, each one, to the child's whole group; the
supervisor then waits up to ``--grace`` seconds (default 60) for the child to
save and exit, SIGKILLs the group after that, and exits with the child's code
(75 for a run that saved) without restarting. A stop signal that arrives
between two attempts ends the supervisor with 75 and starts nothing. A SIGINT
ignored at start stays ignored (shells start background jobs that way).
Under SLURM, ``exec preempt supervise ...`` in the batch script and send the
warning to it (``--signal=B:TERM@120``); without ``B:`` SLURM signals every
process of the step, so the child sees the signal twice (harmless for a
preempt run, which only counts a repeated SIGTERM).

When the child has exited, whatever is still in its group (DataLoader
workers that have not noticed, a stray ``sleep``, a tensorboard the script
started) gets SIGTERM and, ``min(grace, 5)`` s later, SIGKILL: nothing of one
attempt survives into the next, and nothing survives the supervisor. The
supervisor makes itself a child subreaper (Linux) so that orphaned members
of the group become its children and are reaped (in a container whose PID 1
does not reap, they would stay zombies and the group would never empty), and
asks the kernel to send SIGTERM to the child should the supervisor die
(``PR_SET_PDEATHSIG``). Not tracked: processes that leave the group
themselves (``setsid``, ``setpgid``). If one of them holds the output pipes
open, the supervisor stops reading them 0.5 s after the group is empty.

Every event goes to stderr as ``[preempt supervise] <event>``. The log file
gets the same events, one line each, ``<local ISO time> [<supervisor pid>]
<event>``, appended to, so that the history of a requeued job stays in one
place. Where: ``--log FILE``; else, with ``--save-dir DIR`` (the run's
save_dir), ``DIR/supervise.log`` beside the run's ``train.log`` and
``history.jsonl`` (DIR is created if need be; the file is opened as the run
opens its own files there: no symlink followed, regular files only); else no
file at all, stderr only: nothing is written into the current directory
unasked. ``--no-log`` writes no file whatever else is given.

Exit codes of the supervisor (:data:`EXIT_CODES`):

* ``0``: the child completed (its last attempt exited 0).
* ``75``: preempted: a stop signal was forwarded and the child saved, a signal
  came between two attempts, or ``--max-preemptions`` was reached.
* ``78``, ``79``: the last attempt gave up on non-finite losses or on OOM and
  the limits allow no further retry.
* ``2``: bad usage of ``preempt supervise``; nothing was started.
* ``126``, ``127``: CMD could not be executed, or was not found.
* any other: the last child's exit code, ``128 + N`` when it died of signal
  ``N`` (as in a shell): an unknown failure, or a known one at its limits.

Not kept: the supervisor's values across its own restarts. A requeued job
starts again from ``--lr`` and ``--batch-size`` and lowers them again if
needed (the log says what happened before).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from ..checkpoint import safe_io
from ..errors import NONFINITE_EXIT_CODE, OOM_EXIT_CODE, PREEMPTED_EXIT_CODE
from .policy import SuperviseConfig
from .process import Supervisor, become_subreaper

EXIT_USAGE = 2
LOG_NAME = "supervise.log"  # inside --save-dir

EXIT_CODES = f"""\
exit codes:
  0    the command completed (its last attempt exited 0)
  {PREEMPTED_EXIT_CODE}   preempted: a stop signal was forwarded and the command saved; or a signal came between
       two attempts; or --max-preemptions was reached. Run the same line again to continue.
  {NONFINITE_EXIT_CODE}   the last attempt gave up on non-finite losses and --min-lr/--max-retries allow no retry
  {OOM_EXIT_CODE}   the last attempt ran out of memory and --min-batch-size/--max-retries allow no retry
  2    bad usage of preempt supervise (nothing was started)
  126  CMD is not executable;  127  CMD was not found
  any other: the last attempt's exit code, 128+N if it died of signal N. A failure with no known cause
       (no pattern; not 75/78/79) is not retried: a plain bug would fail again."""


# ----------------------------------------------------------------- the CLI


SUMMARY = (
    "run a training command; rerun it after preemption (unchanged), NaN losses (lower lr) and"
    " out-of-memory (smaller batch); see preempt supervise --help"
)


def build_parser(
    prog: str = "preempt supervise", commands: argparse._SubParsersAction | None = None
) -> argparse.ArgumentParser:
    """The one parser of ``preempt supervise``.

    Args:
        prog: The name in its usage and error messages.
        commands: The sub-commands of the ``preempt`` parser (:func:`preempt.cli.main.build_parser`): the parser is
            added there as ``supervise``, so that ``preempt --help`` lists it with :data:`SUMMARY`. None: a
            parser of its own, the one :func:`main` parses with.
    """
    texts: dict[str, Any] = dict(
        usage=f"{prog} [OPTIONS] -- CMD [ARGS...]",
        description=(
            "Run CMD until it completes: restart it unchanged after a preemption (exit 75), with the learning rate\n"
            "divided by --factor after a non-finite loss (exit 78, or a failure after e.g. 'loss: nan'), with\n"
            "batch_size = int(batch_size / --factor) after running out of memory (exit 79, or a failure after\n"
            "e.g. 'CUDA out of memory'). Any other failure ends the supervisor with CMD's exit code.\n"
            "CMD takes the values through the placeholders {lr} and {batch_size} (each needs its option, and each\n"
            "option its placeholder) and through the environment: PREEMPT_SUPERVISE_ATTEMPT, PREEMPT_SUPERVISE_CAUSE,\n"
            "PREEMPT_LR, PREEMPT_LR_SCALE (lr / the first --lr), PREEMPT_BATCH_SIZE.\n"
            "SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 are forwarded to CMD's process group; after --grace seconds the\n"
            "group is SIGKILLed; then the supervisor exits with CMD's code and restarts nothing. Output is copied\n"
            "byte for byte (stdout to stdout, stderr to stderr). Details: pydoc preempt.supervise.command"
        ),
        epilog=EXIT_CODES
        + "\n\nexample:\n  preempt supervise --lr 3e-4 --batch-size 64 -- python train.py --lr {lr} --bs {batch_size}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if commands is None:
        parser = argparse.ArgumentParser(prog=prog, **texts)
    else:
        parser = commands.add_parser("supervise", prog=prog, help=SUMMARY, **texts)
    parser.add_argument("--lr", type=float, metavar="X", help="the first learning rate; CMD must contain {lr}")
    parser.add_argument(
        "--batch-size", type=int, metavar="N", help="the first batch size; CMD must contain {batch_size}"
    )
    parser.add_argument("--min-lr", type=float, default=1e-6, metavar="X", help="never go below (default 1e-6)")
    parser.add_argument("--min-batch-size", type=int, default=1, metavar="N", help="never go below (default 1)")
    parser.add_argument(
        "--factor", type=float, default=1.5, metavar="F", help="divide by F on each retry (default 1.5)"
    )
    parser.add_argument(
        "--max-retries", type=int, default=10, metavar="N", help="retries after non-finite losses and OOM (default 10)"
    )
    parser.add_argument(
        "--max-preemptions",
        type=int,
        default=3,
        metavar="N",
        help="restarts after CMD exits 75 without the supervisor being signalled (default 3)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds CMD has to exit after a forwarded signal before SIGKILL (default 60)",
    )
    parser.add_argument(
        "--save-dir",
        type=Path,
        metavar="DIR",
        help=f"the run's save_dir: the events are appended to DIR/{LOG_NAME} (unless --log or --no-log), and its"
        " newest valid checkpoint is read into memory as each attempt starts (the restore then reads from memory)",
    )
    log = parser.add_mutually_exclusive_group()
    log.add_argument(
        "--log",
        type=Path,
        metavar="FILE",
        help="append one line per event here (its directory is created). Default: DIR/"
        f"{LOG_NAME} with --save-dir DIR, else no file (the events go to stderr in any case)",
    )
    log.add_argument("--no-log", action="store_true", help="write no log file")
    return parser


def log_path(args: argparse.Namespace) -> Path | None:
    """Where the events are appended: ``--log``, else ``--save-dir``'s ``supervise.log``, else nowhere."""
    if args.no_log:
        return None
    if args.log is not None:
        return args.log
    return None if args.save_dir is None else args.save_dir / LOG_NAME


def open_log(path: Path, in_save_dir: bool) -> IO[str]:
    """Opens the log for appending; inside a save_dir as the run opens its files there (safe_io).

    Raises:
        OSError: It cannot be created or appended to (an :class:`~preempt.checkpoint.safe_io.UnsafeFileError` for a
            symlink, a FIFO or a device standing in its place inside the save_dir).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if not in_save_dir:
        return open(path, "a", encoding="utf-8")  # a file the user named: theirs to point anywhere
    fd = safe_io.open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        return os.fdopen(fd, "a", encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise


def main(argv: Sequence[str] | None = None) -> int:
    """``preempt supervise [OPTIONS] -- CMD...``; returns the exit code (argparse exits 2 itself on bad usage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if "--" in argv:
        cut = argv.index("--")
        options, cmd = argv[:cut], argv[cut + 1 :]
    else:
        options, cmd = argv, []
    args, extra = parser.parse_known_args(options)  # --help exits here
    if extra or not cmd:
        parser.error("no command: expected preempt supervise [OPTIONS] -- CMD [ARGS...] (the -- is required)")
    try:
        config = SuperviseConfig(
            cmd=tuple(cmd),
            lr=args.lr,
            batch_size=args.batch_size,
            min_lr=args.min_lr,
            min_batch_size=args.min_batch_size,
            factor=args.factor,
            max_retries=args.max_retries,
            max_preemptions=args.max_preemptions,
            grace=args.grace,
        )
    except ValueError as e:
        parser.error(str(e))
    log: IO[str] | None = None
    path = log_path(args)
    inside = args.log is None or (args.save_dir is not None and safe_io.within(args.log, args.save_dir))
    default = None if args.save_dir is None else args.save_dir.resolve() / LOG_NAME
    if inside and args.log is not None and args.log.parent.resolve() / args.log.name != default:
        # every other name in the save_dir belongs to the run (its lock, its logs, a checkpoint's file)
        parser.error(
            f"--log {args.log}: is inside --save-dir {args.save_dir}; leave --log out (the events go to"
            f" {args.save_dir / LOG_NAME}) or give a file outside it"
        )
    if path is not None:
        try:
            log = open_log(path, in_save_dir=inside)  # closed below
        except OSError as e:
            option = f"--log {args.log}" if args.log is not None else f"--save-dir {args.save_dir}"
            found = str(e) if isinstance(e, safe_io.UnsafeFileError) else f"{path}: {e.strerror or e}"
            parser.error(f"{option}: cannot append to the log ({found})")
    try:
        become_subreaper()
        return Supervisor(config, log=log, save_dir=args.save_dir).run().code
    finally:
        if log is not None:
            log.close()


if __name__ == "__main__":
    sys.exit(main())
