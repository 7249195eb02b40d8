"""What the run tells: ``train.log``, ``history.jsonl``, progress lines, epoch summaries, the GPU monitor, loggers.

:class:`Reporter` starts and stops the run's log file and history
(:mod:`preempt.health.history`), the GPU monitor (:mod:`preempt.health.monitor`) and the metric loggers
(TensorBoard, W&B: :mod:`preempt.health.loggers`, fed by :meth:`Reporter.log_metrics`), writes
progress lines (5 s, 10 s, 20 s, ... then every ``progress_every_s``), metric
points into history.jsonl (:func:`point_interval`) and a summary at each epoch
end.
It reads the loop's counters and changes none.

A history point holds only the metrics measured at its step
(:func:`point_metrics`): those of ``run.step(metrics)`` sampled at the point's
step (and, written before it at their own steps, the latest given since the
previous point), and each ``run.report()`` as a point of its own, written at
once (:meth:`Reporter.measured`). A metric reported every 25 steps is then 1
point per evaluation, not a staircase of its last value at every point.

The epoch summary covers the whole epoch: its sums and seconds come back with
the checkpoint a process resumed from (:class:`~preempt.run.loop_state.EpochSoFar`),
and the part this process ran is shown as such (:func:`epoch_line`).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from .. import _log
from ..errors import Preempted
from ..health.history import EarlyRecords, History, RunLog
from ..health.loggers import Loggers
from ..health.monitor import GPUMonitor
from ..health.progress import Progress, planned_total
from .config import ReportOptions, SaveOptions
from .loop_state import LoopState, Measured
from .write_decisions import SaveRecord

log = _log.log
MAX_MESSAGE = 2000  # characters of a warning kept in history.jsonl
FIRST_PROGRESS_S = 5.0  # the first progress line comes this soon (or at progress_every_s if sooner), then doubles


def point_interval(age_s: float, every_s: float) -> float:
    """The wait before the next metric point in history.jsonl, ``age_s`` seconds into the process.

    Every second for the first 100 s, then a hundredth of the age (about 230 points per tenfold of it), never
    sparser than the progress lines: a short run still draws a curve in ``preempt report --plot``, and a process
    of a day writes about 500 points more than its progress lines alone.
    """
    return min(every_s, max(1.0, age_s / 100.0))


def point_metrics(sampled: Mapping[str, tuple[int, int, float]], after: int, step: int) -> dict[int, Any]:
    """The metrics of a history point at ``step``, and of those written before it: ``{step: (epoch, {name:
    value})}`` in step order, from ``run.step()``'s latest value of each metric (``sampled``: name -> (step,
    epoch, value)) measured after the previous point's step ``after`` and not after ``step``. Each value goes
    under the step it was measured at: a loss given every 10th step is not repeated at the steps between."""
    out: dict[int, Any] = {}
    for name, (at, epoch, value) in sampled.items():
        if after < at <= step:
            out.setdefault(at, (epoch, {}))[1][name] = value
    return dict(sorted(out.items()))


def epoch_line(
    progress: Progress, loop: LoopState, now: float, best: Mapping[str, Any] | None, peak: int | None
) -> str:
    """The summary of the epoch ending ``now``: the means over every process's part (training metrics, then those
    of run.report()), its seconds in all and, when other processes ran part of it, this process's part."""
    means = loop.epoch_means()
    trained = {k: v for k, v in means.items() if k not in loop.evaluated}
    evaluated = {k: v for k, v in means.items() if k in loop.evaluated}
    mine = 0.0 if loop.epoch_since is None else max(0.0, now - loop.epoch_since)
    return progress.epoch_summary(
        loop.epoch,
        trained,
        mine,
        best,
        peak,
        evaluated=evaluated,
        processes=loop.epoch_processes_before + 1,
        seconds=loop.epoch_seconds_before + mine,
        known=loop.epoch_known,
    )


class Reporter:
    """The run's log, history and monitor (see the module docstring)."""

    def __init__(
        self,
        config: ReportOptions,
        saving: SaveOptions,
        save_dir: Path,
        loop: LoopState,
        clock: Callable[[], float] = time.monotonic,
        *,
        rank: int = 0,
        world_size: int = 1,
        log_all_ranks: bool = False,
    ) -> None:
        self.config = config
        self.saving = saving  # what the start line says of the saves
        self.save_dir = save_dir
        self.loop = loop
        self.clock = clock
        self.rank, self.world_size = rank, world_size
        self.log_all_ranks = log_all_ranks  # PREEMPT_LOG_ALL_RANKS (preempt.cluster.environment): ranks > 0 log too
        self.next_at = float("inf")  # when report() has something to do: a progress line or a metric point
        self._first_step = False  # the first safe point after the start is still to be marked
        self.epochs_total: int | None = None  # run.epochs(n)
        self.steps_per_epoch: int | None = None  # run.epochs(n, steps_per_epoch=...): the total of an unsized loader
        self.max_steps: int | None = None  # run.epochs(n, max_steps=...): the loop ends at that step if not before
        self._runlog: RunLog | None = None
        self._held: EarlyRecords | None = None  # what the logger says from the run's entry to start()
        self._history: History | None = None
        self._progress: Progress | None = None
        self._monitor: GPUMonitor | None = None
        self._loggers: Loggers | None = None  # TensorBoard, W&B (rank 0, when asked for)
        self._from = (0.0, 0)  # (clock, step) of the previous record
        self._point_step = 0  # the step of the previous metric point: run.step()'s metrics after it are new
        self._said_inside = False  # the warning about run.report() inside a step, once
        self.crash: dict[str, Any] | None = None  # the previous process died holding the lock: how far it got
        self._base = (0, 0, 0)  # (step, epoch, batch) at the start of this process: the optimizer steps per batch
        self._interval = 0.0  # the wait before the next progress line: short at first, up to progress_every_s
        self._started = 0.0  # clock at start()
        self._line_at = float("inf")  # when the next progress line is due
        self._point_at = float("inf")  # when the next metric point of history.jsonl is due

    def planned(self, epochs: int, steps_per_epoch: int | None, max_steps: int | None) -> None:
        """``run.epochs(n, steps_per_epoch, max_steps=...)``: what the progress line's total and ETA are made of."""
        self.epochs_total, self.steps_per_epoch, self.max_steps = epochs, steps_per_epoch, max_steps

    def hold(self, problems: Iterable[str] = ()) -> None:
        """Keeps the logger's records from now until :meth:`start` opens train.log: the choice of the checkpoint
        to resume from (its quarantines and fallbacks) comes before the file can be opened. ``problems``: what the
        run found wrong in its environment (variables it ignores), said first."""
        self._held = EarlyRecords().hold()
        for problem in problems:
            log.warning("%s", problem)

    def restoring(self, made_at: float | None) -> None:
        """The leader holds the lock and is about to read a checkpoint: history.jsonl gets a ``restoring`` line now,
        so that a process killed in its restore is still one of the run's processes (``preempt report``)."""
        if not self.config.log_file or self.rank != 0:
            return
        self._history = History(self.save_dir, rank=self.rank)
        if self._history.active:
            facts = {"pid": os.getpid(), "proc_start": process_start()}
            self._history.marker("restoring", **facts, **({} if made_at is None else {"made_at": round(made_at, 3)}))

    def start(self, resumed_from: Path | None, resumed_how: str | None = None, *, made_at: float | None = None) -> None:
        """train.log, history.jsonl, the progress line and the GPU monitor, as configured; the start line first
        (``resumed_how``: what the restore loaded, in words, said in it: one line per start). ``made_at``: when the
        run was made (wall clock): before it the process started up, after it the run restored; the first step done
        after it is marked too (``first_step``), for ``preempt report``'s split of a restart."""
        cfg, step = self.config, self.loop.global_step
        self._base = (step, self.loop.epoch, self.loop.batch)
        self._point_step = step
        if self.rank == 0:
            log.info("%s", start_line(self.saving, self.save_dir, resumed_from, step, resumed_how))
        elif resumed_how is not None:  # another rank says only what it loaded (heard with log_all_ranks)
            log.info("%s", resumed_how)
        held, self._held = (self._held or EarlyRecords()).done(), None
        if cfg.log_file:
            self._runlog = RunLog(
                self.save_dir, rank=self.rank, world_size=self.world_size, log_all_ranks=self.log_all_ranks
            )
            self._runlog.start(resumed_from, step)
            self._runlog.replay(held)
            self._history = self._history or History(self.save_dir, rank=self.rank)
            if self._history.active:
                exit_line_at_exit(self.save_dir)
            facts: dict[str, Any] = {
                "epoch": self.loop.epoch,
                "batch": self.loop.batch,
                "pid": os.getpid(),
                "proc_start": process_start(),
            }
            if made_at is not None:
                facts["made_at"] = round(made_at, 3)
            if self.crash is not None:
                facts["crashed"] = self.crash
            if resumed_from is None:
                self._history.marker("start", step=step, **facts)
            else:
                self._history.marker("resume", step=step, from_=str(resumed_from), **facts)
            for record in held.records:  # this process's start said them: after its start marker
                if record.levelno >= logging.WARNING:
                    text = record.getMessage()
                    text = text if len(text) <= MAX_MESSAGE else f"{text[: MAX_MESSAGE - 3]}..."
                    self._history.marker("warning", level=record.levelname, message=text)
        self._progress = Progress(None, every_s=cfg.progress_every_s or 60.0, clock=self.clock)
        if cfg.progress_every_s is not None:
            now = self.clock()
            self._interval = min(cfg.progress_every_s, FIRST_PROGRESS_S)
            self._progress.every_s = self._interval
            self._started, self._from = now, (now, step)
            self._line_at = now + self._interval
            if self._history is not None and self._history.active:
                self._point_at = now + point_interval(0.0, cfg.progress_every_s)
            self.next_at = min(self._line_at, self._point_at)
        if self._history is not None and self._history.active:
            self._first_step = True
            self.next_at = -math.inf  # the first safe point marks the first step(s) done (report)
        if cfg.loggers and self.rank == 0:
            self._loggers = Loggers(cfg.loggers)
            self._loggers.open(self.save_dir, step, resumed=resumed_from is not None)
        if cfg.gpu_every_s is not None and self.rank == 0:
            monitor = GPUMonitor(self.save_dir, cfg.gpu_every_s)
            if monitor.available:
                self._monitor = monitor.start()

    def report(self, batches_per_epoch: int | None, optimizer: torch.optim.Optimizer | None) -> None:
        """A progress line in the log and a metric point in history.jsonl, each when it is due (see ``next_at``); at
        the first safe point after the start, the ``first_step`` marker."""
        if self._first_step and self.loop.global_step > self._base[0]:  # a step done since the start
            self._first_step = False
            if self._history is not None:
                self._history.marker("first_step", step=self.loop.global_step)
        if self.config.progress_every_s is None:
            self.next_at = -math.inf if self._first_step else math.inf
            return
        now, loop, every = self.clock(), self.loop, self.config.progress_every_s
        assert every is not None and self._progress is not None
        if now >= self._line_at:
            self._interval = min(every, self._interval * 2)  # 5 s, 10 s, 20 s, ... up to progress_every_s
            self._line_at = now + self._interval
            bpe, n = batches_per_epoch, self.epochs_total
            measured = total_steps(self._base, loop, bpe, n) if bpe and n is not None else None
            self._progress.total_steps = planned_total(n, self.steps_per_epoch, measured, self.max_steps)
            line = self._progress.update(loop.global_step, loop.epoch, loop.batch, bpe, loop.metrics)
            self._progress.every_s = self._interval
            if line and self.rank == 0:
                log.info("%s", line)
        if now >= self._point_at and self._history is not None:
            self._point_at = now + point_interval(now - self._started, every)
            t0, step0 = self._from
            step = loop.global_step
            self._from = (now, step)
            steps = step - step0
            after = self._point_step if self._point_step <= step else -1  # -1: a rollback took the steps back
            earlier = point_metrics(loop.sampled, after, step)
            _, here = earlier.pop(step, (loop.epoch, {}))
            for at, (epoch, values) in earlier.items():  # measured since the previous point, at their own steps
                self._history.record(at, epoch, values)
            self._point_step = step
            self._history.record(
                step,
                loop.epoch,
                here,
                lr=[float(g["lr"]) for g in optimizer.param_groups] if optimizer is not None else None,
                step_time_s=(now - t0) / steps if steps > 0 else None,
                gpu_mem=self._gpu_memory(),
            )
        self.next_at = -math.inf if self._first_step else min(self._line_at, self._point_at)

    def measured(self, m: Measured) -> None:
        """A ``run.report()``: its own history point, at the step the metrics belong to."""
        if self._history is not None:
            self._history.record(m.step, self.loop.epoch, m.values)
        if m.inside_step and not self._said_inside and self.rank == 0:
            self._said_inside = True
            log.warning(
                "run.report() was called inside step %d (after a batch, before its run.step()): its metrics are"
                " recorded at step %d, the last step counted, though the model may be part way into the next, and"
                " a best checkpoint can only be the first one after them; call run.report() after run.step()"
                ' (README_PREEMPTION.md, "Evaluation in the loop")',
                self.loop.global_step + 1,
                m.step,
            )

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Hands the metrics just recorded (their values as the loop keeps them) to the loggers, at ``step``
        (default: the current step)."""
        if self._loggers is not None:
            kept = self.loop.metrics
            self._loggers.log(self.loop.global_step if step is None else step, {k: kept[k] for k in metrics})

    def epoch_summary(self) -> None:
        """The summary line at an epoch's end: the whole epoch's means and seconds (:func:`epoch_line`)."""
        loop = self.loop
        if loop.batches_since_step:
            log.debug(
                "epoch %d ended with %d batch(es) not followed by run.step()", loop.epoch, loop.batches_since_step
            )
        if self._progress is None or self.rank != 0:
            return
        peak = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        best = loop.best
        shown = None if best is None else {best["metric"]: best["value"], "step": best["step"]}
        log.info("%s", epoch_line(self._progress, loop, self.clock(), shown, peak))

    def predecessor_died(self, step: int | None, pid: Any, during_stop: bool = False) -> None:
        """The previous process died holding the lock, at ``step`` (its beacon): said in the resume marker;
        ``during_stop``: the kill came during its stop, before the stop's checkpoint was durable."""
        self.crash = {"died_at": step, "pid": pid if isinstance(pid, int) and not isinstance(pid, bool) else None}
        if during_stop:
            self.crash["during_stop"] = True

    def checkpoint(self, record: SaveRecord, nbytes: int) -> None:
        """A ``checkpoint`` marker: its step, why, what it cost the loop, and ``at``, when its state was taken."""
        if self._history is None or record.write_s is None:
            return
        at = time.time() - record.write_s - (record.stall_s if record.background else 0.0)
        self._history.marker(
            "checkpoint",
            step=record.step,
            reason=record.reason,
            stall_s=round(record.stall_s, 4),
            write_s=round(record.write_s, 4),
            background=record.background,
            bytes=nbytes,
            at=round(at, 3),
        )

    def marker(self, event: str, **fields: Any) -> None:
        """A marker record in history.jsonl (rollback, ...)."""
        if self._history is not None:
            self._history.marker(event, **fields)

    def ended(self, completed: bool, exc: BaseException | None) -> None:
        """The run's end: a marker (``complete``, ``stop`` or ``error``) and the files closed."""
        if self._loggers is not None:
            code = 0 if completed else exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
            self._loggers.close(code, preempted=isinstance(exc, Preempted))
            self._loggers = None
        if isinstance(exc, Preempted):
            self.stop(
                "stop",
                cause=exc.cause or None,
                code=exc.code,
                requeued=exc.requeued,
                checkpoint=exc.checkpoint,
                **exc.timing,
            )
        elif completed:
            self.stop("complete")
        else:
            # The exits with a code of their own (a lost peer, a NaN or OOM streak) carry their message.
            message = getattr(exc, "message", None)
            self.stop("error", error=(message if isinstance(message, str) else repr(exc))[:200])

    def stop(self, event: str | None = None, **fields: Any) -> None:
        if self._loggers is not None:
            self._loggers.close()
            self._loggers = None
        if self._held is not None:  # a start that failed
            self._held.done()
            self._held = None
        if self._monitor is not None:
            self._monitor.stop()
            self._monitor = None
        if self._history is not None:
            if event is not None:
                loop = self.loop
                self._history.marker(event, step=loop.global_step, epoch=loop.epoch, batch=loop.batch, **fields)
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


def process_start() -> float | None:
    """When this process started (unix seconds, to the clock's tick); None where the system does not say.

    ``preempt report`` counts the time before the run was entered (imports,
    building the model, restoring) as start-up.
    """
    import psutil  # here: only the start and resume markers ask

    try:
        # psutil's create_time is the boot time (whole seconds) plus the start after boot (ticks): less the boot
        # time, the start after boot, placed on the wall clock by the time since boot now (CLOCK_BOOTTIME)
        boot = psutil.boot_time()
        after_boot = psutil.Process().create_time() - boot
        return round(time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - after_boot), 3)
    except (psutil.Error, OSError, AttributeError):  # AttributeError: no CLOCK_BOOTTIME (not Linux)
        return None


def total_steps(base: tuple[int, int, int], loop: LoopState, batches_per_epoch: int, epochs: int) -> int | None:
    """The run's last global step, from the optimizer steps per batch measured since ``base`` (step, epoch, batch).

    Under gradient accumulation a step takes several batches: counting one
    step per batch would put the end, and the ETA, several times too far.
    None until a batch was seen.
    """
    step0, epoch0, batch0 = base
    batches = (loop.epoch - epoch0) * batches_per_epoch + loop.batch - batch0
    if batches <= 0:
        return None
    per_batch = (loop.global_step - step0) / batches
    left = (epochs - loop.epoch) * batches_per_epoch - loop.batch
    return loop.global_step + max(0, round(per_batch * left))


def start_line(cfg: SaveOptions, save_dir: Path, resumed_from: Path | None, step: int, how: str | None = None) -> str:
    """What a user wants to see first: fresh or resumed (``how``: what was loaded, in words), where, what is saved
    when, and what is kept."""
    # A checkpoint of this save_dir, named in ``how``, names it; one of another (a resume request) does not.
    own = how is not None and resumed_from is not None and resumed_from.parent.resolve() == save_dir.resolve()
    where = "" if own else f"{save_dir}: "
    how = how or ("fresh start" if resumed_from is None else f"resumed at step {step}")
    saves = []
    if cfg.checkpoint_interval is not None:
        saves.append(f"every {_log.duration(cfg.checkpoint_interval)}")
    if cfg.checkpoint_every_steps is not None:
        saves.append(f"every {cfg.checkpoint_every_steps} steps")
    if cfg.checkpoints_per_epoch is not None:
        saves.append(f"{cfg.checkpoints_per_epoch} per epoch")
    if cfg.keep_every_steps is not None:
        saves.append(f"at multiples of step {cfg.keep_every_steps}")
    if cfg.best_metric is not None:
        saves.append(f"when {cfg.best_metric} improves")
    saves.append("at a stop and at the end")
    keeps = [f"the last {cfg.keep_last}" if cfg.keep_last is not None else "all"]
    if cfg.keep_best:
        keeps.append(f"the best {cfg.keep_best} by {cfg.best_metric} ({cfg.best_mode})")
    mode = "in the background" if cfg.async_save else "synchronously"
    return f"{where}{how}; checkpoints {', '.join(saves)} ({mode}); keeping {', '.join(keeps)}"


_AT_EXIT: dict[Path, int] = {}  # save_dir -> pid: the history files that get an "exit" line when the process exits


def exit_line_at_exit(save_dir: str | os.PathLike[str]) -> None:
    """Appends ``{"event": "exit"}`` to ``save_dir/history.jsonl`` when this process exits normally.

    The run's own last line (``complete``, ``stop``) comes before the code
    after its ``with`` block (an export, an evaluation) and the interpreter's
    exit: ``preempt report`` counts a process's wall time to this line. Not
    written when the process is killed; written once per save_dir.
    """
    if not _AT_EXIT:
        atexit.register(_write_exit_lines)
    _AT_EXIT[Path(save_dir)] = os.getpid()


def _write_exit_lines() -> None:
    for save_dir, pid in list(_AT_EXIT.items()):
        if pid != os.getpid():  # a forked child (a DataLoader worker) inherits the registry, not the run
            continue
        try:
            hist = History(save_dir) if save_dir.is_dir() else None
        except OSError:
            continue
        if hist is not None:
            hist.marker("exit", pid=pid)
            hist.close()
    _AT_EXIT.clear()
