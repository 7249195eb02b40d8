"""The options of a :class:`~preempt.run.PreemptibleRun`, grouped and validated in one place.

Every keyword argument of the run (but the objects it saves and the clock)
lands here, is checked once, and is read by the part of the run it concerns.
The retention options become one :class:`~preempt.policy.RetentionPolicy`,
which the run's :class:`~preempt.checkpoint.CheckpointManager` is given as it
is. No torch, no disk.
"""

from __future__ import annotations

import dataclasses
import math
import os

from . import slurm
from .errors import PREEMPTED_EXIT_CODE
from .policy import RetentionPolicy, SavePolicy
from .signals import DEFAULT_SIGNALS


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The run's options (see :class:`~preempt.run.PreemptibleRun` for each)."""

    # what is saved when
    checkpoint_interval: float | None = 300.0
    checkpoint_every_steps: int | None = None
    checkpoints_per_epoch: int | None = None
    keep_last: int | None = 2
    keep_best: int = 0
    keep_every_steps: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"
    async_save: bool = True
    # where a run starts
    auto_resume: bool = True
    resume: str | int | os.PathLike[str] | None = "latest"
    weights_only: bool = False
    strict: bool = True
    exit_if_complete: bool = True
    lock_timeout: float = 0.0
    # stopping
    signals: tuple[int, ...] = tuple(DEFAULT_SIGNALS)
    exit_code: int = PREEMPTED_EXIT_CODE
    time_limit: float | str | None = None
    requeue: bool = True
    max_restarts: int | None = None
    sync_every_steps: int = 1
    # reporting
    log_file: bool = True
    progress_every_s: float | None = 60.0
    monitor_gpu: bool | float | None = None
    # health
    max_nonfinite: int = 5
    nonfinite_lr_factor: float = 1.5
    max_rollbacks: int = 3
    max_oom: int = 3
    emergency_save: bool = True

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # normalised values replace the given ones
        set_(self, "signals", tuple(self.signals))
        flags = ("async_save", "auto_resume", "weights_only", "strict", "exit_if_complete", "requeue", "log_file")
        for name in (*flags, "emergency_save"):
            set_(self, name, bool(getattr(self, name)))
        if not _is_int(self.exit_code) or not 0 <= self.exit_code <= 255:
            raise ValueError(f"exit_code: expected an integer in [0, 255], got {self.exit_code!r}")
        r = self.resume
        if isinstance(r, bool) or not (r is None or r in ("latest", "best") or isinstance(r, (int, str, os.PathLike))):
            raise ValueError(f"resume: expected 'latest', 'best', a step, a path or None, got {r!r}")
        if isinstance(r, int) and r < 0:
            raise ValueError(f"resume: a step number must be >= 0, got {r}")
        set_(self, "time_limit", _time_limit(self.time_limit))
        if self.max_restarts is not None and (not _is_int(self.max_restarts) or self.max_restarts < 0):
            raise ValueError(f"max_restarts: expected an integer >= 0 or None, got {self.max_restarts!r}")
        if not _is_int(self.sync_every_steps) or self.sync_every_steps < 1:
            raise ValueError(f"sync_every_steps: expected an integer >= 1, got {self.sync_every_steps!r}")
        for name in ("max_nonfinite", "max_rollbacks", "max_oom"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        factor = self.nonfinite_lr_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
            raise ValueError(f"nonfinite_lr_factor: expected a number > 1, got {factor!r}")
        set_(self, "monitor_gpu", {True: 10.0, False: None}.get(self.monitor_gpu, self.monitor_gpu))  # type: ignore
        for name in ("progress_every_s", "monitor_gpu"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"{name}: expected a number of seconds > 0 or None, got {value!r}")
        self.save_policy()  # its own checks, now rather than at the first save
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
        )

    @property
    def starts_fresh(self) -> bool:
        """Starting over is asked (auto_resume=False or resume=None), whatever the save_dir holds."""
        return not self.auto_resume or self.resume is None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _time_limit(value: float | str | None) -> float | None:
    if value is None:
        return None
    seconds = slurm.parse_duration(value) if isinstance(value, str) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"time_limit: expected a positive number of seconds or '[D-]HH:MM:SS', got {value!r}")
    return float(seconds)
