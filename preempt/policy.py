"""Pure decisions: when to save, when to stop, which checkpoints to keep.

No clock, no disk, no torch: the run gathers the facts and asks. The tests
drive these functions with made-up facts.

The loop calls :func:`decide` only when the cheap prefilter from
:func:`next_due` says something may be due, so the per-step cost stays a few
comparisons. ``next_due`` is conservative: whenever ``decide`` would save,
one of its thresholds has been reached.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable


class Reason(str, enum.Enum):
    """Why a checkpoint was written (recorded in its manifest)."""

    PREEMPT = "preempt"  # a stop signal; the run exits after the save
    INTERVAL = "interval"  # checkpoint_interval seconds passed
    STEPS = "steps"  # the global step is a multiple of checkpoint_every_steps
    PER_EPOCH = "per_epoch"  # one of checkpoints_per_epoch points in the epoch
    MILESTONE = "milestone"  # a multiple of keep_every_steps, kept forever
    BEST = "best"  # the tracked metric improved
    FINAL = "final"  # the run completed
    BRANCH = "branch"  # a resume request started a new timeline from a chosen checkpoint
    WALLTIME = "walltime"  # the walltime keeper stopped the run before its time limit; the run exits after it
    EMERGENCY = "emergency"  # an exception escaped the loop at a step boundary: its state, then the exception


@dataclasses.dataclass(frozen=True, kw_only=True)
class SavePolicy:
    """When periodic checkpoints are due.

    Args:
        interval_s: Seconds between checkpoints; None disables the clock.
        every_steps: Save at every multiple of this global step; None disables.
        per_epoch: Checkpoints per epoch, evenly spaced in batches (needs a
            loader with a length); None disables.
        milestone_steps: Also save at every multiple of this step count (these
            are the checkpoints that keep_every_steps retains).
    """

    interval_s: float | None = 300.0
    every_steps: int | None = None
    per_epoch: int | None = None
    milestone_steps: int | None = None

    def __post_init__(self) -> None:
        if self.interval_s is not None and not (
            isinstance(self.interval_s, (int, float))
            and not isinstance(self.interval_s, bool)
            and self.interval_s > 0
            and math.isfinite(self.interval_s)
        ):
            raise ValueError(
                f"checkpoint_interval: expected a positive number of seconds or None, got {self.interval_s!r}"
            )
        for name, label in (
            ("every_steps", "checkpoint_every_steps"),
            ("per_epoch", "checkpoints_per_epoch"),
            ("milestone_steps", "keep_every_steps"),
        ):
            _check_positive_int_or_none(label, getattr(self, name))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveFacts:
    """What the run knows at a safe point.

    Args:
        now: Monotonic seconds.
        step: Optimizer steps completed (the global step).
        epoch: The epoch the cursor is in.
        batch: Batches of this epoch the loop has consumed.
        batches_per_epoch: len(loader) when known.
        last_save_time: Monotonic time of the last save (or of the run start).
        last_save_step: Global step of the last save (or of the resume).
        last_save_epoch: Epoch of the last save.
        last_save_batch: Batch cursor of the last save.
        stop_requested: A stop signal is pending.
        best_improved: The tracked metric improved since the last save.
        dirty: The state changed since the last save or load.
        stop_at: Monotonic time from which the walltime keeper stops the run
            (see :class:`Walltime`); infinity without a time limit.
    """

    now: float
    step: int
    epoch: int
    batch: int
    batches_per_epoch: int | None
    last_save_time: float
    last_save_step: int
    last_save_epoch: int
    last_save_batch: int
    stop_requested: bool = False
    best_improved: bool = False
    dirty: bool = True
    stop_at: float = math.inf


@dataclasses.dataclass(frozen=True)
class Decision:
    """``save``: write a checkpoint now; ``stop``: then leave the run."""

    save: bool
    stop: bool
    reason: Reason | None


NOTHING = Decision(False, False, None)


def _epoch_slot(policy: SavePolicy, batch: int, batches_per_epoch: int) -> int:
    return batch * policy.per_epoch // batches_per_epoch  # type: ignore[operator]


def decide(policy: SavePolicy, facts: SaveFacts) -> Decision:
    """Whether to save and whether to stop, at a safe point."""
    if facts.stop_requested:
        # A stop with nothing new since the last save or load needs no write.
        return Decision(facts.dirty, True, Reason.PREEMPT)
    if facts.now >= facts.stop_at:
        return Decision(facts.dirty, True, Reason.WALLTIME)
    if not facts.dirty:
        return NOTHING
    if facts.best_improved:
        return Decision(True, False, Reason.BEST)
    stepped = facts.step != facts.last_save_step
    if policy.milestone_steps and stepped and facts.step % policy.milestone_steps == 0:
        return Decision(True, False, Reason.MILESTONE)
    if policy.every_steps and stepped and facts.step % policy.every_steps == 0:
        return Decision(True, False, Reason.STEPS)
    if policy.per_epoch and facts.batches_per_epoch:
        ref = facts.last_save_batch if facts.last_save_epoch == facts.epoch else 0
        if _epoch_slot(policy, facts.batch, facts.batches_per_epoch) > _epoch_slot(
            policy, ref, facts.batches_per_epoch
        ):
            return Decision(True, False, Reason.PER_EPOCH)
    # the same expression as next_due(), so both round alike
    if policy.interval_s is not None and facts.now >= facts.last_save_time + policy.interval_s:
        return Decision(True, False, Reason.INTERVAL)
    return NOTHING


@dataclasses.dataclass(frozen=True)
class Due:
    """Thresholds below which :func:`decide` cannot save (stop and best aside)."""

    step: float
    batch: float
    time: float


def next_due(policy: SavePolicy, facts: SaveFacts) -> Due:
    """The earliest step, batch and clock value at which a save may be due.

    Computed after each decision; valid until the epoch changes (the run
    recomputes at every epoch start).
    """
    step: float = math.inf
    for m in (policy.every_steps, policy.milestone_steps):
        if m:
            step = min(step, (facts.step // m + 1) * m)
    batch: float = math.inf
    if policy.per_epoch and facts.batches_per_epoch:
        ref = facts.last_save_batch if facts.last_save_epoch == facts.epoch else 0
        slot = max(
            _epoch_slot(policy, ref, facts.batches_per_epoch),
            _epoch_slot(policy, facts.batch, facts.batches_per_epoch),
        )
        # smallest b with b * per_epoch // bpe >= slot + 1
        batch = -(-(slot + 1) * facts.batches_per_epoch // policy.per_epoch)
    when: float = facts.stop_at
    if policy.interval_s is not None:
        when = min(when, facts.last_save_time + policy.interval_s)
    return Due(step, batch, when)


PRIOR_SAVE_BYTES_PER_S = 100e6
"""Write speed assumed for the first checkpoint before one has been timed: a slow shared filesystem."""


class Walltime:
    """When to stop so that the stop's checkpoint is durable before a deadline.

    Pure: the run passes the clock's values in. The run stops at the first
    safe point at or after :meth:`stop_at`, which is the deadline minus a
    margin of ``1.5 * (step + gap + save) + SLACK_S``: from a safe point just
    before ``stop_at`` the loop may run one more step (or an epoch's end and
    the next epoch's start) before it notices, then saves.

    * ``save`` is the longest checkpoint this process has timed; before the
      first one, a prior of 0.5 s plus the state's bytes at
      :data:`PRIOR_SAVE_BYTES_PER_S`.
    * ``step`` is the longest average step time over the windows between the
      run's reviews (saves excluded, epoch-end code included). Reviews are
      scheduled at half the time left before ``stop_at`` (at least
      :attr:`MIN_REVIEW_S` apart), so there are about log2(T / 1 s) of them in
      a job of T seconds and the windows near the end are short.
    * ``gap`` is the longest stretch between safe points that is not a step:
      the code after an epoch's last batch (validation), and the start of an
      epoch's loader up to its first batch (worker start-up). The run times
      both, twice per epoch.

    The per-step cost is nil: the run folds :meth:`review_at` into the clock
    threshold that ``run.step()`` already compares with. A single step much
    longer than the average (an evaluation inside the loop every N steps) is
    not foreseen; move it to an epoch's end, or leave room with a shorter
    ``time_limit``.

    Args:
        deadline: Monotonic time by which the stop's checkpoint must be durable.
        prior_save_s: Estimated seconds of one checkpoint until one is timed.
        now: Monotonic time now (the start of the first window).
        step: The global step now.
    """

    SLACK_S = 2.0
    MIN_REVIEW_S = 1.0

    def __init__(self, deadline: float, prior_save_s: float, now: float, step: int) -> None:
        self.deadline = deadline
        self.save_s = prior_save_s
        self.save_measured = False
        self.step_s = 0.0
        self.gap_s = 0.0
        self._base_time = now
        self._base_step = step

    @staticmethod
    def prior_save_s(state_bytes: int) -> float:
        return 0.5 + state_bytes / PRIOR_SAVE_BYTES_PER_S

    def margin(self) -> float:
        return 1.5 * (self.step_s + self.gap_s + self.save_s) + self.SLACK_S

    def stop_at(self) -> float:
        return self.deadline - self.margin()

    def observe(self, now: float, step: int) -> None:
        """At a safe point: the steps since the window started took ``now - start``."""
        if step > self._base_step:
            self.step_s = max(self.step_s, (now - self._base_time) / (step - self._base_step))
            self._base_time, self._base_step = now, step

    def gap(self, seconds: float) -> None:
        """A stretch between safe points that is not a step (epoch end, loader start) took ``seconds``."""
        self.gap_s = max(self.gap_s, seconds)

    def saved(self, seconds: float, now: float, step: int) -> None:
        """A checkpoint took ``seconds``; the next window starts after it."""
        self.save_s = max(self.save_s, seconds) if self.save_measured else seconds
        self.save_measured = True
        self._base_time, self._base_step = now, step

    def review_at(self, now: float) -> float:
        """When the run should next call :meth:`observe` (never after :meth:`stop_at`)."""
        stop = self.stop_at()
        left = stop - now
        if left <= self.MIN_REVIEW_S:
            return stop
        return now + max(left / 2, self.MIN_REVIEW_S)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """Which valid checkpoints survive pruning.

    Args:
        keep_last: The newest N valid checkpoints; None keeps all.
        keep_best: The N best by ``metric`` among checkpoints written because
            the metric improved.
        keep_every_steps: Checkpoints at multiples of this step, kept forever.
        metric: Name of the metric passed to ``run.step(metrics=...)`` or
            ``run.report(...)`` that decides "best".
        mode: ``"min"`` or ``"max"``.
        recycle: Keep the files of one pruned checkpoint for the next save to
            write over in place rather than delete them (see
            :mod:`preempt.commit`, "Recycling").
    """

    keep_last: int | None = 2
    keep_best: int = 0
    keep_every_steps: int | None = None
    metric: str | None = None
    mode: str = "min"
    recycle: bool = True

    def __post_init__(self) -> None:
        _check_positive_int_or_none("keep_last", self.keep_last)
        _check_positive_int_or_none("keep_every_steps", self.keep_every_steps)
        if not isinstance(self.keep_best, int) or isinstance(self.keep_best, bool) or self.keep_best < 0:
            raise ValueError(f"keep_best: expected an integer >= 0, got {self.keep_best!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"best_mode: expected 'min' or 'max', got {self.mode!r}")
        if self.metric is not None and (not isinstance(self.metric, str) or not self.metric):
            raise ValueError(f"best_metric: expected a metric name, got {self.metric!r}")
        if not isinstance(self.recycle, bool):
            raise ValueError(f"recycle_files: expected True or False, got {self.recycle!r}")
        if self.keep_best and self.metric is None:
            raise ValueError(f"keep_best={self.keep_best} needs best_metric= (the name of the metric to rank by)")

    def better(self, new: float, old: float | None) -> bool:
        """Whether ``new`` improves on ``old`` (NaN never does)."""
        if math.isnan(new):
            return False
        if old is None or math.isnan(old):
            return True
        return new < old if self.mode == "min" else new > old


@dataclasses.dataclass(frozen=True)
class Kept:
    """One checkpoint as retention sees it."""

    step: int
    best_value: float | None = None  # set on checkpoints written because the metric improved


def select_kept(policy: RetentionPolicy, checkpoints: Iterable[Kept]) -> set[int]:
    """Steps of the valid checkpoints to keep; every other valid one may go.

    Only valid checkpoints are passed in: corrupt or incomplete ones never count
    toward ``keep_last`` (they are moved aside by the manager, never pruned), so
    newer broken checkpoints cannot push out the last good one. The newest valid
    checkpoint is always kept.
    """
    items = sorted(checkpoints, key=lambda c: c.step, reverse=True)
    if not items:
        return set()
    kept = {items[0].step}
    if policy.keep_last is None:
        kept.update(c.step for c in items)
    else:
        kept.update(c.step for c in items[: policy.keep_last])
    if policy.keep_best:
        ranked = [c for c in items if c.best_value is not None and not math.isnan(c.best_value)]
        ranked.sort(key=lambda c: c.best_value, reverse=policy.mode == "max")  # type: ignore[arg-type,return-value]
        kept.update(c.step for c in ranked[: policy.keep_best])
    if policy.keep_every_steps:
        kept.update(c.step for c in items if c.step % policy.keep_every_steps == 0)
    return kept


def _check_positive_int_or_none(name: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive integer or None, got {value!r}")
