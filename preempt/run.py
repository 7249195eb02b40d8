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

**Exact resume.** The batch order comes from the sampler, a pure function of
(seed, epoch). Creating a DataLoader iterator draws from the global torch RNG
(that draw seeds the workers), so the run snapshots every global RNG just
before it creates the epoch's iterator. A checkpoint inside the batch loop
stores that snapshot and the current RNG state; on resume the run restores
the snapshot, creates the iterator (the same worker seeds are drawn), starts
the sampler at the saved sample, and then restores the current state, so the
loop's own draws (dropout, noise) continue exactly. Draws inside the loader
(augmentation in workers) are seeded per sample, and an iterable dataset's
workers continue from their saved positions: :mod:`preempt.data_replay`.

**Signals.** SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 (configurable) are caught
only between ``__enter__`` and ``__exit__``; before and after, the process's
previous handlers apply. A caught signal is recorded; the next safe point
saves (when anything changed since the last save) and raises
:class:`~preempt.errors.Preempted`, a ``SystemExit`` with code 75.

**Walltime.** With a deadline (the SLURM job's end time, or ``time_limit``)
the run also stops by itself, with no signal, early enough for the stop's
checkpoint to be durable before the deadline; the margin comes from the
measured step and save times (:class:`~preempt.policy.Walltime`). Under
SLURM, a stop at the time limit then requeues the job (rule and limits in
:mod:`preempt.slurm`); other stops only save and exit.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from . import _log, distributed, rng, sharded, state
from .checkpoint import CheckpointManager
from .data_cursor import SEED_MASK, DataCursor
from .dataloading import shield_workers
from .environment import Environment, provenance
from .errors import PREEMPTED_EXIT_CODE, Preempted, PreemptError, RunComplete
from .health import Health, OomStep
from .lock import DirLock, StepBeacon
from .loop_state import LoopState
from .peers import Alone, join
from .policy import Reason, SaveFacts, decide, next_due
from .reporting import Reporter
from .restore import Starter
from .run_config import RunConfig
from .sampler import ResumableSampler
from .save_scheduler import SaveRecord, SaveScheduler
from .signals import DEFAULT_SIGNALS
from .snapshot import Snapshot
from .staging import payload_nbytes
from .stopping import Stopper

__all__ = ["PreemptibleRun", "RunConfig", "SaveRecord"]

log = _log.log
_END = object()
_REASONS = list(Reason)  # save reasons travel between ranks as index + 1


class PreemptibleRun:
    """Makes a training loop stop cleanly on a signal and resume exactly.

    Args:
        save_dir: Directory of this run's checkpoints (created if missing).
        model: The model (DDP and ``torch.compile`` wrappers are seen through).
        optimizer: Its optimizer.
        scheduler: An LR scheduler (anything with state_dict/load_state_dict).
        scaler: A ``torch.amp.GradScaler``.
        checkpoint_interval: Seconds between periodic checkpoints; None disables.
        checkpoint_every_steps: Also save at every multiple of this global step.
        checkpoints_per_epoch: Also save N times per epoch, evenly spaced.
        keep_last: Keep the newest N valid checkpoints (None keeps all).
        keep_best: Also keep the N best by ``best_metric``.
        keep_every_steps: Save at every multiple of this step and keep those forever.
        best_metric: Metric name (from ``run.step(metrics=...)``/``run.report``) ranking "best".
        best_mode: ``"min"`` or ``"max"``.
        auto_resume: Restore the newest valid checkpoint on entering (default).
            False starts fresh and moves existing checkpoints to ``superseded/``.
        resume: Where to start when this run's own checkpoints do not say:
            ``"latest"`` (default), ``"best"``, a step number, a path to another
            save_dir or checkpoint directory, or None (start fresh). A request
            other than "latest" is applied once: the checkpoints written after
            it record it, and a rerun (a requeue) continues from those.
        weights_only: Load only the model's weights from that checkpoint;
            optimizer, scheduler, scaler and counters start fresh (fine-tuning).
        strict: False loads the model tensors whose key and shape match and
            skips (and logs) model keys the checkpoint lacks and checkpoint keys
            the model lacks; a key of another shape is an error either way (see
            :func:`preempt.state.load_model`). Meant for weights_only=True.
        track: Further objects with state_dict()/load_state_dict(), by name.
        signals: The signals that ask for a stop.
        exit_code: The code of the SystemExit raised on a stop (default 75).
        exit_if_complete: On entering a completed run, raise RunComplete (exit 0).
            False continues training past the completed state instead.
        lock_timeout: Seconds to wait when another process holds ``save_dir``
            (see :mod:`preempt.lock`) before failing with LockedError; 0 fails at once.
        time_limit: Walltime of this process, counted from entering the run:
            seconds, or SLURM's ``[D-]HH:MM:SS``. The run stops and saves
            before it ends, as on a signal. Under SLURM the job's end time
            applies anyway (the earlier of the two wins).
        requeue: Under SLURM, requeue the job after the checkpoint of a stop at
            its time limit (see :mod:`preempt.slurm`). False only saves and exits.
        max_restarts: Under SLURM, refuse to start when ``SLURM_RESTART_COUNT``
            exceeds this, and do not requeue once it is reached (exit code 77):
            stops a job that keeps coming back without finishing. None: no limit.
        async_save: Periodic and "best" checkpoints copy the state into host
            buffers (allocated once, reused) and a background thread writes
            them with the same commit protocol, so the loop waits only for the
            copy. At most one write is in flight: a periodic save that comes
            due meanwhile is postponed until it ends; a best or milestone save
            waits for it. A stop's save and the final one are synchronous,
            after the write in flight has finished. The buffers hold one copy
            of the state (pinned host memory when it lives on a GPU); when
            that would take more than half of the host's available memory the
            run saves synchronously and says so. Under torch.distributed rank 0
            writes the replicated state in the background and the other ranks
            write their files at the step; sharded (DCP) state is saved
            synchronously. False: every save is synchronous.
        sync_every_steps: Under torch.distributed, the ranks agree on saving
            and stopping at every N-th ``run.step()`` (one small all-reduce on
            a gloo group; see :mod:`preempt.distributed`). Larger N costs less
            per step and delays a stop and a periodic save by up to N-1 steps.
        log_file: Also write the run's log to ``save_dir/train.log`` (rank 0; the
            other ranks log nothing unless ``PREEMPT_LOG_ALL_RANKS=1``, then to
            the console and ``train.rank<r>.log``),
            appended across restarts with a marker line at each start, and
            keep ``save_dir/history.jsonl``: one line per progress report
            (step, epoch, the metrics given to ``run.step``, learning rates,
            step time, GPU memory) and a marker at each start, resume,
            rollback and stop (:mod:`preempt.history`).
        progress_every_s: Seconds between progress lines (steps/s, ETA) in
            the log and history records; None turns both off. An epoch
            summary is logged at each epoch end either way.
        monitor_gpu: Sample every GPU through NVML every this many seconds (True:
            every 10 s) into ``save_dir/gpu_stats.jsonl``, summarised in
            ``gpu_stats.json`` at the end (:class:`~preempt.monitor.GPUMonitor`);
            None or False: off. Without NVML or a GPU it says so once and does nothing.
        max_nonfinite: ``run.check_loss`` skips a non-finite loss; after this many
            in a row the run rolls back to its last checkpoint and divides the
            learning rates by ``nonfinite_lr_factor`` (data keeps moving on).
        max_rollbacks: After this many rollbacks (or with no checkpoint to roll
            back to) the run exits with code 78 (:data:`~preempt.errors.NONFINITE_EXIT_CODE`).
        max_oom: ``with run.oom_guard():`` skips a batch that runs out of memory;
            after this many in a row the run exits with code 79
            (:data:`~preempt.errors.OOM_EXIT_CODE`): rerun with a smaller batch.
        emergency_save: When an exception escapes the loop at a step boundary
            (no optimizer step begun since the last ``run.step()``), write a
            checkpoint of that state (reason ``"emergency"``) before the
            exception propagates. Not under torch.distributed.
        clock: Monotonic clock (for tests).
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: state.Stateful | None = None,
        scaler: state.Stateful | None = None,
        checkpoint_interval: float | None = 300.0,
        checkpoint_every_steps: int | None = None,
        checkpoints_per_epoch: int | None = None,
        keep_last: int | None = 2,
        keep_best: int = 0,
        keep_every_steps: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        auto_resume: bool = True,
        resume: str | int | os.PathLike[str] | None = "latest",
        weights_only: bool = False,
        strict: bool = True,
        track: Mapping[str, state.Stateful] | None = None,
        signals: Iterable[int] = DEFAULT_SIGNALS,
        exit_code: int = PREEMPTED_EXIT_CODE,
        exit_if_complete: bool = True,
        lock_timeout: float = 0.0,
        time_limit: float | str | None = None,
        requeue: bool = True,
        max_restarts: int | None = None,
        async_save: bool = True,
        sync_every_steps: int = 1,
        log_file: bool = True,
        progress_every_s: float | None = 60.0,
        monitor_gpu: bool | float | None = None,
        max_nonfinite: int = 5,
        nonfinite_lr_factor: float = 1.5,
        max_rollbacks: int = 3,
        max_oom: int = 3,
        emergency_save: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(save_dir, (str, os.PathLike)) or not str(save_dir):
            raise ValueError(f"save_dir: expected a directory path, got {save_dir!r}")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        for name, obj in (("scheduler", scheduler), ("scaler", scaler)):
            _check_stateful(name, obj)
        cfg = self.config = RunConfig(
            checkpoint_interval=checkpoint_interval, checkpoint_every_steps=checkpoint_every_steps,
            checkpoints_per_epoch=checkpoints_per_epoch, keep_last=keep_last, keep_best=keep_best,
            keep_every_steps=keep_every_steps, best_metric=best_metric, best_mode=best_mode, async_save=async_save,
            auto_resume=auto_resume, resume=resume, weights_only=weights_only, strict=strict,
            exit_if_complete=exit_if_complete, lock_timeout=lock_timeout, signals=tuple(signals), exit_code=exit_code,
            time_limit=time_limit, requeue=requeue, max_restarts=max_restarts, sync_every_steps=sync_every_steps,
            log_file=log_file, progress_every_s=progress_every_s, monitor_gpu=monitor_gpu,
            max_nonfinite=max_nonfinite, nonfinite_lr_factor=nonfinite_lr_factor, max_rollbacks=max_rollbacks,
            max_oom=max_oom, emergency_save=emergency_save,
        )  # fmt: skip
        self.save_dir = Path(save_dir)
        self.policy = cfg.save_policy()
        self.manager = CheckpointManager(save_dir, retention=cfg.retention())
        self.components = state.Components(model, optimizer, scheduler, scaler)
        for name, obj in (track or {}).items():
            self._add_tracked(name, obj)
        self.env = Environment.from_env()
        self._clock = clock
        # The parts, each of one concern; the run composes them.
        self.loop = LoopState()
        self.stopper = Stopper(cfg, self.env, self.save_dir, clock)
        self.data = DataCursor(self.stopper.flag.signals)
        self.snapshot = Snapshot(self.components, self.loop, self.data)
        self.saves = SaveScheduler(
            self.manager, self.loop, self.snapshot, self.stopper.flag, clock=clock, on_durable=self.stopper.saved
        )
        self.health = Health(cfg, self.components, self.loop, self.snapshot)
        self.reporter = Reporter(cfg, self.save_dir, self.loop, clock)
        self.peers: Alone = Alone()
        self.resumed_from: Path | None = None
        job = f" (SLURM job {self.env.slurm_job_id})" if self.env.slurm_job_id else ""
        self._lock = DirLock(self.save_dir, purpose=f"training{job}", timeout=lock_timeout)
        self._beacon = StepBeacon(self.save_dir)  # the lock holder's latest step, for whoever finds it dead
        self._step_view: Any = self._beacon.view  # step() stores the step in [0]: shared memory, or a list
        self._starter: Starter | None = None
        self._entered = self._active = False
        self._batches_epoch = -1  # the epoch whose batches() has started
        self._due_step = self._due_batch = self._due_time = math.inf  # below these, run.step() does not look
        self._step_hook: Any = None

    # ---------------------------------------------------------------- what a user reads

    @property
    def global_step(self) -> int:
        """Optimizer steps counted by run.step() over the whole run (all restarts)."""
        return self.loop.global_step

    @property
    def epoch(self) -> int:
        return self.loop.epoch

    @property
    def batch(self) -> int:
        """Batches of the current epoch the loop received."""
        return self.loop.batch

    @property
    def metrics(self) -> dict[str, float]:
        """The latest value of each metric given to run.step() or run.report()."""
        return self.loop.metrics

    @property
    def user_state(self) -> dict[str, Any]:
        """Your own JSON-serialisable state, saved in every checkpoint and restored on resume."""
        return self.snapshot.user_state

    @user_state.setter
    def user_state(self, value: dict[str, Any]) -> None:
        self.snapshot.user_state = value

    @property
    def last_checkpoint(self) -> Path | None:
        """The newest durable checkpoint this process knows of."""
        return self.saves.last_checkpoint

    @property
    def last_save(self) -> SaveRecord | None:
        return self.saves.last_save

    @property
    def failed_saves(self) -> int:
        """Periodic checkpoints that could not be written (disk full, I/O errors)."""
        return self.saves.failed

    @property
    def staging_prepare_s(self) -> float | None:
        """Seconds spent allocating the staging buffers (in the background)."""
        return self.saves.prepare_s

    @property
    def rank(self) -> int:
        return self.peers.rank

    @property
    def world_size(self) -> int:
        return self.peers.world_size

    @property
    def nonfinite(self) -> Any:
        return self.health.nonfinite

    @property
    def oom(self) -> Any:
        return self.health.oom

    @property
    def rollbacks(self) -> int:
        return self.health.rollbacks

    # ---------------------------------------------------------------- enter

    def __enter__(self) -> PreemptibleRun:
        if self._entered:
            raise PreemptError("this PreemptibleRun was already entered; create a new one for another run")
        self._entered = True
        _log.setup(self.env.log_level)
        self._join()
        if not self.stopper.flag.install():
            log.warning(
                "PreemptibleRun entered outside the main thread: stop signals cannot be caught here"
                " (CPython installs handlers only from the main thread)"
            )
        starter = self._starter = Starter(
            self.config, self.manager, self.components, (self.loop, self.data, self.snapshot, self.saves),
            self.peers, self.env,
        )  # fmt: skip
        try:
            if self.peers.leader:
                payload = self._lead(starter)
            else:
                starter.follow()
                self.snapshot.provenance = provenance(self.env)
                payload = self.snapshot.capture()  # unsupported state fails now
            starter.finish_branch()
        except BaseException as e:
            if self.peers.leader:
                starter.refuse(e)
            self.stopper.flag.restore()
            # A completed run has time to delete the leftovers it found; a failed start does not wait.
            self.manager.close(timeout=None if isinstance(e, RunComplete) else 0.0)
            self._lock.release()
            raise
        self._begin(payload)
        return self

    def _join(self) -> None:
        """The run's peers: this process alone, or the ranks of torch.distributed (a collective)."""
        cfg = self.config
        self.snapshot.sharded = sharded.is_sharded(self.components.model)
        if self.snapshot.sharded and not distributed.active():
            raise PreemptError("the model's state is sharded (DTensor/FSDP) but torch.distributed has one rank")
        if self.snapshot.sharded and cfg.weights_only and not cfg.starts_fresh:
            raise PreemptError(
                f"resume={cfg.resume!r}, weights_only=True: loading only the weights into a sharded model is not"
                " supported yet; load them before entering the run, or resume the whole state"
            )
        peers = self.peers = join(cfg.sync_every_steps)
        self.snapshot.rank = self.reporter.rank = peers.rank
        self.reporter.world_size = peers.world_size
        self.saves.peers = peers
        if not peers.leader:
            self.manager.owner = False  # rank 0 cleans, quarantines and prunes

    def _lead(self, starter: Starter) -> state.Payload:
        """The process alone, or rank 0: takes the lock, chooses the starting state, tells the other ranks."""
        cfg = self.config
        self.manager.check_dir()  # a bad save_dir is said now, not at the first checkpoint hours later
        self._lock.acquire()
        if self._lock.previous:  # the previous holder died holding the lock
            starter.predecessor_died, starter.died_at = True, self._beacon.read()
        self.manager.recover()  # only the lock holder may clean up leftovers
        done = self.manager.completion()
        if done is not None and cfg.exit_if_complete and not cfg.starts_fresh and not starter.new_request():
            log.info(
                "%s is complete (step %s, epoch %s); nothing to do. Pass exit_if_complete=False to train further.",
                self.save_dir,
                done.get("step"),
                done.get("epoch"),
            )
            raise RunComplete(str(self.save_dir))
        self.stopper.check_restarts()
        self.snapshot.provenance = provenance(self.env)
        payload = self.snapshot.capture()  # unsupported state fails now
        self.stopper.read_slurm_job(self.snapshot.provenance)
        starter.lead()
        if done is not None:
            self.manager.clear_complete()
        self.stopper.arm_walltime(payload_nbytes(payload), self.loop.global_step)
        return payload

    def _begin(self, payload: state.Payload) -> None:
        """The run is on: clocks, the staging buffers, logs and monitors, the first due points."""
        self._active = True
        assert self._starter is not None
        self.resumed_from = self._starter.resumed_from
        if self.data.seed is None:
            self.data.seed = torch.initial_seed() & SEED_MASK
        if self._lock.held:
            self._beacon.open(self.loop.global_step)
            self._step_view = self._beacon.view
        self.loop.started(self._clock())
        self.health.apply_lr_scale(resumed=self.resumed_from is not None)
        opt = self.components.optimizer
        if opt is not None:
            self._step_hook = opt.register_step_pre_hook(self.loop.optimizer_stepping)
        self.reporter.start(self.resumed_from)
        if self.config.async_save and self.snapshot.sharded:
            if self.peers.leader:
                log.info("async_save: sharded state is saved synchronously (every rank writes its shards through DCP)")
        elif self.config.async_save and self.peers.leader:
            # Under torch.distributed rank 0 writes the replicated state in the background; the other ranks'
            # files (their random generators) are small and written at the step, before rank 0's.
            self.saves.start(payload, optimizer_state_later=opt is not None)
        self._recompute_due()

    # ----------------------------------------------------------------- exit

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        try:
            if exc_type is None and self._active:
                self._finish()
            elif self._active and exc is not None and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
                self.health.emergency(exc, self.saves, alone=self.peers.alone)
        finally:
            self._active = False
            self.stopper.flag.restore()
            if self._step_hook is not None:
                self._step_hook.remove()
                self._step_hook = None
            if isinstance(exc, Preempted):
                event: str | None = "stop"
            elif exc_type is None:
                event = "complete"
            else:
                event = "error"
            self.reporter.stop(event, **({"error": repr(exc)[:200]} if event == "error" else {}))
            try:
                self.saves.close()  # a write in flight is a consistent state: let it become durable
                self.data.stop_workers()
                # After a stop the process must exit within its grace period;
                # unfinished deletions are redone at the next start.
                self.manager.close(timeout=None if exc_type is None else 0.0)
            finally:
                self._step_view = [0]
                self._beacon.close()
                self._lock.release()
        return False

    def _finish(self) -> None:
        """Final checkpoint (when anything changed) and the completion marker."""
        saves = self.saves
        saves.settle()
        needed = self.loop.dirty or saves.last_info is None
        # Rank 0 decides: only it knows whether its last background write became durable.
        last = None if saves.last_checkpoint is None else str(saves.last_checkpoint)
        needed, last = self.peers.broadcast((needed, last))
        if not needed and not self.peers.leader:
            saves.last_checkpoint = None if last is None else Path(last)
            return
        if needed:
            saves.save(Reason.FINAL, "epoch")
        if not self.peers.leader:
            return
        assert saves.last_info is not None
        self.manager.mark_complete(saves.last_info)
        log.info(
            "run complete: step %d, epoch %d; final checkpoint %s",
            self.loop.global_step,
            self.loop.epoch,
            saves.last_info.path,
        )

    # ---------------------------------------------------------------- loop

    def epochs(self, n: int) -> Iterator[int]:
        """Yields epoch numbers from the resumed epoch up to ``n - 1``.

        Each boundary (before every epoch, and after the last) is a safe point.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"epochs: expected an integer >= 0, got {n!r}")
        self._check_active("epochs")
        self.reporter.epochs_total = n
        loop = self.loop
        while True:
            rng_now = self.data.resume_at_epoch(loop.epoch)
            if rng_now is not None:
                rng.restore(rng_now)  # the program point where that checkpoint was taken
            if loop.at_epoch_start:
                self._safe_point("epoch")
            elif self.stopper.flag.requested and not loop.dirty and self.peers.alone:
                self._stop()  # a stop between run.step() and the epoch's end, with nothing to save
            if loop.epoch >= n:
                return
            self.data.set_epoch(loop.epoch)
            self._recompute_due()
            self.reporter.epoch_started()
            yield loop.epoch
            self.reporter.epoch_summary()
            self.stopper.epoch_done()
            if loop.batches_since_step:
                log.debug(
                    "epoch %d ended with %d batch(es) not followed by run.step()", loop.epoch, loop.batches_since_step
                )
            loop.epoch_ended()

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
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
        self._batches_epoch = loop.epoch
        it, start = self.data.open(loader, loop.epoch)
        if it is None:
            return
        loop.at_batch(start)
        self._recompute_due()
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

    def step(self, metrics: Mapping[str, Any] | None = None) -> None:
        """Counts one optimizer step; the safe point where checkpoints happen.

        Call it as the last statement of the loop body, after ``optimizer.step()``.
        May write a checkpoint; after a stop signal, saves and raises Preempted.

        Args:
            metrics: Numbers to record at this step; the one named ``best_metric``
                decides "best" checkpoints.
        """
        loop = self.loop
        step = self._step_view[0] = loop.stepped()
        if metrics is not None:
            loop.record(metrics, self.manager.retention)
        if self.peers.meets(
            step,
            self.stopper.flag.requested
            or loop.best_pending
            or step >= self._due_step
            or loop.batch >= self._due_batch
            or self._clock() >= self._due_time
            or (self.saves.job is not None and self.saves.finished()),
        ):
            self._safe_point("step")

    def report(self, metrics: Mapping[str, Any]) -> None:
        """Records metrics without counting a step (e.g. validation at the end of an epoch).

        When ``best_metric`` improves, the next safe point saves a "best" checkpoint.
        """
        self.loop.record(metrics, self.manager.retention)

    # ----------------------------------------------------------- extras

    def sampler(
        self,
        dataset: Any,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        per_sample_rng: bool = True,
    ) -> ResumableSampler:
        """A ResumableSampler for ``dataset`` whose epoch the run keeps in step.

        With ``per_sample_rng`` (the default) a DataLoader drawing from it seeds
        the random generators of whichever process fetches a sample from
        (seed, epoch, index) first, so random augmentation inside the dataset
        replays exactly, with any number of workers (:mod:`preempt.data_replay`).
        """
        replicas, rank = 1, 0
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            replicas, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        s = ResumableSampler(
            dataset,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            num_replicas=replicas,
            rank=rank,
            per_sample_rng=per_sample_rng,
        )
        s.set_epoch(self.loop.epoch)
        return self.data.add_sampler(s)

    def track(self, name: str, obj: state.Stateful) -> None:
        """Saves and restores ``obj`` (anything with state_dict/load_state_dict) under ``name``.

        When the run resumed, the object's saved state is loaded at once.
        """
        self._add_tracked(name, obj)
        saved = self._starter.saved_tracked if self._starter is not None else {}
        if self._active and not state.load_tracked(name, obj, saved, str(self.resumed_from)):
            if self.resumed_from is not None:
                log.warning("tracked object %r has no state in %s; left as it is", name, self.resumed_from)

    def protect(self, loader: Any) -> Any:
        """Makes a DataLoader's workers ignore stop signals (done for you by run.batches)."""
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
        """True when ``loss`` is finite. Otherwise the step must be skipped: zero the gradients, do not step.

        ::

            loss = compute_loss(model, batch)
            if not run.check_loss(loss):
                opt.zero_grad(set_to_none=True)
                continue  # no backward, no optimizer step, no run.step()
            loss.backward(); opt.step(); run.step()

        After ``max_nonfinite`` in a row the run rolls back to its last
        checkpoint (model, optimizer, scheduler, scaler) and divides the
        learning rates by ``nonfinite_lr_factor``; the data goes on from the
        current batch, so the batches that diverged are not replayed. With no
        checkpoint, under torch.distributed, or after ``max_rollbacks``, it
        raises :class:`~preempt.guards.NonFiniteStreak` (exit code 78). One
        synchronisation with the GPU per call (the finiteness test).
        """
        return self.health.check_loss(
            loss,
            lambda: self.health.roll_back(
                self.saves, self.manager, alone=self.peers.alone, marker=self.reporter.marker
            ),
        )

    def oom_guard(self) -> OomStep:
        """``with run.oom_guard() as s:`` around forward, backward and the optimizer step: an out-of-memory
        error inside is caught, memory is freed, and ``s.skipped`` is True (zero the gradients and skip
        ``run.step()``). ``max_oom`` in a row raise :class:`~preempt.guards.OutOfMemoryStreak` (exit code 79).
        Under torch.distributed the first one does: one rank cannot skip a step alone.
        """
        return self.health.oom_step(alone=self.peers.alone)

    # ------------------------------------------------------------ internals

    def _add_tracked(self, name: str, obj: Any) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"track: expected a non-empty name, got {name!r}")
        if name in self.components.tracked:
            raise ValueError(f"track: the name {name!r} is already tracked")
        _check_stateful(f"track[{name!r}]", obj)
        self.components.tracked[name] = obj

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
        now = self._clock()
        due = self.saves.wake(next_due(self.policy, self._facts(now)), self.policy.milestone_steps)
        self._due_step, self._due_batch = due.step, due.batch
        self._due_time = min(due.time, self.reporter.next_at, self.stopper.review_at(now))

    def _safe_point(self, point: str) -> None:
        """Where a checkpoint may be taken: the peers agree on saving and stopping (alone: trivially)."""
        loop, saves, stopper = self.loop, self.saves, self.stopper
        saves.tend()
        if self._clock() >= self.reporter.next_at:
            self.reporter.report(self.data.batches_per_epoch, self.components.optimizer)
        stopper.observe(loop.global_step)
        decision = decide(self.policy, self._facts(self._clock()))  # rank 0's counts; the others add a signal
        stopper.decided(decision)
        reason = saves.pick(decision.reason if decision.save else None)
        agreed = self.peers.agree(
            stopper.flag.requested,
            _REASONS.index(reason) + 1 if reason is not None else 0,
            walltime_stop=decision.stop and decision.reason is Reason.WALLTIME,
        )
        if agreed.save:
            saves.save(_REASONS[agreed.save - 1], point)
        if agreed.stop:
            saves.settle()  # rank 0's write in flight first
            if self.peers.broadcast(loop.dirty):  # rank 0's view: a signal during that save, or its write failed
                saves.save(Reason.PREEMPT, point)
            self._stop(peer=agreed.signal_rank)
        self._recompute_due()

    def _stop(self, peer: int = -1) -> None:
        loop = self.loop
        self.stopper.stop(
            step=loop.global_step,
            epoch=loop.epoch,
            batch=loop.batch,
            start_step=loop.start_step,
            checkpoint=self.saves.last_checkpoint,
            peer=peer,
        )


def _check_stateful(name: str, obj: Any) -> None:
    if obj is None:
        return
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise TypeError(f"{name}: expected an object with state_dict() and load_state_dict(), got {type(obj).__name__}")
