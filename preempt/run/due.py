"""When a checkpoint is due, and why: the pure decisions of when the run saves.

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
            (see :class:`~preempt.run.stopping.Walltime`); infinity without a time limit.
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
    return batch * (policy.per_epoch or 0) // batches_per_epoch  # (asked only with per_epoch set)


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


def _check_positive_int_or_none(name: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive integer or None, got {value!r}")
