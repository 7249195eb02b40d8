"""PreemptibleRun: the context manager around a training loop.

::

    with PreemptibleRun("runs/exp1", model=model, optimizer=opt) as run:
        sampler = run.sampler(train_set, shuffle=True, seed=0)
        loader = DataLoader(train_set, batch_size=64, sampler=sampler)
        for epoch in run.epochs(10):
            for batch in run.batches(loader):
                train_step(batch)          # forward, backward, optimizer.step(), scheduler.step()
                run.step()                 # the safe point: the last statement of the iteration

**Safe points.** A checkpoint is only ever taken where the state is whole:

* in ``run.step()``, which must come after ``optimizer.step()`` (and any
  per-step scheduler step), as the last statement of the loop body. With
  gradient accumulation, call it only after the optimizer step: micro-batches
  in between are never a checkpoint. A resumed run continues with the batch
  after the one whose ``run.step()`` saved;
* at an epoch boundary inside ``run.epochs()``, after the epoch body's own
  end-of-epoch code, when every batch handed out was followed by ``run.step()``.

**Signals.** SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 (configurable) are caught
only between ``__enter__`` and ``__exit__``; before and after, the process's
previous handlers apply. A caught signal is recorded; the next safe point
saves (when anything changed since the last save) and raises
:class:`~preempt.errors.Preempted`, a ``SystemExit`` with code 75.

**Exact resume** of the data: :mod:`preempt.run.data_cursor`, :mod:`preempt.data.replay`; **walltime**
keeping and SLURM's requeue: :mod:`preempt.run.stopping`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import _log
from ..checkpoint import state
from ..checkpoint.components import gradient_sync
from ..checkpoint.lock import DirLock, StepBeacon
from ..checkpoint.manager import CheckpointManager
from ..checkpoint.staging import payload_nbytes
from ..cluster import launcher_dirs, ray_notice
from ..cluster.environment import CheckSpec, Environment, provenance
from ..data import rng
from ..data.loaders import fabric_unwrapped
from ..data.sampler import ResumableSampler
from ..data.shield import shield_workers
from ..errors import CHECK_ENDED_EXIT_CODE, PeerLost, Preempted, PreemptError, RunComplete
from ..health.guards import NonFiniteGuard, OOMGuard
from ..health.progress import check_epochs
from .check_record import CheckRecorder
from .checkpoint_writer import writer_for
from .config import RunConfig, RunOptions, checked_config
from .data_cursor import DataCursor
from .due import Reason, SaveFacts, decide, next_due
from .guarding import Health, OomStep
from .loop_state import LoopState
from .mirroring import Mirroring
from .peers import join
from .reporting import Reporter
from .restore import PredecessorDied, Starter, check_sharded
from .save_scheduler import SaveScheduler
from .snapshot import Snapshot
from .stopping import Stopper, killed_stopping
from .write_decisions import SYNCHRONOUS, SaveRecord

if TYPE_CHECKING:
    from typing_extensions import Unpack  # (typing's from Python 3.11)

__all__ = ["PreemptibleRun", "RunConfig", "SaveRecord"]

log = _log.log
_END = object()


@dataclasses.dataclass(frozen=True)
class StepHooks:
    """What ``run.step()`` does besides counting, in the rare runs that need it: Accelerate's gradient state (a
    micro-batch that did not synchronise is not a step) and the steps ``preempt check`` acts at. One attribute of
    the run, None in every other run: the hot path tests it once, and the run keeps few enough attributes for
    CPython's fast attribute reads (``tests/unit/test_run.py``)."""

    sync: Any  # ``sync_gradients`` says whether the micro-batch just run ended an accumulation; or None
    check_steps: frozenset[int]
    recorder: CheckRecorder | None = None  # inside a check, on rank 0 of an unsharded model: the live state

    @classmethod
    def of(cls, sync: Any, check: CheckSpec | None, recorder: CheckRecorder | None = None) -> StepHooks | None:
        if sync is None and check is None:
            return None
        steps = frozenset() if check is None else check.saves | check.stops | {check.last}
        return cls(sync, steps | {1} if recorder is not None else steps, recorder)  # step 1: recorder.first_step


class PreemptibleRun:
    """Makes a training loop stop cleanly on a signal and resume exactly.

    The run composes parts of one concern each: :class:`RunConfig` (the options),
    :class:`~preempt.run.loop_state.LoopState` (the counters), :mod:`~preempt.run.peers`
    (one process, or the ranks of torch.distributed), :mod:`~preempt.run.restore`
    (where it starts), :class:`~preempt.run.data_cursor.DataCursor` (where the data
    stands), :class:`~preempt.run.save_scheduler.SaveScheduler` (writing checkpoints),
    :class:`~preempt.run.stopping.Stopper`, :class:`~preempt.run.guarding.Health` and
    :class:`~preempt.run.reporting.Reporter`.

    Args:
        save_dir: Directory of this run's checkpoints (created if missing).
        model: The model (DDP and ``torch.compile`` wrappers are seen through).
        optimizer: Its optimizer.
        scheduler: An LR scheduler (anything with state_dict/load_state_dict).
        scaler: A ``torch.amp.GradScaler``.
        track: Further objects with state_dict()/load_state_dict(), by name.
        config: The options as one :class:`~preempt.run.config.RunConfig` (instead of ``**options``).
        clock: Monotonic clock (for tests).
        **options: The options, each documented and checked in :mod:`preempt.run.config` by its group:
            :class:`~preempt.run.config.SaveOptions` (``checkpoint_interval``, ``checkpoint_every_steps``,
            ``checkpoints_per_epoch``, ``keep_last``, ``keep_best``, ``keep_every_steps``, ``best_metric``,
            ``best_mode``, ``recycle_files``, ``carry_unchanged``, ``async_save``, ``lazy_snapshot``),
            :class:`~preempt.run.config.StartOptions` (``auto_resume``, ``resume``, ``weights_only``, ``strict``,
            ``exit_if_complete``, ``lock_timeout``), :class:`~preempt.run.config.StopOptions` (``signals``,
            ``exit_code``, ``time_limit``, ``requeue``, ``max_restarts``, ``sync_every_steps``),
            :class:`~preempt.run.config.ReportOptions` (``log_file``, ``progress_every_s``, ``log_level``,
            ``monitor_gpu``, ``loggers``), :class:`~preempt.run.config.MirrorOptions` (``mirror``,
            ``mirror_options``, ``mirror_deadline``) and :class:`~preempt.run.config.HealthOptions`
            (``max_nonfinite``, ``nonfinite_lr_factor``, ``max_rollbacks``, ``max_oom``, ``emergency_save``).
            They are read back as ``run.config.<name>``.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: state.Stateful | None = None,
        scaler: state.Stateful | None = None,
        track: Mapping[str, state.Stateful] | None = None,
        config: RunConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        **options: Unpack[RunOptions],
    ) -> None:
        self._made_at = time.time()  # a restart's start-up ends here and its restore begins (preempt report)
        if not isinstance(save_dir, (str, os.PathLike)) or not str(save_dir):
            raise ValueError(f"save_dir: expected a directory path, got {save_dir!r}")
        # Lightning Fabric's wrappers (fabric.setup) hold the objects the run saves, restores and hooks
        model, optimizer = fabric_unwrapped(model), fabric_unwrapped(optimizer)
        self.components = state.Components.checked(model, optimizer, scheduler, scaler, track)
        if config is not None and options:
            raise TypeError(f"PreemptibleRun: config= and options ({', '.join(sorted(options))}) given; pass one")
        cfg = self.config = config if config is not None else RunConfig(**options)  # checks them all
        if not isinstance(cfg, RunConfig):
            raise TypeError(f"PreemptibleRun: config: expected a RunConfig, got {type(cfg).__name__}")
        self.env = Environment.from_env()
        check = self.env.check  # inside `preempt check`: its scratch save_dir, its saves and stops
        if check is not None:
            save_dir, cfg = check.save_dir, checked_config(cfg)
            self.config = cfg
        self.save_dir = Path(save_dir)
        self.policy = cfg.save.save_policy()
        sharded = check_sharded(cfg, self.components.model)
        # This process alone, or the ranks of torch.distributed: under torchrun making the run is a collective.
        peers = self.peers = join(cfg.sync_every_steps)
        job = f" (SLURM job {self.env.slurm_job_id})" if self.env.slurm_job_id else ""
        self._lock = DirLock(self.save_dir, purpose=f"training{job}", timeout=cfg.lock_timeout)
        # rank 0 cleans, quarantines and prunes; each write into the save_dir checks the lock it holds
        self.manager = CheckpointManager(
            save_dir,
            retention=cfg.save.retention(),
            carry_unchanged=cfg.save.carry,
            owner=peers.leader,
            lock=self._lock,
        )
        self._clock = clock  # below: the parts, each of one concern, each whole when made; the run composes them
        self.loop = LoopState()
        self.stopper = Stopper(cfg.stop, self.env, self.save_dir, clock)
        self.data = DataCursor(self.stopper.flag.signals)
        self.snapshot = Snapshot(
            self.components,
            self.loop,
            self.data,
            rank=peers.rank,
            sharded=sharded,
            group_frozen=cfg.save.carry.enabled,
            clock=clock,
        )
        self.health = Health(
            cfg.health, self.components, self.loop, self.snapshot, strict=cfg.strict, alone=peers.alone
        )
        self.reporter = Reporter(
            cfg.report,
            cfg.save,
            self.save_dir,
            self.loop,
            clock,
            rank=peers.rank,
            world_size=peers.world_size,
            log_all_ranks=self.env.log_all_ranks,
        )
        self.mirroring = Mirroring(
            cfg.mirroring, self.manager, self.reporter, self.stopper, clock
        )  # inert without mirror=
        self.saves = SaveScheduler(
            self.manager,
            self.loop,
            self.snapshot,
            self.stopper.flag,
            peers=peers,
            checkpoints=writer_for(self.manager, peers),  # one process's saves, or the ranks' commit: built once
            clock=clock,
            on_durable=self.mirroring.chain(self.stopper.saved),
            on_saved=self.stopper.measuring(self.reporter.checkpoint),  # and what a stop costs, against the grace
        )
        self._every = peers.every  # run.step()'s hot path reads these two directly: the peers' meeting period, the flag
        self._flag = self.stopper.flag
        self.resumed_from: Path | None = None
        self._beacon = StepBeacon(self.save_dir)  # the lock holder's latest step, for whoever finds it dead
        self._starter: Starter | None = None
        self._entered = self._active = False
        self._batches_epoch = -1  # the epoch whose batches() has started
        self._due_time = math.inf  # before this, run.step() does not look (the loop holds the step and batch ones)
        self._step_hook: Any = None
        recorder = None
        if check is not None and peers.rank == 0 and not sharded:
            steps = check.saves | check.stops | {check.last}
            recorder = CheckRecorder(check.live_dir, steps, self.components, self.loop)
        self._hooks = StepHooks.of(gradient_sync(optimizer), check, recorder)

    # ---------------------------------------------------------------- what a user reads

    # Each read-only, each the value of the one part that owns it (typed: what an IDE and mypy see is what runs).

    @property
    def global_step(self) -> int:
        """Optimizer steps counted by run.step(), in all."""
        return self.loop.global_step

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self.loop.epoch

    @property
    def batch(self) -> int:
        """Batches of the current epoch the loop received."""
        return self.loop.batch

    @property
    def metrics(self) -> dict[str, float]:
        """The latest value of each metric given to the run."""
        return self.loop.metrics

    @property
    def last_checkpoint(self) -> Path | None:
        """The newest durable checkpoint known."""
        return self.saves.saved.last_checkpoint

    @property
    def last_save(self) -> SaveRecord | None:
        """The latest checkpoint taken (a SaveRecord)."""
        return self.saves.saved.last_save

    @property
    def failed_saves(self) -> int:
        """Periodic checkpoints that could not be written."""
        return self.saves.saved.failed

    @property
    def staging_prepare_s(self) -> float | None:
        """Seconds spent sizing the staging buffers."""
        return self.saves.background.prepare_s

    @property
    def data_seed(self) -> int | None:
        """The seed of the data's per-sample random streams (a checkpoint keeps it)."""
        return self.data.seed

    @property
    def rank(self) -> int:
        """This process's rank (0 alone)."""
        return self.peers.rank

    @property
    def world_size(self) -> int:
        """The number of ranks (1 alone)."""
        return self.peers.world_size

    @property
    def nonfinite(self) -> NonFiniteGuard:
        """The non-finite loss guard (counts)."""
        return self.health.nonfinite

    @property
    def oom(self) -> OOMGuard:
        """The out-of-memory guard (counts)."""
        return self.health.oom

    @property
    def rollbacks(self) -> int:
        """Rollbacks after non-finite losses so far."""
        return self.health.rollbacks

    @property
    def user_state(self) -> dict[str, Any]:
        """Your own JSON-serialisable state, saved in every checkpoint and restored on resume."""
        return self.snapshot.user_state

    @user_state.setter
    def user_state(self, value: dict[str, Any]) -> None:
        self.snapshot.user_state = value

    # ---------------------------------------------------------------- enter

    def __enter__(self) -> PreemptibleRun:
        if self._entered:
            raise PreemptError("this PreemptibleRun was already entered; create a new one for another run")
        self._entered = True
        _log.setup(self.env.log_level or self.config.log_level)
        self.reporter.hold(self.env.problems)  # until train.log is open: what the start says goes there too
        if not self.stopper.flag.install() and not ray_notice.in_ray_worker():
            log.warning(
                "PreemptibleRun entered outside the main thread: stop signals cannot be caught here"
                " (CPython installs handlers only from the main thread)"
            )
        elif not self.stopper.flag.installed:  # Ray's worker thread: its main thread keeps Ray's SIGTERM handler
            log.info(
                "in a Ray worker's thread: the run stops on Ray's drain of its node, and on a stop signal inside"
                " preempt.ray.reporting(run), which installs its handler on the actor's main thread"
            )
        parts = (self.loop, self.data, self.snapshot, self.saves)
        starter = self._starter = Starter(
            self.config,
            self.manager,
            self.components,
            parts,
            self.peers,
            self.env,
            own_lock=self._lock,
            mirroring=self.mirroring,
        )
        try:
            if self.peers.leader:
                payload = self._start_as_leader(starter)
            else:
                starter.load_leaders_choice()
                payload = self.snapshot.capture_at_start()  # unsupported state fails now
            self.snapshot.started(self._provenance())
            if self.peers.nodes is not None:  # the ranks' nodes share no save_dir: each node's leader uploads its part
                self.mirroring.nodes(self.peers.rank, self.peers.nodes)
            starter.supersede_and_save_branch()
        except BaseException as e:
            if self.peers.leader:
                starter.tell_failure(e)
            self.stopper.flag.restore()
            # a start that failed past its restoring line ends it, as a run's error would
            self.reporter.stop(None if isinstance(e, RunComplete) else "error", error=repr(e)[:200])
            # A completed run has time to delete the leftovers it found; a failed start does not wait.
            self.manager.close(timeout=None if isinstance(e, RunComplete) else 0.0)
            self._lock.release()
            raise
        self._begin(payload)
        return self

    def _start_as_leader(self, starter: Starter) -> state.Payload:
        """The process alone, or rank 0: takes the lock, chooses the starting state, tells the other ranks."""
        self.manager.check_dir()  # a bad save_dir is said now, not at the first checkpoint hours later
        hydra_dir = launcher_dirs.hydra_output_dir()
        if launcher_dirs.inside(self.save_dir, hydra_dir):
            assert hydra_dir is not None
            log.warning("%s", launcher_dirs.warning(self.save_dir, hydra_dir))
        self._lock.acquire()
        died = None
        if self._lock.previous:  # the previous holder died holding the lock
            # (killed_stopping: the kill came before its stop was durable)
            died = PredecessorDied(self._beacon.read(), killed_stopping(self.save_dir))
            self.reporter.predecessor_died(
                died.reached_step, self._lock.previous.get("pid"), during_stop=died.killed_stopping is not None
            )
        self.manager.recover()  # only the lock holder may clean up leftovers
        done = self.manager.completion()
        if done is not None and starter.completed(done):
            log.info(
                "%s is complete (step %s, epoch %s); nothing to do. Pass exit_if_complete=False to train further.",
                self.save_dir,
                done.get("step"),
                done.get("epoch"),
            )
            raise RunComplete(str(self.save_dir))
        self.reporter.restoring(self._made_at)
        self.stopper.check_restarts()
        payload = self.snapshot.capture_at_start()  # unsupported state fails now
        self.stopper.read_slurm_job()
        self.mirroring.enter(self.config.starts_fresh)  # a new machine: the mirror's newest checkpoint pulled
        starter.choose_and_load(self._lock.identity, died)
        if done is not None:
            self.manager.clear_complete()
        self.stopper.arm_walltime(payload_nbytes(payload), self.loop.global_step, self.peers.alone)
        return payload

    def _provenance(self) -> dict[str, Any]:
        """Where and with what this run runs, for its manifests; the SLURM job's end time as the stopper read it
        (the leader asks scontrol when the environment does not say it)."""
        found = provenance(self.env)
        end_time = self.stopper.end_time if self.stopper.end_time is not None else self.env.slurm_job_end_time
        if isinstance(found.get("slurm"), dict):
            found["slurm"] = {**found["slurm"], "end_time": end_time}
        return found

    def _begin(self, payload: state.Payload) -> None:
        """The run is on: clocks, the staging buffers, logs and monitors, the first due points."""
        self._active = True
        assert self._starter is not None
        self.resumed_from = self._starter.resumed_from
        self.data.begin(torch.initial_seed())  # the data seed, and every DataLoader's workers shielded
        if self._lock.held:
            self._beacon.open(self.loop.global_step)
            self.loop.publish(self._beacon.view)
        self.loop.started(self._clock())
        self.health.apply_lr_scale(resumed=self.resumed_from is not None)
        opt = self.components.optimizer
        self._step_hook = self.loop.watch(opt)  # whether an optimizer step is under way, or done before run.step()
        self.reporter.start(self.resumed_from, self._starter.resume_line, made_at=self._made_at)
        self.stopper.start(self.reporter.marker, lambda: self.loop.global_step)  # the grace; the notices' watcher
        self.mirroring.begin(self.saves.last_info)
        if self.config.async_save:
            self.saves.start(payload, optimizer_state_later=opt is not None, lazy=self.config.lazy_snapshot)
        self._recompute_due()

    # ----------------------------------------------------------------- exit

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        lost = self.peers.lost(exc) if self._active else None
        if lost is not None:  # another rank died during a collective of the loop's own: leave as in one of ours
            exc_type, exc = PeerLost, lost
        try:
            if exc_type is None and self._active:
                try:
                    self._finish()
                except BaseException as e:  # the final checkpoint failed: the run ends with that error, not complete
                    exc_type, exc = type(e), e
                    raise
            elif self._active and exc is not None and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
                self.health.emergency(exc, self.saves)
        finally:
            self._active = False
            self.stopper.flag.restore()
            watch_error = self.stopper.close()  # the notices' watcher: a bug of its own is raised below
            if self._step_hook is not None:
                self._step_hook.remove()
                self._step_hook = None
            self.mirroring.close(exc_type is None, self.saves.last_info)  # the final checkpoint waited for (bounded)
            self.reporter.ended(exc_type is None, exc)
            try:
                self.saves.close()  # a write in flight is a consistent state: let it become durable
                self.data.end()
                # After a stop the process must exit within its grace period; the next start redoes deletions.
                self.manager.close(timeout=None if exc_type is None else 0.0)
            finally:
                self.loop.publish(None)
                self._beacon.close()
                self._lock.release()
        if lost is not None:
            raise lost  # its __cause__ is the loop's error
        if watch_error is not None:
            if exc_type is None:
                raise watch_error
            log.error("the notices' watcher failed: %r", watch_error)

    def _finish(self) -> None:
        """Final checkpoint (when anything changed) and the completion marker."""
        saves = self.saves
        saves.wait_for_job()
        needed = self.loop.dirty or saves.last_info is None  # rank 0 decides: it knows if its last write is durable
        last = None if saves.last_checkpoint is None else str(saves.last_checkpoint)
        needed, last = self.peers.broadcast((needed, last))
        if not needed and not self.peers.leader:
            saves.told(None if last is None else Path(last))
            return
        if needed:
            saves.save(Reason.FINAL, "epoch")
        if not self.peers.leader:
            return
        final = saves.last_info
        assert final is not None
        try:
            self.manager.mark_complete(final)
        except OSError as e:  # a full disk that the final checkpoint still fitted (written over recycled files)
            log.warning(
                "could not write %s/complete.json (%s): the final checkpoint is durable, and a rerun resumes from it"
                " with nothing left to train",
                self.save_dir,
                e,
            )
        loop = self.loop
        log.info("run complete: step %d, epoch %d; final checkpoint %s", loop.global_step, loop.epoch, final.path)

    # ---------------------------------------------------------------- loop

    def epochs(
        self, n: int, steps_per_epoch: int | None = None, *, max_steps: int | None = None
    ) -> Generator[int, None, None]:
        """Yields epoch numbers from the resumed epoch up to ``n - 1``.

        Each boundary (before every epoch, and after the last) is a safe point. ``steps_per_epoch`` (the run.step()
        calls of one epoch) gives the progress line a total and an ETA where the loader has no length; ``max_steps``
        (a loop that ends at that global step when it comes before the last epoch's end: the loop itself breaks
        there) is the total when it comes first.
        """
        check_epochs(n, steps_per_epoch, max_steps)
        self._check_active("epochs")
        self.reporter.planned(n, steps_per_epoch, max_steps)
        loop = self.loop
        while True:
            rng_now = self.data.resume_at_epoch(loop.epoch)
            if rng_now is not None:
                rng.restore(rng_now)  # the program point where that checkpoint was taken
            if loop.at_epoch_start:
                self._safe_point("epoch")
            elif self.peers.alone and self.stopper.pending(loop.global_step) and not loop.dirty:
                self._stop()  # a stop between run.step() and the epoch's end, with nothing to save
            if loop.epoch >= n:
                return
            self.data.set_epoch(loop.epoch)
            self._recompute_due()
            loop.epoch_began(self._clock())
            yield loop.epoch
            self.reporter.epoch_summary()
            self.stopper.epoch_done()
            if self._hooks is not None and self._hooks.recorder is not None:
                self._hooks.recorder.epoch_ended(loop.epoch, loop.global_step)
            loop.epoch_ended()

    def batches(self, loader: Iterable[Any]) -> Generator[Any, None, None]:
        """Yields the loader's batches for the current epoch, from the resumed batch on.

        Call once per epoch. The cursor counts batches the loop received, not
        those the workers prefetched.
        """
        self._check_active("batches")
        loop, stopper = self.loop, self.stopper
        if self._batches_epoch == loop.epoch:
            raise PreemptError(
                f"run.batches() was already used in epoch {loop.epoch}; iterate epochs with run.epochs(n)"
            )
        epoch = self._batches_epoch = loop.epoch
        it, start = self.data.open(loader, epoch)
        if it is None:
            return
        if self._hooks is not None and self._hooks.recorder is not None:
            it = self._hooks.recorder.watching(it)
        loop.at_batch(start)
        self._recompute_due()
        try:  # run out or left: what follows is end-of-epoch code (run.report() there waits for the epoch's end)
            if stopper.walltime is not None:
                # time the loader's start (worker start-up, first batch) once per epoch, outside the per-batch loop
                t0 = self._clock()
                first = next(it, _END)
                if first is _END:
                    return
                stopper.loader_gap(self._clock() - t0)
                loop.took_batch()
                yield first
            for item in it:
                loop.took_batch()
                yield item
            stopper.loader_done()
        finally:  # (a generator left by a break may be closed later, in another epoch)
            loop.batches_closed(epoch)

    def step(self, metrics: Mapping[str, Any] | None = None) -> None:
        """Counts one optimizer step; the safe point where checkpoints happen.

        Call it as the last statement of the loop body, after ``optimizer.step()``.
        May write a checkpoint; after a stop signal, saves and raises Preempted.
        Inside Accelerate's ``accelerator.accumulate(model)`` (the optimizer given was prepared by Accelerate), a
        micro-batch whose gradients were not synchronised is not a step: nothing is counted or saved there, and its
        metrics are recorded at the step counted last.

        Args:
            metrics: Numbers to record at this step; the one named ``best_metric``
                decides "best" checkpoints.
        """
        loop = self.loop
        hooks = self._hooks
        if hooks is not None and hooks.sync is not None and not hooks.sync.sync_gradients:
            if metrics is not None:
                loop.record(metrics, self.manager.retention)
                self.reporter.log_metrics(metrics)
            return
        look = loop.stepped()
        step = loop.global_step
        if metrics is not None:
            loop.record(metrics, self.manager.retention)
            self.reporter.log_metrics(metrics)
            look = look or loop.best_pending
        if hooks is not None and step in hooks.check_steps:
            self._check_point(step)
        # The ranks meet at every sync_every_steps-th step, all together; alone, only when something may be due.
        if self._every:
            if step % self._every == 0:
                self._safe_point("step")
        elif (
            look
            or self._flag.requested
            or self._clock() >= self._due_time
            or (self.saves.job is not None and self.saves.finished())
        ):
            self._safe_point("step")

    def report(self, metrics: Mapping[str, Any], *, step: int | None = None) -> None:
        """Records metrics measured at ``step`` (default ``run.global_step``): evaluate after ``run.step()``, a safe
        point where a better ``best_metric`` is saved at once as that step's "best" checkpoint and a stop is taken
        (after the batches loop: at the epoch boundary). README_PREEMPTION.md, "Evaluation in the loop"."""
        measured = self.loop.report(metrics, self.manager.retention, step)
        self.reporter.measured(measured)
        self.reporter.log_metrics(metrics, step=measured.step)
        if self._active and measured.at_step and self.peers.alone and (measured.best or self._flag.requested):
            self._safe_point("step")

    # ----------------------------------------------------------- extras

    def sampler(
        self, dataset: Any, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False, per_sample_rng: bool = True
    ) -> ResumableSampler:
        """A ResumableSampler for ``dataset`` whose epoch the run keeps in step.

        With ``per_sample_rng`` (the default) a DataLoader drawing from it seeds
        the random generators of whichever process fetches a sample from
        (seed, epoch, index) first, so random augmentation inside the dataset
        replays exactly, with any number of workers (:mod:`preempt.data.replay`).
        """
        return self.data.make_sampler(
            dataset,
            epoch=self.loop.epoch,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            per_sample_rng=per_sample_rng,
        )

    def track(self, name: str, obj: state.Stateful) -> None:
        """Saves and restores ``obj`` (with state_dict/load_state_dict) as ``name``; loaded at once when resumed."""
        self.components.track(name, obj)
        if self._active and self._starter is not None:
            self._starter.load_tracked(name, obj)

    def protect(self, loader: Any) -> Any:
        """Shields a DataLoader's workers from stop signals for good, wherever it is iterated; returns the loader.
        Every loader iterated while the run is active is shielded anyway: this is for one iterated before or after."""
        return shield_workers(loader, self.stopper.flag.signals)

    def request_stop(self) -> None:
        """Asks the run to save and stop at the next safe point, as a signal would."""
        self.stopper.flag.request(None)

    @property
    def stop_requested(self) -> bool:
        """A stop signal (or request_stop) is pending."""
        return self.stopper.flag.requested

    def wait_for_checkpoint(self, timeout: float | None = None) -> Path | None:
        """Waits for the background write in flight, if any; returns the newest durable checkpoint.

        Under torch.distributed the background writes are rank 0's: on the
        other ranks this returns at once, with the newest checkpoint they saw
        committed synchronously (rank 0 knows of the later ones).

        Raises:
            TimeoutError: The write still runs after ``timeout`` seconds.
            CheckpointWriteError: The write failed other than for want of disk
                (a failed periodic write is logged and counted in ``failed_saves``).
        """
        path = self.saves.wait(timeout)
        if self._active:
            self._recompute_due()  # a save postponed behind that write is due now
        return path

    def check_loss(self, loss: torch.Tensor | float) -> bool:
        """True when ``loss`` is finite. Otherwise skip the step: zero the gradients, no backward, no run.step().

        After ``max_nonfinite`` in a row the run rolls back to its last checkpoint with lower learning rates
        (:meth:`preempt.run.guarding.Health.check_loss`); it cannot roll back: exit code 78.
        """
        return self.health.check_loss(
            loss,
            lambda: self.health.roll_back(self.saves, self.manager, marker=self.reporter.marker),
        )

    def oom_guard(self) -> OomStep:
        """``with run.oom_guard() as s:`` around forward, backward and the optimizer step: an out-of-memory
        error inside is caught, memory is freed, and ``s.skipped`` is True (zero the gradients and skip
        ``run.step()``). ``max_oom`` in a row raise :class:`~preempt.health.guards.OutOfMemoryStreak` (exit code 79).
        Under torch.distributed the first one does: one rank cannot skip a step alone.
        """
        return self.health.oom_step()

    # ------------------------------------------------------------ internals

    def _check_active(self, what: str) -> None:
        if not self._active:
            raise PreemptError(f"run.{what}() is only available inside 'with PreemptibleRun(...) as run:'")

    def _facts(self, now: float) -> SaveFacts:
        return self.loop.facts(
            now,
            batches_per_epoch=self.data.batches_per_epoch,
            stop_requested=self.stopper.flag.requested,
            stop_at=self.stopper.stop_at(),
        )

    def _recompute_due(self) -> None:
        """The thresholds below which run.step() does not go through the safe point: each part's earliest."""
        self.saves.start_pool_if_due()  # after the safe point's saves: a pool may be written ahead now
        now = self._clock()
        due = self.saves.adjusted_due(next_due(self.policy, self._facts(now)), self.policy.milestone_steps)
        self.loop.wake_at(due.step, due.batch)
        self._due_time = min(due.time, self.reporter.next_at, self.stopper.review_at(now))

    def _safe_point(self, point: str) -> None:
        """Where a checkpoint may be taken: the peers agree on saving and stopping (alone: trivially)."""
        loop, saves, stopper = self.loop, self.saves, self.stopper
        saves.take_finished_and_prepare()
        if self._clock() >= self.reporter.next_at:
            self.reporter.report(self.data.batches_per_epoch, self.components.optimizer)
        stopper.observe(loop.global_step)
        decision = decide(self.policy, self._facts(self._clock()))  # rank 0's counts; the others add a signal
        stopper.decided(decision)
        reason = saves.pick(decision.reason if decision.save else None)
        requested = stopper.flag.requested  # what this rank told the peers: the stop's cause is what they agreed on
        agreed = self.peers.agree(
            requested,
            reason,
            walltime_stop=decision.stop and decision.reason is Reason.WALLTIME,
        )
        if agreed.stop:
            stopper.stopping(loop.global_step, agreed.signal_rank)  # left behind if the kill comes before it is durable
        if agreed.save is not None:  # a signal that came during a write stops the run here, with that checkpoint
            if not saves.save(agreed.save, point) and not agreed.stop:  # (after a copy alone: the next)
                requested = stopper.flag.requested
                agreed = self.peers.agree(requested, None)
        if agreed.stop:
            saves.before_stop()  # rank 0's write in flight: cancelled when the state moved past it, else awaited
            # After a synchronous save here every rank learnt its outcome in the commit; else rank 0's view decides
            # (a signal during its write in flight, or that write failed)
            if loop.dirty if agreed.save in SYNCHRONOUS else self.peers.broadcast(loop.dirty):
                saves.save(Reason.PREEMPT, point)
            self._stop(peer=agreed.signal_rank, requested=requested)
        self._recompute_due()

    def _check_point(self, step: int) -> None:
        """A step ``preempt check`` named: its checkpoint, then the stop there (as a signal's), a SIGKILL once that
        checkpoint is durable, or the end of the check (a stop whose exit code says so, the run not complete)."""
        check = self.env.check
        assert check is not None
        recorder = self._hooks.recorder if self._hooks is not None else None
        if step == 1 and recorder is not None:
            recorder.first_step()
        if step in check.saves or step == check.last or (check.kill and step in check.stops):
            self.saves.save(Reason.STEPS, "step")  # synchronous inside a check: durable on every rank when it returns
            if recorder is not None:
                recorder.record(step)  # the live state that checkpoint is held to
        if check.kill and step in check.stops:
            self.peers.broadcast(None)  # every rank's files are written before any rank dies
            os.kill(os.getpid(), signal.SIGKILL)
        if step == check.last or step in check.stops:
            self.stopper.flag.request(None)
            try:
                self._safe_point("step")
            except Preempted as e:
                if step == check.last:
                    e.code = CHECK_ENDED_EXIT_CODE
                raise

    def _stop(self, peer: int = -1, requested: bool | None = None) -> None:
        self.stopper.stop(
            self.loop,
            checkpoint=self.saves.last_checkpoint,
            peer=peer,
            requested=requested,
            mirror_wait=self.mirroring.at_stop,
        )
