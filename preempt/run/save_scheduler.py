"""When and how a checkpoint is written: now, in the background, or postponed.

:class:`SaveScheduler` runs one background job at a time, each of its own kind (:mod:`preempt.run.write_decisions`: a
:class:`~preempt.run.write_decisions.SaveJob` holds its reason, its staging completion and its future; sizing the
buffers; a pool of files written ahead for the saves to write over, :class:`preempt.checkpoint.recycle.Pool`), and a
periodic save postponed behind that job. A save goes down to the checkpoint writer built once for the run
(:mod:`preempt.run.checkpoint_writer`: one process's save or the ranks' commit). Its parts: the buffers and the writer
thread (:mod:`preempt.run.background`), sharded state written by the ranks' writers (:mod:`preempt.run.sharded_saves`)
and what came of each save (:mod:`preempt.run.outcomes`); its choices, the pure functions of
:mod:`preempt.run.write_decisions` (pick, write_mode, adjusted_due), unit-tested with made-up facts. Periodic saves due
while a write is in flight are postponed until it ends (those due by the clock also while the buffers are being sized);
best and milestone saves wait for it (they are of their own step); the stop's, the final, a branch's and an emergency
save are synchronous.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

from .. import _log, _testing
from ..checkpoint import recycle, state
from ..checkpoint.cancel import WriteCancelled, cancellable
from ..checkpoint.manager import CheckpointInfo, CheckpointManager, Pending
from ..checkpoint.manifest import Manifest
from ..checkpoint.names import checkpoint_name
from ..checkpoint.staging import BackgroundWriter, LazyCopy, Stager
from ..cluster import sharded
from ..cluster.signals import StopFlag
from ..errors import CheckpointWriteError
from .background import Background, Writer
from .checkpoint_writer import CheckpointWriter, writer_for
from .due import Due, Reason
from .loop_state import LoopState
from .outcomes import Outcomes
from .peers import Alone, Peers
from .sharded_saves import ShardedSaves
from .snapshot import Snapshot
from .write_decisions import (
    POSTPONABLE,
    Job,
    Outcome,
    PrepareJob,
    ReserveJob,
    SaveJob,
    SaveRecord,
    adjusted_due,
    outcome_of,
    pick,
    write_mode,
)

log = _log.log
# the outcomes of a save whose state is not on disk: the state is due again
_NOT_ON_DISK = frozenset(
    {Outcome.TORN, Outcome.CHANGED, Outcome.CANCELLED, Outcome.NOT_WRITTEN, Outcome.LOCK_LOST, Outcome.BROKEN}
)


class SaveScheduler:
    """Writes the run's checkpoints (see the module docstring)."""

    def __init__(
        self,
        manager: CheckpointManager,
        loop: LoopState,
        snapshot: Snapshot,
        flag: StopFlag,
        *,
        peers: Peers | None = None,
        checkpoints: CheckpointWriter | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_durable: Callable[[float, float, int], None] | None = None,
        on_saved: Callable[[SaveRecord, int], None] | None = None,
        writer: Callable[[], Writer] = BackgroundWriter,
        stager: Callable[[], Stager] = Stager,
    ) -> None:
        self.manager = manager
        self.loop = loop
        self.snapshot = snapshot
        self.flag = flag
        self.peers: Peers = peers or Alone()
        self.checkpoints = checkpoints or writer_for(manager, self.peers)  # where a save goes down, built once
        self.clock = clock
        self.background = Background(writer, stager)  # the staging buffers and the writer, once started
        self.saved = Outcomes(  # what came of the saves so far, and what each outcome means
            manager, loop, flag, self.background, clock=clock, on_durable=on_durable, on_saved=on_saved
        )
        self.sharded: ShardedSaves | None = None  # sharded state under torch.distributed, saved in the background
        self.pool = recycle.Pool()  # files written ahead for the saves to write over
        self.job: Job | None = None  # the writer's current job, until its outcome is taken
        self.postponed: Reason | None = None

    # what the run and the tests read of it (each part owns its own)
    pinned = property(lambda self: self.background.pinned, doc="The staging buffers are in pinned host memory.")
    buffer_nbytes = property(lambda self: self.background.nbytes, doc="The staging buffers' size in bytes.")
    stager = property(lambda self: self.background.stager, doc="The staging buffers, while background saves may be.")
    prepare_at = property(lambda self: self.background.prepare_at, doc="When the buffers are sized for the state.")
    prepare_s = property(lambda self: self.background.prepare_s, doc="Seconds spent sizing the staging buffers.")
    sizes = property(lambda self: self.pool.sizes, doc="The state's tensor bytes per file, as the buffers were sized.")
    last_save = property(lambda self: self.saved.last_save, doc="The latest checkpoint taken (a SaveRecord).")
    last_info = property(lambda self: self.saved.last_info, doc="The newest durable checkpoint known here.")
    last_checkpoint = property(lambda self: self.saved.last_checkpoint, doc="Its path (rank 0's, when told).")
    failed = property(lambda self: self.saved.failed, doc="Periodic checkpoints that could not be written.")

    def start(self, payload: Any, *, optimizer_state_later: bool, lazy: bool = False) -> None:
        """Background saves from now: the buffers are sized for ``payload`` in the background.

        An optimizer that has state already was restored (a resume). The buffers are then sized once, for the whole
        state, at the first step (``payload`` was captured before the restore, without the moments): not now, while
        the other ranks may still be restoring on the same cores (sizing them at the start made two ranks' restore
        several times slower: ``bench/README.md``, "A restart's restore"), and not twice.

        ``lazy``: the copies of the parameters and the optimizer's state are made while the loop runs its next
        forward and backward, by the writer (on the CPU) or by the GPU's copy engine on a side stream (on a GPU), and
        the optimizer's pre-step hook waits for them, on the GPU for a GPU's
        (:class:`~preempt.checkpoint.staging.LazyCopy`); not with sharded state.

        Under torch.distributed rank 0 writes the replicated state in the background; the other ranks' files
        (their random generators) are small and written at the step, before rank 0's. Sharded state: every rank
        copies its pieces and its files, and every rank's writer runs the whole distributed commit, DCP's
        collectives included, on a gloo group of the writers' own (see :meth:`_save_sharded`).
        """
        bg = self.background
        if self.snapshot.sharded:
            if self.peers.alone:
                log.info("async_save: sharded state in one process is saved synchronously (through DCP)")
                return
            self.sharded = ShardedSaves(self.manager, self.peers, bg.new_stager())
        elif not self.peers.leader:
            return
        # the frozen base is read where it lives, never copied
        frozen = {state.BASE_FILE, state.shard_files(self.peers.rank)[0]} if self.snapshot.group_frozen else set()
        bg.open(live=frozenset(frozen))
        optimizer = self.snapshot.components.optimizer
        if lazy and optimizer is not None and self.sharded is None:
            bg.lazily(optimizer.register_step_pre_hook(self._optimizer_stepping))
        if optimizer is not None and optimizer.state:  # restored: sized at the first step boundary, for all of it
            bg.prepare_after(self.loop.global_step)
            return
        self._prepare(payload)
        if optimizer_state_later:
            bg.prepare_after(self.loop.global_step + 1)  # its moments appear at the first optimizer step

    def adjusted_due(self, due: Due, milestone_steps: int | None) -> Due:
        """The policy's thresholds ``due``, adjusted for a postponed save and a buffer sizing to start
        (:func:`~preempt.run.write_decisions.adjusted_due`): when ``run.step()`` must look again."""
        step = self.loop.global_step
        return adjusted_due(
            due,
            step=step,
            milestone_steps=milestone_steps,
            postponed=self.postponed,
            job=self._blocking(),
            prepare_at=self.background.prepare_at,
        )

    def finished(self) -> bool:
        """The job in flight has ended and its outcome waits to be taken."""
        writer = self.background.writer
        return self.job is not None and writer is not None and not writer.busy

    def take_finished_and_prepare(self) -> None:
        """At a safe point: takes the outcome of a job that has finished (never waits for one in flight); then sizes the
        buffers for the optimizer's state once it has some and no job is in flight."""
        if self.finished():
            self.take_outcome()
        bg = self.background
        if bg.prepare_at is not None and self.loop.global_step >= bg.prepare_at and self.job is None:
            # before a postponed save too: the save then copies into touched buffers (or, due by the clock, waits
            # for them: pick), where its own staging would size them in the loop
            bg.prepare_after(None)
            # sized for what a save stages: the random generators' states beside the optimizer's moments
            self._prepare(self.snapshot.tensors() if self.snapshot.sharded else self.snapshot.capture())

    def pick(self, reason: Reason | None) -> Reason | None:
        """At a safe point, after :meth:`take_finished_and_prepare`: the save to take now (see :func:`pick`)."""
        now, self.postponed = pick(
            reason,
            job=None if self.job is None else self.job.kind,
            staging=self.background.stager is not None,
            postponed=self.postponed,
            dirty=self.loop.dirty,
        )
        if self.postponed is not None and now is None and reason is not None:
            busy = "the staging buffers are being sized" if isinstance(self.job, PrepareJob) else "a write is in flight"
            log.debug("a %s checkpoint is due while %s: postponed", reason.value, busy)
        return now

    def save(self, reason: Reason, point: str) -> bool:
        """Writes a checkpoint of the current state, in the background when it may.

        A periodic save that fails for want of disk (any OSError) is logged and
        training goes on; the next one is tried when it is next due. A save that
        cannot be skipped (the stop's, the final one, a branch's) raises.

        Returns True when every rank, by agreement, only copied the state (sharded
        state saved in the background): no rank waited for a write, so the ranks
        need not agree again before the loop goes on.
        """
        how = write_mode(
            reason,
            job=None if self.job is None else self.job.kind,
            staging=self.background.stager is not None,
            writing=self._writing(),
        )
        # a pool written ahead stops at its next piece while the state is copied (it writes zeros of its own, not
        # the buffers): its outcome is taken just before this save's files are written over it
        job = self.job
        pool = isinstance(job, ReserveJob) and how.cancel
        if isinstance(job, ReserveJob) and pool:
            job.cancel.set()
        elif how.cancel:
            self.cancel()
        elif how.wait:
            self.wait_for_job()
        bg = self.background
        background = how.background and bg.stager is not None  # waiting for the job may have turned staging off
        if self.sharded is not None and how.background:  # sharded: every rank must take the same path
            background = self.peers.all(background)
        self.postponed = None
        with self.flag.critical():
            t0 = self.clock()
            manifest = self.snapshot.manifest(reason, point, self.manager.retention)
            log.debug("saving %s (%s)", self.manager.save_dir / checkpoint_name(manifest.step), reason.value)
            _testing.emit("saving", step=manifest.step, reason=reason.value, background=background)
            payload, live = self.snapshot.content()
            # an unchanged frozen base is carried, not staged or written; one the writer reads after the step is
            # hashed now, so that what it writes can be checked against the step
            read_later = bg.stager.live if background and bg.stager is not None else frozenset()
            payload = self.manager.mark_carried(payload, manifest.step, read_later=read_later)
            if background and self.sharded is not None:
                self._save_sharded(reason, manifest, t0, payload, live)
                return True
            staged, lazy = bg.copy(payload, self.snapshot.components.optimizer) if background else (None, None)
            if how.stage and live is None and bg.stager is not None:
                payload = bg.staged_now(payload)
            extra = None if live is None else functools.partial(sharded.save, tensors=live, rank=self.peers.rank)
            if pool:
                self.wait_for_job()
            try:
                got = self.checkpoints.write(payload, manifest, extra=extra, defer=staged is not None)
            except OSError as e:
                if lazy is not None:  # never written: no optimizer step may wait for it
                    lazy.drop()
                self.saved.not_written(reason, e)
                return False
            if isinstance(got, Pending):
                assert staged is not None  # deferred only when a staged copy was asked for
                write = functools.partial(self._finish, got, staged, manifest, lazy)
                self._submit(reason, manifest, t0, write, staging=lazy)
            elif got is None:  # another rank's files are durable; rank 0 writes its own and commits in the background
                self.saved.taken(SaveRecord(manifest.step, reason.value, self.clock() - t0, background=True))
                self.loop.taken(manifest.step, manifest.cursor, self.clock())
            else:
                self.saved.durable(reason, got, t0)
        return False

    def _finish(self, pending: Pending, staged: Any, manifest: Manifest, lazy: LazyCopy | None) -> CheckpointInfo:
        """The writer's thread: the lazy copies of the snapshot first, then its files written and committed."""
        if lazy is not None:
            lazy.run()
        return self.checkpoints.finish(pending, staged, manifest)

    def _blocking(self) -> bool:
        """A job is in flight that a periodic save waits for (a pool written ahead is cancelled instead)."""
        return self.job is not None and not isinstance(self.job, ReserveJob)

    def _writing(self) -> Reason | None:
        """The reason of the checkpoint being written in the background, if one is."""
        return self.job.reason if isinstance(self.job, SaveJob) else None

    def before_stop(self) -> None:
        """At a stop: a periodic write of a state the loop has moved past is cancelled, a pool written ahead told to
        stop; any other job is waited for."""
        job = self.job
        if isinstance(job, ReserveJob):
            job.cancel.set()  # its outcome is taken by the stop's save, after the copy of the state (or at the end)
        elif job is not None and self.loop.dirty and self._writing() in POSTPONABLE:
            self.cancel()
        else:
            self.wait_for_job()

    def cancel(self) -> None:
        """Stops the write in flight before its rename (its temporary directory is removed) and takes the outcome."""
        job = self.job
        if isinstance(job, (SaveJob, ReserveJob, PrepareJob)) and job.cancel is not None:
            job.cancel.set()
        self.wait_for_job()

    def loaded(self, info: CheckpointInfo) -> None:
        """The run restored ``info``: the newest durable checkpoint, and nothing to save until the loop moves."""
        self.saved.loaded(info)

    def told(self, path: Path | None) -> None:
        """Another rank: rank 0's newest durable checkpoint, as rank 0 told it."""
        self.saved.told(path)

    def _optimizer_stepping(self, *_: Any) -> None:
        """The optimizer's pre-step hook: the lazy copies of the snapshot in flight are made first."""
        job = self.job
        if isinstance(job, SaveJob) and job.staging is not None:
            job.staging.wait()

    def _save_sharded(self, reason: Reason, manifest: Manifest, t0: float, payload: Any, live: Any) -> None:
        """Every rank copies its files (its pieces of the sharded state among them) into its buffers; then its writer
        runs the distributed commit with the other ranks' writers (:mod:`preempt.run.sharded_saves`). Not
        cancellable: a stop waits for it."""
        assert self.sharded is not None
        staged = self.background.staging().stage(payload)  # no fallback here: every rank must take the same path
        write = functools.partial(self.sharded.write, staged, manifest, self.sharded.extra(live))
        self._submit(reason, manifest, t0, write, cancel=False)

    def _submit(
        self,
        reason: Reason,
        manifest: Manifest,
        t0: float,
        write: Callable[[], CheckpointInfo],
        *,
        staging: LazyCopy | None = None,
        cancel: bool = True,
    ) -> None:
        """Hands a staged snapshot's write to the background writer (``staging``: its lazy copies, made first;
        ``cancel``: a stop may cancel it)."""
        t1 = self.clock()
        record = SaveRecord(manifest.step, reason.value, t1 - t0, background=True)
        self.saved.taken(record)
        self.loop.taken(manifest.step, manifest.cursor, t1)
        event = threading.Event() if cancel else None

        def job() -> CheckpointInfo:
            if event is None:
                return write()
            with cancellable(event):
                return write()

        self.job = SaveJob(reason, record, self.background.running().submit(job), t0, staging, event)
        log.debug("step %d staged in %s; writing in the background", manifest.step, _log.duration(t1 - t0))

    def wait(self, timeout: float | None = None) -> Path | None:
        """Waits for the job in flight and takes its outcome; returns the newest durable checkpoint.

        Raises:
            TimeoutError: The write still runs after ``timeout`` seconds.
            CheckpointWriteError: The write failed other than for want of disk.
        """
        if self.job is not None and not isinstance(self.job, ReserveJob):  # a pool written ahead is nobody's checkpoint
            if not futures.wait([self.job.future], timeout).done:
                raise TimeoutError(f"the background write of a checkpoint still runs after {timeout} s")
            self.take_outcome()
        return self.saved.last_checkpoint

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Waits for the job in flight to end without taking its outcome (the next safe point takes it)."""
        return self.job is None or bool(futures.wait([self.job.future], timeout).done)

    def take_outcome(self) -> None:
        """Waits for the background job and takes its outcome (:func:`~preempt.run.write_decisions.outcome_of`): one
        handler per :class:`~preempt.run.write_decisions.Outcome`.

        Raises:
            CheckpointWriteError: A background write failed other than with an OSError.
            LockLostError: The save_dir is no longer this run's.
        """
        job = self.job
        if job is None:
            return
        self.job = None
        try:
            result, error = job.future.result(), None
        except Exception as e:
            result, error = None, e
        self.background.running().join()  # its thread has ended: it holds nothing of the state now
        outcome = outcome_of(job.kind, error)
        if outcome in _NOT_ON_DISK:
            self.loop.changed()  # that state is not on disk: a stop or the end must save again
            self.postponed = None  # a failed periodic write is retried when the next save is due
        if isinstance(job, SaveJob):
            self.saved.of(job, outcome, result, error)
            return
        bg = self.background
        match outcome:
            case Outcome.PREPARED:
                bg.prepared(result)
                self.pool.ready(bg.prepare_at is None)  # sized for the whole state: its files' sizes are known
            case Outcome.PREPARE_FAILED:
                log.warning("async_save: could not allocate the staging buffers (%r); saving synchronously", error)
                bg.refused()
            case Outcome.RESERVED:
                assert isinstance(job, ReserveJob)
                log.debug(
                    "%s written ahead in %s, for the next save to write over",
                    result,
                    _log.duration(self.clock() - job.started),
                )
            case Outcome.RESERVE_FAILED:
                if not isinstance(error, WriteCancelled):
                    log.warning("%s: could not write a pool ahead for the saves: %r", self.manager.save_dir, error)

    def wait_for_job(self) -> None:
        """Waits for the job in flight and takes its outcome (:meth:`take_outcome`), before a save that cannot be
        skipped; a failed write is logged, not raised."""
        if self.job is None:
            return
        try:
            self.take_outcome()
        except CheckpointWriteError as e:
            log.error("%s", e)

    def close(self) -> None:
        """At the end of the run: a write in flight is a consistent state, so it may become durable."""
        self.background.unhook()
        if self.job is None:
            return
        if isinstance(self.job, ReserveJob):
            self.cancel()
            return
        try:
            self.take_outcome()
        except BaseException as e:  # the way the run ended is what propagates; a second Ctrl-C stops the wait
            log.error("the background checkpoint write did not complete: %r", e)

    def _prepare(self, payload: Any) -> None:
        """Sizes the staging buffers for the state in the background (allocated and touched once)."""
        bg = self.background
        shard_stager: Any = None if self.sharded is None else self.sharded.stager
        stager, writer = bg.stager, bg.writer
        if stager is None or writer is None or self.job is not None:
            return
        shards = None
        if shard_stager is not None:  # sharded: this rank's own files and pieces, not the components' DTensors
            payload, live = self.snapshot.content()
            shards = ShardedSaves.pieces(live)
        stop = threading.Event()  # a stop's save does not wait for the pages to be touched (write_decisions.write_mode)
        job = bg.sizing(payload, shards, shard_stager, stop)
        if job is None:
            return
        # the pool written ahead: not for the frozen base, which is mostly carried (a pool of its size would be
        # written at every start of the job for the rare checkpoint that writes the base afresh)
        files = {name: ts for name, (ts, _) in payload.tensor_files.items() if name not in stager.live}
        self.pool.sized({name: sum(t.nbytes for t in ts.values()) for name, ts in files.items()})
        self.job = PrepareJob(writer.submit(job), stop)

    def start_pool_if_due(self) -> None:
        """At the end of a safe point: starts writing a pool ahead when one is due and the writer is free.

        Not earlier in the safe point: a save taken there would cancel it at once. The pool is written when
        ``save_dir`` has none (:func:`preempt.checkpoint.recycle.reserve`).
        """
        manager = self.manager
        if self.job is not None or self.postponed is not None:  # the postponed save would cancel it at once
            return
        wanted = self.sharded is None and manager.owner and manager.retention.recycle
        sizes = self.pool.take(manager.save_dir, wanted=wanted)
        if sizes is None:
            return
        cancel = threading.Event()
        job = functools.partial(self._reserve, sizes, cancel)
        self.job = ReserveJob(self.background.running().submit(job), self.clock(), cancel)

    def _reserve(self, sizes: dict[str, int], cancel: threading.Event) -> Path:
        """The writer's thread: a pool of files written ahead, until a save cancels it."""
        with cancellable(cancel):
            return self.manager.reserve(sizes)
