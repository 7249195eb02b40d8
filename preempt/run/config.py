"""The options of a :class:`~preempt.run.preemptible.PreemptibleRun`, each declared once, grouped by concern.

Six groups, each a frozen keyword-only dataclass whose fields carry their default and their documentation and
whose ``__post_init__`` checks them: :class:`SaveOptions` (what is saved when, and how), :class:`StartOptions`
(where a run starts), :class:`StopOptions` (stopping, walltime, SLURM's requeue), :class:`ReportOptions` (logs,
history, metric loggers), :class:`MirrorOptions` (object storage) and :class:`HealthOptions` (the guards).
:class:`RunConfig` is all six at once: ``PreemptibleRun(save_dir, keep_last=3)`` and ``RunConfig(keep_last=3)``
take the same flat keywords (read back flat too, ``config.keep_last``), and it holds each group whole, built from
them (``config.save``, ``config.start``, ``config.stop``, ``config.report``, ``config.mirroring``, ``config.health``):
each part of the run is given its own group (torchtitan's nested ``Config``). :class:`RunOptions` names the same
keywords for type checkers (``**options: Unpack[RunOptions]``); a unit test keeps it equal to the dataclasses'
fields.

A value given in a form of its own (``time_limit="01:00:00"``, ``monitor_gpu=True``, ``carry_unchanged=True``) is
kept in its normal form, and where that form is narrower than what a user may pass, a field of its own that the
user does not set holds it with its true type (``time_limit_s``, ``gpu_every_s``, ``carry``).

The retention options become one :class:`~preempt.checkpoint.retention.RetentionPolicy`, the saving ones one
:class:`~preempt.run.due.SavePolicy`. No torch, no disk.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any, TypedDict, TypeGuard

from .. import _log
from ..checkpoint.carry import CarryOptions
from ..checkpoint.retention import RetentionPolicy
from ..cluster import slurm
from ..cluster.environment import NOTICE_PLATFORMS
from ..cluster.signals import DEFAULT_SIGNALS
from ..errors import PREEMPTED_EXIT_CODE
from ..health import loggers as metric_loggers
from .due import SavePolicy

LOG_LEVELS = _log.LEVELS
_set = object.__setattr__  # a frozen dataclass's __post_init__ replaces a given value by its normal form


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """What is saved when, what is kept, and how a checkpoint is written."""

    checkpoint_interval: float | None = 300.0
    """Seconds between periodic checkpoints; None disables."""
    checkpoint_every_steps: int | None = None
    """Also save at every multiple of this global step."""
    checkpoints_per_epoch: int | None = None
    """Also save N times per epoch, evenly spaced."""
    keep_last: int | None = 2
    """Keep the newest N valid checkpoints (None keeps all)."""
    keep_best: int = 0
    """Also keep the N best by ``best_metric``."""
    keep_every_steps: int | None = None
    """Save at every multiple of this step and keep those forever."""
    best_metric: str | None = None
    """Metric name (from ``run.step(metrics=...)``/``run.report``) ranking "best"."""
    best_mode: str = "min"
    """``"min"`` or ``"max"``."""
    recycle_files: bool = True
    """Keep the files of one pruned checkpoint (hidden, as ``.recycle-*``) and write the next checkpoint over them
    in place, instead of deleting them and writing into new disk blocks, which on thin-provisioned and cloud disks
    is several times slower (``bench/README.md``). Costs the space of one checkpoint between saves, nothing more
    at the peak. Needs ``keep_last`` or ``keep_best`` to prune something. With ``async_save``, a new job's writer
    writes such a pool ahead once the state is complete (:mod:`preempt.checkpoint.recycle`)."""
    carry_unchanged: bool | CarryOptions = True
    """The model's frozen parameters that no optimizer holds go to a file of their own (``base.safetensors``), and a
    checkpoint hard-links that file from the previous checkpoint instead of writing it when its bytes are unchanged:
    fine-tuning writes what it trains, not the frozen base. "Unchanged" is proven at the step: the live tensors are
    hashed and compared with the previous copy's digest (version counters and addresses may only say "changed"), so a
    write behind autograd (``.data``, NumPy views, custom kernels) is caught at the checkpoint it would have made stale;
    such a file is written at every checkpoint from then on. Trained tensors, buffers and the optimizer's state are
    written at every checkpoint. Every checkpoint stays complete (:mod:`preempt.checkpoint.carry`). True, False (every
    file written, the model in one file), or :class:`~preempt.checkpoint.carry.CarryOptions`."""
    async_save: bool = True
    """Periodic and "best" checkpoints copy the state into host buffers (allocated once, reused) and a background
    thread writes them with the same commit protocol, so the loop waits only for the copy. At most one write is in
    flight: a periodic save that comes due meanwhile is postponed until it ends; a best or milestone save waits for
    it. A stop's save and the final one are synchronous, after the write in flight has finished. The buffers hold
    one copy of the state (pinned host memory when it lives on a GPU); when that would take more than half of the
    host's available memory the run saves synchronously and says so. Under torch.distributed rank 0 writes the
    replicated state in the background and the other ranks write their files at the step; with sharded (DCP) state
    every rank copies its pieces and the ranks' writers commit together in the background. False: every save is
    synchronous."""
    lazy_snapshot: bool = False
    """With ``async_save``, a checkpoint copies the parameters and the optimizer's state while the loop runs its
    next forward and backward, which only read them: on the CPU the writer thread makes the copies, and
    ``optimizer.step()`` (through a pre-step hook) waits for whatever is not copied yet before it changes them; on a
    GPU its copy engine makes them on a side stream and the hook orders the step after them on the GPU, not the
    host. Everything else is copied at the step. Something else that changes one of those tensors in place before
    its copy is made is seen (its version counter moved): that checkpoint is not written, the run says so and
    copies at the step from then on. Off by default: a change through ``tensor.data`` is not seen, and where a copy
    made by another thread competes with the loop for the same cores it saves little (``bench/README.md``)."""

    carry: CarryOptions = dataclasses.field(init=False, repr=False, compare=False)
    """``carry_unchanged`` as :class:`~preempt.checkpoint.carry.CarryOptions` (made from it; not an option)."""

    def __post_init__(self) -> None:
        for name in ("recycle_files", "async_save", "lazy_snapshot"):
            _set(self, name, bool(getattr(self, name)))
        _set(self, "carry", CarryOptions.of(self.carry_unchanged))
        _set(self, "carry_unchanged", self.carry)
        self.save_policy()  # their own checks, now rather than at the first save
        self.retention()

    def save_policy(self) -> SavePolicy:
        return SavePolicy(
            interval_s=self.checkpoint_interval,
            every_steps=self.checkpoint_every_steps,
            per_epoch=self.checkpoints_per_epoch,
            milestone_steps=self.keep_every_steps,
        )

    def retention(self) -> RetentionPolicy:
        return RetentionPolicy(
            keep_last=self.keep_last,
            keep_best=self.keep_best,
            keep_every_steps=self.keep_every_steps,
            metric=self.best_metric,
            mode=self.best_mode,
            recycle=self.recycle_files,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class StartOptions:
    """Where a run starts: its own newest checkpoint, another one, or nothing."""

    auto_resume: bool = True
    """Restore the newest valid checkpoint on entering. False starts fresh and moves existing checkpoints to
    ``superseded/``."""
    resume: str | int | os.PathLike[str] | None = "latest"
    """Where to start when this run's own checkpoints do not say: ``"latest"``, ``"best"``, a step number, a path
    to another save_dir or checkpoint directory, or None (start fresh). A request other than "latest" is applied
    once: the checkpoints written after it record it, and a rerun (a requeue) continues from those."""
    weights_only: bool = False
    """Load only the model's weights from that checkpoint; optimizer, scheduler, scaler and counters start fresh
    (fine-tuning)."""
    strict: bool = True
    """False loads the model tensors whose key and shape match and skips (and logs) model keys the checkpoint lacks
    and checkpoint keys the model lacks; a key of another shape is an error either way
    (:func:`preempt.checkpoint.state.load_model`). Meant for ``weights_only=True``."""
    exit_if_complete: bool = True
    """On entering a completed run, raise RunComplete (exit 0). False continues training past the completed state."""
    lock_timeout: float = 0.0
    """Seconds to wait when another process holds ``save_dir`` (:mod:`preempt.checkpoint.lock`) before failing with
    LockedError; 0 fails at once."""

    def __post_init__(self) -> None:
        for name in ("auto_resume", "weights_only", "strict", "exit_if_complete"):
            _set(self, name, bool(getattr(self, name)))
        r = self.resume
        if isinstance(r, bool) or not (r is None or r in ("latest", "best") or isinstance(r, (int, str, os.PathLike))):
            raise ValueError(f"resume: expected 'latest', 'best', a step, a path or None, got {r!r}")
        if isinstance(r, int) and r < 0:
            raise ValueError(f"resume: a step number must be >= 0, got {r}")
        t = self.lock_timeout
        if not _is_number(t) or not t >= 0:
            raise ValueError(f"lock_timeout: expected seconds >= 0, got {t!r}")

    @property
    def starts_fresh(self) -> bool:
        """Starting over is asked (auto_resume=False or resume=None), whatever the save_dir holds."""
        return not self.auto_resume or self.resume is None


@dataclasses.dataclass(frozen=True, kw_only=True)
class StopOptions:
    """What asks for a stop, how the process leaves, and what SLURM is told."""

    signals: Iterable[int] = tuple(int(s) for s in DEFAULT_SIGNALS)  # plain ints: a config parser can show them
    """The signals that ask for a stop."""
    exit_code: int = PREEMPTED_EXIT_CODE
    """The code of the SystemExit raised on a stop."""
    time_limit: float | str | None = None
    """Walltime of this process, counted from entering the run: seconds, or SLURM's ``[D-]HH:MM:SS``. The run stops
    and saves before it ends, as on a signal. Under SLURM the job's end time applies anyway (the earlier wins)."""
    requeue: bool = True
    """Under SLURM, requeue the job after the checkpoint of a stop at its time limit (:mod:`preempt.cluster.slurm`).
    False only saves and exits."""
    max_restarts: int | None = None
    """Under SLURM, refuse to start when ``SLURM_RESTART_COUNT`` exceeds this, and do not requeue once it is
    reached (exit code 77): stops a job that keeps coming back without finishing. None: no limit."""
    sync_every_steps: int = 1
    """Under torch.distributed, the ranks agree on saving and stopping at every N-th ``run.step()`` (one small
    all-reduce on a gloo group; :mod:`preempt.cluster.distributed`). Larger N costs less per step and delays a stop
    and a periodic save by up to N-1 steps."""
    notices: str | None = None
    """``"aws"``, ``"gce"`` or ``"azure"``: a thread polls that platform's metadata service for an advance notice
    (a spot interruption, a preemption, a scheduled eviction or termination) and the run stops at its next step as
    on SIGTERM (:mod:`preempt.cluster.notices`); ``"ray"``: Ray's drain of this node
    (:mod:`preempt.cluster.ray_notice`). None: ``PREEMPT_NOTICES`` if set, else ``"ray"`` in a Ray actor (a Ray
    Train worker), else nothing is probed."""
    grace: float | None = None
    """Seconds from a stop's signal to the kill (Kubernetes' ``terminationGracePeriodSeconds``, ...). The run warns
    once when its measured stop would not fit. None: ``PREEMPT_GRACE_S``, else what the run can read (torchrun's
    shutdown timeout, SLURM's KillWait: :mod:`preempt.cluster.grace`)."""

    time_limit_s: float | None = dataclasses.field(init=False, repr=False, compare=False)
    """``time_limit`` in seconds (made from it; not an option)."""

    def __post_init__(self) -> None:
        _set(self, "signals", tuple(self.signals))
        _set(self, "requeue", bool(self.requeue))
        if not _is_int(self.exit_code) or not 0 <= self.exit_code <= 255:
            raise ValueError(f"exit_code: expected an integer in [0, 255], got {self.exit_code!r}")
        _set(self, "time_limit_s", _time_limit(self.time_limit))
        _set(self, "time_limit", self.time_limit_s)
        if self.max_restarts is not None and (not _is_int(self.max_restarts) or self.max_restarts < 0):
            raise ValueError(f"max_restarts: expected an integer >= 0 or None, got {self.max_restarts!r}")
        if not _is_int(self.sync_every_steps) or self.sync_every_steps < 1:
            raise ValueError(f"sync_every_steps: expected an integer >= 1, got {self.sync_every_steps!r}")
        if self.notices is not None and self.notices not in NOTICE_PLATFORMS:
            raise ValueError(f"notices: expected one of {', '.join(NOTICE_PLATFORMS)} or None, got {self.notices!r}")
        g = self.grace
        if g is not None and (not _is_number(g) or not math.isfinite(g) or g <= 0):
            raise ValueError(f"grace: expected a number of seconds > 0 or None, got {g!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportOptions:
    """What the run tells: its log, its history, progress lines, GPU samples, metric loggers."""

    log_file: bool = True
    """Also write the run's log to ``save_dir/train.log`` (rank 0; the other ranks log only errors unless
    ``PREEMPT_LOG_ALL_RANKS=1``, then to the console and ``train.rank<r>.log``), appended across restarts with a
    marker line at each start, and keep ``save_dir/history.jsonl``: metric points (step, epoch, the metrics given to
    ``run.step``, learning rates, step time, GPU memory) and a marker at each start, resume, checkpoint, rollback
    and stop (:mod:`preempt.health.history`)."""
    progress_every_s: float | None = 60.0
    """Seconds between progress lines (step, epoch, the metrics given to ``run.step``, steps/s, ETA) in the log;
    None turns them and the metric points of ``history.jsonl`` off. The first line comes after 5 s (or this, if
    sooner) and the wait doubles up to this, so a short run shows its metrics too. An epoch summary (the epoch's
    mean of each metric) is logged at each epoch end either way."""
    log_level: str | None = None
    """The level of the ``preempt`` logger: ``"DEBUG"`` (every checkpoint, postponements, staging), ``"INFO"``
    (start, progress, epoch summaries, stops, checkpoints that are not routine background ones), ``"WARNING"``,
    ``"ERROR"``. The environment variable ``PREEMPT_LOG_LEVEL`` overrides it. None: INFO, or what your logging
    setup says."""
    monitor_gpu: bool | float | None = None
    """Sample every GPU through NVML every this many seconds (True: every 10 s) into ``save_dir/gpu_stats.jsonl``,
    summarised in ``gpu_stats.json`` at the end (:class:`~preempt.health.monitor.GPUMonitor`); None or False: off.
    Without NVML or a GPU it says so once and does nothing."""
    loggers: Iterable[Any] | None = ()
    """Where the metrics of ``run.step(metrics=...)`` and ``run.report(...)`` also go, at their step (rank 0):
    ``"tensorboard"`` (``save_dir/tensorboard``), ``"wandb"`` (a W&B run whose id is kept in
    ``save_dir/wandb.json``), or :class:`~preempt.health.loggers.TensorBoard` / :class:`~preempt.health.loggers.WandB`
    objects with options. One run across restarts (:mod:`preempt.health.loggers`). Optional extras, imported only
    when asked for."""

    gpu_every_s: float | None = dataclasses.field(init=False, repr=False, compare=False)
    """``monitor_gpu`` in seconds, or None (made from it; not an option)."""

    def __post_init__(self) -> None:
        _set(self, "log_file", bool(self.log_file))
        gpu = self.monitor_gpu
        every = 10.0 if gpu is True else None if gpu is False else gpu
        for name, value in (("progress_every_s", self.progress_every_s), ("monitor_gpu", every)):
            if value is not None and (not _is_number(value) or not value > 0):
                raise ValueError(f"{name}: expected a number of seconds > 0 or None, got {value!r}")
        _set(self, "gpu_every_s", every)
        _set(self, "monitor_gpu", every)
        level = self.log_level
        if level is not None and (not isinstance(level, str) or level.upper() not in LOG_LEVELS):
            raise ValueError(f"log_level: expected one of {', '.join(LOG_LEVELS)} or None, got {level!r}")
        _set(self, "loggers", metric_loggers.checked(self.loggers))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MirrorOptions:
    """A copy of every committed checkpoint in object storage, and the way back from it (:mod:`preempt.mirror`)."""

    mirror: str | None = None
    """A URL of object storage (``"s3://bucket/prefix"``, or any fsspec URL) that every committed checkpoint is
    copied to in the background after it is durable locally, data first and manifest last; the run's retention
    applies there too. On entering, when save_dir holds no valid checkpoint as new as the mirror's newest complete
    one (a new machine), that one is downloaded, verified and resumed from. A stop waits up to ``mirror_deadline``
    for its checkpoint's upload and says which step the mirror holds. Needs ``pip install 'preempt-torch[mirror]'``;
    credentials come from the standard AWS variables and profiles, or ``mirror_options``."""
    mirror_options: Mapping[str, Any] | None = None
    """fsspec storage options for ``mirror`` (``endpoint_url``, ``key``, ``secret``, ``config_kwargs``, ...; never
    logged), and ``create_bucket=True`` to create a missing bucket."""
    mirror_deadline: float = 60.0
    """Seconds a stop (and the end of the run) waits for its checkpoint to be in the mirror, at most half the time
    left when SLURM's end or the walltime keeper's is known."""

    def __post_init__(self) -> None:
        _check_mirror(self.mirror, self.mirror_options, self.mirror_deadline)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HealthOptions:
    """The guards: non-finite losses, out-of-memory steps, and the checkpoint of a loop that raised."""

    max_nonfinite: int = 5
    """``run.check_loss`` skips a non-finite loss; after this many in a row the run rolls back to its last
    checkpoint and divides the learning rates by ``nonfinite_lr_factor`` (data keeps moving on)."""
    nonfinite_lr_factor: float = 1.5
    """What a rollback divides the learning rates by (> 1)."""
    max_rollbacks: int = 3
    """After this many rollbacks (or with no checkpoint to roll back to) the run exits with code 78
    (:data:`~preempt.errors.NONFINITE_EXIT_CODE`)."""
    max_oom: int = 3
    """``with run.oom_guard():`` skips a batch that runs out of memory; after this many in a row the run exits with
    code 79 (:data:`~preempt.errors.OOM_EXIT_CODE`): rerun with a smaller batch."""
    emergency_save: bool = True
    """When an exception escapes the loop at a step boundary (no optimizer step begun since the last
    ``run.step()``), write a checkpoint of that state (reason ``"emergency"``) before the exception propagates. Not
    under torch.distributed."""

    def __post_init__(self) -> None:
        _set(self, "emergency_save", bool(self.emergency_save))
        for name in ("max_nonfinite", "max_rollbacks", "max_oom"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        factor = self.nonfinite_lr_factor
        if not _is_number(factor) or not factor > 1:
            raise ValueError(f"nonfinite_lr_factor: expected a number > 1, got {factor!r}")


GROUPS = (SaveOptions, StartOptions, StopOptions, ReportOptions, MirrorOptions, HealthOptions)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig(HealthOptions, MirrorOptions, ReportOptions, StopOptions, StartOptions, SaveOptions):
    """Every option of a run: the six groups' fields as flat keywords, and each group whole, built from them.

    (The bases are listed last group first: a dataclass collects its bases' fields from the end of the list, so
    ``dataclasses.fields(RunConfig)`` and the signature list them in the order of :data:`GROUPS`.)

    ``PreemptibleRun(save_dir, model=..., **options)`` builds one (or takes ``config=RunConfig(...)``); each part
    of the run is given its own group. The flat fields hold the values the groups checked, in their normal forms.
    """

    save: SaveOptions = dataclasses.field(init=False, repr=False, compare=False)
    """The save options (the scheduler's, the manager's, the start line's)."""
    start: StartOptions = dataclasses.field(init=False, repr=False, compare=False)
    """Where the run starts (the restore's)."""
    stop: StopOptions = dataclasses.field(init=False, repr=False, compare=False)
    """Stopping, walltime, SLURM (the stopper's)."""
    report: ReportOptions = dataclasses.field(init=False, repr=False, compare=False)
    """Logs, history, metric loggers (the reporter's)."""
    mirroring: MirrorOptions = dataclasses.field(init=False, repr=False, compare=False)
    """The mirror's options (named so because the flat ``mirror`` is its URL)."""
    health: HealthOptions = dataclasses.field(init=False, repr=False, compare=False)
    """The guards' options."""

    def __post_init__(self) -> None:
        for name, group in _GROUP_FIELDS.items():
            options = group(**{f.name: getattr(self, f.name) for f in dataclasses.fields(group) if f.init})  # checks
            for f in dataclasses.fields(group):
                _set(self, f.name, getattr(options, f.name))  # the normal forms, and the values made from them
            _set(self, name, options)


# RunConfig's field that holds each group whole
_GROUP_FIELDS: dict[str, type[Any]] = {
    "save": SaveOptions,
    "start": StartOptions,
    "stop": StopOptions,
    "report": ReportOptions,
    "mirroring": MirrorOptions,
    "health": HealthOptions,
}


class RunOptions(TypedDict, total=False):
    """The keywords of :class:`RunConfig`, for ``**options: Unpack[RunOptions]`` (type checkers, IDEs); the
    defaults and documentation are the dataclasses'."""

    checkpoint_interval: float | None
    checkpoint_every_steps: int | None
    checkpoints_per_epoch: int | None
    keep_last: int | None
    keep_best: int
    keep_every_steps: int | None
    best_metric: str | None
    best_mode: str
    recycle_files: bool
    carry_unchanged: bool | CarryOptions
    async_save: bool
    lazy_snapshot: bool
    auto_resume: bool
    resume: str | int | os.PathLike[str] | None
    weights_only: bool
    strict: bool
    exit_if_complete: bool
    lock_timeout: float
    signals: Iterable[int]
    exit_code: int
    time_limit: float | str | None
    requeue: bool
    max_restarts: int | None
    sync_every_steps: int
    notices: str | None
    grace: float | None
    log_file: bool
    progress_every_s: float | None
    log_level: str | None
    monitor_gpu: bool | float | None
    loggers: Iterable[Any] | None
    mirror: str | None
    mirror_options: Mapping[str, Any] | None
    mirror_deadline: float
    max_nonfinite: int
    nonfinite_lr_factor: float
    max_rollbacks: int
    max_oom: int
    emergency_save: bool


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_mirror(url: object, options: object, deadline: object) -> None:
    """The mirror's options: a URL with a scheme, a mapping of named options (their values never shown), seconds."""
    if url is not None and (not isinstance(url, str) or "://" not in url or url.split("://", 1)[0] == ""):
        shown = url.split("@")[-1] if isinstance(url, str) else type(url).__name__  # no userinfo in the message
        raise ValueError(f"mirror: expected a URL such as 's3://bucket/prefix' or None, got {shown!r}")
    if options is not None:
        if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
            raise ValueError(f"mirror_options: expected a mapping of option names to values, got {type(options)}")
        if url is None:
            raise ValueError("mirror_options: given without mirror=; expected a mirror URL too")
    if not _is_number(deadline) or not math.isfinite(deadline) or deadline < 0:
        raise ValueError(f"mirror_deadline: expected a number of seconds >= 0, got {deadline!r}")


def _time_limit(value: float | str | None) -> float | None:
    if value is None:
        return None
    seconds = slurm.parse_duration(value) if isinstance(value, str) else value
    if not _is_number(seconds) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"time_limit: expected a positive number of seconds or '[D-]HH:MM:SS', got {value!r}")
    return float(seconds)


def checked_config(config: RunConfig) -> RunConfig:
    """``config`` inside ``preempt check`` (:class:`~preempt.cluster.environment.CheckSpec`): the check decides when
    checkpoints are written (none on a clock, which would differ between runs), keeps every one of them for the
    comparison, writes them synchronously (each durable when ``run.step()`` returns), always resumes from its own,
    and touches nothing outside its scratch save_dir: no mirror, metric loggers, GPU samples, walltime or requeue."""
    return dataclasses.replace(
        config,
        checkpoint_interval=None,
        checkpoint_every_steps=None,
        checkpoints_per_epoch=None,
        keep_last=None,
        keep_best=0,
        keep_every_steps=None,
        recycle_files=False,
        async_save=False,
        lazy_snapshot=False,
        auto_resume=True,
        time_limit=None,
        requeue=False,
        max_restarts=None,
        monitor_gpu=None,
        loggers=(),
        mirror=None,
        mirror_options=None,
    )


# What a framework integration sets itself (from the framework's objects), never its user.
INTEGRATION_OWN = ("model", "optimizer", "scheduler", "scaler", "clock")


def integration_config(who: str, **options: Any) -> RunConfig:
    """The :class:`RunConfig` of a framework integration's ``**options``, each checked now, named in the errors.

    Raises:
        TypeError: An option that PreemptibleRun does not take, or one the integration sets itself.
        ValueError: An option's value out of its range.
    """
    own = sorted(set(options) & set(INTEGRATION_OWN))
    if own:
        raise TypeError(f"{who}: {', '.join(own)}: set from the framework's objects, not an option")
    names = {f.name for f in dataclasses.fields(RunConfig) if f.init}  # the options, not the values made of them
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(
            f"{who}: unknown option(s) {', '.join(unknown)}; PreemptibleRun's options are {', '.join(sorted(names))}"
        )
    return RunConfig(**options)
