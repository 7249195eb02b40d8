"""What ``preempt supervise`` decides, with no process in sight: the output patterns that name a failure's
cause, the cause of an attempt's end, the next attempt's learning rate and batch size, the configuration, and
the command line and environment of the next attempt. Pure functions, unit-tested without a child process.
(The pattern table and the rules are documented in :mod:`preempt.supervise.command`.)
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Mapping, Sequence
from typing import Literal

from ..cluster.supervised import ENV_ATTEMPT, ENV_BATCH_SIZE, ENV_CAUSE, ENV_LR, ENV_LR_SCALE
from ..errors import (
    NONFINITE_EXIT_CODE,
    OOM_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    REQUEUE_FAILED_EXIT_CODE,
    RESTART_LIMIT_EXIT_CODE,
    SAVE_FAILED_EXIT_CODE,
)


# Causes of an attempt's end.
class Cause(str, enum.Enum):
    """Why an attempt ended (a str: it is written as it is to the supervisor's JSON and log)."""

    def __str__(self) -> str:  # "oom", not "Cause.OOM", in f-strings on every Python
        return str(self.value)

    COMPLETE = "complete"
    PREEMPTED = "preempted"
    NONFINITE = "nonfinite"
    OOM = "oom"
    FAILED = "failed"


COMPLETE, PREEMPTED, NONFINITE, OOM, FAILED = Cause

_OWNED_ENV = (ENV_ATTEMPT, ENV_CAUSE, ENV_LR, ENV_LR_SCALE, ENV_BATCH_SIZE)

LR_PLACEHOLDER, BATCH_SIZE_PLACEHOLDER = "{lr}", "{batch_size}"

_MAX_CARRY = 1 << 16  # bytes of an unfinished line kept for scanning; beyond that it is scanned as it is
_CARRY_TAIL = 256  # ... keeping this much, longer than any pattern's match


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


class Scanner:
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
        for name, count in (("--max-retries", self.max_retries), ("--max-preemptions", self.max_preemptions)):
            if count < 0:
                raise ValueError(f"{name}: expected an integer >= 0, found {count}")
        if not math.isfinite(self.grace) or self.grace < 0:
            raise ValueError(f"--grace: expected seconds >= 0, found {self.grace}")
        if not math.isfinite(self.min_lr) or self.min_lr < 0:
            raise ValueError(f"--min-lr: expected a number >= 0, found {self.min_lr}")
        if self.min_batch_size < 1:
            raise ValueError(f"--min-batch-size: expected an integer >= 1, found {self.min_batch_size}")
        text = " ".join(self.cmd)
        given: tuple[tuple[str, float | int | None, str], ...] = (
            ("--lr", self.lr, LR_PLACEHOLDER),
            ("--batch-size", self.batch_size, BATCH_SIZE_PLACEHOLDER),
        )
        for option, value, placeholder in given:
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
