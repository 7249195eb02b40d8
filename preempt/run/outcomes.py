"""What came of the run's saves, and what each outcome means: the log line, the records, the callbacks.

:class:`Outcomes` keeps the newest durable checkpoint, the latest save's record (``run.last_save``) and the count
of failed periodic saves, and handles each :class:`~preempt.run.write_decisions.Outcome` of a checkpoint written in the
background: durable, cancelled by a stop, torn or changed (not written: the state is due again), not written for
want of disk (training goes on), the lock lost or broken (the run ends). The scheduler
(:mod:`preempt.run.save_scheduler`) runs the saves; this part says what came of them.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import _log, _testing
from ..checkpoint import carry
from ..checkpoint.manager import CheckpointInfo, CheckpointManager
from ..checkpoint.names import checkpoint_name
from ..cluster.signals import StopFlag
from ..errors import SAVE_FAILED_EXIT_CODE, CheckpointWriteError, SaveFailed
from .background import Background
from .due import Reason
from .loop_state import LoopState
from .write_decisions import POSTPONABLE, Outcome, SaveJob, SaveRecord

log = _log.log


class Outcomes:
    """The run's saves so far, and the handlers of what came of each (see the module docstring).

    Args:
        on_durable: Called with (seconds, now, step) of each durable save.
        on_saved: Called with (record, bytes) of each durable save.
    """

    def __init__(
        self,
        manager: CheckpointManager,
        loop: LoopState,
        flag: StopFlag,
        background: Background,
        *,
        clock: Callable[[], float],
        on_durable: Callable[[float, float, int], None] | None = None,
        on_saved: Callable[[SaveRecord, int], None] | None = None,
    ) -> None:
        self.manager = manager
        self.loop = loop
        self.flag = flag
        self.background = background  # what a torn or changed snapshot turns off
        self.clock = clock
        self.on_durable = on_durable
        self.on_saved = on_saved
        self.last_save: SaveRecord | None = None  # the latest checkpoint taken
        self.last_info: CheckpointInfo | None = None  # the newest durable checkpoint this process wrote or loaded
        self.last_checkpoint: Path | None = None  # its path (under torch.distributed: rank 0's, when told)
        self.failed = 0  # periodic checkpoints that could not be written

    def taken(self, record: SaveRecord) -> None:
        """A checkpoint was taken (its files durable on another rank, or being written in the background)."""
        self.last_save = record

    def loaded(self, info: CheckpointInfo) -> None:
        """The run restored ``info``: the newest durable checkpoint, and nothing to save until the loop moves."""
        assert info.manifest is not None
        self.last_info, self.last_checkpoint = info, info.path
        self.loop.taken(info.manifest.step, info.manifest.cursor, self.clock())

    def told(self, path: Path | None) -> None:
        """Another rank: rank 0's newest durable checkpoint, as rank 0 told it."""
        self.last_checkpoint = path

    def durable(self, reason: Reason, info: CheckpointInfo, t0: float) -> None:
        """A synchronous save is durable."""
        self.loaded(info)
        t1 = self.clock()
        self.last_save = SaveRecord(info.step, reason.value, t1 - t0, t1 - t0, info.path)
        took = _log.duration(t1 - t0) + carry.summary(info.manifest)
        log.info("checkpoint %s (%s) written in %s", info.path, reason.value, took)
        self._said(info)
        if self.on_durable is not None:
            self.on_durable(t1 - t0, t1, self.loop.global_step)

    def _said(self, info: CheckpointInfo) -> None:
        if self.on_saved is not None and self.last_save is not None:
            files = info.manifest.files if info.manifest is not None else {}
            self.on_saved(self.last_save, sum(d.size for d in files.values()))

    def of(self, job: SaveJob, outcome: Outcome, result: Any, error: BaseException | None) -> None:
        """What came of a checkpoint written in the background: one handler per :class:`Outcome`."""
        match outcome:
            case Outcome.WRITTEN:
                self._written(job, result)
            case Outcome.TORN:
                self._torn(job, error)
            case Outcome.CHANGED:
                self._changed(job, error)
            case Outcome.BEHIND_AUTOGRAD:
                assert isinstance(error, carry.WrittenBehindAutograd)
                self._behind_autograd(job, error)
            case Outcome.CANCELLED:
                _testing.emit("cancelled", step=job.record.step, reason=job.reason.value)
                log.info(
                    "the background write of step %d (%s) was cancelled after %s: the stop saves the current state",
                    job.record.step,
                    job.reason.value,
                    self._since(job.started),
                )
            case Outcome.NOT_WRITTEN:
                assert isinstance(error, OSError)
                self.not_written(job.reason, error, step=job.record.step)
            case Outcome.LOCK_LOST:
                assert error is not None
                raise error  # the save_dir is no longer this run's: the run ends, nothing more is written there
            case Outcome.BROKEN:
                last = self.last_checkpoint
                raise CheckpointWriteError(
                    f"the background write of checkpoint {checkpoint_name(job.record.step)} in"
                    f" {self.manager.save_dir} failed: {error!r}; the last good checkpoint is {last or '(none)'}",
                    None if last is None else str(last),
                ) from error

    def _since(self, started: float) -> str:
        return _log.duration(self.clock() - started)

    def _written(self, job: SaveJob, info: CheckpointInfo) -> None:
        """A background checkpoint is durable."""
        now = self.clock()
        lazy = job.staging
        stall = job.record.stall_s + (lazy.waited if lazy is not None else 0.0)  # and the optimizer's wait, if lazy
        self.last_save = dataclasses.replace(job.record, stall_s=stall, write_s=now - job.started, path=info.path)
        self.last_info, self.last_checkpoint = info, info.path
        # Routine checkpoints written in the background say so at DEBUG: a run would print little else.
        log.log(
            logging.DEBUG if job.reason in POSTPONABLE else logging.INFO,
            "checkpoint %s (%s) written in %s in the background%s; the loop waited %s",
            info.path,
            job.record.reason,
            _log.duration(now - job.started),
            carry.summary(info.manifest),
            _log.duration(job.record.stall_s),
        )
        self._said(info)
        if self.on_durable is not None:
            self.on_durable(now - job.started, now, info.step)

    def _torn(self, job: SaveJob, error: BaseException | None) -> None:
        """A lazy snapshot was changed before its copy was made: it is not written; copies are made at the step
        from now on, and the state is due again."""
        self.background.copy_at_step()
        log.warning(
            "the checkpoint of step %d is not written: %s (something other than optimizer.step() changes it"
            " between steps); checkpoints copy the state at the step from now on",
            job.record.step,
            error,
        )

    def _changed(self, job: SaveJob, error: BaseException | None) -> None:
        """A tensor the writer read where it lives was changed meanwhile: that checkpoint is not committed; the
        frozen base is copied at the step from now on, and the state is due again."""
        self.background.copy_frozen_base()
        log.warning(
            "the checkpoint of step %d is not written: %s (a tensor no optimizer holds, read without a copy, changed"
            " between steps); checkpoints copy the frozen base at the step from now on",
            job.record.step,
            error,
        )

    def _behind_autograd(self, job: SaveJob, error: carry.WrittenBehindAutograd) -> None:
        """A file the writer read where it lives came out other than it was at the step: that checkpoint is not
        committed; the file is written from a copy made at the step from now on, and the state is due again."""
        log.warning("the checkpoint of step %d is not written: %s", job.record.step, error)
        self.manager.carrier.distrust(error.file, "its tensors changed between the step and their write")

    def not_written(self, reason: Reason, error: OSError, step: int | None = None) -> None:
        """A save that failed for want of disk or I/O: a periodic one is logged and training goes on; the stop's
        ends the run (:class:`~preempt.errors.SaveFailed`), the final or a branch's raises."""
        loop = self.loop
        self.failed += 1
        code = (
            f" ({errno.errorcode[error.errno]})" if error.errno is not None and error.errno in errno.errorcode else ""
        )
        step = loop.global_step if step is None else step
        what = (
            f"could not write checkpoint {checkpoint_name(step)} ({reason.value}) in {self.manager.save_dir}:"
            f" {error.strerror or error}{code}"
        )
        info = self.last_info
        good = info.step if info is not None and info.manifest is not None else None
        _testing.emit("checkpoint_failed", step=step, reason=reason.value, errno=error.errno, last_good=good)
        if info is None or info.manifest is None:
            last, last_good = "there is no earlier checkpoint", None
        else:
            ago = _log.duration(max(0.0, time.time() - info.manifest.created))
            last = f"the last good checkpoint is {info.path} (step {info.step}, saved {ago} ago)"
            last_good = str(info.path)
        if reason == Reason.PREEMPT:
            lost = loop.global_step - (info.step if info is not None else 0)
            log.error(
                "%s; %s; the %d step(s) since are lost; exiting with code %d", what, last, lost, SAVE_FAILED_EXIT_CODE
            )
            raise SaveFailed(SAVE_FAILED_EXIT_CODE, self.flag.signum, last_good, error) from error
        if reason in (Reason.FINAL, Reason.BRANCH):
            raise CheckpointWriteError(f"{what}; {last}", last_good) from error
        # A periodic checkpoint: its partial files are gone, older checkpoints untouched (nothing is deleted to
        # make room). Training goes on; the next try comes when the next checkpoint is due, not at every step.
        log.error("%s; %s; training goes on and tries again at the next checkpoint", what, last)
        loop.save_skipped(self.clock())
