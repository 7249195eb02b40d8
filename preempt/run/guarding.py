"""The run's health: non-finite losses, out-of-memory batches, rollbacks, emergency checkpoints, learning-rate scale.

:class:`Health` applies the guards of :mod:`preempt.health.guards` (pure counting)
to the run: a streak of non-finite losses rolls the model and optimizer back
to the last checkpoint with lower learning rates; a batch that runs out of
memory is skipped; an exception that escapes the loop at a step boundary gets
a checkpoint of that state first; ``preempt supervise --lr`` rescales the
learning rates a checkpoint restores.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .. import _log
from ..checkpoint import state
from ..checkpoint.manager import CheckpointManager
from ..cluster.supervised import Supervised
from ..errors import LockLostError
from ..health import guards
from .config import HealthOptions
from .due import Reason
from .loop_state import LoopState
from .save_scheduler import SaveScheduler
from .snapshot import Snapshot

log = _log.log


class Health:
    """The guards of one run (see the module docstring)."""

    def __init__(
        self,
        config: HealthOptions,
        components: state.Components,
        loop: LoopState,
        snapshot: Snapshot,
        *,
        strict: bool = True,
        alone: bool = True,
    ) -> None:
        self.config = config
        self.strict = strict  # a rollback loads the model as the run's start does (StartOptions.strict)
        self.alone = alone  # one process: under torch.distributed no rollback, no emergency save, no OOM skipped
        self.components = components
        self.loop = loop
        self.snapshot = snapshot  # holds the learning-rate scale that checkpoints record
        self.nonfinite = guards.NonFiniteGuard(
            max_in_a_row=config.max_nonfinite, lr_factor=float(config.nonfinite_lr_factor)
        )
        # under torch.distributed the first OOM ends the run: one rank cannot skip a step alone
        self.oom = guards.OOMGuard(max_in_a_row=config.max_oom if alone else 1)
        self.rollbacks = 0

    def apply_lr_scale(self, resumed: bool) -> None:
        """Under ``preempt supervise --lr``: rescales learning rates restored from a checkpoint to its PREEMPT_LR_SCALE.

        The scale is relative to the run's original learning rate and recorded
        in each checkpoint, so a resume applies only the difference. A fresh
        start takes the lowered ``{lr}`` from its command line as it is.
        """
        sup = Supervised.from_env()
        if sup is None or sup.lr is None:
            return
        snap, opt = self.snapshot, self.components.optimizer
        if not resumed or opt is None:
            snap.rescaled(sup.lr_scale)
            return
        if math.isclose(sup.lr_scale, snap.lr_scale, rel_tol=1e-9):
            return
        factor = sup.lr_scale / snap.lr_scale
        lrs = guards.scale_lr(opt, self.components.scheduler, factor)
        log.info(
            "learning rates x%.6g: preempt supervise asks for %.6g of the original (PREEMPT_LR_SCALE), the checkpoint"
            " ran at %.6g; now %s",
            factor,
            sup.lr_scale,
            snap.lr_scale,
            ", ".join(f"{lr:.6g}" for lr in lrs),
        )
        snap.rescaled(sup.lr_scale)

    def check_loss(self, loss: torch.Tensor | float, rollback: Callable[[], None]) -> bool:
        """``run.check_loss``: True when ``loss`` is finite; otherwise the step must be skipped.

        ::

            loss = compute_loss(model, batch)
            if not run.check_loss(loss):
                opt.zero_grad(set_to_none=True)
                continue  # no backward, no optimizer step, no run.step()
            loss.backward(); opt.step(); run.step()

        After ``max_nonfinite`` in a row ``rollback`` is called: the run rolls
        back to its last checkpoint (model, optimizer, scheduler, scaler) and
        divides the learning rates by ``nonfinite_lr_factor``; the data goes on
        from the current batch, so the batches that diverged are not replayed.
        With no checkpoint, under torch.distributed, or after ``max_rollbacks``,
        it raises :class:`~preempt.health.guards.NonFiniteStreak` (exit code 78). One
        synchronisation with the GPU per call (the finiteness test).
        """
        g = self.nonfinite
        if g.check(loss):
            return True
        self.loop.batch_skipped()  # the batch is consumed; nothing changed since the last step boundary
        log.warning(
            "non-finite loss (%s) at step %d: update skipped (%d in a row, %d in all)",
            g.last_value,
            self.loop.global_step + 1,
            g.in_a_row,
            g.total,
        )
        if g.exhausted:
            rollback()
        return False

    def roll_back(self, saves: SaveScheduler, manager: CheckpointManager, *, marker: Callable[..., None]) -> None:
        """Model, optimizer, scheduler and scaler back to the last checkpoint, learning rates lowered.

        Raises:
            NonFiniteStreak: No checkpoint, under torch.distributed, or after ``max_rollbacks`` (exit code 78).
        """
        g, loop = self.nonfinite, self.loop
        saves.wait_for_job()  # a background write in flight may be the checkpoint to roll back to
        info = saves.last_info
        why = None
        if info is None:
            why = "there is no checkpoint to roll back to"
        elif not self.alone:
            why = "rolling back is not supported under torch.distributed"
        elif self.rollbacks >= self.config.max_rollbacks:
            why = f"the run already rolled back {self.rollbacks} time(s) (max_rollbacks)"
        if why is not None:
            streak = guards.NonFiniteStreak(
                g.in_a_row, g.total, step=loop.global_step + 1, value=g.last_value, factor=g.lr_factor
            )
            log.error("%s; %s", streak, why)
            raise streak
        assert info is not None
        state.apply(self.components, manager.read(info), strict=self.strict)
        factor = 1.0 / g.lr_factor
        lrs = []
        if self.components.optimizer is not None:
            lrs = guards.scale_lr(self.components.optimizer, self.components.scheduler, factor)
        self.snapshot.rescaled(self.snapshot.lr_scale * factor)
        self.rollbacks += 1
        g.reset_streak()
        reached = loop.global_step
        loop.rolled_back(info.step)
        log.warning(
            "%d non-finite losses in a row: rolled back to %s (step %d), learning rates / %g, now %s; the data"
            " goes on from epoch %d batch %d (rollback %d of at most %d)",
            g.max_in_a_row,
            info.path,
            info.step,
            g.lr_factor,
            ", ".join(f"{lr:.6g}" for lr in lrs) or "-",
            loop.epoch,
            loop.batch,
            self.rollbacks,
            self.config.max_rollbacks,
        )
        marker("rollback", step=info.step, from_step=reached, lr_scale=self.snapshot.lr_scale)

    def emergency(self, exc: BaseException, saves: SaveScheduler) -> None:
        """An exception escaped the loop: saves the state when it is that of a step boundary."""
        loop = self.loop
        what = f"{type(exc).__name__} escaped the training loop at step {loop.global_step}"
        last = saves.last_checkpoint or "(none)"
        if not self.config.emergency_save or not self.alone or isinstance(exc, LockLostError):  # nothing to write into
            return
        unsafe = not_a_boundary(loop)
        if unsafe is not None:
            log.error("%s %s: no emergency checkpoint; the last one is %s", what, unsafe, last)
            return
        try:
            saves.wait_for_job()
            if not loop.dirty:
                since = f"checkpoint {last}" if saves.last_info is not None else "the start"
                log.error("%s; nothing changed since %s: no emergency checkpoint", what, since)
                return
            loop.unwind_batches()  # the batch that failed is trained again by the rerun
            saves.save(Reason.EMERGENCY, "step" if loop.batch else "epoch")
        except Exception as e:  # never mask the exception that ended the loop
            log.error("%s; the emergency checkpoint failed too: %r (the last one is %s)", what, e, last)
            return
        log.error("%s: emergency checkpoint %s written; a rerun continues from it", what, saves.last_checkpoint)

    def oom_step(self) -> OomStep:
        """The context manager of ``run.oom_guard()``; under torch.distributed the first OOM ends the run."""
        return OomStep(self.oom, self.loop)


def not_a_boundary(loop: LoopState) -> str | None:
    """Why the state is not one an emergency checkpoint may hold (an error escaped the loop now); None when it is.

    Only an optimizer step under way (begun, not returned) may have half-updated the state; one that returned before
    its ``run.step()`` left the weights a step ahead of the counters. Micro-batches taken since the last
    ``run.step()`` without an optimizer step, or code between ``run.step()`` and the next batch (an evaluation), leave
    the state of the last step boundary: those get the checkpoint.
    """
    if loop.stepping:
        return "during an optimizer step (the state may be half-updated)"
    if loop.updated:
        return (
            "after optimizer.step() and before run.step() (the weights are one step ahead of the step counter;"
            " call run.step() right after the optimizer step, before an evaluation)"
        )
    return None


class OomStep:
    """``with run.oom_guard() as s:``: the OOMGuard's step, and a skipped batch is a step boundary."""

    def __init__(self, oom: guards.OOMGuard, loop: LoopState) -> None:
        self.oom, self.loop = oom, loop
        self._step = oom.step()
        self.skipped = False

    def __enter__(self) -> OomStep:
        self._step.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        suppressed = bool(self._step.__exit__(exc_type, exc, tb))
        self.skipped = self._step.skipped
        if self.skipped:
            self.loop.batch_skipped()
            log.warning(
                "out of memory at step %d: batch skipped (%d in a row, %d in all)",
                self.loop.global_step + 1,
                self.oom.in_a_row,
                self.oom.total,
            )
        return suppressed
