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

import dataclasses
import errno
import math
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from . import _log, codec, distributed, guards, rng, sharded, slurm, state
from .checkpoint import CheckpointInfo, CheckpointManager
from .commit import MANIFEST
from .data_replay import LoaderFeed
from .dataloading import find_sampler, length, shield_workers
from .environment import Environment, provenance
from .errors import (
    PREEMPTED_EXIT_CODE,
    REQUEUE_FAILED_EXIT_CODE,
    RESTART_LIMIT_EXIT_CODE,
    SAVE_FAILED_EXIT_CODE,
    CheckpointWriteError,
    IncompatibleStateError,
    NoCheckpointError,
    Preempted,
    PreemptError,
    RestartLimitReached,
    RunComplete,
    SaveFailed,
    SlurmError,
)
from .history import History, Progress, RunLog
from .lock import DirLock, StepBeacon
from .manifest import Cursor, Manifest
from .monitor import GPUMonitor
from .policy import Decision, Reason, SaveFacts, SavePolicy, Walltime, decide, next_due
from .sampler import ResumableSampler
from .signals import DEFAULT_SIGNALS, StopFlag, signal_name
from .staging import BackgroundWriter, Stager, host_memory_available, payload_nbytes
from .supervised import Supervised

log = _log.log
_END = object()

# Periodic saves: one that comes due while a background write is in flight is postponed until it ends.
# The others wait for it: a best or milestone checkpoint is of its own step, and a stop must be saved now.
_POSTPONABLE = frozenset({Reason.INTERVAL, Reason.STEPS, Reason.PER_EPOCH})
_ASYNC_MEMORY_SHARE = 0.5  # staging buffers may take at most this share of the host's available memory
_REASONS = list(Reason)  # save reasons travel between ranks as index + 1
_SEED_MASK = (1 << 53) - 1  # the run's seed, kept exact by any JSON reader


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


@dataclasses.dataclass(frozen=True)
class _Job:
    """What the background writer is doing: preparing buffers, or writing a staged snapshot."""

    kind: str  # "prepare" or "save"
    record: SaveRecord | None = None
    started: float = 0.0  # clock at the start of the save


@dataclasses.dataclass(frozen=True)
class _Resume:
    """What a loaded checkpoint asks the loop to restore at its program point."""

    info: CheckpointInfo
    cursor: Cursor
    rng_now: rng.RngState
    rng_epoch_start: rng.RngState | None
    sampler: dict[str, Any] | None
    loader: Any = None  # where an iterable dataset's workers stood (preempt.data_replay.LoaderFeed.state)


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
        if not isinstance(exit_code, int) or not 0 <= exit_code <= 255:
            raise ValueError(f"exit_code: expected an integer in [0, 255], got {exit_code!r}")
        if isinstance(resume, bool) or not (
            resume is None or resume in ("latest", "best") or isinstance(resume, (int, str, os.PathLike))
        ):
            raise ValueError(f"resume: expected 'latest', 'best', a step, a path or None, got {resume!r}")
        if isinstance(resume, int) and resume < 0:
            raise ValueError(f"resume: a step number must be >= 0, got {resume}")
        self.time_limit = _time_limit(time_limit)
        if max_restarts is not None and (
            not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0
        ):
            raise ValueError(f"max_restarts: expected an integer >= 0 or None, got {max_restarts!r}")
        self.requeue = bool(requeue)
        self.max_restarts = max_restarts
        self.async_save = bool(async_save)
        if not isinstance(sync_every_steps, int) or isinstance(sync_every_steps, bool) or sync_every_steps < 1:
            raise ValueError(f"sync_every_steps: expected an integer >= 1, got {sync_every_steps!r}")
        self.sync_every_steps = sync_every_steps
        for name, value in (("max_nonfinite", max_nonfinite), ("max_rollbacks", max_rollbacks), ("max_oom", max_oom)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        if not isinstance(nonfinite_lr_factor, (int, float)) or not nonfinite_lr_factor > 1:
            raise ValueError(f"nonfinite_lr_factor: expected a number > 1, got {nonfinite_lr_factor!r}")
        if monitor_gpu is True:
            monitor_gpu = 10.0
        elif monitor_gpu is False:
            monitor_gpu = None
        for name, value in (("progress_every_s", progress_every_s), ("monitor_gpu", monitor_gpu)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"{name}: expected a number of seconds > 0 or None, got {value!r}")
        self.log_file = bool(log_file)
        self.progress_every_s = progress_every_s
        self.monitor_gpu = monitor_gpu
        self.max_rollbacks = max_rollbacks
        self.emergency_save = bool(emergency_save)
        self.nonfinite = guards.NonFiniteGuard(max_in_a_row=max_nonfinite, lr_factor=float(nonfinite_lr_factor))
        self.oom = guards.OOMGuard(max_in_a_row=max_oom)
        self.rollbacks = 0
        self.rank, self.world_size = 0, 1  # set on entering, under torch.distributed
        self.save_dir = Path(save_dir)
        self.policy = SavePolicy(
            interval_s=checkpoint_interval,
            every_steps=checkpoint_every_steps,
            per_epoch=checkpoints_per_epoch,
            milestone_steps=keep_every_steps,
        )
        self.manager = CheckpointManager(
            save_dir,
            keep_last=keep_last,
            keep_best=keep_best,
            keep_every_steps=keep_every_steps,
            best_metric=best_metric,
            best_mode=best_mode,
        )
        self.components = state.Components(model, optimizer, scheduler, scaler)
        for name, obj in (track or {}).items():
            self._add_tracked(name, obj)
        self.auto_resume = bool(auto_resume)
        self.resume = resume
        self.weights_only = bool(weights_only)
        self.strict = bool(strict)
        self.exit_code = exit_code
        self.exit_if_complete = bool(exit_if_complete)
        self._flag = StopFlag(signals, clock)
        self._clock = clock
        self.env = Environment.from_env()
        job = f" (SLURM job {self.env.slurm_job_id})" if self.env.slurm_job_id else ""
        self._lock = DirLock(self.save_dir, purpose=f"training{job}", timeout=lock_timeout)
        self._beacon = StepBeacon(self.save_dir)  # the lock holder's latest step, for whoever finds it dead
        self._step_view: Any = self._beacon.view  # step() stores the step in [0]: shared memory, or a list
        self._died_at: int | None = None  # the step a previous holder reached before it died (None: unknown)
        self._predecessor_died = False

        # Progress. Read these; the run updates them.
        self.global_step = 0
        self.epoch = 0
        self.batch = 0
        self.user_state: dict[str, Any] = {}
        self.metrics: dict[str, float] = {}
        self.resumed_from: Path | None = None
        self.last_checkpoint: Path | None = None
        self.failed_saves = 0  # periodic checkpoints that could not be written (disk full, I/O errors)
        self.last_save: SaveRecord | None = None
        self.staging_prepare_s: float | None = None  # seconds spent allocating the staging buffers (background)

        self._entered = False
        self._active = False
        self._dirty = False
        self._batches_since_step = 0
        self._batches_epoch = -1  # the epoch whose batches() has started
        self._batches_per_epoch: int | None = None
        self._samples_per_batch: int | None = None  # global samples per batch, when known
        self._sample_offset = 0  # samples of the epoch done minus batch * samples per batch (after a resize)
        self._sampler: ResumableSampler | None = None
        self._samplers: list[ResumableSampler] = []
        # Loaders seen by batches(), each with what replaying it exactly needs; their persistent workers stop at exit.
        self._feeds: weakref.WeakKeyDictionary[Any, LoaderFeed] = weakref.WeakKeyDictionary()
        self._feed: LoaderFeed | None = None  # the current epoch's
        self._run_seed: int | None = None  # seeds iterable datasets' per-sample streams (torch's seed at the start)
        self._epoch_rng: rng.RngState | None = None
        self._resume: _Resume | None = None
        self._best: dict[str, Any] | None = None
        self._best_pending = False
        self._lineage: dict[str, Any] = {}
        self._provenance: dict[str, Any] = {}
        self._saved_tracked: Mapping[str, Any] = {}
        self._last_info: CheckpointInfo | None = None
        self._last_save_time = 0.0
        self._last_save_step = 0
        self._last_save_epoch = 0
        self._last_save_batch = 0
        self._due_step: float = math.inf
        self._due_batch: float = math.inf
        self._due_time: float = math.inf
        self._walltime: Walltime | None = None
        self._end_time: float | None = None  # the SLURM job's end time, unix seconds
        self._kill_wait: float | None = None  # SLURM's KillWait, seconds
        self._scontrol_missing = False
        self._start_step = 0
        self._grace_warned = False
        self._walltime_margin = 0.0
        self._loader_done: float | None = None  # when the epoch's loader ran out (walltime keeping only)
        self._stager: Stager | None = None
        self._writer: BackgroundWriter | None = None
        self._job: _Job | None = None  # the background writer's current job, until collected
        self._postponed: Reason | None = None  # a periodic save that came due while a write was in flight
        self._prepare_at_step: int | None = None  # the step after which the buffers are sized for the optimizer
        self._coord: distributed.Coordinator | None = None
        self._sharded = False  # the model's state is DTensors: its tensors go through DCP (preempt.sharded)
        self._lr_scale = 1.0  # learning rates relative to the run's own, as lowered by rollbacks and the supervisor
        self._stepping = False  # an optimizer step began since the last run.step() (the state may be half-updated)
        self._step_hook: Any = None
        self._runlog: RunLog | None = None
        self._history: History | None = None
        self._progress: Progress | None = None
        self._next_report = math.inf
        self._monitor: GPUMonitor | None = None
        self._epoch_started = 0.0
        self._report_from = (0.0, 0)
        self._epochs_total: int | None = None
        self._announced = False  # rank 0 told the other ranks which checkpoint to load (before a sharded load)
        self._branching = False  # a resume request is being applied (rank 0 tells the other ranks)
        self._branch_rest: tuple[Any, ...] | None = None  # under torch.distributed: what is left of applying it

    # ---------------------------------------------------------------- enter

    def __enter__(self) -> PreemptibleRun:
        if self._entered:
            raise PreemptError("this PreemptibleRun was already entered; create a new one for another run")
        self._entered = True
        _log.setup(self.env.log_level)
        if distributed.active():
            self._join_ranks()
            if self.rank != 0:
                return self._enter_follower()
        elif sharded.is_sharded(self.components.model):
            raise PreemptError("the model's state is sharded (DTensor/FSDP) but torch.distributed has one rank")
        if not self._flag.install():
            log.warning(
                "PreemptibleRun entered outside the main thread: stop signals cannot be caught here"
                " (CPython installs handlers only from the main thread)"
            )
        try:
            self.manager.check_dir()  # a bad save_dir is said now, not at the first checkpoint hours later
            self._lock.acquire()
            if self._lock.previous:  # the previous holder died holding the lock
                self._predecessor_died, self._died_at = True, self._beacon.read()
            self.manager.recover()  # only the lock holder may clean up leftovers
            done = self.manager.completion()
            fresh = not self.auto_resume or self.resume is None  # starting over is asked: complete or not
            if done is not None and self.exit_if_complete and not fresh and not self._new_request():
                log.info(
                    "%s is complete (step %s, epoch %s); nothing to do. Pass exit_if_complete=False to train further.",
                    self.save_dir,
                    done.get("step"),
                    done.get("epoch"),
                )
                raise RunComplete(str(self.save_dir))
            self._check_restarts()
            self._provenance = provenance(self.env)
            payload = self._capture()  # unsupported state fails now
            self._read_slurm_job()
            self._start()
            if done is not None:
                self.manager.clear_complete()
            self._arm_walltime(payload)
            if self._coord is not None and not self._announced:
                self._announce(None if self.resumed_from is None else str(self.resumed_from))
            if self._branch_rest is not None:
                self._coord.barrier()  # type: ignore[union-attr]  # every rank has loaded the source
                self._finish_branch(*self._branch_rest)
        except BaseException as e:
            if self._coord is not None and not self._announced:
                self._coord.broadcast(("complete" if isinstance(e, RunComplete) else "fail", repr(e), False))
            self._flag.restore()
            # A completed run has time to delete the leftovers it found; a failed start does not wait.
            self.manager.close(timeout=None if isinstance(e, RunComplete) else 0.0)
            self._lock.release()
            raise
        self._begin(payload)
        return self

    def _begin(self, payload: state.Payload) -> None:
        """The run is on: clocks, the staging buffers, logs and monitors, the first due points."""
        self._active = True
        if self._run_seed is None:
            self._run_seed = torch.initial_seed() & _SEED_MASK
        if self._lock.held:
            self._beacon.open(self.global_step)
            self._step_view = self._beacon.view
        self._last_save_time = self._clock()
        self._start_step = self.global_step
        self._apply_lr_scale()
        opt = self.components.optimizer
        if opt is not None:
            self._step_hook = opt.register_step_pre_hook(self._optimizer_stepping)
        self._start_reports()
        if self.async_save and self._sharded:
            if self.rank == 0:
                log.info("async_save: sharded state is saved synchronously (every rank writes its shards through DCP)")
        elif self.async_save and self.rank == 0:
            # Under torch.distributed rank 0 writes the replicated state in the background; the other ranks'
            # files (their random generators) are small and written at the step, before rank 0's.
            self._stager, self._writer = Stager(), BackgroundWriter()
            self._prepare(payload)
            if self.components.optimizer is not None:
                self._prepare_at_step = self.global_step + 1  # its moments appear at the first optimizer step
        self._recompute_due()

    def _optimizer_stepping(self, *_: Any) -> None:
        self._stepping = True

    def _apply_lr_scale(self) -> None:
        """Under ``preempt supervise --lr``: rescales learning rates restored from a checkpoint to its PREEMPT_LR_SCALE.

        The scale is relative to the run's original learning rate and recorded
        in each checkpoint, so a resume applies only the difference. A fresh
        start takes the lowered ``{lr}`` from its command line as it is.
        """
        sup = Supervised.from_env()
        if sup is None or sup.lr is None:
            return
        opt = self.components.optimizer
        if self.resumed_from is None or opt is None:
            self._lr_scale = sup.lr_scale
            return
        if math.isclose(sup.lr_scale, self._lr_scale, rel_tol=1e-9):
            return
        factor = sup.lr_scale / self._lr_scale
        lrs = guards.scale_lr(opt, self.components.scheduler, factor)
        log.info(
            "learning rates x%.6g: preempt supervise asks for %.6g of the original (PREEMPT_LR_SCALE), the checkpoint"
            " ran at %.6g; now %s",
            factor,
            sup.lr_scale,
            self._lr_scale,
            ", ".join(f"{lr:.6g}" for lr in lrs),
        )
        self._lr_scale = sup.lr_scale

    def _start_reports(self) -> None:
        """train.log, history.jsonl, the progress line and the GPU monitor, as configured."""
        if self.log_file:
            every_rank = os.environ.get("PREEMPT_LOG_ALL_RANKS", "") not in ("", "0")
            self._runlog = RunLog(self.save_dir, rank=self.rank, world_size=self.world_size, log_all_ranks=every_rank)
            self._runlog.start(self.resumed_from, self.global_step)
            self._history = History(self.save_dir, rank=self.rank)
            if self.resumed_from is None:
                self._history.marker("start", step=self.global_step, pid=os.getpid())
            else:
                self._history.marker("resume", step=self.global_step, from_=str(self.resumed_from), pid=os.getpid())
        self._progress = Progress(None, every_s=self.progress_every_s or 60.0, clock=self._clock)
        if self.progress_every_s is not None:
            self._next_report = self._clock() + self.progress_every_s
            self._report_from = (self._clock(), self.global_step)
        if self.monitor_gpu is not None and self.rank == 0:
            monitor = GPUMonitor(self.save_dir, self.monitor_gpu)
            if monitor.available:
                self._monitor = monitor.start()

    def _report(self) -> None:
        """A progress line in the log and a record in history.jsonl (every ``progress_every_s``)."""
        now = self._clock()
        assert self.progress_every_s is not None and self._progress is not None
        self._next_report = now + self.progress_every_s
        t0, step0 = self._report_from
        self._report_from = (now, self.global_step)
        bpe, n = self._batches_per_epoch, self._epochs_total
        if bpe and n is not None and self._progress.total_steps is None:
            # one optimizer step per batch from here on (an estimate under gradient accumulation)
            self._progress.total_steps = self.global_step + (n - self.epoch) * bpe - self.batch
        line = self._progress.update(self.global_step, self.epoch, self.batch, bpe, self.metrics)
        if line and self.rank == 0:
            log.info("%s", line)
        if self._history is not None:
            steps = self.global_step - step0
            opt = self.components.optimizer
            self._history.record(
                self.global_step,
                self.epoch,
                self.metrics,
                lr=[float(g["lr"]) for g in opt.param_groups] if opt is not None else None,
                step_time_s=(now - t0) / steps if steps > 0 else None,
                gpu_mem=_gpu_memory(self._monitor),
            )

    def _stop_reports(self, event: str | None = None, **fields: Any) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        if self._monitor is not None:
            self._monitor.stop()
            self._monitor = None
        if self._history is not None:
            if event is not None:
                self._history.marker(event, step=self.global_step, **fields)
            self._history.close()
            self._history = None
        if self._runlog is not None:
            self._runlog.close()
            self._runlog = None

    def _join_ranks(self) -> None:
        """Under torch.distributed: checks what is supported and creates the ranks' coordinator (a collective)."""
        self._sharded = sharded.is_sharded(self.components.model)
        if self._sharded and self.weights_only and self.auto_resume and self.resume is not None:
            raise PreemptError(
                f"resume={self.resume!r}, weights_only=True: loading only the weights into a sharded model is not"
                " supported yet; load them before entering the run, or resume the whole state"
            )
        self._coord = distributed.Coordinator()
        self.rank, self.world_size = self._coord.rank, self._coord.world_size
        if self.rank != 0:
            self.manager.owner = False  # rank 0 cleans, quarantines and prunes

    def _enter_follower(self) -> PreemptibleRun:
        """A rank other than 0 enters: rank 0 holds the lock and chooses the checkpoint; this rank loads it."""
        coord = self._coord
        assert coord is not None
        if not self._flag.install():
            log.warning("PreemptibleRun entered outside the main thread: stop signals cannot be caught here")
        try:
            kind, detail, branch = coord.broadcast(None)
            if kind == "complete":
                raise RunComplete(str(self.save_dir))
            if kind == "fail":
                raise PreemptError(f"rank 0 could not start the run in {self.save_dir}: {detail}")
            self._provenance = provenance(self.env)
            payload = self._capture()  # unsupported state fails now
            if detail is None:
                self._lineage = {"request": None, "started": time.time()}
            else:
                self._load_chosen(Path(detail), weights_only=branch and self.weights_only)
            if branch:
                coord.barrier()  # every rank has loaded the source: rank 0 may move the old timeline aside
                self._dirty = True
                self._save(Reason.BRANCH, "epoch" if self._resume is None else self._resume.cursor.point)
        except BaseException:
            self._flag.restore()
            raise
        self._begin(payload)
        return self

    def _announce(self, path: str | None) -> None:
        """Rank 0 tells the others which checkpoint to load, and whether a resume request is being applied."""
        assert self._coord is not None
        self._coord.broadcast(("start", path, self._branching))
        self._announced = True

    def _load_chosen(self, path: Path, *, weights_only: bool) -> None:
        """A rank other than 0 loads the checkpoint rank 0 chose (in this save_dir or, for a request, another)."""
        here = path.parent.resolve() == self.save_dir.resolve()
        source = self.manager if here else CheckpointManager(path.parent, owner=False)
        info = next((c for c in source.list() if c.path.resolve() == path.resolve()), None)
        if info is None or info.status != "valid":
            raise NoCheckpointError(f"rank {self.rank}: {path}, chosen by rank 0, is not a valid checkpoint")
        if weights_only:
            if self.components.model is not None:
                state.load_model(self.components.model, source.read(info, weights_only=True), strict=self.strict)
            self.resumed_from = info.path
            return
        if state.rank_files(self.rank)[1] not in info.manifest.files:
            log.warning(
                "rank %d: %s was written by fewer ranks; this rank starts from rank 0's random state", self.rank, path
            )
        self._restore(info, source.read(info, rank=self.rank))

    def _check_restarts(self) -> None:
        count = self.env.slurm_restart_count or 0
        if self.env.slurm_job_id and self.max_restarts is not None and count > self.max_restarts:
            log.error(
                "SLURM job %s is at restart %d but max_restarts=%d: not training (exit code %d); resubmit the"
                " job to continue from %s",
                self.env.slurm_job_id,
                count,
                self.max_restarts,
                RESTART_LIMIT_EXIT_CODE,
                self.save_dir,
            )
            raise RestartLimitReached(count, self.max_restarts)

    def _read_slurm_job(self) -> None:
        """Under SLURM: the job's end time, KillWait, and whether scontrol is there (one call each)."""
        env = self.env
        end_time: float | None = env.slurm_job_end_time
        if env.slurm_job_id:
            try:
                job = slurm.show_job(env.slurm_job_id)
            except SlurmError as e:
                self._scontrol_missing = e.missing
                log.warning(
                    "SLURM job %s: %s. This job cannot requeue itself: a stop at its time limit will exit with"
                    " code %d for a wrapper script to requeue or resubmit it.%s",
                    env.slurm_job_id,
                    e,
                    REQUEUE_FAILED_EXIT_CODE,
                    ""
                    if end_time
                    else " Its end time is unknown too (no SLURM_JOB_END_TIME): walltime keeping needs time_limit=",
                )
            else:
                end_time = end_time or job.end_time
                self._kill_wait = slurm.kill_wait()
                if self.requeue and job.requeue is False:
                    log.warning(
                        "SLURM job %s has Requeue=0 (--no-requeue): a stop at its time limit cannot requeue it"
                        " and will exit with code %d",
                        env.slurm_job_id,
                        REQUEUE_FAILED_EXIT_CODE,
                    )
            self._end_time = end_time
            if isinstance(self._provenance.get("slurm"), dict):
                self._provenance["slurm"] = {**self._provenance["slurm"], "end_time": end_time}

    def _arm_walltime(self, payload: state.Payload) -> None:
        """Starts the walltime keeper when there is a deadline: the job's end time or time_limit."""
        env, end_time = self.env, self._end_time
        now, wall = self._clock(), time.time()
        limits = []  # (seconds left, what)
        if end_time is not None:
            limits.append((end_time - wall, f"SLURM job {env.slurm_job_id}"))
        if self.time_limit is not None:
            limits.append((self.time_limit, f"time_limit={self.time_limit:g} s"))
        if not limits:
            return
        left, what = min(limits)
        nbytes = sum(
            t.numel() * t.element_size() for tensors, _ in payload.tensor_files.values() for t in tensors.values()
        )
        self._walltime = Walltime(now + left, Walltime.prior_save_s(nbytes), now, self.global_step)
        log.info(
            "walltime: %s ends in %s (at %s); the run stops and saves before then",
            what,
            _log.duration(max(0.0, left)),
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall + left)),
        )

    def _start(self) -> None:
        """Chooses the starting state: own latest, a requested checkpoint, or fresh."""
        if not self.auto_resume or self.resume is None:
            self._start_fresh({"request": None}, supersede=True)
            return
        request = self._request()
        latest = next((c for c in self.manager.list() if c.status == "valid"), None)
        if request is None or (latest is not None and latest.manifest.lineage.get("request") == request):
            # Plain "latest", or the requested timeline already exists: continue it.
            try:
                info, loaded = self.manager.load("latest")
            except NoCheckpointError as e:
                if e.corrupt:
                    log.warning("%s; starting fresh (the broken checkpoints are in %s/quarantine)", e, self.save_dir)
                if request is None:
                    self._start_fresh({"request": None}, supersede=False)
                    return
                info = None
            if info is not None and (request is None or info.manifest.lineage.get("request") == request):
                self._restore(info, loaded)
                return
        self._branch(request)

    def _branch(self, request: dict[str, Any]) -> None:
        """Applies a resume request once: loads its checkpoint and starts a new timeline from it."""
        source_dir, selector = self._request_source()
        own = source_dir == self.save_dir.resolve()
        if own and not any(c.status == "valid" for c in self.manager.list()):
            log.info("%s has no checkpoint yet; starting fresh", self.save_dir)
            self._start_fresh({"request": request}, supersede=False)
            return
        source = self.manager if own else CheckpointManager(source_dir, owner=False)
        self._branching = True
        info, loaded = source.load(selector, weights_only=self.weights_only)
        if self.weights_only:
            if self.components.model is not None:
                state.load_model(self.components.model, loaded, strict=self.strict)
            self.resumed_from = info.path
            log.info(
                "loaded the weights of %s (step %d); optimizer, scheduler and counters start fresh",
                info.path,
                info.step,
            )
        else:
            self._restore(info, loaded)
        point = "epoch" if self._resume is None else self._resume.cursor.point
        if self._coord is not None:
            self._branch_rest = (request, info, own, point)  # after the other ranks have loaded the source too
            return
        self._finish_branch(request, info, own, point)

    def _finish_branch(self, request: dict[str, Any], info: CheckpointInfo, own: bool, point: str) -> None:
        """The new timeline of a resume request: the old one moved aside, and a first checkpoint at once."""
        # Checkpoints that would shadow the new timeline are moved aside, not deleted.
        shadowing = [
            c
            for c in self.manager.list()
            if c.status == "valid" and (self.weights_only or not own or c.step > info.step)
        ]
        moved = self.manager.supersede(shadowing)
        if moved:
            log.warning("moved %d checkpoint(s) of the previous timeline to %s/superseded", len(moved), self.save_dir)
        self._lineage = {"request": request, "source": str(info.path), "started": time.time()}
        # The new timeline gets its first checkpoint at once, so that a rerun continues it.
        self._dirty = True
        self._save(Reason.BRANCH, point)

    def _new_request(self) -> bool:
        """A resume request (other than "latest") that the newest checkpoint does not record yet."""
        request = self._request() if self.auto_resume and self.resume is not None else None
        if request is None:
            return False
        latest = next((c for c in self.manager.list() if c.status == "valid"), None)
        return latest is None or latest.manifest.lineage.get("request") != request

    def _request(self) -> dict[str, Any] | None:
        """The resume request as recorded in lineage; None for plain "latest"."""
        if self.resume == "latest" and not self.weights_only:
            return None
        target: Any = self.resume
        if isinstance(target, (str, os.PathLike)) and target not in ("latest", "best"):
            target = str(Path(target).resolve())
        return {"resume": target, "weights_only": self.weights_only}

    def _request_source(self) -> tuple[Path, Any]:
        """The save_dir to load from and the selector within it."""
        r = self.resume
        if r in ("latest", "best") or isinstance(r, int):
            return self.save_dir.resolve(), r
        path = Path(r).resolve()  # type: ignore[arg-type]
        if (path / MANIFEST).is_file():
            from .commit import parse_checkpoint_name

            step = parse_checkpoint_name(path.name)
            if step is None:
                raise NoCheckpointError(f"resume={r!r}: {path} holds a manifest but is not named step_<N>")
            return path.parent, step
        if not path.is_dir():
            raise NoCheckpointError(f"resume={r!r}: {path} is neither a save_dir nor a checkpoint directory")
        return path, "latest"

    def _start_fresh(self, lineage: dict[str, Any], *, supersede: bool) -> None:
        self._say_predecessor_died(0)
        existing = [c for c in self.manager.list() if c.status == "valid"]
        if existing and supersede:
            moved = self.manager.supersede(existing)
            log.warning(
                "starting fresh (auto_resume=False or resume=None): moved %d existing checkpoint(s) to %s/superseded",
                len(moved),
                self.save_dir,
            )
        self._lineage = {**lineage, "started": time.time()}

    def _restore(self, info: CheckpointInfo, loaded: state.Loaded) -> None:
        """Puts a verified checkpoint's state into the components and the run."""
        m = info.manifest
        assert m is not None
        tree = loaded.tree
        where = f"{info.path}/{state.STATE_JSON}"
        try:
            rngs = tree["rng"]
            rng_now = rng.from_tree(rngs["now"], where)
            rng_epoch = rng.from_tree(rngs["epoch_start"], where) if rngs.get("epoch_start") else None
        except (KeyError, TypeError) as e:
            raise IncompatibleStateError(f"{where}: no RNG state ({e}); was it written by PreemptibleRun?") from None
        if not isinstance(tree.get("user", {}), dict):
            raise IncompatibleStateError(f"{where}: user: expected an object, found {type(tree['user']).__name__}")
        data = tree.get("data") or {}  # absent in checkpoints of earlier versions
        if not isinstance(data, dict):
            raise IncompatibleStateError(f"{where}: data: expected an object, found {type(data).__name__}")
        seed = data.get("seed")
        if isinstance(seed, int) and not isinstance(seed, bool):
            self._run_seed = seed & _SEED_MASK
        c = self.components
        if loaded.sharded:
            state.apply(state.Components(None, None, c.scheduler, c.scaler, c.tracked), loaded, strict=self.strict)
            if self._coord is not None and self.rank == 0:
                # loading sharded state is a collective: the other ranks must learn the checkpoint first
                self._announce(str(info.path))
            if c.model is None:
                raise IncompatibleStateError(f"{info.path}: holds a sharded model but the run has no model")
            try:
                rest = (tree.get("sharded") or {}).get("optimizer")
                sharded.load_into(info.path, state.unwrap_model(c.model), c.optimizer, rest, where)
            except (ValueError, KeyError, RuntimeError) as e:
                raise IncompatibleStateError(f"{info.path}: sharded state does not load: {e}") from e
        else:
            state.apply(c, loaded, strict=self.strict)
        self._saved_tracked = tree.get("tracked", {})
        self.user_state = dict(tree.get("user") or {})
        scale = tree.get("lr_scale", 1.0)
        self._lr_scale = float(scale) if isinstance(scale, (int, float)) and scale > 0 else 1.0
        rng.restore(rng_now)
        c = m.cursor
        self.global_step = m.step
        self.epoch = c.epoch
        self.batch = c.batch
        self.metrics = dict(m.metrics)
        self._best = m.best
        self._lineage = dict(m.lineage)
        self._resume = _Resume(info, c, rng_now, rng_epoch, m.sampler, data.get("loader"))
        self._mark_saved(info)
        self.resumed_from = info.path
        age = _log.duration(max(0.0, time.time() - m.created))
        of = f"/{c.batches_per_epoch}" if c.batches_per_epoch >= 0 else ""
        env = self.env
        job = ""
        if env.slurm_job_id:
            array = f" (array {env.slurm_array_job_id}_{env.slurm_array_task_id})" if env.slurm_array_job_id else ""
            job = f"restart {env.slurm_restart_count or 0} of job {env.slurm_job_id}{array}: "
        log.info(
            "%sresumed from %s: step %d, epoch %d, batch %d%s, saved %s ago",
            job,
            info.path,
            m.step,
            c.epoch,
            c.batch,
            of,
            age,
        )
        self._say_predecessor_died(m.step)

    def _say_predecessor_died(self, resumed_step: int) -> None:
        """After a crash (no clean stop), how far the dead process got and what is recomputed."""
        if not self._predecessor_died:
            return
        self._predecessor_died = False
        what = "without stopping (killed: SIGKILL, out of memory, or its node failed)"
        if self._died_at is None or self._died_at < resumed_step:
            log.warning("the previous process died %s; how far it got is not known", what)
            return
        lost = self._died_at - resumed_step
        log.warning(
            "the previous process died %s at step %d: the %d step(s) since step %d will be recomputed",
            what,
            self._died_at,
            lost,
            resumed_step,
        )

    # ----------------------------------------------------------------- exit

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        try:
            if exc_type is None and self._active:
                self._finish()
            elif self._active and exc is not None and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
                self._emergency(exc)
        finally:
            self._active = False
            self._flag.restore()
            if isinstance(exc, Preempted):
                event: str | None = "stop"
            elif exc_type is None:
                event = "complete"
            else:
                event = "error"
            self._stop_reports(event, **({"error": repr(exc)[:200]} if event == "error" else {}))
            try:
                if self._job is not None:
                    # The loop raised while a background write was in flight: that snapshot is a consistent
                    # state, so let it become durable (a second Ctrl-C stops the wait). Its outcome is logged;
                    # the exception that ended the loop is the one that propagates.
                    try:
                        self._collect()
                    except BaseException as e:
                        log.error("the background checkpoint write did not complete: %r", e)
                for loader, feed in list(self._feeds.items()):
                    try:
                        feed.stop_workers(loader)
                    except Exception as e:  # never mask how the run ended
                        log.warning("could not stop the DataLoader's persistent workers: %s", e)
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
        self._settle()
        needed = self._dirty or self._last_info is None
        if self._coord is not None:
            # Rank 0 decides: only it knows whether its last background write became durable.
            last = None if self.last_checkpoint is None else str(self.last_checkpoint)
            needed, last = self._coord.broadcast((needed, last))
            if not needed and self.rank != 0:
                self.last_checkpoint = None if last is None else Path(last)
                return
        if needed:
            self._save(Reason.FINAL, "epoch")
        if self.rank != 0:
            return
        assert self._last_info is not None
        self.manager.mark_complete(self._last_info)
        log.info(
            "run complete: step %d, epoch %d; final checkpoint %s", self.global_step, self.epoch, self._last_info.path
        )

    # ---------------------------------------------------------------- loop

    def epochs(self, n: int) -> Iterator[int]:
        """Yields epoch numbers from the resumed epoch up to ``n - 1``.

        Each boundary (before every epoch, and after the last) is a safe point.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"epochs: expected an integer >= 0, got {n!r}")
        self._check_active("epochs")
        self._epochs_total = n
        while True:
            r = self._resume
            if r is not None and r.cursor.point == "epoch" and r.cursor.epoch == self.epoch:
                rng.restore(r.rng_now)  # the program point where that checkpoint was taken
                self._resume = None
            if self.batch == 0 and self._batches_since_step == 0:
                if self._coord is not None:
                    self._safe_point_ranks("epoch")
                else:
                    self._safe_point("epoch")
            elif self._flag.requested and not self._dirty and self._coord is None:
                self._stop()
            if self.epoch >= n:
                return
            for s in self._samplers:
                s.set_epoch(self.epoch)
            self._recompute_due()
            self._epoch_started = self._clock()
            yield self.epoch
            self._epoch_summary()
            if self._walltime is not None and self._loader_done is not None:
                self._walltime.gap(self._clock() - self._loader_done)  # the epoch's end-of-epoch code
                self._loader_done = None
            if self._batches_since_step:
                log.debug(
                    "epoch %d ended with %d batch(es) not followed by run.step()", self.epoch, self._batches_since_step
                )
            self.epoch += 1
            self.batch = 0
            self._dirty = True

    def _epoch_summary(self) -> None:
        if self._progress is None or self.rank != 0:
            return
        peak = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        log.info(
            "%s",
            self._progress.epoch_summary(
                self.epoch, self.metrics, self._clock() - self._epoch_started, self._best, peak
            ),
        )

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Yields the loader's batches for the current epoch, from the resumed batch on.

        Call once per epoch. The cursor counts batches the loop received, not
        those the workers prefetched.
        """
        self._check_active("batches")
        if self._batches_epoch == self.epoch:
            raise PreemptError(
                f"run.batches() was already used in epoch {self.epoch}; iterate epochs with run.epochs(n)"
            )
        self._batches_epoch = self.epoch
        shield_workers(loader, self._flag.signals)
        feed = self._feed = self._feed_for(loader)
        found = find_sampler(loader)
        sampler, per_batch = found if found else (None, None)
        if sampler is not None:
            sampler.set_epoch(self.epoch)
        self._sampler = sampler
        self._samples_per_batch = per_batch * sampler.num_replicas if sampler and per_batch else None
        self._batches_per_epoch = length(loader)
        r = self._resume
        if r is not None and r.cursor.point == "step" and r.cursor.epoch == self.epoch:
            self._resume = None
            it, start = self._resume_iterator(loader, r, sampler, feed)
            if it is None:
                return
        else:
            self._epoch_rng = rng.capture()
            self._sample_offset = 0
            it, start = feed.iterate(loader, self.epoch), 0
        self.batch = start
        self._recompute_due()
        wt = self._walltime
        if wt is not None:
            # time the loader's start (worker start-up, first batch) once per epoch, outside the per-batch loop
            t0 = self._clock()
            first = next(it, _END)
            if first is _END:
                return
            wt.gap(self._clock() - t0)
            self.batch += 1
            self._batches_since_step += 1
            yield first
        for item in it:
            self.batch += 1
            self._batches_since_step += 1
            yield item
        if wt is not None:
            self._loader_done = self._clock()

    def _feed_for(self, loader: Iterable[Any]) -> LoaderFeed:
        """The loader's LoaderFeed, made at its first epoch (a list or another plain iterable gets a passing one)."""
        assert self._run_seed is not None
        try:
            feed = self._feeds.get(loader)
        except TypeError:  # not weakly referable: nothing to keep between epochs
            return LoaderFeed(loader, self._run_seed)
        if feed is None:
            feed = self._feeds[loader] = LoaderFeed(loader, self._run_seed)
        return feed

    def _resume_iterator(
        self, loader: Iterable[Any], r: _Resume, sampler: ResumableSampler | None, feed: LoaderFeed
    ) -> tuple[Iterator[Any] | None, int]:
        """Recreates the epoch's iterator as it was at the checkpoint (see the module docstring)."""
        c = r.cursor
        self._check_sampler(r, sampler)
        self._epoch_rng = r.rng_epoch_start
        total = self._batches_per_epoch
        start = c.batch
        self._sample_offset = 0
        finished = total is not None and start >= total
        if sampler is not None and self._samples_per_batch and c.sample >= 0:
            finished = c.sample >= sampler.total  # in samples: ceil(sample / new batch) can reach len(loader) early
            if c.batch and c.sample != c.batch * self._samples_per_batch:
                old = c.sample // c.batch
                start = -(-c.sample // self._samples_per_batch)
                self._sample_offset = c.sample - start * self._samples_per_batch
                log.warning(
                    "the batch size changed (%d -> %d samples per step): continuing at sample %d of the epoch,"
                    " batch %d",
                    old,
                    self._samples_per_batch,
                    c.sample,
                    start,
                )
        if finished:
            rng.restore(r.rng_now)  # the epoch was finished; nothing to iterate
            return None, start
        if r.rng_epoch_start is not None:
            rng.restore(r.rng_epoch_start)
        why_not = feed.can_seek(r.loader, self.epoch)
        if sampler is not None and self._samples_per_batch and c.sample >= 0:
            sampler.start_at(c.sample)
            it = feed.iterate(loader, self.epoch)
        elif why_not is None:
            it = feed.iterate(loader, self.epoch, r.loader)
            log.info(
                "the IterableDataset's %d worker(s) continue where each stood at batch %d (no batch replayed)",
                max(feed.num_workers, 1),
                start,
            )
        else:
            it = feed.iterate(loader, self.epoch)
            if start and feed.kind == "iterable":
                log.warning("%s: replaying %d batch(es) to reach the resume point", why_not, start)
            elif start:
                log.warning(
                    "the loader has no ResumableSampler (use run.sampler()); replaying %d batch(es) to reach the"
                    " resume point",
                    start,
                )
            for _ in range(start):
                next(it)
        rng.restore(r.rng_now)
        return it, start

    def _check_sampler(self, r: _Resume, sampler: ResumableSampler | None) -> None:
        saved = r.sampler
        if sampler is None or not saved:
            return
        now = sampler.state_dict()
        for key in ("dataset_len", "shuffle", "seed"):
            if key in saved and saved[key] != now[key]:
                raise IncompatibleStateError(
                    f"{r.info.path}/{MANIFEST}: sampler {key} was {saved[key]!r}, now {now[key]!r};"
                    " the data order cannot continue where it stopped"
                )
        if saved.get("per_sample_rng", now["per_sample_rng"]) != now["per_sample_rng"]:
            log.warning(
                "sampler per_sample_rng was %s, now %s: random draws inside the DataLoader will not replay those of"
                " the run so far",
                saved["per_sample_rng"],
                now["per_sample_rng"],
            )

    def step(self, metrics: Mapping[str, Any] | None = None) -> None:
        """Counts one optimizer step; the safe point where checkpoints happen.

        Call it as the last statement of the loop body, after ``optimizer.step()``.
        May write a checkpoint; after a stop signal, saves and raises Preempted.

        Args:
            metrics: Numbers to record at this step; the one named ``best_metric``
                decides "best" checkpoints.
        """
        self.global_step += 1
        self._step_view[0] = self.global_step
        self._batches_since_step = 0
        self._stepping = False
        self._dirty = True
        if metrics is not None:
            self._record(metrics)
        if self._coord is not None:
            if self.global_step % self.sync_every_steps == 0:
                self._safe_point_ranks("step")
            return
        if (
            self._flag.requested
            or self._best_pending
            or self.global_step >= self._due_step
            or self.batch >= self._due_batch
            or self._clock() >= self._due_time
            or (self._job is not None and not self._writer.busy)  # type: ignore[union-attr]
        ):
            self._safe_point("step")

    def report(self, metrics: Mapping[str, Any]) -> None:
        """Records metrics without counting a step (e.g. validation at the end of an epoch).

        When ``best_metric`` improves, the next safe point saves a "best" checkpoint.
        """
        self._record(metrics)

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
        s.set_epoch(self.epoch)
        self._samplers.append(s)
        return s

    def track(self, name: str, obj: state.Stateful) -> None:
        """Saves and restores ``obj`` (anything with state_dict/load_state_dict) under ``name``.

        When the run resumed, the object's saved state is loaded at once.
        """
        self._add_tracked(name, obj)
        if self._active and not state.load_tracked(name, obj, self._saved_tracked, str(self.resumed_from)):
            if self.resumed_from is not None:
                log.warning("tracked object %r has no state in %s; left as it is", name, self.resumed_from)

    def protect(self, loader: Any) -> Any:
        """Makes a DataLoader's workers ignore stop signals (done for you by run.batches)."""
        return shield_workers(loader, self._flag.signals)

    def request_stop(self) -> None:
        """Asks the run to save and stop at the next safe point, as a signal would."""
        self._flag.request(None)

    @property
    def stop_requested(self) -> bool:
        """A stop signal (or request_stop) is pending."""
        return self._flag.requested

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
        if self._job is not None:
            assert self._writer is not None
            if not self._writer.wait(timeout):
                raise TimeoutError(f"the background write of a checkpoint still runs after {timeout} s")
            self._collect()
        return self.last_checkpoint

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
        g = self.nonfinite
        if g.check(loss):
            return True
        self._batches_since_step = 0  # the batch is consumed; nothing changed since the last step boundary
        self._stepping = False
        log.warning(
            "non-finite loss (%s) at step %d: update skipped (%d in a row, %d in all)",
            g.last_value,
            self.global_step + 1,
            g.in_a_row,
            g.total,
        )
        if g.exhausted:
            self._rollback()
        return False

    def oom_guard(self) -> Any:
        """``with run.oom_guard() as s:`` around forward, backward and the optimizer step: an out-of-memory
        error inside is caught, memory is freed, and ``s.skipped`` is True (zero the gradients and skip
        ``run.step()``). ``max_oom`` in a row raise :class:`~preempt.guards.OutOfMemoryStreak` (exit code 79).
        Under torch.distributed the first one does: one rank cannot skip a step alone.
        """
        if self._coord is not None:
            self.oom.max_in_a_row = 1
        return _OomStep(self)

    def _rollback(self) -> None:
        g = self.nonfinite
        self._settle()  # a background write in flight may be the checkpoint to roll back to
        info = self._last_info
        why = None
        if info is None:
            why = "there is no checkpoint to roll back to"
        elif self._coord is not None:
            why = "rolling back is not supported under torch.distributed"
        elif self.rollbacks >= self.max_rollbacks:
            why = f"the run already rolled back {self.rollbacks} time(s) (max_rollbacks)"
        if why is not None:
            streak = guards.NonFiniteStreak(
                g.in_a_row, g.total, step=self.global_step + 1, value=g.last_value, factor=g.lr_factor
            )
            log.error("%s; %s", streak, why)
            raise streak
        assert info is not None
        loaded = self.manager.read(info)
        state.apply(self.components, loaded, strict=self.strict)
        factor = 1.0 / g.lr_factor
        lrs = []
        if self.components.optimizer is not None:
            lrs = guards.scale_lr(self.components.optimizer, self.components.scheduler, factor)
        self._lr_scale *= factor
        self.rollbacks += 1
        g.reset_streak()
        self.global_step = info.step
        self._dirty = True
        log.warning(
            "%d non-finite losses in a row: rolled back to %s (step %d), learning rates / %g, now %s; the data"
            " goes on from epoch %d batch %d (rollback %d of at most %d)",
            g.max_in_a_row,
            info.path,
            info.step,
            g.lr_factor,
            ", ".join(f"{lr:.6g}" for lr in lrs) or "-",
            self.epoch,
            self.batch,
            self.rollbacks,
            self.max_rollbacks,
        )
        if self._history is not None:
            self._history.marker("rollback", step=info.step, lr_scale=self._lr_scale)

    def _emergency(self, exc: BaseException) -> None:
        """An exception escaped the loop: saves the state when it is that of a step boundary."""
        what = f"{type(exc).__name__} escaped the training loop at step {self.global_step}"
        last = self.last_checkpoint or "(none)"
        if not self.emergency_save or self._coord is not None:
            return
        if self._stepping:
            log.error(
                "%s during an optimizer step (the state may be half-updated): no emergency checkpoint; the last one"
                " is %s",
                what,
                last,
            )
            return
        try:
            self._settle()
            if not self._dirty:
                since = f"checkpoint {last}" if self._last_info is not None else "the start"
                log.error("%s; nothing changed since %s: no emergency checkpoint", what, since)
                return
            self.batch -= self._batches_since_step  # the batch that failed is trained again by the rerun
            self._batches_since_step = 0
            self._save(Reason.EMERGENCY, "step" if self.batch else "epoch")
        except Exception as e:  # never mask the exception that ended the loop
            log.error("%s; the emergency checkpoint failed too: %r (the last one is %s)", what, e, last)
            return
        log.error("%s: emergency checkpoint %s written; a rerun continues from it", what, self.last_checkpoint)

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

    def _record(self, metrics: Mapping[str, Any]) -> None:
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics: expected a mapping of names to numbers, got {type(metrics).__name__}")
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(
                        f"metrics[{key!r}]: expected one number, got a tensor of shape {tuple(value.shape)}"
                    )
                value = value.item()
            if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"metrics[{key!r}]: expected a number, got {value!r}")
            self.metrics[key] = float(value)
            ret = self.manager.retention
            if key == ret.metric and ret.better(float(value), None if self._best is None else self._best["value"]):
                self._best = {"metric": key, "mode": ret.mode, "value": float(value), "step": self.global_step}
                self._best_pending = True

    def _facts(self) -> SaveFacts:
        return SaveFacts(
            now=self._clock(),
            step=self.global_step,
            epoch=self.epoch,
            batch=self.batch,
            batches_per_epoch=self._batches_per_epoch,
            last_save_time=self._last_save_time,
            last_save_step=self._last_save_step,
            last_save_epoch=self._last_save_epoch,
            last_save_batch=self._last_save_batch,
            stop_requested=self._flag.requested,
            best_improved=self._best_pending,
            dirty=self._dirty,
            stop_at=math.inf if self._walltime is None else self._walltime.stop_at(),
        )

    def _recompute_due(self) -> None:
        facts = self._facts()
        due = next_due(self.policy, facts)
        self._due_step, self._due_batch, self._due_time = due.step, due.batch, due.time
        if self._postponed is not None:
            # Periodic saves wait for the write in flight (step() sees it end); milestones stay due.
            m = self.policy.milestone_steps
            self._due_step = (self.global_step // m + 1) * m if m else math.inf
            self._due_batch = self._due_time = math.inf
        if self._prepare_at_step is not None and self._job is None:  # else step() sees the job end
            self._due_step = min(self._due_step, self._prepare_at_step)
        self._due_time = min(self._due_time, self._next_report)
        if self._walltime is not None:
            self._due_time = min(self._due_time, self._walltime.review_at(facts.now))

    def _tend_writer(self) -> None:
        """Takes the outcome of a finished background job; sizes the buffers for the optimizer once it has state."""
        if self._job is not None and not self._writer.busy:  # type: ignore[union-attr]
            self._collect()
        if (
            self._prepare_at_step is not None
            and self.global_step >= self._prepare_at_step
            and self._job is None
            and self._postponed is None  # the postponed save goes first; its staging sizes the buffers anyway
        ):
            self._prepare_at_step = None
            self._prepare()

    def _safe_point(self, point: str) -> None:
        self._tend_writer()
        if self._clock() >= self._next_report:
            self._report()
        if self._walltime is not None:
            self._walltime.observe(self._clock(), self.global_step)
        decision: Decision = decide(self.policy, self._facts())
        if decision.reason is Reason.WALLTIME and self._walltime is not None:
            self._walltime_margin = self._walltime.margin()  # for the log line: the save updates the estimate
        if decision.save:
            self._save(decision.reason, point)  # type: ignore[arg-type]
        elif self._postponed is not None and self._job is None and self._dirty:
            self._save(self._postponed, point)  # the write that postponed it has ended
        if decision.stop or self._flag.requested:
            self._settle()  # the save in flight first
            if self._dirty:  # the signal came during that save, or the write in flight failed
                self._save(Reason.PREEMPT, point)
            self._stop()
        self._recompute_due()

    def _safe_point_ranks(self, point: str) -> None:
        """A safe point under torch.distributed: every rank does what the ranks agree (one all-reduce)."""
        coord = self._coord
        assert coord is not None
        self._tend_writer()  # rank 0's (the others have no background writer)
        if self._clock() >= self._next_report:
            self._report()
        if self._walltime is not None:  # rank 0's only
            self._walltime.observe(self._clock(), self.global_step)
        decision: Decision = decide(self.policy, self._facts())  # rank 0's counts; the others only add a signal
        if decision.reason is Reason.WALLTIME and self._walltime is not None:
            self._walltime_margin = self._walltime.margin()
        reason = decision.reason if decision.save else None
        writing = self._job is not None and self._job.kind == "save"
        if reason in _POSTPONABLE and writing and self._stager is not None:
            self._postponed = reason  # decided here, before the ranks agree: they all skip it
            reason = None
        elif reason is None and self._postponed is not None and not writing and self._dirty:
            reason = self._postponed  # the write that postponed it has ended
        code = _REASONS.index(reason) + 1 if reason is not None else 0
        walltime = decision.stop and decision.reason is Reason.WALLTIME
        agreed = coord.agree(self._flag.requested, code, walltime_stop=walltime)
        if agreed.save:
            self._save(_REASONS[agreed.save - 1], point)
        if agreed.stop:
            self._settle()  # rank 0's write in flight first
            if coord.broadcast(self._dirty):  # rank 0's view: a signal during that save, or its write failed
                self._save(Reason.PREEMPT, point)
            self._stop(peer=agreed.signal_rank)
        self._recompute_due()

    def _stop(self, peer: int = -1) -> None:
        f = self._flag
        now = self._clock()
        if not f.requested and self._walltime is None:
            # Under torch.distributed: another rank received the signal, or rank 0's walltime keeper stopped.
            cause = slurm.Cause.SIGNAL if peer >= 0 else slurm.Cause.WALLTIME
            what = f"a stop signal received by rank {peer}" if peer >= 0 else "rank 0's walltime keeper"
        elif f.requested:
            cause = slurm.Cause.SIGNAL if f.signum is not None else slurm.Cause.REQUEST
            what = signal_name(f.signum) if f.signum is not None else "request"
            if f.received_at is not None:
                what += f" {_log.duration(now - f.received_at)} after it arrived"
        else:
            cause = slurm.Cause.WALLTIME
            wt = self._walltime
            assert wt is not None
            what = (
                f"walltime ({_log.duration(max(0.0, wt.deadline - now))} before the deadline; margin"
                f" {_log.duration(self._walltime_margin)} for steps of {_log.duration(wt.step_s)}, epoch ends of"
                f" {_log.duration(wt.gap_s)} and saves of {_log.duration(wt.save_s)})"
            )
        code, requeued = self._after_stop(cause, None if f.received_at is None else time.time() - (now - f.received_at))
        where = self.last_checkpoint or "(no checkpoint: nothing had changed)"
        log.info(
            "stopping on %s at step %d (epoch %d, batch %d); state in %s; exit code %d",
            what,
            self.global_step,
            self.epoch,
            self.batch,
            where,
            code,
        )
        checkpoint = None if self.last_checkpoint is None else str(self.last_checkpoint)
        raise Preempted(code, f.signum, checkpoint, requeued=requeued)

    def _after_stop(self, cause: slurm.Cause, signal_time: float | None) -> tuple[int, bool]:
        """Requeues the SLURM job when the stop is its time limit; returns the exit code and whether it did."""
        env = self.env
        if not env.slurm_job_id or not self.requeue or (env.rank or 0) != 0:
            return self.exit_code, False
        job = None
        if cause is slurm.Cause.SIGNAL and not self._scontrol_missing:
            try:
                job = slurm.show_job(env.slurm_job_id, timeout=5.0)
            except SlurmError as e:
                log.warning("SLURM job %s: %s", env.slurm_job_id, e)
        decision = slurm.decide_requeue(
            cause=cause,
            signal_time=signal_time,
            end_time=self._end_time,
            job=job,
            restart_count=env.slurm_restart_count or 0,
            max_restarts=self.max_restarts,
            progressed=self.global_step > self._start_step,
        )
        name = f"SLURM job {env.slurm_job_id}"
        if decision.action is slurm.Action.NONE:
            log.info("%s: not requeued: %s", name, decision.why)
            return self.exit_code, False
        if decision.action is slurm.Action.REFUSE:
            log.error(
                "%s: not requeued: %s (exit code %d); resubmit the job to continue from %s",
                name,
                decision.why,
                RESTART_LIMIT_EXIT_CODE,
                self.save_dir,
            )
            return RESTART_LIMIT_EXIT_CODE, False
        target = slurm.requeue_target(env.slurm_job_id, env.slurm_array_job_id, env.slurm_array_task_id)
        signals = self._flag.count  # SLURM's SIGTERM for the requeue may come before scontrol returns
        try:
            slurm.requeue(target)
        except SlurmError as e:
            log.error(
                "%s: %s; could not requeue it: %s. The state is saved: requeue or resubmit the job (exit code %d)",
                name,
                decision.why,
                e,
                REQUEUE_FAILED_EXIT_CODE,
            )
            return REQUEUE_FAILED_EXIT_CODE, False
        log.info(
            "%s: %s; requeued it (scontrol requeue %s): restart %d continues from step %d",
            name,
            decision.why,
            target,
            (env.slurm_restart_count or 0) + 1,
            self.global_step,
        )
        # SLURM now ends the job with SIGTERM to all its processes. Receive it here, while the handlers are
        # still in place, so that the process exits with the documented code instead of dying of it.
        until = time.monotonic() + 2.0
        while self._flag.count == signals and self._flag.installed and time.monotonic() < until:
            time.sleep(0.01)
        return self.exit_code, True

    def _run_state(self) -> dict[str, Any]:
        codec.check_json(self.user_state, "run.user_state")
        epoch_rng = self._epoch_rng
        if epoch_rng is None and self._resume is not None:
            epoch_rng = self._resume.rng_epoch_start
        r = self._resume  # not yet back at its program point: its loader position still holds
        loader = r.loader if r is not None else (self._feed.state() if self._feed is not None else None)
        return {
            "rng": {
                "now": rng.to_tree(rng.capture()),
                "epoch_start": rng.to_tree(epoch_rng) if epoch_rng is not None else None,
            },
            "data": {"seed": self._run_seed, "loader": loader},
            "user": self.user_state,
            "lr_scale": self._lr_scale,
        }

    def _save(self, reason: Reason, point: str) -> None:
        """Writes a checkpoint of the current state, in the background when ``async_save`` allows.

        A periodic save that fails for want of disk (any OSError) is logged and
        training goes on; the next one is tried when it is next due. A save that
        cannot be skipped (the stop's, the final one, a branch's) raises.
        """
        background = self._stager is not None and reason not in (
            Reason.PREEMPT,
            Reason.WALLTIME,
            Reason.FINAL,
            Reason.BRANCH,
            Reason.EMERGENCY,
        )
        if self._job is not None:
            writing = self._job.kind == "save" and self._writer.busy  # type: ignore[union-attr]
            if background and reason in _POSTPONABLE and writing:
                if self._postponed is None:
                    log.debug("a %s checkpoint is due while a write is in flight: postponed", reason.value)
                self._postponed = reason
                return
            self._settle()  # best and milestone checkpoints, and synchronous saves, wait for the write
            background = background and self._stager is not None
        self._postponed = None
        with self._flag.critical():
            t0 = self._clock()
            cursor, sampler = self._cursor()
            manifest = Manifest(
                step=self.global_step,
                cursor=dataclasses.replace(cursor, point=point),
                reason=reason.value,
                created=time.time(),
                files={},
                sampler=sampler,
                metrics=dict(self.metrics),
                best=self._best,
                # a later save at the step that set the best (the final one) holds the same weights: still the best
                is_best=self._best_pending or (self._best is not None and self._best["step"] == self.global_step),
                lineage=self._lineage,
                provenance=self._provenance,
            )
            log.debug("saving %s (%s)", self.save_dir / f"step_{self.global_step:09d}", reason.value)
            payload = self._rank_payload()
            if self._coord is not None:
                self._save_ranks(reason, payload, manifest, t0, background)
                return
            if background:
                staged = self._copy(payload)
                if staged is not None:
                    self._submit(reason, manifest, t0, lambda: self.manager.save(staged, manifest))
                    return
            try:
                info = self.manager.save(payload, manifest)
            except OSError as e:
                self._save_failed(reason, e)
                return
            self._saved(reason, info, t0)

    def _saved(self, reason: Reason, info: CheckpointInfo, t0: float) -> None:
        """A synchronous save is durable."""
        self._mark_saved(info)
        t1 = self._clock()
        self.last_save = SaveRecord(info.step, reason.value, t1 - t0, t1 - t0, info.path)
        log.info("checkpoint %s (%s) written in %s", info.path, reason.value, _log.duration(t1 - t0))
        self._saved_in(t1 - t0, t1, self.global_step)

    def _save_ranks(
        self, reason: Reason, payload: state.Payload, manifest: Manifest, t0: float, background: bool
    ) -> None:
        """A save under torch.distributed (a collective); rank 0 may write its part in the background."""
        assert self._coord is not None
        staged = self._copy(payload) if background else None
        extra = self._dcp_files if self._sharded else None
        try:
            got = distributed.save_ranked(self.manager, self._coord, payload, manifest, extra, defer=staged is not None)
        except OSError as e:
            self._save_failed(reason, e)
            return
        if isinstance(got, distributed.Deferred):
            assert staged is not None
            self._submit(reason, manifest, t0, lambda: got.finish(self.manager, staged, manifest))
        elif got is None:  # another rank's files are durable; rank 0 writes its own and commits in the background
            self.last_save = SaveRecord(manifest.step, reason.value, self._clock() - t0, background=True)
            self._mark_staged(manifest.step, manifest.cursor)
        else:
            self._saved(reason, got, t0)

    def _capture(self) -> state.Payload:
        """Everything but what DCP writes (the tensors of sharded state), as the files of a checkpoint."""
        c = self.components
        if not self._sharded:
            return state.capture(c, self._run_state())
        _, rest = sharded.split_state(state.unwrap_model(c.model), c.optimizer)  # type: ignore[arg-type]
        run_state = {**self._run_state(), "sharded": {"optimizer": rest}}
        return state.capture(state.Components(None, None, c.scheduler, c.scaler, c.tracked), run_state)

    def _dcp_files(self, directory: Path) -> list[str]:
        """This rank's pieces of the sharded model and optimizer (a collective)."""
        c = self.components
        tensors, _ = sharded.split_state(state.unwrap_model(c.model), c.optimizer)  # type: ignore[arg-type]
        return sharded.save(directory, tensors, self.rank)

    def _rank_payload(self) -> state.Payload:
        """What this process writes: everything on rank 0; under torch.distributed, only its RNG on the others."""
        if self.rank == 0:
            return self._capture()
        run_state = self._run_state()
        own = state.capture(state.Components(), {"rng": run_state["rng"], "data": run_state["data"]})
        tensors, meta = own.tensor_files[state.STATE_FILE]
        tensor_file, json_file = state.rank_files(self.rank)
        return state.Payload(
            tensor_files={tensor_file: (tensors, meta)}, json_files={json_file: own.json_files[state.STATE_JSON]}
        )

    def _copy(self, payload: state.Payload) -> state.Payload | None:
        """The state copied into the staging buffers; None: save synchronously (and from now on)."""
        assert self._stager is not None
        try:
            return self._stager.stage(payload)
        except (MemoryError, RuntimeError) as e:  # e.g. pinned memory refused
            log.warning("async_save: could not stage the state in host memory (%s); saving synchronously from now", e)
            self._stager = None
            return None

    def _submit(self, reason: Reason, manifest: Manifest, t0: float, write: Callable[[], CheckpointInfo]) -> None:
        """Hands a staged snapshot's write to the background writer."""
        writer = self._writer
        assert writer is not None
        t1 = self._clock()
        record = SaveRecord(manifest.step, reason.value, t1 - t0, background=True)
        self.last_save = record
        self._mark_staged(manifest.step, manifest.cursor)
        self._job = _Job("save", record, t0)
        writer.submit(write)
        log.debug("step %d staged in %s; writing in the background", manifest.step, _log.duration(t1 - t0))

    def _collect(self) -> None:
        """Waits for the background writer's job and takes its outcome.

        Raises:
            CheckpointWriteError: A background write failed other than with an OSError.
        """
        job, writer = self._job, self._writer
        if job is None:
            return
        assert writer is not None
        self._job = None
        if self._postponed is not None:
            self._due_step = min(self._due_step, self.global_step + 1)  # the next step takes the postponed save
        try:
            result = writer.result()
        except Exception as e:
            if job.kind == "prepare":
                log.warning("async_save: could not allocate the staging buffers (%r); saving synchronously", e)
                self._stager = None
                return
            assert job.record is not None
            self._dirty = True  # that state is not on disk: a stop or the end must save again
            self._postponed = None  # a failed periodic write is retried when the next save is due
            if isinstance(e, OSError):
                self._save_failed(Reason(job.record.reason), e, step=job.record.step)
                return
            last = self.last_checkpoint
            raise CheckpointWriteError(
                f"the background write of checkpoint step_{job.record.step:09d} in {self.save_dir} failed: {e!r};"
                f" the last good checkpoint is {last or '(none)'}",
                None if last is None else str(last),
            ) from e
        if job.kind == "prepare":
            self.staging_prepare_s = (self.staging_prepare_s or 0.0) + result
            return
        info: CheckpointInfo = result
        assert job.record is not None
        now = self._clock()
        self.last_save = dataclasses.replace(job.record, write_s=now - job.started, path=info.path)
        self._last_info = info
        self.last_checkpoint = info.path
        log.info(
            "checkpoint %s (%s) written in %s in the background; the loop waited %s",
            info.path,
            job.record.reason,
            _log.duration(now - job.started),
            _log.duration(job.record.stall_s),
        )
        self._saved_in(now - job.started, now, info.step)

    def _settle(self) -> None:
        """Lets the write in flight finish before a save that cannot be skipped; its failure is logged."""
        if self._job is None:
            return
        try:
            self._collect()
        except CheckpointWriteError as e:
            log.error("%s", e)

    def _prepare(self, payload: state.Payload | None = None) -> None:
        """Sizes the staging buffers for the state in the background (allocated and touched once)."""
        stager, writer = self._stager, self._writer
        if stager is None or writer is None or self._job is not None:
            return
        if payload is None:
            payload = state.capture(self.components, {})
        nbytes = payload_nbytes(payload)
        available = host_memory_available()
        if available is not None and nbytes - stager.nbytes > available * _ASYNC_MEMORY_SHARE:
            log.warning(
                "async_save: a copy of the state (%s) would take more than %d%% of the host memory available (%s);"
                " checkpoints are written synchronously",
                _log.size(nbytes),
                int(_ASYNC_MEMORY_SHARE * 100),
                _log.size(available),
            )
            self._stager = None
            return

        def job() -> float:
            t0 = time.perf_counter()
            stager.prepare(payload)
            return time.perf_counter() - t0

        self._job = _Job("prepare")
        writer.submit(job)

    def _saved_in(self, seconds: float, now: float, step: int) -> None:
        if self._walltime is not None:
            self._walltime.saved(seconds, now, step)
        self._check_grace(seconds)

    def _check_grace(self, seconds: float) -> None:
        """Warns once when a stop could not be saved within SLURM's KillWait."""
        if self._kill_wait is None or self._grace_warned:
            return
        step = self._walltime.step_s if self._walltime is not None else 0.0
        if seconds + step <= self._kill_wait:
            return
        self._grace_warned = True
        log.warning(
            "a checkpoint took %s (plus %s to reach the next step) but SLURM kills %s after SIGTERM (KillWait):"
            " a scancel, scontrol requeue or preemption will lose the steps since the last checkpoint. The time"
            " limit is covered by the walltime keeper; for the rest checkpoint more often or ask for a longer"
            " KillWait or GraceTime",
            _log.duration(seconds),
            _log.duration(step),
            _log.duration(self._kill_wait),
        )

    def _save_failed(self, reason: Reason, error: OSError, step: int | None = None) -> None:
        self.failed_saves += 1
        code = f" ({errno.errorcode[error.errno]})" if error.errno in errno.errorcode else ""
        step = self.global_step if step is None else step
        what = (
            f"could not write checkpoint step_{step:09d} ({reason.value}) in {self.save_dir}:"
            f" {error.strerror or error}{code}"
        )
        info = self._last_info
        if info is None or info.manifest is None:
            last, last_good = "there is no earlier checkpoint", None
        else:
            ago = _log.duration(max(0.0, time.time() - info.manifest.created))
            last, last_good = (
                f"the last good checkpoint is {info.path} (step {info.step}, saved {ago} ago)",
                str(info.path),
            )
        if reason == Reason.PREEMPT:
            lost = self.global_step - (info.step if info is not None else 0)
            log.error(
                "%s; %s; the %d step(s) since are lost; exiting with code %d", what, last, lost, SAVE_FAILED_EXIT_CODE
            )
            raise SaveFailed(SAVE_FAILED_EXIT_CODE, self._flag.signum, last_good, error) from error
        if reason in (Reason.FINAL, Reason.BRANCH):
            raise CheckpointWriteError(f"{what}; {last}", last_good) from error
        # A periodic checkpoint: its partial files are gone, older checkpoints untouched (nothing is deleted to
        # make room). Training goes on; the next try comes when the next checkpoint is due, not at every step.
        log.error("%s; %s; training goes on and tries again at the next checkpoint", what, last)
        self._best_pending = False
        self._last_save_time = self._clock()
        self._last_save_step = self.global_step
        self._last_save_epoch = self.epoch
        self._last_save_batch = self.batch

    def _cursor(self) -> tuple[Cursor, dict[str, Any] | None]:
        """Where the loop stands, and the sampler's state."""
        r = self._resume
        if r is not None and r.info.step == self.global_step and r.cursor.epoch == self.epoch:
            # Not yet back at the checkpoint's program point: its cursor still describes the loop.
            return r.cursor, r.sampler
        spb = self._samples_per_batch
        sample = -1 if spb is None else self.batch * spb + self._sample_offset
        sampler = None
        if self._sampler is not None:
            sampler = self._sampler.state_dict()
            if sample >= 0:
                sample = min(sample, self._sampler.total)
        cursor = Cursor(
            epoch=self.epoch,
            batch=self.batch,
            sample=0 if self.batch == 0 else sample,
            point="epoch",
            batches_per_epoch=-1 if self._batches_per_epoch is None else self._batches_per_epoch,
        )
        return cursor, sampler

    def _mark_saved(self, info: CheckpointInfo) -> None:
        m = info.manifest
        assert m is not None
        self._last_info = info
        self.last_checkpoint = info.path
        self._mark_staged(m.step, m.cursor)

    def _mark_staged(self, step: int, cursor: Cursor) -> None:
        """The state at ``step`` is taken: nothing to save until the loop changes it."""
        self._dirty = False
        self._best_pending = False
        self._last_save_time = self._clock()
        self._last_save_step = step
        self._last_save_epoch = cursor.epoch
        self._last_save_batch = cursor.batch


def _time_limit(value: float | str | None) -> float | None:
    if value is None:
        return None
    seconds = slurm.parse_duration(value) if isinstance(value, str) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"time_limit: expected a positive number of seconds or '[D-]HH:MM:SS', got {value!r}")
    return float(seconds)


def _check_stateful(name: str, obj: Any) -> None:
    if obj is None:
        return
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise TypeError(f"{name}: expected an object with state_dict() and load_state_dict(), got {type(obj).__name__}")


class _OomStep:
    """The context manager of ``run.oom_guard()``: the OOMGuard's step, and a skipped batch is a step boundary."""

    def __init__(self, run: PreemptibleRun) -> None:
        self.run = run
        self._step = run.oom.step()
        self.skipped = False

    def __enter__(self) -> _OomStep:
        self._step.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        suppressed = bool(self._step.__exit__(exc_type, exc, tb))
        self.skipped = self._step.skipped
        if self.skipped:
            run = self.run
            run._batches_since_step = 0
            run._stepping = False
            log.warning(
                "out of memory at step %d: batch skipped (%d in a row, %d in all)",
                run.global_step + 1,
                run.oom.in_a_row,
                run.oom.total,
            )
        return suppressed


def _gpu_memory(monitor: GPUMonitor | None) -> dict[str, Any] | None:
    """GPU memory for a history record: the monitor's NVML reading, else torch's own counters."""
    if monitor is not None:
        return {str(k): v for k, v in monitor.read_memory().items()} or None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}
    return None
