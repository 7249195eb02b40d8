r"""``preempt supervise``: rerun a training command until it completes.

::

    preempt supervise --lr 3e-4 --batch-size 64 -- python train.py --lr {lr} --batch-size {batch_size}

The supervisor runs the command (CMD) as a child in a process group of its
own, streams the child's output to its own as it comes, scans it for the
patterns below, and decides from the child's exit code (and the last pattern
seen) whether to run it again and with which values. Each run of CMD is an
*attempt*. Imports no torch (which alone takes ~1.5 s to import): it starts at once.

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
guard skips a bad step, logs it and carries on, and only its exit code (78,
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
text. :meth:`preempt.supervised.Supervised.from_env` reads them back (the runtime's side).

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

The log (``--log``, default ``./supervise.log``; ``--no-log`` for none) is
appended to, so that the history of a requeued job stays in one place; each
line is one event, ``<local ISO time> [<supervisor pid>] <event>``, and the
same event goes to stderr as ``[preempt supervise] <event>``.

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
import ctypes
import dataclasses
import datetime
import math
import os
import re
import selectors
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Literal

from ._log import duration
from .errors import (
    NONFINITE_EXIT_CODE,
    OOM_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    REQUEUE_FAILED_EXIT_CODE,
    RESTART_LIMIT_EXIT_CODE,
    SAVE_FAILED_EXIT_CODE,
)
from .signals import DEFAULT_SIGNALS, signal_name
from .supervised import ENV_ATTEMPT, ENV_BATCH_SIZE, ENV_CAUSE, ENV_LR, ENV_LR_SCALE

# Causes of an attempt's end.
COMPLETE, PREEMPTED, NONFINITE, OOM, FAILED = "complete", "preempted", "nonfinite", "oom", "failed"
Cause = Literal["complete", "preempted", "nonfinite", "oom", "failed"]

EXIT_USAGE, EXIT_CANNOT_EXECUTE, EXIT_NOT_FOUND = 2, 126, 127

_OWNED_ENV = (ENV_ATTEMPT, ENV_CAUSE, ENV_LR, ENV_LR_SCALE, ENV_BATCH_SIZE)

LR_PLACEHOLDER, BATCH_SIZE_PLACEHOLDER = "{lr}", "{batch_size}"

DEFAULT_LOG = Path("supervise.log")
_LEFTOVER_GRACE = 5.0  # s between SIGTERM and SIGKILL for what is left in the group after the child exited
_DRAIN = 0.5  # s to read the pipes after the group is empty; longer only if a process outside it holds them
_TICK = 1.0  # s; the loop wakes on output, signals and SIGCHLD; this only bounds a missed wakeup
_READ = 1 << 16
_MAX_CARRY = 1 << 16  # bytes of an unfinished line kept for scanning; beyond that it is scanned as it is
_CARRY_TAIL = 256  # ... keeping this much, longer than any pattern's match

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


# ----------------------------------------------------------------- patterns


@dataclasses.dataclass(frozen=True)
class Pattern:
    """One line of the pattern table: what it means and what it looks like."""

    cause: Cause
    regex: re.Pattern[bytes]
    examples: tuple[str, ...]


def _pattern(cause: Cause, regex: str, *examples: str) -> Pattern:
    return Pattern(cause, re.compile(regex.encode(), re.IGNORECASE), examples)


PATTERNS: tuple[Pattern, ...] = (
    _pattern(NONFINITE, r"loss\s+is\s+(?:nan|[+-]?inf)\b", "Loss is NaN at epoch 123", "loss is nan", "loss is inf"),
    _pattern(
        NONFINITE,
        r"loss\s*[=:]\s*(?:nan|[+-]?inf)\b",
        "Loss=nan",
        "loss: nan",
        "training/loss: nan",
        "hard_loss: nan",
        "val_loss=-inf",
    ),
    _pattern(
        OOM, r"CUDA(?: error:)? out of memory", "CUDA out of memory. Tried to allocate", "CUDA error: out of memory"
    ),
    _pattern(OOM, r"Resource exhausted", "Resource exhausted: OOM when allocating tensor"),
    _pattern(OOM, r"XLA memory error", "XLA memory error"),
    _pattern(OOM, r"Device memory exhausted", "Device memory exhausted"),
    _pattern(OOM, r"OutOfMemoryError", "torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError"),
)


@dataclasses.dataclass(frozen=True)
class Match:
    cause: Cause
    text: str  # the matched text, decoded for messages
    stream: str  # "stdout" or "stderr"


def find_patterns(text: bytes, stream: str = "stdout") -> list[Match]:
    """Every pattern match in ``text``, in the order of their positions."""
    found = []
    for p in PATTERNS:
        for m in p.regex.finditer(text):
            found.append((m.start(), Match(p.cause, m.group().decode("utf-8", "replace"), stream)))
    return [m for _, m in sorted(found, key=lambda t: t[0])]


class _Scanner:
    """Finds patterns in a stream that arrives in chunks cut anywhere, one finished line at a time."""

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self._carry = b""

    def feed(self, data: bytes) -> list[Match]:
        buf = self._carry + data
        cut = max(buf.rfind(b"\n"), buf.rfind(b"\r"))
        if cut < 0:
            if len(buf) <= _MAX_CARRY:
                self._carry = buf
                return []
            # A very long unfinished line: scan what there is and keep a tail so that a match across the cut is
            # still found. A match inside the tail may be reported twice, which changes nothing.
            self._carry = buf[-_CARRY_TAIL:]
            return find_patterns(buf, self.stream)
        self._carry = buf[cut + 1 :]
        return find_patterns(buf[: cut + 1], self.stream)

    def close(self) -> list[Match]:
        rest, self._carry = self._carry, b""
        return find_patterns(rest, self.stream) if rest else []


# ------------------------------------------------------------- the decisions


def classify(code: int, last_pattern: Cause | None) -> Cause:
    """The cause of an attempt's end, from its exit code (shell style) and the last pattern in its output.

    The exit code wins; a pattern counts only for a failure that no code explains.
    """
    if code == 0:
        return COMPLETE
    if code == PREEMPTED_EXIT_CODE:
        return PREEMPTED
    if code == NONFINITE_EXIT_CODE:
        return NONFINITE
    if code == OOM_EXIT_CODE:
        return OOM
    if code in (SAVE_FAILED_EXIT_CODE, REQUEUE_FAILED_EXIT_CODE, RESTART_LIMIT_EXIT_CODE):
        return FAILED
    return last_pattern or FAILED


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to do after an attempt: run again (``retry`` with new values, ``restart`` unchanged) or ``stop``."""

    action: Literal["retry", "restart", "stop"]
    lr: float | None
    batch_size: int | None
    reason: str


def fmt(x: float) -> str:
    """A learning rate (or scale) as given to the child: 6 significant digits, ``0.000666667``."""
    return format(x, ".6g")


def plan_next(
    config: SuperviseConfig, cause: Cause, *, lr: float | None, batch_size: int | None, retries: int, preemptions: int
) -> Plan:
    """Decides what follows an attempt that ended with ``cause``; pure.

    Args:
        config: The limits and the factor.
        cause: From :func:`classify`.
        lr: The attempt's learning rate (None without ``--lr``).
        batch_size: The attempt's batch size (None without ``--batch-size``).
        retries: Retries (non-finite and OOM) made so far.
        preemptions: Restarts after preemption made so far.
    """

    def stop(reason: str) -> Plan:
        return Plan("stop", lr, batch_size, reason)

    if cause == COMPLETE:
        return stop("the command completed")
    if cause == PREEMPTED:
        if preemptions >= config.max_preemptions:
            return stop(f"preempted, and --max-preemptions {config.max_preemptions} restarts were made")
        return Plan(
            "restart",
            lr,
            batch_size,
            f"preempted: restarting unchanged (restart {preemptions + 1} of {config.max_preemptions})",
        )
    if cause == FAILED:
        return stop("failed with no known cause (no pattern; not 75/78/79); not retried, a plain error would recur")
    if retries >= config.max_retries:
        return stop(f"{cause}, and --max-retries {config.max_retries} retries were made")
    step = f"(retry {retries + 1} of {config.max_retries})"
    if cause == NONFINITE:
        if lr is None:
            return stop("non-finite loss, but no --lr to lower (give --lr and put {lr} into the command)")
        new_lr = lr / config.factor
        if new_lr < config.min_lr:
            return stop(f"non-finite loss, and lr {fmt(new_lr)} would be below --min-lr {fmt(config.min_lr)}")
        return Plan("retry", new_lr, batch_size, f"non-finite loss: lr {fmt(lr)} -> {fmt(new_lr)} {step}")
    if batch_size is None:
        return stop("out of memory, but no --batch-size to lower (give --batch-size and put {batch_size} into it)")
    new_bs = int(batch_size / config.factor)
    if new_bs < config.min_batch_size:
        return stop(f"out of memory, and batch_size {new_bs} would be below --min-batch-size {config.min_batch_size}")
    return Plan("retry", lr, new_bs, f"out of memory: batch_size {batch_size} -> {new_bs} {step}")


# ------------------------------------------------------- config and contract


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuperviseConfig:
    """What ``preempt supervise`` was asked to do; validated on creation.

    Raises:
        ValueError: Naming the option, the value and what is allowed.
    """

    cmd: tuple[str, ...]
    lr: float | None = None
    batch_size: int | None = None
    min_lr: float = 1e-6
    min_batch_size: int = 1
    factor: float = 1.5
    max_retries: int = 10
    max_preemptions: int = 3
    grace: float = 60.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "cmd", tuple(self.cmd))
        if not self.cmd:
            raise ValueError("no command: expected preempt supervise [OPTIONS] -- CMD [ARGS...]")
        if not math.isfinite(self.factor) or self.factor <= 1:
            raise ValueError(f"--factor: expected a number > 1, found {self.factor}")
        for name, value in (("--max-retries", self.max_retries), ("--max-preemptions", self.max_preemptions)):
            if value < 0:
                raise ValueError(f"{name}: expected an integer >= 0, found {value}")
        if not math.isfinite(self.grace) or self.grace < 0:
            raise ValueError(f"--grace: expected seconds >= 0, found {self.grace}")
        if not math.isfinite(self.min_lr) or self.min_lr < 0:
            raise ValueError(f"--min-lr: expected a number >= 0, found {self.min_lr}")
        if self.min_batch_size < 1:
            raise ValueError(f"--min-batch-size: expected an integer >= 1, found {self.min_batch_size}")
        text = " ".join(self.cmd)
        for option, value, placeholder in (
            ("--lr", self.lr, LR_PLACEHOLDER),
            ("--batch-size", self.batch_size, BATCH_SIZE_PLACEHOLDER),
        ):
            if value is None and placeholder in text:
                raise ValueError(f"the command uses {placeholder} but {option} is not given: give {option} VALUE")
            if value is not None and placeholder not in text:
                raise ValueError(
                    f"{option} {value} is given but the command has no {placeholder}, so it would never see a lowered"
                    f" value; put {placeholder} where it takes the value (e.g. {option} {placeholder}, or"
                    f" env VAR={placeholder} CMD...)"
                )
        if self.lr is not None:
            if not math.isfinite(self.lr) or self.lr <= 0:
                raise ValueError(f"--lr: expected a number > 0, found {self.lr}")
            if self.lr < self.min_lr:
                raise ValueError(f"--lr {fmt(self.lr)} is below --min-lr {fmt(self.min_lr)}; lower --min-lr")
        if self.batch_size is not None:
            if self.batch_size < 1:
                raise ValueError(f"--batch-size: expected an integer >= 1, found {self.batch_size}")
            if self.batch_size < self.min_batch_size:
                raise ValueError(
                    f"--batch-size {self.batch_size} is below --min-batch-size {self.min_batch_size};"
                    " lower --min-batch-size"
                )


def substitute(cmd: Sequence[str], lr: float | None, batch_size: int | None) -> list[str]:
    """CMD with ``{lr}`` and ``{batch_size}`` replaced; nothing else changes."""
    out = []
    for arg in cmd:
        if lr is not None:
            arg = arg.replace(LR_PLACEHOLDER, fmt(lr))
        if batch_size is not None:
            arg = arg.replace(BATCH_SIZE_PLACEHOLDER, str(batch_size))
        out.append(arg)
    return out


def child_env(
    environ: Mapping[str, str],
    *,
    attempt: int,
    cause: Cause | None,
    lr: float | None,
    lr_scale: float | None,
    batch_size: int | None,
) -> dict[str, str]:
    """The environment of one attempt (see the module docstring for the variables)."""
    env = {k: v for k, v in environ.items() if k not in _OWNED_ENV}
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[ENV_ATTEMPT] = str(attempt)
    if cause is not None:
        env[ENV_CAUSE] = cause
    if lr is not None:
        env[ENV_LR] = fmt(lr)
        env[ENV_LR_SCALE] = fmt(1.0 if lr_scale is None else lr_scale)
    if batch_size is not None:
        env[ENV_BATCH_SIZE] = str(batch_size)
    return env


# --------------------------------------------------------------- the process


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One run of CMD, as the summary shows it."""

    number: int
    argv: tuple[str, ...]
    lr: float | None
    batch_size: int | None
    code: int  # shell style: 128 + N for death by signal N
    cause: Cause
    seconds: float
    pattern: Match | None  # the last pattern seen in its output
    signalled: tuple[int, ...] = ()  # the stop signals forwarded to it


@dataclasses.dataclass(frozen=True)
class Result:
    code: int
    reason: str
    attempts: tuple[Attempt, ...]


def exit_code(returncode: int) -> int:
    """Popen's returncode (``-N`` for death by signal N) as a shell reports it (``128 + N``)."""
    return 128 - returncode if returncode < 0 else returncode


def _killpg(pgid: int, sig: int) -> bool:
    """Sends ``sig`` to the group; False when the group is gone (or not ours)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _same_file(a: int, b: int) -> bool:
    try:
        return os.path.samestat(os.fstat(a), os.fstat(b))
    except OSError:
        return a == b


def _reap(pgid: int) -> None:
    """Reaps the exited members of the group that are our children (orphans, thanks to the subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-pgid, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36


def become_subreaper() -> bool:
    """Makes orphaned descendants this process's children (Linux ``PR_SET_CHILD_SUBREAPER``); False elsewhere.

    Process-wide, so only the ``preempt supervise`` command calls it, not :class:`Supervisor`.
    """
    libc = _libc()
    return libc is not None and libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


class Supervisor:
    """Runs the attempts of one ``preempt supervise``.

    Installs its signal handlers (main thread only) for the duration of :meth:`run` and restores them.

    Args:
        config: What to run and the limits.
        log: A text file the events are appended to (one line each), or None.
        environ: The environment the attempts' environments derive from (default ``os.environ``).
        stdout_fd: Where the child's stdout goes.
        stderr_fd: Where the child's stderr goes.
        err: Where the supervisor's own messages go (default ``sys.stderr``).
        clock: Monotonic clock.
    """

    def __init__(
        self,
        config: SuperviseConfig,
        *,
        log: IO[str] | None = None,
        environ: Mapping[str, str] | None = None,
        stdout_fd: int = 1,
        stderr_fd: int = 2,
        err: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._log = log
        self._environ = dict(os.environ if environ is None else environ)
        self._out = {"stdout": stdout_fd, "stderr": stderr_fd}
        self._err = err
        # The child's streams that end up where our messages go (its stderr; its stdout too on a terminal), and
        # whether the child's last write there left a line unfinished (a progress bar): a message then starts on a
        # new line.
        self._shares_err = {name for name, fd in self._out.items() if _same_file(fd, stderr_fd)}
        self._open_line = False
        self._clock = clock
        self._pending: list[int] = []  # stop signals not yet forwarded (appended by the handler)
        self.stop_signal: int | None = None  # the first stop signal received
        self._wake_r = self._wake_w = -1
        self._libc = _libc()
        self._parent = os.getpid()

    # ------------------------------------------------------------ messages

    def event(self, message: str) -> None:
        """One event: a line on stderr and a line in the log."""
        message = message.replace("\n", "\\n")
        err = self._err or sys.stderr
        newline = "\n" if self._open_line else ""
        self._open_line = False
        try:
            err.write(f"{newline}[preempt supervise] {message}\n")
            err.flush()
        except (BrokenPipeError, ValueError):
            pass  # nobody reads our stderr any more; the log still gets it
        if self._log is not None:
            now = datetime.datetime.now().astimezone().isoformat(timespec="milliseconds")
            self._log.write(f"{now} [{self._parent}] {message}\n")
            self._log.flush()

    def _values(self, lr: float | None, batch_size: int | None) -> str:
        parts = ([f"lr {fmt(lr)}"] if lr is not None else []) + (
            [f"batch_size {batch_size}"] if batch_size is not None else []
        )
        return f" ({', '.join(parts)})" if parts else ""

    # ------------------------------------------------------------- signals

    def _on_stop(self, signum: int, frame: object) -> None:
        # Only records (preempt.signals' rule); the loop forwards at once, woken by the wakeup fd.
        self._pending.append(signum)
        if self.stop_signal is None:
            self.stop_signal = signum

    def _install(self) -> dict[int, object]:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        previous: dict[int, object] = {}
        for sig in DEFAULT_SIGNALS:
            handler = signal.getsignal(sig)
            if sig == signal.SIGINT and handler == signal.SIG_IGN:
                continue
            previous[sig] = handler
            signal.signal(sig, self._on_stop)
        # A Python-level SIGCHLD handler, so that the C handler writes to the wakeup fd when the child exits.
        previous[signal.SIGCHLD] = signal.getsignal(signal.SIGCHLD)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        previous[-1] = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        return previous

    def _restore(self, previous: dict[int, object]) -> None:
        signal.set_wakeup_fd(previous.pop(-1))  # type: ignore[arg-type]
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # type: ignore[arg-type]
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _preexec(self) -> None:
        # In the child between fork and exec: die with the supervisor (a SIGKILLed supervisor cannot clean up).
        # SIGTERM, not SIGKILL: a preempt run saves. Races with the supervisor's death, hence the getppid check.
        if self._libc is not None:
            self._libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            if os.getppid() != self._parent:
                os.kill(os.getpid(), signal.SIGTERM)

    # ------------------------------------------------------------ the loop

    def run(self) -> Result:
        """Runs attempts until one completes or the plan says stop; returns the exit code and the history."""
        cfg = self.config
        previous = self._install()
        attempts: list[Attempt] = []
        try:
            self.event(
                f"supervising {shlex.join(cfg.cmd)}: --max-retries {cfg.max_retries}, --max-preemptions"
                f" {cfg.max_preemptions}, --factor {fmt(cfg.factor)}, --grace {fmt(cfg.grace)} s"
                + (f", --lr {fmt(cfg.lr)}, --min-lr {fmt(cfg.min_lr)}" if cfg.lr is not None else "")
                + (
                    f", --batch-size {cfg.batch_size}, --min-batch-size {cfg.min_batch_size}"
                    if cfg.batch_size is not None
                    else ""
                )
            )
            lr, bs = cfg.lr, cfg.batch_size
            retries = preemptions = 0
            cause: Cause | None = None
            while True:
                if self.stop_signal is not None:
                    code = PREEMPTED_EXIT_CODE
                    reason = (
                        f"{signal_name(self.stop_signal)} before attempt {len(attempts) + 1} started; not starting it"
                    )
                    break
                attempt = self._attempt(len(attempts) + 1, lr, bs, cause)
                attempts.append(attempt)
                plan = plan_next(cfg, attempt.cause, lr=lr, batch_size=bs, retries=retries, preemptions=preemptions)
                code = attempt.code
                if plan.action == "stop" and not (self.stop_signal is not None and attempt.signalled):
                    reason = plan.reason
                    break
                if self.stop_signal is not None:
                    how = "forwarded to it" if attempt.signalled else "after it ended"
                    if not attempt.signalled:
                        code = PREEMPTED_EXIT_CODE
                    reason = f"{signal_name(self.stop_signal)} {how}; not starting another attempt"
                    break
                self.event(plan.reason)
                if plan.action == "retry":
                    retries += 1
                else:
                    preemptions += 1
                lr, bs, cause = plan.lr, plan.batch_size, attempt.cause
            self._summary(attempts, code, reason)
            return Result(code, reason, tuple(attempts))
        finally:
            self._restore(previous)

    def _summary(self, attempts: list[Attempt], code: int, reason: str) -> None:
        self.event(f"stop: {reason}; exit {code}")
        self.event(f"summary: {len(attempts)} attempt(s)")
        for a in attempts:
            extra = ""
            if a.signalled:
                extra += f", after {'+'.join(signal_name(s) for s in a.signalled)}"
            if (
                a.pattern is not None
                and a.cause in (NONFINITE, OOM)
                and a.code not in (NONFINITE_EXIT_CODE, OOM_EXIT_CODE)
            ):
                extra += f", {a.pattern.stream} said {a.pattern.text!r}"
            self.event(
                f"  attempt {a.number}: exit {a.code}, {a.cause}{extra}, {duration(a.seconds)}"
                f"{self._values(a.lr, a.batch_size)}: {shlex.join(a.argv)}"
            )

    def _attempt(self, number: int, lr: float | None, batch_size: int | None, cause: Cause | None) -> Attempt:
        cfg = self.config
        argv = substitute(cfg.cmd, lr, batch_size)
        scale = None if lr is None or cfg.lr is None else lr / cfg.lr
        env = child_env(self._environ, attempt=number, cause=cause, lr=lr, lr_scale=scale, batch_size=batch_size)
        start = self._clock()
        try:
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
                preexec_fn=self._preexec if self._libc is not None else None,
            )
        except OSError as e:
            code = EXIT_NOT_FOUND if isinstance(e, (FileNotFoundError, NotADirectoryError)) else EXIT_CANNOT_EXECUTE
            self.event(f"attempt {number}: cannot run {argv[0]!r}: {e.strerror or e}")
            return Attempt(number, tuple(argv), lr, batch_size, code, FAILED, self._clock() - start, None)
        self.event(f"attempt {number}: pid {proc.pid}{self._values(lr, batch_size)}: {shlex.join(argv)}")
        last, signalled = self._pump(number, proc)
        seconds = self._clock() - start
        assert proc.returncode is not None
        code = exit_code(proc.returncode)
        result = classify(code, last.cause if last is not None else None)
        died = f" (killed by {signal_name(-proc.returncode)})" if proc.returncode < 0 else ""
        self.event(f"attempt {number}: exit {code}{died} after {duration(seconds)}: {result}")
        return Attempt(number, tuple(argv), lr, batch_size, code, result, seconds, last, tuple(signalled))

    def _pump(self, number: int, proc: subprocess.Popen[bytes]) -> tuple[Match | None, list[int]]:
        """Copies the child's output, forwards signals and cleans its group up, until all of it is gone.

        Returns:
            The last pattern seen, and the stop signals forwarded.
        """
        assert proc.stdout is not None and proc.stderr is not None
        pgid = proc.pid  # start_new_session: the child leads its own group
        pipes = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
        scanners = {fd: _Scanner(name) for fd, name in pipes.items()}
        sel = selectors.DefaultSelector()
        for fd in pipes:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        last: Match | None = None
        seen: set[Cause] = set()
        signalled: list[int] = []
        kill_at: float | None = None  # the end of --grace after the first forwarded signal
        exited = gave_up = False
        leftover_kill_at: float | None = None
        give_up_at: float | None = None
        close_at: float | None = None

        def scanned(matches: list[Match]) -> None:
            nonlocal last
            for m in matches:
                if m.cause not in seen:
                    seen.add(m.cause)
                    self.event(f"attempt {number}: {m.cause} pattern on {m.stream}: {m.text!r}")
            if matches:
                last = matches[-1]

        try:
            while True:
                now = self._clock()
                while self._pending:
                    sig = self._pending.pop(0)
                    if exited:
                        continue  # what is left of the group is being cleaned up anyway
                    _killpg(pgid, sig)
                    signalled.append(sig)
                    if kill_at is None:
                        kill_at = now + self.config.grace
                        self.event(
                            f"attempt {number}: {signal_name(sig)} received; forwarded to process group {pgid};"
                            f" waiting up to {fmt(self.config.grace)} s for it to exit"
                        )
                    else:
                        self.event(f"attempt {number}: {signal_name(sig)} received; forwarded to process group {pgid}")
                if not exited and proc.poll() is not None:
                    exited = True
                if not exited and kill_at is not None and now >= kill_at:
                    self.event(f"attempt {number}: still running {fmt(self.config.grace)} s after the signal; SIGKILL")
                    _killpg(pgid, signal.SIGKILL)
                    kill_at = math.inf
                deadlines = [kill_at] if kill_at is not None and not exited else []
                if exited:
                    _reap(pgid)
                    alive = not gave_up and _killpg(pgid, 0)
                    if alive and leftover_kill_at is None:
                        wait = min(self.config.grace, _LEFTOVER_GRACE)
                        self.event(
                            f"attempt {number}: processes left in group {pgid} after the command exited;"
                            f" SIGTERM, SIGKILL after {fmt(wait)} s"
                        )
                        _killpg(pgid, signal.SIGTERM)
                        leftover_kill_at = now + wait
                    elif alive and give_up_at is None and now >= (leftover_kill_at or 0.0):
                        self.event(f"attempt {number}: processes still in group {pgid}; SIGKILL")
                        _killpg(pgid, signal.SIGKILL)
                        give_up_at = now + 2.0
                    elif alive and give_up_at is not None and now >= give_up_at:
                        self.event(
                            f"attempt {number}: group {pgid} still not empty 2 s after SIGKILL (zombies that"
                            " nobody reaps?); going on"
                        )
                        gave_up, alive = True, False
                    if alive:
                        # Members that are not our children exit without a SIGCHLD to wake us: poll.
                        deadlines.append(now + 0.05)
                    elif not pipes:
                        break
                    elif close_at is None:
                        close_at = now + _DRAIN
                        deadlines.append(close_at)
                    elif now >= close_at:
                        self.event(
                            f"attempt {number}: its output is still open, held by a process outside group"
                            f" {pgid}; no longer reading it"
                        )
                        break
                    else:
                        deadlines.append(close_at)
                timeout = min([_TICK, *(max(0.0, d - now) for d in deadlines)])
                for key, _ in sel.select(timeout):
                    fd = key.fd
                    if fd == self._wake_r:
                        try:
                            while os.read(fd, 512):
                                pass
                        except BlockingIOError:
                            pass
                        continue
                    try:
                        data = os.read(fd, _READ)
                    except BlockingIOError:
                        continue
                    if not data:
                        sel.unregister(fd)
                        scanned(scanners[fd].close())
                        del pipes[fd]
                        continue
                    self._copy(pipes[fd], data)
                    scanned(scanners[fd].feed(data))
        finally:
            for fd in pipes:
                scanned(scanners[fd].close())
            sel.close()
            proc.stdout.close()
            proc.stderr.close()
            if proc.returncode is None:  # only after an exception in the loop: leave nothing behind
                _killpg(pgid, signal.SIGKILL)
                proc.wait()
        return last, signalled

    def _copy(self, stream: str, data: bytes) -> None:
        fd = self._out[stream]
        if fd < 0:
            return
        if stream in self._shares_err:
            self._open_line = not data.endswith(b"\n")
        view = memoryview(data)
        try:
            while view:
                try:
                    n = os.write(fd, view)
                except BlockingIOError:  # an O_NONBLOCK stdout that is full
                    time.sleep(0.001)
                    continue
                view = view[n:]
        except (BrokenPipeError, OSError):
            # The reader of our stdout/stderr left: keep reading (and scanning) the child's, so it never blocks.
            self._out[stream] = -1


# ----------------------------------------------------------------- the CLI


def build_parser(prog: str = "preempt supervise") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
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
            "byte for byte (stdout to stdout, stderr to stderr). Details: pydoc preempt.supervise"
        ),
        epilog=EXIT_CODES
        + "\n\nexample:\n  preempt supervise --lr 3e-4 --batch-size 64 -- python train.py --lr {lr} --bs {batch_size}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    log = parser.add_mutually_exclusive_group()
    log.add_argument(
        "--log",
        type=Path,
        default=DEFAULT_LOG,
        metavar="FILE",
        help=f"append one line per event here (default ./{DEFAULT_LOG}; its directory is created)",
    )
    log.add_argument("--no-log", action="store_true", help="write no log file")
    return parser


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
    if not args.no_log:
        try:
            args.log.parent.mkdir(parents=True, exist_ok=True)
            log = open(args.log, "a", encoding="utf-8")  # closed below
        except OSError as e:
            parser.error(f"--log {args.log}: cannot append to it ({e.strerror or e})")
    try:
        become_subreaper()
        return Supervisor(config, log=log).run().code
    finally:
        if log is not None:
            log.close()


if __name__ == "__main__":
    sys.exit(main())
