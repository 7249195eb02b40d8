"""How the save scheduler writes a checkpoint: its decisions, pure functions of facts; its jobs and records.

* :func:`pick` -- at a safe point: which save to take now, and which waits;
* :func:`write_mode` -- for a save: wait for the job in flight first, cancel it? in the background?
* :func:`adjusted_due` -- the step and time at which ``run.step()`` must look again;
* :func:`outcome_of` -- what the end of a background job means, one :class:`Outcome` per handler.

:class:`~preempt.run.save_scheduler.SaveScheduler` acts on them; they are unit-tested
without threads (``tests/unit/test_save_scheduler.py``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ClassVar

from ..checkpoint.cancel import WriteCancelled
from ..checkpoint.carry import WrittenBehindAutograd
from ..checkpoint.staging import ChangedWhileWritten, LazyCopy, TornSnapshot
from ..errors import LockLostError
from .due import Due, Reason

POSTPONABLE = frozenset({Reason.INTERVAL, Reason.STEPS, Reason.PER_EPOCH})
# saves due by the clock, whose step is nobody's choice: the buffers' sizing postpones them too (see pick)
BY_TIME = frozenset({Reason.INTERVAL})
SYNCHRONOUS = frozenset({Reason.PREEMPT, Reason.WALLTIME, Reason.FINAL, Reason.BRANCH, Reason.EMERGENCY})
STOPS = frozenset({Reason.PREEMPT, Reason.WALLTIME})  # saves racing the grace period: they never wait for stale work


@dataclasses.dataclass(frozen=True)
class SaveRecord:
    """The latest checkpoint the run took (``run.last_save``).

    Attributes:
        step: Its global step.
        reason: Why it was taken (``"interval"``, ``"preempt"``, ...).
        stall_s: Seconds the training loop spent in it: the whole save when
            synchronous, the copy into the staging buffers when asynchronous.
        write_s: Seconds from the start of the save to its checkpoint being
            durable; None while a background write is in flight.
        path: The checkpoint directory once durable, else None. Under
            torch.distributed a checkpoint that rank 0 writes in the
            background stays None on the other ranks.
        background: Written by the background writer.
    """

    step: int
    reason: str
    stall_s: float
    write_s: float | None = None
    path: Path | None = None
    background: bool = False

    @property
    def durable(self) -> bool:
        """The checkpoint is on disk with all its files and manifest fsynced."""
        return self.path is not None


class JobKind(enum.Enum):
    """What the background writer does."""

    PREPARE = "prepare"  # sizes (allocates and touches) the staging buffers
    SAVE = "save"  # writes a staged snapshot: a checkpoint
    RESERVE = "reserve"  # writes a pool of files ahead for the next save to write over (nobody's checkpoint)


@dataclasses.dataclass(frozen=True)
class SaveJob:
    """A checkpoint written in the background, with all that is known of it: why (its :class:`Reason`), its record,
    its staging completion (the lazy copies the writer makes first, which the optimizer's next step waits for; None
    when the copy was made at the step) and its future (the write's completion: the checkpoint, or the error)."""

    kind: ClassVar[JobKind] = JobKind.SAVE
    reason: Reason
    record: SaveRecord
    future: Future[Any]
    started: float  # clock at the start of the save
    staging: LazyCopy | None = None
    cancel: threading.Event | None = None  # set: the write stops before its rename (cancel.cancellable); None: never


@dataclasses.dataclass(frozen=True)
class PrepareJob:
    """The staging buffers being sized in the background; the future's result is the seconds it took. ``cancel``
    set: it ends at its next step (the pages not touched yet are faulted by the first copy)."""

    kind: ClassVar[JobKind] = JobKind.PREPARE
    future: Future[Any]
    cancel: threading.Event | None = None


@dataclasses.dataclass(frozen=True)
class ReserveJob:
    """A pool of files being written ahead (nobody's checkpoint: a save cancels it); the future's result is the pool."""

    kind: ClassVar[JobKind] = JobKind.RESERVE
    future: Future[Any]
    started: float
    cancel: threading.Event


Job = SaveJob | PrepareJob | ReserveJob  # the background writer's one job in flight


class Outcome(enum.Enum):
    """What the end of a background job means; the scheduler has one handler for each."""

    PREPARED = "prepared"  # the staging buffers are sized
    PREPARE_FAILED = "prepare failed"  # they could not be: saves are synchronous from now on
    RESERVED = "reserved"  # a pool is written ahead
    RESERVE_FAILED = "reserve failed"  # it was not (cancelled, or the disk refused): nothing lost
    WRITTEN = "written"  # the checkpoint is durable
    TORN = "torn"  # a lazy snapshot changed before its copy was made: not written
    CHANGED = "changed"  # a tensor read where it lives changed during the write: not committed
    BEHIND_AUTOGRAD = "behind autograd"  # a file read where it lives came out other than at the step: not committed
    CANCELLED = "cancelled"  # a stop cancelled the write: the stop saves the current state
    NOT_WRITTEN = "not written"  # the write failed for want of disk or I/O: training goes on
    LOCK_LOST = "lock lost"  # the save_dir is no longer this run's
    BROKEN = "broken"  # any other error: the run ends with it


def outcome_of(kind: JobKind, error: BaseException | None) -> Outcome:
    """What a job of ``kind`` that ended with ``error`` (None: it succeeded) means."""
    if error is None:
        return {JobKind.PREPARE: Outcome.PREPARED, JobKind.SAVE: Outcome.WRITTEN, JobKind.RESERVE: Outcome.RESERVED}[
            kind
        ]
    if isinstance(error, WrittenBehindAutograd):
        return Outcome.BEHIND_AUTOGRAD
    if isinstance(error, ChangedWhileWritten):
        return Outcome.CHANGED
    if isinstance(error, TornSnapshot):
        return Outcome.TORN
    if kind is JobKind.RESERVE:
        return Outcome.RESERVE_FAILED
    if kind is JobKind.PREPARE:
        return Outcome.PREPARE_FAILED
    if isinstance(error, WriteCancelled):
        return Outcome.CANCELLED
    if isinstance(error, OSError):
        return Outcome.NOT_WRITTEN
    if isinstance(error, LockLostError):
        return Outcome.LOCK_LOST
    return Outcome.BROKEN


# ---------------------------------------------------------------------------- the pure decisions


def pick(
    reason: Reason | None, *, job: JobKind | None, staging: bool, postponed: Reason | None, dirty: bool
) -> tuple[Reason | None, Reason | None]:
    """At a safe point: the save to take now (None: none) and the periodic save that stays postponed.

    A periodic save due while a write is in flight waits for the step after it ends. One due by the clock
    (``checkpoint_interval``) also waits while the staging buffers are being sized, at a process's start: the loop
    goes on instead of waiting for the sizing (several times a steady save's copy), and the save is taken at the first
    step after, into touched buffers. A save due at a step count or an epoch's end keeps its step and waits for the
    sizing (a fraction of a second, once per process).

    Args:
        reason: What the save policy says is due (None: nothing).
        job: The kind of the background job in flight, if any.
        staging: Background saves are possible.
        postponed: A periodic save postponed earlier.
        dirty: The state changed since the last checkpoint.
    """

    def waits(r: Reason) -> bool:
        return staging and (job is JobKind.SAVE and r in POSTPONABLE or job is JobKind.PREPARE and r in BY_TIME)

    if reason is not None and waits(reason):
        return None, reason
    if reason is None and postponed is not None and not waits(postponed) and dirty:
        return postponed, postponed  # the job that postponed it has ended
    return reason, postponed


# A synchronous save (the stop's, the final one) while staging buffers exist copies the state into them and writes
# them itself: page-aligned memory laid out as the files goes to the disk without the page cache
# (preempt.checkpoint.direct_io). False: it writes the live tensors through the page cache (what bench_async.py's row 6
# compares; bench/README.md has the figures).
STAGE_SYNCHRONOUS = True


@dataclasses.dataclass(frozen=True)
class WriteMode:
    """How a save taken now is written (:func:`write_mode`)."""

    wait: bool  # wait for the job in flight first
    background: bool  # stage the state and let the writer write it
    cancel: bool = False  # stop the write in flight instead of waiting for it: this save supersedes it
    stage: bool = False  # written at once, from the staging buffers (STAGE_SYNCHRONOUS)


def write_mode(reason: Reason, *, job: JobKind | None, staging: bool, writing: Reason | None = None) -> WriteMode:
    """How to write a save that is taken now.

    Args:
        writing: The reason of the snapshot the writer is writing (when ``job`` is a save).

    A stop's save does not wait for a periodic write in flight: that snapshot is older than the state the stop
    saves, so it is cancelled (its partial files removed) and the stop's durable time is that of one write. A
    best or milestone write in flight is waited for: it is kept for its own sake. A pool being written ahead
    is cancelled by any save, which writes over what it holds; the staging buffers being sized are cut short by a
    stop, whose copy into them faults what was not touched yet (work done ahead for speed never delays a stop). A
    synchronous save copies the state into the staging buffers, when there are any, and writes from them
    (:data:`STAGE_SYNCHRONOUS`): nothing is in flight
    then to use them.
    """
    background = staging and reason not in SYNCHRONOUS
    stage = staging and not background and STAGE_SYNCHRONOUS  # the job in flight is waited for or cancelled first
    if job is JobKind.RESERVE:
        return WriteMode(wait=False, background=background, cancel=True, stage=stage)
    if job is JobKind.PREPARE and reason in STOPS:  # the buffers are taken as they are: the copy faults the rest
        return WriteMode(wait=False, background=background, cancel=True, stage=stage)
    if job is JobKind.SAVE and reason in STOPS and writing in POSTPONABLE:
        return WriteMode(wait=False, background=background, cancel=True, stage=stage)
    return WriteMode(wait=job is not None, background=background, stage=stage)


def adjusted_due(
    due: Due, *, step: int, milestone_steps: int | None, postponed: Reason | None, job: bool, prepare_at: int | None
) -> Due:
    """The policy's thresholds, adjusted for the scheduler: a postponed save, a buffer sizing to start."""
    if postponed is not None:
        if job:  # periodic saves wait for the write in flight (run.step() sees it end); milestones stay due
            m = milestone_steps
            return Due((step // m + 1) * m if m else math.inf, math.inf, math.inf)
        return Due(step + 1, math.inf, math.inf)  # its write ended: the next step takes it
    if prepare_at is not None and not job:
        return Due(min(due.step, prepare_at), due.batch, due.time)
    return due
