"""The progress line and the epoch summary of a run, as text for people.

:class:`Progress` builds the human-readable lines (pure: no I/O, an
injectable clock): a progress line at most every ``every_s`` seconds, with
steps/s over the window since the last line and an ETA that is left out when
the rate is unknown or zero, and capped (``ETA >99d``) instead of printing
absurd numbers; and the epoch summary line.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from .._log import duration, size

ETA_CAP_S = 99 * 86400.0  # beyond this an ETA says nothing useful: shown as ">99d"


def fmt_number(v: Any) -> str:
    """A metric for people: ``2.3456789`` -> ``"2.346"``, ``3e-4`` -> ``"0.0003"``, ``1.2e-5`` -> ``"1.200e-05"``.

    Integers as they are; non-finite floats as ``nan``/``inf``/``-inf``; a
    value with ``.item()`` (a 0-d tensor) is converted first.
    """
    if isinstance(v, bool):
        return str(v)
    if not isinstance(v, (int, float)) and callable(getattr(v, "item", None)):
        v = v.item()
    if isinstance(v, int):
        return str(v)
    if not isinstance(v, float):
        return str(v)
    if not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    a = abs(v)
    if a == 0:
        return "0"
    if 1e-4 <= a < 1e5:
        return f"{v:.4g}"
    return f"{v:.3e}"


def _metrics(metrics: Mapping[str, Any] | None) -> str:
    return " ".join(f"{k} {fmt_number(v)}" for k, v in (metrics or {}).items())


def _rate(steps_per_s: float) -> str:
    if steps_per_s >= 1:
        return f"{steps_per_s:.3g} steps/s"
    return f"{duration(1 / steps_per_s)}/step"


def eta_seconds(remaining_steps: int, steps_per_s: float | None) -> float | None:
    """Seconds left at this rate; None when the rate is unknown, zero or not finite, or nothing is left."""
    if steps_per_s is None or not math.isfinite(steps_per_s) or steps_per_s <= 0 or remaining_steps <= 0:
        return None
    return min(remaining_steps / steps_per_s, ETA_CAP_S)


def check_epochs(n: object, steps_per_epoch: object = None, max_steps: object = None) -> None:
    """The arguments of ``run.epochs(n, steps_per_epoch=..., max_steps=...)``, checked.

    Raises:
        ValueError: ``n`` is not an integer >= 0, or ``steps_per_epoch`` is neither None nor an integer >= 1, or
            ``max_steps`` neither None nor an integer >= 0.
    """
    if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 0):
        raise ValueError(
            f"epochs: max_steps: expected None or an integer >= 0 (the loop's last global step), got {max_steps!r}"
        )
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"epochs: expected an integer >= 0, got {n!r}")
    if steps_per_epoch is not None and (
        not isinstance(steps_per_epoch, int) or isinstance(steps_per_epoch, bool) or steps_per_epoch < 1
    ):
        raise ValueError(
            "epochs: steps_per_epoch: expected None or an integer >= 1 (the run.step() calls of one epoch),"
            f" got {steps_per_epoch!r}"
        )


def planned_total(
    epochs: int | None, steps_per_epoch: int | None, measured: int | None = None, max_steps: int | None = None
) -> int | None:
    """The run's last global step, for ``step N/T`` and the ETA; None when it cannot be known.

    ``epochs * steps_per_epoch`` when the loop said how many ``run.step()`` calls an epoch has
    (``run.epochs(n, steps_per_epoch=...)``, for a loader without a length such as an IterableDataset's); otherwise
    ``measured``, the caller's estimate from the loader's length and the steps per batch seen so far. A loop that
    ends at a step count (``run.epochs(n, max_steps=...)``, a framework's ``max_steps``) ends there if that comes first.
    """
    planned = None
    if epochs is not None:
        planned = epochs * steps_per_epoch if steps_per_epoch is not None else measured
    if max_steps is None:
        return planned
    return max_steps if planned is None else min(planned, max_steps)


class Progress:
    """Progress lines, at most one every ``every_s`` seconds, and epoch summaries. Pure: returns text.

    ::

        progress = Progress(total_steps=10_000, every_s=30)
        for ...:
            line = progress.update(step, epoch, batch, len(loader), {"loss": loss_value})
            if line:
                log.info(line)

    A line looks like ``step 1200/10000 | epoch 3 batch 120/500 | loss 2.346
    | 4.21 steps/s | ETA 34m50s``. The first :meth:`update` returns a line at
    once (the run is alive) without a rate; later ones return a line when
    ``every_s`` seconds passed since the previous line, with the rate over
    that window (pauses such as checkpoint writes included: it is the rate
    the ETA needs). The ETA is left out while the rate is unknown or zero and
    capped at :data:`ETA_CAP_S`; after a clock that did not advance, or a
    step count that went backwards, the rate is unknown.

    Epochs and batches are printed as given; pass ``epoch + 1`` for 1-based
    numbers.

    Args:
        total_steps: Steps of the whole run, for ``step N/T`` and the ETA; None if unknown.
        every_s: Seconds between two lines (>= 0; 0: every update).
        clock: Monotonic seconds, for tests.
    """

    def __init__(
        self, total_steps: int | None, *, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not (isinstance(every_s, (int, float)) and math.isfinite(every_s) and every_s >= 0):
            raise ValueError(f"Progress every_s: expected a number of seconds >= 0, found {every_s!r}")
        if total_steps is not None and (not isinstance(total_steps, int) or total_steps < 0):
            raise ValueError(f"Progress total_steps: expected None or an integer >= 0, found {total_steps!r}")
        self.total_steps = total_steps
        self.every_s = float(every_s)
        self._clock = clock
        self._last_t: float | None = None
        self._last_step = 0
        self.steps_per_s: float | None = None  # the rate over the last window

    def update(
        self,
        step: int,
        epoch: int,
        batch: int,
        batches_per_epoch: int | None,
        metrics: Mapping[str, Any] | None = None,
    ) -> str | None:
        """A progress line when one is due, else None (cheap: one clock read)."""
        now = self._clock()
        if self._last_t is not None:
            dt = now - self._last_t
            if dt < self.every_s:
                return None
            ds = step - self._last_step
            self.steps_per_s = ds / dt if dt > 0 and ds >= 0 else None
        self._last_t, self._last_step = now, step
        parts = [f"step {step}" + (f"/{self.total_steps}" if self.total_steps is not None else "")]
        parts.append(f"epoch {epoch} batch {batch}" + (f"/{batches_per_epoch}" if batches_per_epoch else ""))
        if metrics:
            parts.append(_metrics(metrics))
        if self.steps_per_s is not None and self.steps_per_s > 0:
            parts.append(_rate(self.steps_per_s))
        if self.total_steps is not None:
            eta = eta_seconds(self.total_steps - step, self.steps_per_s)
            if eta is not None:
                parts.append("ETA >99d" if eta >= ETA_CAP_S else f"ETA {duration(eta)}")
        return " | ".join(parts)

    def epoch_summary(
        self,
        epoch: int,
        metrics: Mapping[str, Any] | None,
        epoch_time_s: float | None,
        best: Mapping[str, Any] | None = None,
        peak_gpu_mem: int | None = None,
        *,
        evaluated: Mapping[str, Any] | None = None,
        processes: int = 1,
        seconds: float | None = None,
        known: bool = True,
    ) -> str:
        """``epoch 3 done in 4m13s | train_loss 0.2346 | eval_loss 0.3457 | best eval_loss 0.3012 (epoch 2) |
        peak GPU memory 4.5 GiB``; an epoch run by several processes (stopped and resumed):
        ``epoch 0 done: 9.61 s over 2 processes (this one 1.24 s) | loss 4.415 | val_loss 3.868``.

        Args:
            epoch: The epoch, printed as given.
            metrics: The epoch's metrics (e.g. the means of the training metrics).
            epoch_time_s: Its duration in this process; None leaves it out.
            best: The best so far, e.g. ``{"eval_loss": 0.3012, "epoch": 2}``;
                ``epoch`` and ``step`` keys go into the parentheses.
            peak_gpu_mem: Peak device memory in bytes (e.g.
                ``torch.cuda.max_memory_allocated()``); None leaves it out.
            evaluated: Metrics of evaluations (``run.report()``), shown after ``metrics``.
            processes: The processes that ran part of the epoch, this one included.
            seconds: The epoch's seconds over all of them (with ``processes`` > 1).
            known: False: the part before this process is unknown (``metrics`` cover this process only).
        """
        took = "" if epoch_time_s is None else duration(epoch_time_s)
        if not known:  # resumed from a checkpoint of an earlier version, inside the epoch
            head = f"epoch {epoch} done: {took or '?'} in this process (its checkpoint has no record of the rest)"
        elif processes > 1 and seconds is not None:
            head = f"epoch {epoch} done: {duration(seconds)} over {processes} processes (this one {took or '?'})"
        else:
            head = f"epoch {epoch} done" + (f" in {took}" if took else "")
        parts = [head]
        if metrics:
            parts.append(_metrics(metrics))
        if evaluated:
            parts.append(_metrics(evaluated))
        if best:
            where = [f"{k} {best[k]}" for k in ("epoch", "step") if k in best]
            values = {k: v for k, v in best.items() if k not in ("epoch", "step")}
            parts.append(f"best {_metrics(values)}".rstrip() + (f" ({', '.join(where)})" if where else ""))
        if peak_gpu_mem is not None:
            parts.append(f"peak GPU memory {size(peak_gpu_mem)}")
        return " | ".join(parts)


__all__ = ["ETA_CAP_S", "Progress", "check_epochs", "eta_seconds", "fmt_number", "planned_total"]
