"""Runtime guards: skip a step whose loss is NaN/inf or that ran out of memory; give up after a streak.

Pure logic: nothing here knows about :class:`~preempt.run.preemptible.PreemptibleRun`,
checkpoints or signals. The run (or a user's loop) calls them.

:class:`NonFiniteGuard` checks a loss and counts non-finite ones in a row::

    guard = NonFiniteGuard(max_in_a_row=5)
    loss = compute_loss(model, batch)
    if not guard.check(loss):          # one GPU sync for a CUDA tensor
        optimizer.zero_grad(set_to_none=True)
        guard.raise_if_exhausted(step)  # NonFiniteStreak: exit code 78
        continue                        # skip the step
    loss.backward(); optimizer.step()

:class:`OOMGuard` is a context manager around one step: an out-of-memory
error inside it is caught, memory is freed and the step is marked skipped;
the ``max_in_a_row``-th OOM in a row raises :class:`OutOfMemoryStreak`
(exit code 79) instead::

    oom = OOMGuard(max_in_a_row=3)
    with oom.step() as s:
        loss = model(batch).loss; loss.backward(); optimizer.step()
    if s.skipped:
        optimizer.zero_grad(set_to_none=True)  # a half-done backward left gradients behind
        continue

:func:`scale_lr` multiplies the learning rate of an optimizer and of the
schedule driving it by one factor, so that the rest of the schedule is the
old one times that factor: what a run resumed by ``preempt supervise`` after
a NaN does with ``PREEMPT_LR_SCALE`` (the restored optimizer and scheduler
hold the learning rates from before the lowering).

Exit codes: the two streak exceptions are :class:`SystemExit` subclasses, as
:class:`preempt.errors.Preempted` is: giving up is the end of this process's
part of the work, not a bug, and ``preempt supervise`` reads the code
(:data:`~preempt.errors.NONFINITE_EXIT_CODE` 78: lower the learning rate;
:data:`~preempt.errors.OOM_EXIT_CODE` 79: lower the batch size). A SystemExit
with an integer code prints nothing, so both log their message at ERROR on
the ``preempt`` logger when raised by a guard.

Under torch.distributed a skipped step must be skipped by every rank, or the
ranks enter different collectives and hang: the caller must agree on
``skipped`` across ranks (an all-reduce of a flag) before acting on it.
"""

from __future__ import annotations

import gc
import math
import traceback
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch

from .._log import log
from ..errors import NONFINITE_EXIT_CODE, OOM_EXIT_CODE

# ----------------------------------------------------------------------------------------- exit exceptions


class NonFiniteStreak(SystemExit):
    """The loss was NaN or infinite ``in_a_row`` steps in a row; exit code 78 (``NONFINITE_EXIT_CODE``).

    The state at this point is not worth saving (the last good checkpoint
    is): rerun with a lower learning rate. ``str()`` is the message.

    Attributes:
        in_a_row: Non-finite losses in a row.
        total: Non-finite losses in this process.
        step: The step of the last one, when the caller said.
        value: The last non-finite value (nan, inf, -inf), when it was a scalar.
        message: What happened and what to do.
    """

    def __init__(
        self, in_a_row: int, total: int, *, step: int | None = None, value: float | None = None, factor: float = 1.5
    ) -> None:
        super().__init__(NONFINITE_EXIT_CODE)
        self.in_a_row = in_a_row
        self.total = total
        self.step = step
        self.value = value
        what = "not finite" if value is None else _fmt_value(value)
        at = f" up to step {step}" if step is not None else ""
        self.message = (
            f"the loss was {what} {in_a_row} steps in a row{at} ({total} in all); giving up (exit code "
            f"{NONFINITE_EXIT_CODE}). The learning rate is likely too high: rerun with a lower one (e.g. divided by "
            f"{factor:g}), or run under `preempt supervise --lr LR -- python train.py --lr {{lr}}`, which does that"
        )

    def __str__(self) -> str:
        return self.message


class OutOfMemoryStreak(SystemExit):
    """``in_a_row`` steps in a row ran out of device memory; exit code 79 (``OOM_EXIT_CODE``).

    Raised by :class:`OOMGuard` from the last out-of-memory error
    (``__cause__``). ``str()`` is the message.

    Attributes:
        in_a_row: Out-of-memory errors in a row.
        total: Out-of-memory errors in this process.
        error: The last one.
        message: What happened and what to do.
    """

    def __init__(self, in_a_row: int, total: int, error: BaseException | None = None) -> None:
        super().__init__(OOM_EXIT_CODE)
        self.in_a_row = in_a_row
        self.total = total
        self.error = error
        last = f"; the last: {_first_line(error)}" if error is not None else ""
        self.message = (
            f"out of memory {in_a_row} steps in a row ({total} in all){last}; giving up (exit code {OOM_EXIT_CODE}). "
            "Lower the batch size: rerun with a smaller one, or run under "
            "`preempt supervise --batch-size B -- python train.py --batch-size {batch_size}`, which does that"
        )

    def __str__(self) -> str:
        return self.message


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _fmt_value(v: float) -> str:
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else f"{v:g}"


# -------------------------------------------------------------------------------------------- NonFiniteGuard


class NonFiniteGuard:
    """Counts non-finite losses, in a row and in all.

    Args:
        max_in_a_row: :attr:`exhausted` once this many losses in a row were
            not finite (>= 1).
        lr_factor: The factor (> 1) by which a retry should divide the
            learning rate; named in :class:`NonFiniteStreak`'s message. The
            same default as ``preempt supervise --factor``. A caller that
            recovers in the same process uses ``scale_lr(opt, sched, 1 / guard.lr_factor)``.

    Attributes:
        in_a_row: Non-finite losses since the last finite one.
        total: Non-finite losses seen by this guard.
        last_value: The last non-finite loss (nan, inf, -inf) when it was a
            scalar; None for a multi-element tensor or before any.
    """

    def __init__(self, max_in_a_row: int = 5, lr_factor: float = 1.5) -> None:
        if isinstance(max_in_a_row, bool) or not isinstance(max_in_a_row, int) or max_in_a_row < 1:
            raise ValueError(f"NonFiniteGuard max_in_a_row: expected an integer >= 1, found {max_in_a_row!r}")
        if not (isinstance(lr_factor, (int, float)) and math.isfinite(lr_factor) and lr_factor > 1):
            raise ValueError(f"NonFiniteGuard lr_factor: expected a number > 1, found {lr_factor!r}")
        self.max_in_a_row = max_in_a_row
        self.lr_factor = float(lr_factor)
        self.in_a_row = 0
        self.total = 0
        self.last_value: float | None = None

    def check(self, loss: torch.Tensor | float) -> bool:
        """True when ``loss`` is finite (every element of a tensor); counts it otherwise.

        A tensor costs one ``torch.isfinite(loss).all()`` and one conversion
        of that 0-d bool to Python: for a CUDA tensor this waits for the GPU
        to finish the work queued so far (one device synchronisation per
        call, as ``loss.item()`` would). To avoid a second sync, pass the
        float when the loop converts the loss anyway. A finite loss resets
        the streak; the value of a non-finite scalar tensor is read (a second
        sync) only then.
        """
        if isinstance(loss, torch.Tensor):
            ok = bool(torch.isfinite(loss).all())
            value = None if ok or loss.numel() != 1 else float(loss.detach().reshape(()).float().cpu())
        else:
            value = float(loss)
            ok = math.isfinite(value)
        if ok:
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.total += 1
        self.last_value = value
        return False

    @property
    def exhausted(self) -> bool:
        """``max_in_a_row`` or more non-finite losses in a row."""
        return self.in_a_row >= self.max_in_a_row

    def reset_streak(self) -> None:
        """Forgets the current streak (``total`` stays), e.g. after lowering the learning rate in process."""
        self.in_a_row = 0

    def raise_if_exhausted(self, step: int | None = None) -> None:
        """Logs and raises :class:`NonFiniteStreak` when :attr:`exhausted`; else does nothing."""
        if not self.exhausted:
            return
        e = NonFiniteStreak(self.in_a_row, self.total, step=step, value=self.last_value, factor=self.lr_factor)
        log.error("%s", e.message)
        raise e

    def state_dict(self) -> dict[str, Any]:
        """The counters, so that a streak survives a checkpoint if the caller wants it to."""
        return {"in_a_row": self.in_a_row, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.in_a_row = int(state.get("in_a_row", 0))
        self.total = int(state.get("total", 0))


# ---------------------------------------------------------------------------------------------------- OOMGuard

# torch.OutOfMemoryError since 2.5 (the same class as torch.cuda.OutOfMemoryError, which exists since 1.13).
_OOM_TYPES: tuple[type[BaseException], ...] = tuple(
    {t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)) if t}
)


def is_oom(e: BaseException) -> bool:
    """``e`` is an out-of-memory error: ``torch.OutOfMemoryError``, or a RuntimeError saying "out of memory".

    The second form covers older torch and other backends (``CUDA error: out
    of memory`` from the runtime rather than the caching allocator, ``MPS
    backend out of memory``). Not covered: the CPU allocator's "can't
    allocate memory" and cuBLAS/cuDNN's ``*_ALLOC_FAILED``.
    """
    if _OOM_TYPES and isinstance(e, _OOM_TYPES):
        return True
    return isinstance(e, RuntimeError) and "out of memory" in str(e)


def free_memory() -> None:
    """``gc.collect()``, then ``torch.cuda.empty_cache()`` when CUDA is initialised.

    Returns the cached blocks to the driver: the next attempt (and other
    processes) see the freed memory, and fragmentation is undone.
    """
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class _Step:
    """The object ``with guard.step() as s`` binds: ``s.skipped`` says whether the block ran out of memory."""

    __slots__ = ("_guard", "skipped")

    def __init__(self, guard: OOMGuard) -> None:
        self._guard = guard
        self.skipped = False

    def __enter__(self) -> _Step:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None:
            self._guard.ok()
            return False
        if not self._guard.handle(exc, tb):
            return False  # not an OOM: passes through untouched
        self.skipped = True
        return True


class OOMGuard:
    """Skips steps that run out of device memory; raises :class:`OutOfMemoryStreak` after a streak.

    ``with guard.step() as s:`` around the step's forward, backward and
    optimizer step. When an out-of-memory error (:func:`is_oom`) leaves the
    block, the guard drops the local variables of the frames the error came
    through (the activations of the failed forward live there, and a
    traceback keeps them alive), runs :func:`free_memory`, counts the error,
    and suppresses it: ``s.skipped`` is True and execution continues after
    the ``with``. The ``max_in_a_row``-th error in a row is not suppressed:
    it becomes :class:`OutOfMemoryStreak` (logged at ERROR). Any other
    exception passes through untouched, and a block that finishes resets the
    streak (as does :meth:`ok`, for a caller that catches errors itself and
    calls :meth:`handle`).

    What the guard cannot undo is the caller's: gradients of a half-done
    backward (``optimizer.zero_grad(set_to_none=True)``), a GradScaler
    between ``scale`` and ``update``, partial gradient accumulation.

    Args:
        max_in_a_row: Out-of-memory errors in a row that end the process (>= 1;
            1: the first one does).

    Attributes:
        in_a_row: Out-of-memory errors since the last step that finished.
        total: Out-of-memory errors handled by this guard.
        skipped: The last step was skipped.
        last_error: The last out-of-memory error (its frames' locals cleared).
    """

    def __init__(self, max_in_a_row: int = 3) -> None:
        if isinstance(max_in_a_row, bool) or not isinstance(max_in_a_row, int) or max_in_a_row < 1:
            raise ValueError(f"OOMGuard max_in_a_row: expected an integer >= 1, found {max_in_a_row!r}")
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.total = 0
        self.skipped = False
        self.last_error: BaseException | None = None

    def step(self) -> _Step:
        """A context manager for one step; ``as s`` gives ``s.skipped``."""
        self.skipped = False
        return _Step(self)

    def ok(self) -> None:
        """The step finished: resets the streak."""
        self.in_a_row = 0
        self.skipped = False

    def handle(self, exc: BaseException, tb: TracebackType | None = None) -> bool:
        """Counts and cleans up after ``exc`` when it is an out-of-memory error.

        Returns:
            True: it was one, memory was freed, the caller should skip the
            step. False: it was not (nothing was done; re-raise it).

        Raises:
            OutOfMemoryStreak: It was the ``max_in_a_row``-th in a row (from ``exc``).
        """
        if not is_oom(exc):
            return False
        # The frames between the `with` and the allocation that failed hold the forward's tensors; the traceback
        # keeps those frames alive until the exception dies. Clear their locals (the frame still running, the
        # caller's, refuses: clear_frames skips it).
        traceback.clear_frames(tb if tb is not None else exc.__traceback__)
        self.in_a_row += 1
        self.total += 1
        self.skipped = True
        self.last_error = exc
        free_memory()
        if self.in_a_row >= self.max_in_a_row:
            e = OutOfMemoryStreak(self.in_a_row, self.total, exc)
            log.error("%s", e.message)
            raise e from exc
        return True


# ------------------------------------------------------------------------------------------------- scale_lr

# Per parameter group: the learning-rate keys of torch's optimizers and schedulers (OneCycleLR keeps its
# schedule in the groups: initial_lr = max_lr / div_factor, min_lr = initial_lr / final_div_factor).
_GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")
# Per scheduler: lists of per-group learning rates (LRScheduler: base_lrs, _last_lr; CyclicLR: max_lrs;
# ReduceLROnPlateau: min_lrs) and absolute floors that the schedule approaches (CosineAnnealingLR,
# CosineAnnealingWarmRestarts: eta_min; ReduceLROnPlateau: default_min_lr, for groups added later).
_SCHED_LISTS = ("base_lrs", "_last_lr", "max_lrs", "min_lrs")
_SCHED_SCALARS = ("eta_min", "default_min_lr")


def _scaled(v: Any, factor: float, done: set[int]) -> Any:
    if isinstance(v, torch.Tensor):
        if id(v) not in done:  # one tensor in two places (older torch aliased _last_lr and the groups' lr)
            done.add(id(v))
            v.mul_(factor)  # in place: a fused/capturable optimizer may hold this very tensor
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return v
    return v * factor


def _schedulers(scheduler: Any) -> Iterable[Any]:
    """The scheduler and those it drives (SequentialLR, ChainedScheduler keep them in ``_schedulers``)."""
    seen: set[int] = set()
    todo = [scheduler]
    while todo:
        s = todo.pop()
        if s is None or id(s) in seen:
            continue
        seen.add(id(s))
        yield s
        todo.extend(getattr(s, "_schedulers", ()) or ())


def scale_lr(optimizer: torch.optim.Optimizer, scheduler: Any, factor: float) -> list[float]:
    """Multiplies every learning rate of ``optimizer`` and ``scheduler`` by ``factor``.

    After it, the schedule continues as the old one times ``factor``: each
    param group's ``lr``, ``initial_lr``, ``max_lr``, ``min_lr`` (those
    present); the scheduler's ``base_lrs``, ``_last_lr``, ``max_lrs``,
    ``min_lrs``, ``eta_min`` and ``default_min_lr`` (those present), and the
    same for the schedulers a SequentialLR or ChainedScheduler drives. Tested
    for StepLR, CosineAnnealingLR (floors included), LambdaLR, OneCycleLR,
    CyclicLR, ReduceLROnPlateau, SequentialLR. A tensor learning rate is
    multiplied in place.

    Call it after loading the state (a resumed run) and before the next
    ``optimizer.step()``. Not scaled: a LambdaLR whose lambda returns an
    absolute value rather than a multiplier (the schedule is the lambda's).

    Args:
        optimizer: The optimizer.
        scheduler: Its learning-rate scheduler, or None.
        factor: The multiplier, finite and > 0 (``1 / 1.5`` to lower by 1.5).

    Returns:
        The new learning rate of each param group.

    Raises:
        ValueError: ``factor`` is not a finite number > 0.
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (0 < factor < math.inf):
        raise ValueError(f"scale_lr factor: expected a finite number > 0, found {factor!r}")
    done: set[int] = set()
    for group in optimizer.param_groups:
        for key in _GROUP_KEYS:
            if key in group:
                group[key] = _scaled(group[key], factor, done)
    for s in _schedulers(scheduler):
        for name in _SCHED_LISTS:
            values = getattr(s, name, None)
            if isinstance(values, (list, tuple)):
                setattr(s, name, type(values)(_scaled(v, factor, done) for v in values))
        for name in _SCHED_SCALARS:
            value = getattr(s, name, None)
            if isinstance(value, (int, float, torch.Tensor)) and not isinstance(value, bool):
                setattr(s, name, _scaled(value, factor, done))
    return [float(g["lr"]) for g in optimizer.param_groups]


__all__ = [
    "NonFiniteGuard",
    "NonFiniteStreak",
    "OOMGuard",
    "OutOfMemoryStreak",
    "free_memory",
    "is_oom",
    "scale_lr",
]
