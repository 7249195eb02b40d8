"""The training loader Lightning iterates: the user's, processed as Lightning would, its batches from the run.

Lightning asks its data source (the LightningModule's or the datamodule's ``train_dataloader``, or the loader given
to ``fit``) for the training loader and creates each epoch's iterator itself. For an exact resume the run must
create that iterator (it restores the random state from just before it, seeds each sample's draws and starts at
the saved batch: :mod:`preempt.run.data_cursor`). So, for the time of the fit, the source hands Lightning a
:class:`~preempt.data.stand_in.RunBatches` instead: it wraps the user's loader after Lightning's own processing
(the distributed sampler under DDP, the workers' ``worker_init_fn``), has its length, shows its sampler (Lightning
sets the sampler's epoch through it), and each ``iter()`` asks the run for the next epoch's batches.

A loader that samples with torch's own ``RandomSampler`` or ``SequentialSampler`` (``shuffle=True`` or ``False``), or
Lightning's ``DistributedSampler`` under DDP, is remade with a
:class:`~preempt.data.sampler.ResumableSampler` in its place (:func:`resumable`): a resumed epoch then starts at its
sample without loading the batches before it, and random draws inside the dataset are seeded per sample (with any
number of workers). Any other loader is iterated as it is, and a resumed epoch replays its batches up to the saved
one (exact when it yields the same batches again; the log says so).

Lightning's data source is read from ``trainer.fit_loop._data_source`` (private, pinned by the Lightning tests):
its ``instance`` is the LightningModule, the datamodule, or the loader itself, and ``name`` the hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import PreemptError

if TYPE_CHECKING:
    import lightning.pytorch as pl

HOOK = "train_dataloader"


def resumable(loader: Any, make_sampler: Callable[..., Any], seed: int) -> Any:
    """``loader`` remade with ``make_sampler(dataset, shuffle=, seed=, drop_last=)`` in place of torch's sampler.

    Only a ``DataLoader`` over a map-style dataset whose batches a plain ``BatchSampler`` forms from a
    ``RandomSampler`` (without replacement or a sample count), a ``SequentialSampler`` or a ``DistributedSampler``
    (whose own seed and ``drop_last`` are kept); anything else is returned as it is. Lightning's
    ``_update_dataloader`` remakes it, as Lightning does when it adds a distributed sampler.
    """
    from lightning.fabric.utilities.data import _update_dataloader
    from torch.utils.data import (
        BatchSampler,
        DataLoader,
        DistributedSampler,
        IterableDataset,
        RandomSampler,
        SequentialSampler,
    )

    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    if type(loader.batch_sampler) is not BatchSampler:
        return loader
    sampler = loader.sampler
    drop_last = False
    if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        shuffle = True
    elif type(sampler) is SequentialSampler:
        shuffle = False
    elif type(sampler) is DistributedSampler:
        shuffle, seed, drop_last = sampler.shuffle, sampler.seed, sampler.drop_last
    else:
        return loader
    return _update_dataloader(loader, make_sampler(loader.dataset, shuffle=shuffle, seed=seed, drop_last=drop_last))


class SourceSwap:
    """Makes the trainer's training-data source hand out what ``wrap`` makes of its loader, until :meth:`undo`.

    Args:
        trainer: The trainer being fit.
        wrap: Turns the loader the source gives into what Lightning iterates.
    """

    def __init__(self, trainer: pl.Trainer, wrap: Callable[[Any], Any]) -> None:
        import lightning.pytorch as pl

        source = getattr(trainer.fit_loop, "_data_source", None)
        if source is None or not hasattr(source, "instance") or not hasattr(source, "name"):
            raise PreemptError(
                "PreemptCallback: this Lightning version keeps no trainer.fit_loop._data_source with instance and"
                " name; preempt cannot hand Lightning the run's batches (supported: lightning>=2.2,<2.7)"
            )
        self._undo: Callable[[], None] | None = None
        instance, name = source.instance, source.name
        if isinstance(instance, (pl.LightningModule, pl.LightningDataModule)):
            if name != HOOK:
                raise PreemptError(f"PreemptCallback: the training data source's hook is {name!r}, not {HOOK!r}")
            original = getattr(instance, HOOK)

            def train_dataloader() -> Any:
                return wrap(original())

            # an attribute of the instance: Lightning calls getattr(instance, "train_dataloader")
            object.__setattr__(instance, HOOK, train_dataloader)

            def undo() -> None:
                if instance.__dict__.get(HOOK) is train_dataloader:
                    del instance.__dict__[HOOK]

            self._undo = undo
        elif instance is not None:  # the loader given to fit(train_dataloaders=...), returned by the source as is
            source.instance = wrap(instance)

            def undo_given() -> None:
                source.instance = instance

            self._undo = undo_given

    def undo(self) -> None:
        """Leaves the source as it was."""
        if self._undo is not None:
            self._undo()
            self._undo = None
