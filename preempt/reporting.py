"""What the run tells: ``train.log``, ``history.jsonl``, progress lines, epoch summaries, the GPU monitor.

:class:`Reporter` starts and stops the run's log file and history
(:mod:`preempt.history`) and the GPU monitor (:mod:`preempt.monitor`), writes
a progress record every ``progress_every_s`` and a summary at each epoch end.
It reads the loop's counters and changes none.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import _log
from .errors import Preempted
from .history import History, Progress, RunLog
from .loop_state import LoopState
from .monitor import GPUMonitor
from .run_config import RunConfig

log = _log.log


class Reporter:
    """The run's log, history and monitor (see the module docstring)."""

    def __init__(
        self, config: RunConfig, save_dir: Path, loop: LoopState, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.save_dir = save_dir
        self.loop = loop
        self.clock = clock
        self.rank, self.world_size = 0, 1
        self.next_at = float("inf")  # when the next progress record is due
        self.epochs_total: int | None = None
        self._runlog: RunLog | None = None
        self._history: History | None = None
        self._progress: Progress | None = None
        self._monitor: GPUMonitor | None = None
        self._epoch_started = 0.0
        self._from = (0.0, 0)  # (clock, step) of the previous record

    def start(self, resumed_from: Path | None) -> None:
        """train.log, history.jsonl, the progress line and the GPU monitor, as configured."""
        cfg, step = self.config, self.loop.global_step
        if cfg.log_file:
            every_rank = os.environ.get("PREEMPT_LOG_ALL_RANKS", "") not in ("", "0")
            self._runlog = RunLog(self.save_dir, rank=self.rank, world_size=self.world_size, log_all_ranks=every_rank)
            self._runlog.start(resumed_from, step)
            self._history = History(self.save_dir, rank=self.rank)
            if resumed_from is None:
                self._history.marker("start", step=step, pid=os.getpid())
            else:
                self._history.marker("resume", step=step, from_=str(resumed_from), pid=os.getpid())
        self._progress = Progress(None, every_s=cfg.progress_every_s or 60.0, clock=self.clock)
        if cfg.progress_every_s is not None:
            self.next_at = self.clock() + cfg.progress_every_s
            self._from = (self.clock(), step)
        if cfg.monitor_gpu is not None and self.rank == 0:
            monitor = GPUMonitor(self.save_dir, cfg.monitor_gpu)
            if monitor.available:
                self._monitor = monitor.start()

    def report(self, batches_per_epoch: int | None, optimizer: torch.optim.Optimizer | None) -> None:
        """A progress line in the log and a record in history.jsonl (every ``progress_every_s``)."""
        now, loop, every = self.clock(), self.loop, self.config.progress_every_s
        assert every is not None and self._progress is not None
        self.next_at = now + every
        t0, step0 = self._from
        self._from = (now, loop.global_step)
        bpe, n = batches_per_epoch, self.epochs_total
        if bpe and n is not None and self._progress.total_steps is None:
            # one optimizer step per batch from here on (an estimate under gradient accumulation)
            self._progress.total_steps = loop.global_step + (n - loop.epoch) * bpe - loop.batch
        line = self._progress.update(loop.global_step, loop.epoch, loop.batch, bpe, loop.metrics)
        if line and self.rank == 0:
            log.info("%s", line)
        if self._history is not None:
            steps = loop.global_step - step0
            self._history.record(
                loop.global_step,
                loop.epoch,
                loop.metrics,
                lr=[float(g["lr"]) for g in optimizer.param_groups] if optimizer is not None else None,
                step_time_s=(now - t0) / steps if steps > 0 else None,
                gpu_mem=self._gpu_memory(),
            )

    def epoch_started(self) -> None:
        self._epoch_started = self.clock()

    def epoch_summary(self) -> None:
        if self._progress is None or self.rank != 0:
            return
        peak = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        loop = self.loop
        took = self.clock() - self._epoch_started
        log.info("%s", self._progress.epoch_summary(loop.epoch, loop.metrics, took, loop.best, peak))

    def marker(self, event: str, **fields: Any) -> None:
        """A marker record in history.jsonl (rollback, ...)."""
        if self._history is not None:
            self._history.marker(event, **fields)

    def ended(self, completed: bool, exc: BaseException | None) -> None:
        """The run's end: a marker (``complete``, ``stop`` or ``error``) and the files closed."""
        if isinstance(exc, Preempted):
            self.stop("stop")
        elif completed:
            self.stop("complete")
        else:
            self.stop("error", error=repr(exc)[:200])

    def stop(self, event: str | None = None, **fields: Any) -> None:
        if self._monitor is not None:
            self._monitor.stop()
            self._monitor = None
        if self._history is not None:
            if event is not None:
                self._history.marker(event, step=self.loop.global_step, **fields)
            self._history.close()
            self._history = None
        if self._runlog is not None:
            self._runlog.close()
            self._runlog = None

    def _gpu_memory(self) -> dict[str, Any] | None:
        """GPU memory for a history record: the monitor's NVML reading, else torch's own counters."""
        if self._monitor is not None:
            return {str(k): v for k, v in self._monitor.read_memory().items()} or None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}
        return None
