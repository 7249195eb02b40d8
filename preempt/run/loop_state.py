"""Where the training loop stands: the counters, written in one place.

:class:`LoopState` is the only writer of the step, the epoch, the batch, whether
anything changed since the last checkpoint (``dirty``), whether an optimizer
step is half done (``stepping``) or done before its ``run.step()``
(``updated``), the last checkpoint's position and the best metric. The other
parts of the run read these fields and change them through the methods below,
each named after the event that changes them. No clock, no
disk: the unit tests drive it with plain numbers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from ..checkpoint.manifest import Cursor
from ..checkpoint.retention import RetentionPolicy
from .save_policy import SaveFacts


@dataclasses.dataclass(slots=True)
class LoopState:
    """The loop's counters (read them; change them through the methods)."""

    global_step: int = 0
    epoch: int = 0
    batch: int = 0  # batches of the epoch the loop received
    batches_since_step: int = 0  # received since the last run.step() (micro-batches of gradient accumulation)
    stepping: bool = False  # optimizer.step() began and has not returned: the state may be half-updated
    updated: bool = False  # optimizer.step() returned since the last run.step(): the weights are a step ahead of it
    dirty: bool = False  # changed since the last checkpoint (or load)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    epoch_totals: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # name -> [sum, count] (finite)
    metrics_restored: bool = False  # metrics came back from a checkpoint (sorted): the next record() sets the order
    best: dict[str, Any] | None = None  # {"metric", "mode", "value", "step"} of the best value so far
    best_pending: bool = False  # the best improved since the last checkpoint
    start_step: int = 0  # the step this process started from
    last_save_time: float = 0.0
    last_save_step: int = 0
    last_save_epoch: int = 0
    last_save_batch: int = 0
    # run.step() looks further (the safe point) once the step or the batch reaches these (the run sets them)
    wake_step: float = math.inf
    wake_batch: float = math.inf
    beacon: Any = dataclasses.field(default_factory=lambda: [0])  # stepped() stores the step in [0] (lock.StepBeacon)

    # ------------------------------------------------------------ the loop's events

    def started(self, now: float) -> None:
        """The run is on: periodic checkpoints count from now."""
        self.start_step = self.global_step
        self.last_save_time = now

    def took_batch(self) -> None:
        self.batch += 1
        self.batches_since_step += 1

    def at_batch(self, batch: int) -> None:
        """The epoch's iterator starts at ``batch`` (0, or where a resumed epoch continues)."""
        self.batch = batch

    def optimizer_stepping(self, *_: Any) -> None:
        """The optimizer's step-pre hook: from here until the step returns the state may be half-updated."""
        self.stepping = True

    def optimizer_stepped(self, *_: Any) -> None:
        """The optimizer's step-post hook: the step is whole, and the weights are ahead of the last run.step()."""
        self.stepping, self.updated = False, True

    def watch(self, optimizer: Any) -> Any:
        """Hooks :meth:`optimizer_stepping` and :meth:`optimizer_stepped` on ``optimizer``; returns a handle whose
        ``remove()`` takes both off (None for no optimizer)."""
        if optimizer is None:
            return None
        return _Hooks((optimizer.register_step_pre_hook(self.optimizer_stepping),
                       optimizer.register_step_post_hook(self.optimizer_stepped)))  # fmt: skip

    def stepped(self) -> bool:
        """``run.step()``: one optimizer step done; True when the safe point must look (a threshold or a best)."""
        step = self.global_step = self.beacon[0] = self.global_step + 1
        self.batches_since_step = 0
        self.stepping = self.updated = False
        self.dirty = True
        return step >= self.wake_step or self.batch >= self.wake_batch or self.best_pending

    def batch_skipped(self) -> None:
        """A batch consumed without a step (non-finite loss, out of memory): a step boundary again."""
        self.batches_since_step = 0
        self.stepping = self.updated = False

    def epoch_ended(self) -> None:
        self.epoch += 1
        self.batch = 0
        self.dirty = True
        self.epoch_totals = {}

    def unwind_batches(self) -> None:
        """The batches received since the last step are trained again by the rerun (an emergency save)."""
        self.batch -= self.batches_since_step
        self.batches_since_step = 0

    @property
    def at_epoch_start(self) -> bool:
        return self.batch == 0 and self.batches_since_step == 0

    def publish(self, view: Any) -> None:
        """Every step is stored into ``view[0]`` (shared memory that outlives a killed process); None: stop."""
        self.beacon = [0] if view is None else view

    def wake_at(self, step: float, batch: float) -> None:
        """The thresholds at which :meth:`stepped` says to look further (the run takes each part's earliest)."""
        self.wake_step, self.wake_batch = step, batch

    # ------------------------------------------------------------ metrics

    def record(self, metrics: Mapping[str, Any], retention: RetentionPolicy) -> None:
        """Takes numbers (or one-element tensors) by name; a better ``retention.metric`` makes a best checkpoint due.

        Raises:
            TypeError, ValueError: A value is not one number.
        """
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics: expected a mapping of names to numbers, got {type(metrics).__name__}")
        restored = None
        if self.metrics_restored:  # shown in the order the loop gives them, as before the restart
            restored, self.metrics, self.metrics_restored = self.metrics, {}, False
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(
                        f"metrics[{key!r}]: expected one number, got a tensor of shape {tuple(value.shape)}"
                    )
                value = value.item()
            if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"metrics[{key!r}]: expected a number, got {value!r}")
            value = float(value)
            self.metrics[key] = value
            if math.isfinite(value):
                total = self.epoch_totals.get(key)
                if total is None:
                    self.epoch_totals[key] = [value, 1.0]
                else:
                    total[0] += value
                    total[1] += 1.0
            if key == retention.metric and retention.better(value, None if self.best is None else self.best["value"]):
                self.best = {"metric": key, "mode": retention.mode, "value": value, "step": self.global_step}
                self.best_pending = True
        if restored:
            for key, value in restored.items():
                self.metrics.setdefault(key, value)

    def epoch_means(self) -> dict[str, float]:
        """The mean of each metric over this epoch's records (in this process), non-finite values left out."""
        return {k: s / n for k, (s, n) in self.epoch_totals.items() if n}

    @property
    def holds_best(self) -> bool:
        """The state now is the best one (a later save at the step that set the best holds the same weights)."""
        return self.best_pending or (self.best is not None and self.best["step"] == self.global_step)

    # ------------------------------------------------------------ checkpoints

    def taken(self, step: int, cursor: Cursor, now: float) -> None:
        """The state at ``step`` is in a checkpoint (or staged for one): nothing to save until the loop changes it."""
        self.dirty = False
        self.best_pending = False
        self.last_save_time = now
        self.last_save_step = step
        self.last_save_epoch = cursor.epoch
        self.last_save_batch = cursor.batch

    def save_skipped(self, now: float) -> None:
        """A periodic checkpoint could not be written: the next try comes when the next one is due."""
        self.best_pending = False
        self.last_save_time = now
        self.last_save_step = self.global_step
        self.last_save_epoch = self.epoch
        self.last_save_batch = self.batch

    def changed(self) -> None:
        """The state differs from the last checkpoint's (a failed write, a new timeline)."""
        self.dirty = True

    def restored(self, step: int, cursor: Cursor, metrics: Mapping[str, float], best: dict[str, Any] | None) -> None:
        """Loaded from a checkpoint at ``step``."""
        self.global_step = step
        self.epoch = cursor.epoch
        self.batch = cursor.batch
        self.metrics = dict(metrics)
        self.metrics_restored = True
        self.best = best

    def rolled_back(self, step: int) -> None:
        """Model and optimizer are those of ``step`` again; the data goes on from where it is."""
        self.global_step = step
        self.dirty = True

    def facts(
        self,
        now: float,
        *,
        batches_per_epoch: int | None,
        stop_requested: bool,
        stop_at: float = math.inf,
    ) -> SaveFacts:
        """What :func:`preempt.run.save_policy.decide` needs to know about the loop."""
        return SaveFacts(
            now=now,
            step=self.global_step,
            epoch=self.epoch,
            batch=self.batch,
            batches_per_epoch=batches_per_epoch,
            last_save_time=self.last_save_time,
            last_save_step=self.last_save_step,
            last_save_epoch=self.last_save_epoch,
            last_save_batch=self.last_save_batch,
            stop_requested=stop_requested,
            best_improved=self.best_pending,
            dirty=self.dirty,
            stop_at=stop_at,
        )


class _Hooks(tuple):
    """Several hook handles removed together."""

    def remove(self) -> None:
        for handle in self:
            handle.remove()
