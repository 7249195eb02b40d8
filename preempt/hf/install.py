"""``install(trainer, save_dir, **options)``: a Hugging Face Trainer driven through a PreemptibleRun.

The Trainer runs its own loop; ``install`` takes over seven of its methods on the instance (any subclass keeps its
own overrides of the rest) and adds one callback, so that the run is called where a hand-written loop would call it:

============================  ==========================================================================================
the Trainer's point           the run
============================  ==========================================================================================
``get_train_dataloader``      the Trainer's loader, built as the Trainer builds it but with preempt's sampler (seeded by
                              ``data_seed``, else ``seed``), handed over as a :class:`~preempt.data.stand_in.RunBatches`
                              whose epochs the run opens (exact mid-epoch, per-sample random streams in the workers)
``_init_training_state``      the Trainer's fresh state; the optimizer made now, the run entered with the model, the
                              optimizer and the Trainer's state, so that a checkpoint is restored before the Trainer
                              counts where it starts; it starts at the run's epoch and batch
``on_train_begin``            the scheduler, made since, loaded from the same checkpoint (the optimizer's learning rates
                              set back to its last ones: making a scheduler overwrites them); the Trainer's counters
                              (loss, flos, seconds: :mod:`.trainer_state`), which it has just zeroed, continued
``_run_epoch``                ``run.epochs`` moves to the epoch; in the resumed one the Trainer's own count of the
                              batches done is kept, and the run (not the Trainer) skips them and restores the RNG
``_maybe_log_save_evaluate``  after it, at an optimizer step (never inside gradient accumulation): ``run.step()`` with
                              the metrics of the evaluation it ran, the safe point of periodic checkpoints, of the best
                              one and of the stop (a checkpoint, exit code 75). The step's log, evaluation,
                              ``best_metric`` and callbacks (``EarlyStoppingCallback``) come before its checkpoint, as
                              in an uninterrupted run; at an epoch's end, an evaluation's metrics to ``run.report``
``on_evaluate``               the random state put back as it was after the step before the evaluation
``_finalize_training``        ``train_runtime`` and the rates over the seconds trained by every process of the run
``train``                     the run left when training ends (a final checkpoint, the run marked complete) or fails
============================  ==========================================================================================

The Trainer's own checkpoints are turned off (``save_strategy="no"``): preempt writes them, and the Trainer's saving
arguments set preempt's options (:func:`_from_trainer_args`).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any

import torch
import transformers
import transformers.trainer as hf_trainer
from torch.utils.data import DataLoader

from .. import _log, _testing
from ..data import rng
from ..data.sampler import ResumableSampler
from ..data.stand_in import RunBatches
from ..errors import NoCheckpointError, PreemptError
from ..run.config import integration_config
from ..run.preemptible import PreemptibleRun
from .trainer_state import TrainerProgress

log = _log.log
WHO = "preempt.hf.install"
# What the Trainer is told to resume from in the resumed epoch: its count of the batches done is kept, and its
# RNG load and batch skipping are the run's.
RESUMED = "<preempt>"


class _Driver(transformers.TrainerCallback):
    """The run behind one Trainer: the methods ``install`` puts on the Trainer, and its callback."""

    def __init__(
        self, trainer: Any, save_dir: str, options: dict[str, Any], track: dict[str, Any], *, saves: bool = False
    ) -> None:
        self.trainer = trainer
        self.saves = saves  # the Trainer was asked to save checkpoints (its save_strategy, before preempt's "no")
        self.save_dir = save_dir
        self.options = options
        self.track = track
        self.run: PreemptibleRun | None = None
        self._epochs: Generator[int, None, None] | None = None
        self._eval_rng: rng.RngState | None = None
        self._num_epochs = 0
        self._progress: TrainerProgress | None = None
        self._stepped = False  # an optimizer step ended; its run.step() comes after the Trainer's log and evaluation
        self._in_step_end = False  # inside _maybe_log_save_evaluate: an evaluation's metrics wait for its end
        self._evaluated: dict[str, float] = {}
        self._originals = {name: getattr(trainer, name) for name in _TAKEN}

    # ------------------------------------------------------------------ the methods taken over

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint not in (None, False):
            raise PreemptError(
                f"{WHO}: preempt resumes from {self.save_dir} by itself; call trainer.train() without"
                f" resume_from_checkpoint (got {resume_from_checkpoint!r})"
            )
        try:
            out = self._originals["train"](None, *args, **kwargs)
        except BaseException as e:
            self._leave(e)
            raise
        self._leave(None)
        return out

    def get_train_dataloader(self) -> RunBatches:
        trainer, args = self.trainer, self.trainer.args
        dataset, collator = trainer.train_dataset, trainer.data_collator
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if _is_hf_dataset(dataset):
            dataset = trainer._remove_unused_columns(dataset, description="Training")
        else:
            collator = trainer._get_collator_with_removed_columns(collator, description="Training")
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise PreemptError(f"{WHO}: an IterableDataset as train_dataset is not supported yet; use a map-style one")
        seed = args.data_seed if args.data_seed is not None else args.seed
        workers = args.dataloader_num_workers
        # under torchrun the sampler shards the order by rank, as the Trainer's own (through Accelerate) would
        sampler = ResumableSampler(
            dataset, shuffle=True, seed=seed, num_replicas=max(1, args.world_size), rank=args.process_index
        )
        loader = DataLoader(
            dataset,
            batch_size=trainer._train_batch_size,
            sampler=sampler,
            collate_fn=collator,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers and workers > 0,
            prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
            drop_last=args.dataloader_drop_last,
        )
        return RunBatches(loader, self._open_epoch)

    def init_training_state(
        self, max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: int, resume: Any, trial: Any
    ) -> tuple[int, int]:
        trainer = self.trainer
        self._originals["_init_training_state"](max_steps, num_update_steps_per_epoch, num_train_epochs, None, trial)
        # made now, so that the run restores it: the Trainer's _prepare_for_training keeps an existing optimizer
        trainer.create_optimizer()
        self._progress = TrainerProgress(trainer)
        track = {**self.track, "transformers": self._progress}
        run = PreemptibleRun(
            self.save_dir,
            model=trainer.model,
            optimizer=trainer.optimizer,
            scaler=getattr(trainer.accelerator, "scaler", None),
            track=track,
            **self.options,
        )
        run.__enter__()  # restores the newest checkpoint; a completed run exits 0 here
        self.run = run
        self._num_epochs = int(num_train_epochs)
        # the progress line's total: the Trainer's optimizer steps, up to max_steps when it ends training first
        per_epoch = int(num_update_steps_per_epoch) if num_update_steps_per_epoch else None
        last = int(max_steps) if trainer.args.max_steps > 0 else None
        self._epochs = run.epochs(self._num_epochs, per_epoch, max_steps=last)
        return run.epoch, run.batch

    def run_epoch(self, **kw: Any) -> Any:
        run, epochs = self.run, self._epochs
        if run is None or epochs is None:
            raise PreemptError(f"{WHO}: an epoch began before the run was entered")
        epoch, loader = kw["epoch"], kw["train_dataloader"]
        got = next(epochs, None)  # the previous epoch ends, this one begins: a safe point (a stop may land here)
        while got is not None and got < epoch:  # resumed at an epoch's last step: that epoch is done
            for _ in run.batches(loader.loader):
                raise PreemptError(f"{WHO}: the Trainer left epoch {got} with batches left in the run's")
            got = next(epochs, None)
        if got != epoch:
            raise PreemptError(f"{WHO}: the Trainer is in epoch {epoch}, the run in epoch {got}")
        resumed = epoch == kw["epochs_trained"] and kw["steps_trained_in_current_epoch"] > 0
        kw["resume_from_checkpoint"] = RESUMED if resumed else None
        if resumed and kw["steps_trained_in_current_epoch"] >= kw["steps_in_epoch"]:
            # stopped at the epoch's last step: the Trainer draws no batch of it, the run is brought to its end so
            # that what it records of the loaders is of the next epoch, as in an uninterrupted run
            for _ in run.batches(loader.loader):
                raise PreemptError(f"{WHO}: the run has batches left in epoch {epoch} after its last step")
        with _batches_skipped_by_the_run() if resumed else contextlib.nullcontext():
            return self._originals["_run_epoch"](**kw)

    def load_rng_state(self, checkpoint: Any) -> None:
        if checkpoint != RESUMED:
            self._originals["_load_rng_state"](checkpoint)

    def maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        self._in_step_end, self._evaluated = True, {}
        state = self.trainer.state
        best = state.best_metric
        try:
            self._originals["_maybe_log_save_evaluate"](*args, **kwargs)
        finally:
            self._in_step_end = False
        if self.saves and state.best_metric != best:
            # the Trainer records the best step only when it saves itself; preempt saves in its place
            state.best_global_step = state.global_step
        stepped, metrics = self._stepped, self._evaluated
        self._stepped, self._evaluated = False, {}
        run = self.run
        if run is None:
            return
        if stepped:
            run.step(metrics or None)  # the step's safe point: a checkpoint now holds its log and evaluation
        elif metrics:
            run.report(metrics)  # an evaluation at the epoch's end: a better best_metric saved, a stop taken here

    def finalize_training(self, trial: Any, num_train_samples: Any, start_time: float) -> Any:
        before = self._progress.seconds_before if self._progress is not None else 0.0
        return self._originals["_finalize_training"](trial, num_train_samples, start_time - before)

    def _open_epoch(self, loader: Iterable[Any]) -> Iterator[Any]:
        if self.run is None:
            raise PreemptError(f"{WHO}: the training loader was iterated outside trainer.train()")
        return self.run.batches(loader)

    # ------------------------------------------------------------------ the callback

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        run, trainer = self.run, self.trainer
        if run is None:
            return
        scheduler = trainer.lr_scheduler
        if scheduler is not None:
            run.track("scheduler", scheduler)  # loaded now when the run resumed
            if run.resumed_from is not None and hasattr(scheduler, "get_last_lr"):
                # a new scheduler set the optimizer's rates to its first ones; they are the saved last ones again
                for group, lr in zip(_raw(trainer.optimizer).param_groups, scheduler.get_last_lr(), strict=True):
                    group["lr"] = lr
        if self._progress is not None:
            self._progress.continue_counters()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is None:
            return
        self._stepped = True  # run.step() after the Trainer's log and evaluation of this step (maybe_log_save_evaluate)
        # an evaluation due after this step draws from the global generators (its loader's iterator): the state is
        # kept here and put back when it ends, so that training draws alike whether a resumed run repeats it or not
        self._eval_rng = rng.capture()

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        if self.run is None:
            return
        if self._eval_rng is not None:
            rng.restore(self._eval_rng)
        numbers = {
            k: v
            for k, v in (metrics or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        if self._in_step_end:
            self._evaluated.update(numbers)  # to the run once the Trainer has taken its best_metric from them
        elif numbers:
            self.run.report(numbers)  # an evaluation outside the loop's steps (eval_on_start, a callback's)

    # ------------------------------------------------------------------ the end

    def _leave(self, exception: BaseException | None) -> None:
        run, epochs = self.run, self._epochs
        self.run, self._epochs = None, None
        if run is None:
            return
        if exception is not None:
            run.__exit__(type(exception), exception, exception.__traceback__)
            return
        if epochs is not None:
            finished = self.trainer.state.epoch or 0.0
            if finished >= self._num_epochs - 1e-9:
                for _ in epochs:  # every epoch ran: the run's last epoch boundary (a safe point)
                    raise PreemptError(f"{WHO}: the run has epochs left after the Trainer's last one")
            else:  # max_steps (or a callback) ended it inside an epoch: the final checkpoint holds that position
                epochs.close()
        run.__exit__(None, None, None)
        if self.trainer.args.load_best_model_at_end:
            self._load_best(run)

    def _load_best(self, run: PreemptibleRun) -> None:
        """``load_best_model_at_end``: the model's weights from the best checkpoint by ``best_metric``."""
        from ..checkpoint.manager import CheckpointManager

        try:
            info, loaded = CheckpointManager(self.save_dir, owner=False).load("best", weights_only=True)
        except NoCheckpointError:
            log.warning("%s: no checkpoint ranks best by %s; the model is the last one", WHO, run.config.best_metric)
            return
        self.trainer.model.load_state_dict(loaded.model)
        log.info("loaded the best model: %s (%s %s)", info.path, run.config.best_metric, info.valid.best_value)
        _testing.emit("best_loaded", step=info.step, metric=run.config.best_metric, value=info.valid.best_value)


_TAKEN = (
    "train",
    "get_train_dataloader",
    "_init_training_state",
    "_run_epoch",
    "_load_rng_state",
    "_maybe_log_save_evaluate",
    "_finalize_training",
)


def install(
    trainer: Any, save_dir: str | os.PathLike[str], *, track: Mapping[str, Any] | None = None, **options: Any
) -> Any:
    """Gives ``trainer`` (a ``transformers.Trainer`` or any subclass) preempt's stop, exact resume and checkpoints.

    Call it once, after the Trainer is built; then ``trainer.train()`` as before, without ``resume_from_checkpoint``:
    a rerun of the same script resumes from ``save_dir`` by itself.

    Args:
        trainer: The Trainer.
        save_dir: Directory of the run's checkpoints.
        track: Further objects with state_dict()/load_state_dict() to save, by name.
        **options: :class:`~preempt.run.preemptible.PreemptibleRun`'s options, checked now.

    Returns:
        The Trainer callback that drives the run (its ``run`` is the PreemptibleRun while training).

    Raises:
        TypeError: ``trainer`` is not a Trainer, or an option is unknown or set by the installer.
        ValueError: An option's value out of its range.
        PreemptError: preempt was installed on this Trainer already, or it asks for what is not supported yet.
    """
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(f"{WHO}: expected a transformers.Trainer (or a subclass), got {type(trainer).__name__}")
    if not isinstance(save_dir, (str, os.PathLike)) or not str(save_dir):
        raise ValueError(f"{WHO}: save_dir: expected a directory path, got {save_dir!r}")
    missing = [name for name in _TAKEN if not callable(getattr(trainer, name, None))]
    if missing:
        raise PreemptError(
            f"{WHO}: this Trainer (transformers {transformers.__version__}) has no {', '.join(missing)};"
            " preempt.hf needs transformers 5.3 or newer (pip install 'preempt-torch[hf]')"
        )
    if any(isinstance(cb, _Driver) for cb in trainer.callback_handler.callbacks):
        raise PreemptError(f"{WHO}: preempt is installed on this Trainer already")
    args = trainer.args
    options = {**_from_trainer_args(args, options), **options}
    integration_config(WHO, **options)
    saves = getattr(args.save_strategy, "value", args.save_strategy) != "no"
    args.save_strategy = transformers.trainer_utils.SaveStrategy.NO  # preempt writes the checkpoints
    driver = _Driver(trainer, str(save_dir), dict(options), dict(track or {}), saves=saves)
    trainer.add_callback(driver)
    trainer.train = driver.train
    trainer.get_train_dataloader = driver.get_train_dataloader
    trainer._init_training_state = driver.init_training_state
    trainer._run_epoch = driver.run_epoch
    trainer._load_rng_state = driver.load_rng_state
    trainer._maybe_log_save_evaluate = driver.maybe_log_save_evaluate
    trainer._finalize_training = driver.finalize_training
    return driver


def _from_trainer_args(args: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """What the Trainer's saving arguments mean once preempt saves: options given to ``install`` win.

    ``save_strategy="steps"`` with ``save_steps``: the cadence (``checkpoint_every_steps``) when none is given;
    ``save_total_limit``: ``keep_last``; ``load_best_model_at_end`` with ``metric_for_best_model`` and
    ``greater_is_better``: preempt keeps the best checkpoint by that evaluation metric (``best_metric``,
    ``best_mode``, ``keep_best=1``), and the model is loaded from it when training ends.
    """
    out: dict[str, Any] = {}
    cadence = {"checkpoint_interval", "checkpoint_every_steps", "checkpoints_per_epoch"} & set(options)
    if not cadence and getattr(args.save_strategy, "value", args.save_strategy) == "steps" and args.save_steps:
        out.update(checkpoint_every_steps=int(args.save_steps), checkpoint_interval=None)
    if args.save_total_limit is not None:
        out["keep_last"] = int(args.save_total_limit)
    if args.load_best_model_at_end:
        metric = args.metric_for_best_model or "loss"
        out.update(
            best_metric=metric if metric.startswith("eval_") else f"eval_{metric}",
            best_mode="max" if args.greater_is_better else "min",
            keep_best=max(1, int(options.get("keep_best", 1))),
        )
    return out


@contextlib.contextmanager
def _batches_skipped_by_the_run() -> Iterator[None]:
    """The Trainer's ``skip_first_batches`` leaves the run's stand-in as it is: the run starts it at its batch."""
    original = hf_trainer.skip_first_batches

    def skip_first_batches(loader: Any, num_batches: int = 0) -> Any:
        return loader if isinstance(loader, RunBatches) else original(loader, num_batches)

    hf_trainer.skip_first_batches = skip_first_batches
    try:
        yield
    finally:
        hf_trainer.skip_first_batches = original


def _raw(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer inside Accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def _is_hf_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)
