"""Where the training loop stands: the counters, written in one place.

:class:`LoopState` is the only writer of the step, the epoch, the batch, whether
anything changed since the last checkpoint (``dirty``), whether an optimizer
step is half done (``stepping``) or done before its ``run.step()``
(``updated``), the last checkpoint's position, the metrics
(each at the step it was measured), the best metric and the current epoch's
totals. The other parts of the run read these fields and change them through
the methods below, each named after the event that changes them. No clock, no
disk: the unit tests drive it with plain numbers (the clock's readings come in
as arguments).

**Metrics and their steps.** ``run.step(metrics)`` records at the step it
counts; ``run.report(metrics, step=None)`` at ``step``, by default the last
step counted (:func:`report_step`): an evaluation after ``run.step()``
belongs to that step, and the state then is that step's, so a better
``best_metric`` is saved as that step's "best" checkpoint (:class:`Measured`
says when the report is at such a safe point).

**The epoch across processes.** The epoch's sums and counts of each metric,
its seconds and the processes that ran part of it are saved in every
checkpoint (:meth:`LoopState.epoch_record`) and restored with it
(:func:`epoch_so_far`), so that the summary at the epoch's end covers the
whole epoch, not only the part this process ran.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from ..checkpoint.manifest import Cursor
from ..checkpoint.retention import RetentionPolicy
from ..errors import CorruptCheckpointError
from .due import SaveFacts


def report_step(step: Any, global_step: int) -> int:
    """The step a ``run.report()`` belongs to: ``step``, or the last step counted when None.

    Raises:
        TypeError: ``step`` is not an integer.
        ValueError: ``step`` is negative or ahead of the steps counted.
    """
    if step is None:
        return global_step
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"run.report(step=...): expected an integer step, got {step!r}")
    if not 0 <= step <= global_step:
        raise ValueError(
            f"run.report(step={step}): expected a step from 0 to {global_step} (run.global_step, the last step"
            " counted by run.step()); evaluate after run.step() and report at that step"
        )
    return step


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """``metrics`` as floats, every one checked before any is recorded."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics: expected a mapping of names to numbers, got {type(metrics).__name__}")
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"metrics[{key!r}]: expected one number, got a tensor of shape {tuple(value.shape)}")
            value = value.item()
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"metrics[{key!r}]: expected a number, got {value!r}")
        out[key] = float(value)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Measured:
    """What one ``run.report()`` recorded, and where the loop stood.

    Attributes:
        step: The step the metrics belong to.
        values: The metrics, as floats.
        at_step: The state now is that step's, between two steps of the epoch's batches (an evaluation
            after ``run.step()``): a safe point, where a best checkpoint or a stop is taken; a rerun from it
            goes on with the next batch, after the evaluation.
        best: The best metric improved.
        inside_step: Reported after a batch and before its ``run.step()``: the state is half a step on.
    """

    step: int
    values: dict[str, float]
    at_step: bool
    best: bool
    inside_step: bool


@dataclasses.dataclass(frozen=True, slots=True)
class EpochSoFar:
    """The current epoch as a checkpoint left it: what the processes before this one ran of it."""

    epoch: int
    seconds: float  # of this epoch, up to the checkpoint, over those processes
    processes: int  # the processes that ran part of it
    totals: dict[str, list[float]]  # name -> [sum, count] of the finite values
    evaluated: tuple[str, ...]  # the names recorded by run.report()
    known: bool = True  # False: a process before did not know its own earlier part (an older checkpoint)


def epoch_so_far(value: Any, where: str) -> EpochSoFar | None:
    """The ``epoch`` entry of a checkpoint's run state, checked; None when absent (checkpoints of earlier versions).

    Raises:
        CorruptCheckpointError: A value no run could have saved; the message names the field.
    """
    if value is None:
        return None

    def bad(field: str, expected: str, found: Any) -> CorruptCheckpointError:
        name = f"epoch.{field}" if field else "epoch"
        return CorruptCheckpointError(f"{where}: {name}: expected {expected}, found {found!r:.80}")

    if not isinstance(value, dict):
        raise bad("", "an object", value)
    epoch, seconds, processes = value.get("epoch"), value.get("seconds"), value.get("processes")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise bad("epoch", "an integer >= 0", epoch)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
        raise bad("seconds", "a finite number >= 0", seconds)
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
        raise bad("processes", "an integer >= 0", processes)
    totals, evaluated, known = value.get("totals", {}), value.get("evaluated", []), value.get("known", True)
    if not isinstance(totals, dict):
        raise bad("totals", "an object", totals)
    for name, pair in totals.items():
        ok = isinstance(pair, list) and len(pair) == 2
        if not ok or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) for x in pair):
            raise bad(f"totals[{name!r}]", "[sum, count], two finite numbers", pair)
        if pair[1] < 0:
            raise bad(f"totals[{name!r}]", "a count >= 0", pair[1])
    if not isinstance(evaluated, list) or not all(isinstance(n, str) for n in evaluated):
        raise bad("evaluated", "a list of metric names", evaluated)
    if not isinstance(known, bool):
        raise bad("known", "true or false", known)
    return EpochSoFar(
        epoch,
        float(seconds),
        processes,
        {k: [float(s), float(n)] for k, (s, n) in totals.items()},
        tuple(evaluated),
        known,
    )


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
    batches_open: bool = False  # the epoch's run.batches() is handing out batches (not yet run out)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the latest value of each
    # run.step()'s metrics: name -> (step, epoch, value) of the latest, for the history's points
    sampled: dict[str, tuple[int, int, float]] = dataclasses.field(default_factory=dict)
    metrics_restored: bool = False  # metrics came back from a checkpoint (sorted): the next record() sets the order
    best: dict[str, Any] | None = None  # {"metric", "mode", "value", "step"} of the best value so far
    best_pending: bool = False  # the best improved since the last checkpoint
    # the current epoch over every process that ran part of it (EpochSoFar restores the earlier part)
    epoch_totals: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # name -> [sum, count] (finite)
    evaluated: set[str] = dataclasses.field(default_factory=set)  # names recorded by run.report() in this epoch
    epoch_since: float | None = None  # the clock when this process began its part of the epoch
    epoch_seconds_before: float = 0.0  # of this epoch, run by the processes before this one
    epoch_processes_before: int = 0
    epoch_known: bool = True  # False: resumed inside the epoch from a checkpoint that did not record its part
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
        self.batches_open = True

    def batches_closed(self, epoch: int) -> None:
        """The batches of ``epoch`` ran out (or were left): what follows is its end-of-epoch code."""
        if epoch == self.epoch:
            self.batches_open = False

    def epoch_began(self, now: float) -> None:
        """``run.epochs()`` hands out the epoch: this process's part of it starts (the earlier part is restored)."""
        self.epoch_since = now

    def optimizer_stepping(self, *_: Any) -> None:
        """The optimizer's step-pre hook: from here until the step returns the state may be half-updated."""
        self.stepping = True

    def optimizer_stepped(self, *_: Any) -> None:
        """The optimizer's step-post hook: the step is whole, and the weights are ahead of the last run.step()."""
        self.stepping, self.updated = False, True

    def watch(self, optimizer: Any) -> Any:
        """Hooks :meth:`optimizer_stepping` and :meth:`optimizer_stepped` on ``optimizer``, and :func:`follow_steps`
        (for carry); returns a handle whose ``remove()`` takes them off (None for
        no optimizer)."""
        if optimizer is None:
            return None
        stepping = optimizer.register_step_pre_hook(self.optimizer_stepping)
        stepped = optimizer.register_step_post_hook(self.optimizer_stepped)
        return _Hooks((stepping, stepped, *follow_steps(optimizer)))

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
        self.batches_open = False
        self.epoch_totals, self.evaluated = {}, set()
        self.epoch_since, self.epoch_seconds_before, self.epoch_processes_before = None, 0.0, 0
        self.epoch_known = True

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

    def record(
        self,
        metrics: Mapping[str, Any],
        retention: RetentionPolicy,
        step: int | None = None,
        *,
        evaluated: bool = False,
    ) -> bool:
        """Takes numbers (or one-element tensors) by name, measured at ``step`` (default: the step counted last).

        A better ``retention.metric`` makes a best checkpoint due. ``evaluated``: from ``run.report()`` (its
        history point is written at once), else from ``run.step()`` (sampled into the history's points).
        Returns whether the best improved.

        Raises:
            TypeError, ValueError: A value is not one number (nothing is recorded then).
        """
        return self._record(_numbers(metrics), retention, self.global_step if step is None else step, evaluated)

    def _record(self, values: dict[str, float], retention: RetentionPolicy, step: int, evaluated: bool) -> bool:
        restored = None
        if self.metrics_restored:  # shown in the order the loop gives them, as before the restart
            restored, self.metrics, self.metrics_restored = self.metrics, {}, False
        improved = False
        for key, value in values.items():
            self.metrics[key] = value
            if evaluated:
                self.evaluated.add(key)
            else:
                self.sampled[key] = (step, self.epoch, value)
            if math.isfinite(value):
                total = self.epoch_totals.get(key)
                if total is None:
                    self.epoch_totals[key] = [value, 1.0]
                else:
                    total[0] += value
                    total[1] += 1.0
            if key == retention.metric and retention.better(value, None if self.best is None else self.best["value"]):
                self.best = {"metric": key, "mode": retention.mode, "value": value, "step": step}
                self.best_pending = improved = True
        if restored:
            for key, value in restored.items():
                self.metrics.setdefault(key, value)
        return improved

    def report(self, metrics: Mapping[str, Any], retention: RetentionPolicy, step: Any = None) -> Measured:
        """``run.report()``: metrics measured at ``step`` (:func:`report_step`), e.g. an evaluation.

        Code after ``run.step()`` may have drawn random numbers: the state differs from a checkpoint taken at
        that step (``dirty``).

        Raises:
            TypeError, ValueError: A bad step or value (nothing is recorded then).
        """
        at = report_step(step, self.global_step)
        values = _numbers(metrics)
        inside = self.batches_since_step > 0 or self.stepping
        improved = self._record(values, retention, at, evaluated=True)
        self.dirty = True
        return Measured(at, values, at == self.global_step and self.batches_open and not inside, improved, inside)

    def epoch_means(self) -> dict[str, float]:
        """The mean of each metric over this epoch's records (every process's part), non-finite values left out."""
        return {k: s / n for k, (s, n) in self.epoch_totals.items() if n}

    def epoch_record(self, now: float) -> dict[str, Any]:
        """The current epoch so far, as a checkpoint taken ``now`` keeps it (read back by :func:`epoch_so_far`)."""
        ran = 0.0 if self.epoch_since is None else max(0.0, now - self.epoch_since)
        return {
            "epoch": self.epoch,
            "seconds": self.epoch_seconds_before + ran,
            "processes": self.epoch_processes_before + (self.epoch_since is not None),
            "totals": {k: [s, n] for k, (s, n) in self.epoch_totals.items() if math.isfinite(s)},
            "evaluated": sorted(self.evaluated),
            "known": self.epoch_known,
        }

    @property
    def holds_best(self) -> bool:
        """A checkpoint now is marked best: the state is the best one's step (a later save at that step holds the
        same weights), or the first checkpoint after a best that could not be saved at its own step (reported
        inside a step, under torch.distributed, or for an earlier step): its manifest's ``best.step`` says so."""
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

    def restored(
        self,
        step: int,
        cursor: Cursor,
        metrics: Mapping[str, float],
        best: dict[str, Any] | None,
        so_far: EpochSoFar | None = None,
    ) -> None:
        """Loaded from a checkpoint at ``step``; ``so_far``: its epoch as the processes before left it."""
        self.global_step = step
        self.epoch = cursor.epoch
        self.batch = cursor.batch
        self.metrics = dict(metrics)
        self.metrics_restored = True
        self.best = best
        if so_far is not None and so_far.epoch == cursor.epoch:
            self.epoch_totals = {k: list(v) for k, v in so_far.totals.items()}
            self.evaluated = set(so_far.evaluated)
            self.epoch_seconds_before, self.epoch_processes_before = so_far.seconds, so_far.processes
            self.epoch_known = so_far.known
        else:  # an older checkpoint: inside its epoch, the part before it is unknown
            self.epoch_known = cursor.batch == 0

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
        """What :func:`preempt.run.due.decide` needs to know about the loop."""
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


def follow_steps(optimizer: Any) -> tuple[Any, Any]:
    """Hooks on ``optimizer`` that make each of its steps visible to the version counters, for carrying unchanged
    files (:mod:`preempt.checkpoint.carry`: a fused kernel writes without bumping them); returns the two handles. A
    step that bumped the first parameter with a gradient costs nothing more."""
    watched: list[tuple[torch.Tensor, int]] = []

    def before(opt: Any, args: Any, kwargs: Any) -> None:
        watched.clear()
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    watched.append((p, p._version))
                    return

    def after(opt: Any, args: Any, kwargs: Any) -> None:
        if not watched or watched[0][0]._version != watched[0][1]:
            return
        tensors = [p for group in opt.param_groups for p in group["params"]]
        tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        try:
            torch.autograd.graph.increment_version(tensors)
        except TypeError:  # torch before 2.4 takes one tensor at a time
            for t in tensors:
                torch.autograd.graph.increment_version(t)

    return optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)


class _Hooks(tuple):
    """Several hook handles removed together."""

    def remove(self) -> None:
        for handle in self:
            handle.remove()
