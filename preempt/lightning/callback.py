"""PreemptCallback: a Lightning fit driven through a PreemptibleRun, from the hooks Lightning calls.

The callback holds one :class:`~preempt.run.preemptible.PreemptibleRun` for the time of ``trainer.fit`` and calls
it where a hand-written loop would:

========================  =========================================================================================
Lightning hook            the run
========================  =========================================================================================
``setup`` (fit)           the callback moved after every other one, so that its safe point sees their state; a
                          rerun's LightningCLI ``config.yaml`` written by an earlier process of the run let through
                          (:mod:`~preempt.lightning.cli_config`)
``on_fit_start``          entered with the module, optimizers, schedulers, scaler and Lightning's own state
                          (:class:`~preempt.lightning.trainer_state.TrainerState`); a checkpoint is restored here,
                          the loops' counters included; a completed run exits 0 here. Then the training-data source
                          (the module's or the datamodule's hook, or the loader given to ``fit``) hands Lightning
                          :class:`~preempt.lightning.batches.RunBatches`
``on_train_start``        the stop signals taken back from Lightning's signal connector (registered just before)
an epoch's first batch    ``run.epochs`` moves to the epoch, ``run.batches`` opens it (exact mid-epoch)
``on_train_batch_end``    ``run.step()`` when the batch ended with an optimizer step (never between accumulated
                          micro-batches): periodic checkpoints, and the stop (a checkpoint, exit code 75); when a
                          validation is due after this batch, ``run.step()`` waits for its end
``on_validation_end``     the random state put back as it was after the batch before the validation, so that
                          training draws the same numbers whether or not a resumed run repeats a validation; then the
                          step that waited for it: a checkpoint here holds what the validation changed (its logged
                          metrics, ``ModelCheckpoint``'s best, ``EarlyStopping``'s counter), and Lightning resumes
                          after it without validating again (its loops' "restarted on last" state)
``on_train_end``          the run left: a final checkpoint when anything changed, the run marked complete
``on_exception``          the run left with the exception (a stop's ``Preempted`` too)
========================  =========================================================================================

Lightning's own SIGTERM handler would make the process exit 0 at the end of the batch, and under SLURM its SIGUSR1
handler saves and requeues inside the handler. The run's handlers flag only: Lightning's SIGUSR1 handler is never
installed (a handler exists when Lightning looks), and its SIGTERM handler is replaced in ``on_train_start``; the
connector's saved "original" handlers are set to those from before the run, so both restore the same ones.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any

import lightning.pytorch as pl

from .. import _log
from ..data import rng
from ..data.stand_in import RunBatches
from ..errors import PreemptError
from ..run.config import integration_config
from ..run.preemptible import PreemptibleRun
from .batches import SourceSwap, resumable
from .cli_config import OwnConfig, let_rerun_write
from .trainer_state import TrainerState

log = _log.log

_MANY_EPOCHS = 1 << 31  # max_epochs=-1 (or None with max_steps): the run counts epochs without an end
# The Lightning versions tested (pyproject.toml's extra, CI): older ones are refused, newer ones warned about.
SUPPORTED = ((2, 5), (2, 6))


def _check_version(version: str) -> None:
    try:
        found = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return  # a development build: nothing to say
    if found < SUPPORTED[0]:
        raise PreemptError(
            f"PreemptCallback: Lightning {version} is older than {'.'.join(map(str, SUPPORTED[0]))}, the oldest"
            " supported (2.4 resumes inside gradient accumulation inexactly); pip install 'preempt-torch[lightning]'"
        )
    if found > SUPPORTED[1]:
        log.warning(
            "PreemptCallback: Lightning %s is newer than the versions tested (up to %s.x); the callback reads two"
            " private attributes of the trainer and says so if they are gone",
            version,
            ".".join(map(str, SUPPORTED[1])),
        )


class PreemptCallback(pl.Callback):
    """Gives a Lightning run preempt's stop, exact resume and safe checkpoints.

    Args:
        save_dir: Directory of the run's checkpoints; rerunning the same command resumes from it (no ``ckpt_path``).
        track: Further objects with state_dict()/load_state_dict() to save, by name (as PreemptibleRun's).
        **options: :class:`~preempt.run.preemptible.PreemptibleRun`'s options (``checkpoint_interval``,
            ``checkpoint_every_steps``, ``keep_last``, ``signals``, ``time_limit``...), checked here.

    Raises:
        TypeError: An option that PreemptibleRun does not take, or one the callback sets itself.
        ValueError: An option's value out of its range (the message names it).
    """

    def __init__(
        self, save_dir: str | os.PathLike[str], *, track: Mapping[str, Any] | None = None, **options: Any
    ) -> None:
        _check_version(pl.__version__)
        if not isinstance(save_dir, (str, os.PathLike)) or not str(save_dir):
            raise ValueError(f"PreemptCallback: save_dir: expected a directory path, got {save_dir!r}")
        # Passed straight on (**options), so that LightningCLI's parser (jsonargparse) reads the options' names and
        # types from RunConfig: a YAML config's init_args are checked like Python's.
        self.config = integration_config("PreemptCallback", **options)
        self.save_dir = str(save_dir)
        self.options = dict(options)
        self.track = dict(track or {})
        self.run: PreemptibleRun | None = None
        self._swap: SourceSwap | None = None
        self._epochs: Generator[int, None, None] | None = None
        self._steps_seen = 0
        self._before: dict[int, Any] = {}  # the signal handlers from before the run
        self._handlers: dict[int, Any] = {}  # the run's
        self._val_rng: rng.RngState | None = None
        self._loader: Iterable[Any] | None = None  # the training loader the run iterates (inside RunBatches)
        self._step_after_validation = False  # run.step() of the batch before a validation, due at its end
        self._own_config: OwnConfig | None = None  # SaveConfigCallbacks let write the run's own config.yaml again

    @property
    def state_key(self) -> str:
        return "PreemptCallback"

    # ------------------------------------------------------------------ set up

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if sum(isinstance(cb, PreemptCallback) for cb in trainer.callbacks) > 1:
            raise PreemptError("PreemptCallback: one per trainer (found several in trainer.callbacks)")
        # Before LightningCLI's SaveConfigCallback checks its file: the callbacks after this one are still to set up.
        pending = trainer.callbacks[trainer.callbacks.index(self) + 1 :]
        self._own_config = let_rerun_write(trainer, pending, self.save_dir)
        # Last of all (Lightning put ModelCheckpoint last when it was built): at the safe point every other
        # callback's hooks of that batch or validation have run, so a checkpoint holds what they changed.
        # A new list: Lightning is iterating the old one to call this very hook (a list changed in place would
        # skip the callback after this one).
        trainer.callbacks = [cb for cb in trainer.callbacks if cb is not self] + [self]

    def _wrap(self, trainer: pl.Trainer, loader: Any) -> RunBatches:
        """The user's training loader, processed as Lightning processes one, its epochs opened by the run."""
        from lightning.pytorch.trainer.connectors.data_connector import _process_dataloader
        from lightning.pytorch.trainer.states import RunningStage, TrainerFn
        from lightning.pytorch.utilities.combined_loader import CombinedLoader

        if isinstance(loader, (CombinedLoader, Mapping, list, tuple)):
            raise PreemptError(
                "PreemptCallback: train_dataloader returned several loaders"
                f" ({type(loader).__name__}); preempt resumes one training loader exactly. Combine them in one"
                " Dataset, or train without PreemptCallback"
            )
        run = self.run
        if run is None:
            raise PreemptError("PreemptCallback: the training loader was asked for outside trainer.fit")
        processed = _process_dataloader(trainer, TrainerFn.FITTING, RunningStage.TRAINING, loader)
        # the order's seed: seed_everything's (Lightning's distributed sampler uses it too), else the run's data seed,
        # which a checkpoint keeps
        assert run.data_seed is not None  # (drawn when the run began)
        seed = int(os.environ.get("PL_GLOBAL_SEED", run.data_seed))
        processed = self._loader = resumable(processed, run.sampler, seed)
        return RunBatches(processed, lambda inner: self._open_epoch(trainer, inner))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        notes = self._give_config_back()  # every callback's setup has run
        optimizers = list(trainer.optimizers)
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        track: dict[str, Any] = dict(self.track)
        for name, extra in (("optimizer", optimizers[1:]), ("scheduler", schedulers[1:])):
            for i, obj in enumerate(extra, start=1):
                track[f"lightning.{name}_{i}"] = obj
        track["lightning"] = TrainerState(trainer, pl_module, self)
        run = PreemptibleRun(
            self.save_dir,
            model=pl_module,
            optimizer=optimizers[0] if optimizers else None,
            scheduler=schedulers[0] if schedulers else None,
            scaler=getattr(trainer.precision_plugin, "scaler", None),
            track=track,
            **self.options,
        )
        signals = run.config.signals
        main = threading.current_thread() is threading.main_thread()
        self._before = {sig: signal.getsignal(sig) for sig in signals} if main else {}
        run.__enter__()  # restores the newest checkpoint (Lightning's loops too); a completed run exits 0 here
        self.run = run
        for note in notes:
            log.info("%s", note)
        self._handlers = {sig: signal.getsignal(sig) for sig in signals} if main else {}
        max_epochs, max_steps = trainer.max_epochs, trainer.max_steps
        self._epochs = run.epochs(
            max_epochs if max_epochs is not None and max_epochs >= 0 else _MANY_EPOCHS,
            max_steps=max_steps if max_steps is not None and max_steps >= 0 else None,
        )
        self._steps_seen = trainer.global_step
        # The loader is asked for after this hook, whichever way it was given (the module's hook, a datamodule's,
        # fit(train_dataloaders=...)): from now on the run is there to open its epochs.
        self._swap = SourceSwap(trainer, lambda loader: self._wrap(trainer, loader))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Takes the stop signals back from Lightning's signal connector, which registered its own just before."""
        connector = getattr(trainer, "_signal_connector", None)
        originals = getattr(connector, "_original_handlers", None)
        if not isinstance(originals, dict):
            raise PreemptError(
                "PreemptCallback: this Lightning version keeps no trainer._signal_connector._original_handlers;"
                " preempt cannot take the stop signals over (supported: lightning>=2.2,<2.7)"
            )
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
            if sig in originals:
                originals[sig] = self._before[sig]  # what Lightning's teardown puts back: the handler before the run
        self._steps_seen = trainer.global_step

    # ------------------------------------------------------------------ the loop's points

    def _open_epoch(self, trainer: pl.Trainer, loader: Iterable[Any]) -> Iterator[Any]:
        run, epochs = self.run, self._epochs
        if run is None or epochs is None:
            raise PreemptError("PreemptCallback: the training loader was iterated outside trainer.fit")
        _start_skipped_epoch(trainer)
        epoch = self._catch_up(trainer.current_epoch)
        if epoch != trainer.current_epoch:
            raise PreemptError(
                f"PreemptCallback: Lightning is in epoch {trainer.current_epoch}, the run in epoch {epoch};"
                " the training loader must be iterated once per epoch (reload_dataloaders_every_n_epochs and"
                " several iterations of it per epoch are not supported)"
            )
        return run.batches(loader)

    def _catch_up(self, until: int) -> int | None:
        """The run's next epoch of ``until`` or later (None: no epoch left); its epochs before ``until`` must have no
        batch left. The previous epoch ends, the next begins: a safe point (a stop may land here).

        Resumed from the last step of an epoch, Lightning goes on with the next one (or, after the last epoch's last
        step, ends the fit without iterating the loader): the run finishes that epoch first, iterating nothing.
        """
        run, epochs = self.run, self._epochs
        assert run is not None and epochs is not None
        epoch = next(epochs, None)
        while epoch is not None and epoch < until:
            if self._loader is None:
                raise PreemptError(f"PreemptCallback: the fit ended in epoch {epoch} without a training loader")
            for _ in run.batches(self._loader):
                raise PreemptError(f"PreemptCallback: Lightning left epoch {epoch} with batches left in the run's")
            epoch = next(epochs, None)
        return epoch

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """The safe point: after an optimizer step and its schedulers, never between accumulated micro-batches."""
        if self.run is None:
            return
        self._step_pending()  # a validation that was due did not run (an empty validation loader)
        if trainer.global_step != self._steps_seen:
            self._steps_seen = trainer.global_step
            if _validation_due(trainer):
                self._step_after_validation = True
            else:
                self.run.step()
        # A validation due after this batch runs next, and creating its loader's iterator draws from the global
        # generators before any validation hook: the state is kept here and put back when the validation ends.
        self._val_rng = rng.capture()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_rng is not None and not trainer.sanity_checking:
            rng.restore(self._val_rng)
        self._val_rng = None
        if not trainer.sanity_checking:
            self._step_pending()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_pending()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step_pending()

    def _step_pending(self) -> None:
        if self._step_after_validation and self.run is not None:
            self._step_after_validation = False
            self.run.step()

    # ------------------------------------------------------------------ the end

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step_pending()
        run, epochs = self.run, self._epochs
        if run is None or epochs is None:
            return
        _complete_skipped_batch(trainer)
        max_epochs = trainer.max_epochs or 0
        if trainer.fit_loop.epoch_progress.current.processed >= max_epochs > 0:
            # every epoch ran: the run's last epoch boundary (a safe point)
            if self._catch_up(max_epochs) is not None:
                raise PreemptError("PreemptCallback: the run has epochs left after Lightning's last one")
        else:  # max_steps, should_stop (EarlyStopping), a time limit: the final checkpoint holds the epoch's position
            epochs.close()
        self._leave(None)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            self._leave(exception)
        finally:  # Lightning calls no teardown hook after an exception
            self._undo_swap()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        try:
            if self.run is not None:  # fit left without on_train_end or on_exception (no training batch at all)
                self._leave(None)
        finally:
            self._undo_swap()

    def _undo_swap(self) -> None:
        self._give_config_back()
        if self._swap is not None:
            self._swap.undo()
            self._swap = None

    def _give_config_back(self) -> list[str]:
        own, self._own_config = self._own_config, None
        if own is None:
            return []
        own.undo()
        return own.notes

    def _leave(self, exception: BaseException | None) -> None:
        run, self.run = self.run, None
        self._epochs = None
        if run is None:
            return
        if exception is None:
            run.__exit__(None, None, None)
        else:
            run.__exit__(type(exception), exception, exception.__traceback__)

    def state_dict(self) -> dict[str, Any]:
        return {}  # the run's state lives in its own checkpoints, not in Lightning's


def _start_skipped_epoch(trainer: pl.Trainer) -> None:
    """Starts the epoch Lightning's restart skipped starting: resumed from a checkpoint taken at the last batch of
    an epoch, Lightning 2.5-2.6 restores "mid-epoch", finishes that epoch at once and goes on into the next one
    without counting it ready and started, nor calling ``on_train_epoch_start``: the progress counters end one lower
    than an uninterrupted fit's and a callback misses that epoch's start. Seen as an epoch being iterated whose start
    was not counted (started == processed); what Lightning skipped is done here, before the epoch's first batch."""
    fit_loop = trainer.fit_loop
    progress = fit_loop.epoch_progress.current
    if progress.started != progress.processed or not getattr(fit_loop, "restarted_mid_epoch", False):
        return
    from lightning.pytorch.trainer import call

    fit_loop.epoch_progress.increment_ready()
    call._call_callback_hooks(trainer, "on_train_epoch_start")
    call._call_lightning_module_hook(trainer, "on_train_epoch_start")
    fit_loop.epoch_progress.increment_started()


def _complete_skipped_batch(trainer: pl.Trainer) -> None:
    """Completes the batch Lightning's restart left uncompleted: resumed from a checkpoint taken at the last batch of
    the last epoch, Lightning 2.5-2.6 count the epoch done and end the fit without running its epoch loop, whose
    restart would have counted that batch completed and stepped; the fit would end with those counters one lower
    than an uninterrupted fit's. Seen at the fit's end as a batch processed but not completed."""
    epoch_loop = trainer.fit_loop.epoch_loop
    total = epoch_loop.batch_progress.total
    if total.completed != total.processed - 1 or not getattr(epoch_loop, "restarting", False):
        return
    epoch_loop.batch_progress.increment_completed()
    epoch_loop._batches_that_stepped += 1


def _validation_due(trainer: pl.Trainer) -> bool:
    """Whether Lightning validates right after the batch that just ended (asked as its training epoch loop asks it
    after ``on_train_batch_end``; a time-based ``val_check_interval`` is asked at that moment, and the same answer
    is agreed by every rank only when it does not depend on time)."""
    if not trainer.enable_validation:
        return False
    epoch_loop = trainer.fit_loop.epoch_loop
    if getattr(epoch_loop, "_skip_next_val", False):
        return False
    ask = getattr(epoch_loop, "_should_check_val_fx", None)
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if ask is None or fetcher is None:
        return False  # another Lightning: the step is taken at once, as before
    return bool(ask(fetcher))
