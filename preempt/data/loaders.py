"""What the run needs to know and do about a DataLoader.

* Find the :class:`~preempt.data.sampler.ResumableSampler` inside a loader, so a
  resumed epoch can start at the right sample without loading anything.
* Stop the persistent workers a loader keeps, when the run ends.

Keeping stop signals away from the workers is :mod:`preempt.data.shield`.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import BatchSampler

from .. import _torch_compat
from .sampler import ResumableSampler


def shutdown_workers(loader: Any) -> None:
    """Stops the persistent workers a DataLoader keeps between epochs (``persistent_workers=True``).

    The run shuts them down itself when it ends, rather than leaving them to
    the loader's deletion or to the interpreter's exit. Uses the iterator's own
    shutdown (:func:`preempt._torch_compat.shutdown_iterator`; absent: nothing to do).
    """
    if _torch_compat.shutdown_iterator(_torch_compat.loader_iterator(loader)):
        _torch_compat.forget_iterator(loader)


def find_sampler(loader: Any) -> tuple[ResumableSampler, int] | None:
    """The ResumableSampler feeding ``loader`` and the samples per batch, when skipping is exact.

    Skipping ``k`` batches is skipping ``k * batch_size`` samples of the sampler
    only when the batches are formed by a plain ``BatchSampler`` (or when the
    loader does not batch). A custom batch sampler (bucketing, say) may group
    samples in any order, so then None is returned and the run replays batches.
    """
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, ResumableSampler):
        return None
    batches = getattr(loader, "batch_sampler", None)
    if batches is None:
        return sampler, 1
    if type(batches) is BatchSampler and batches.sampler is sampler:
        return sampler, batches.batch_size
    return None


def index_sampler(loader: Any) -> ResumableSampler | None:
    """The ResumableSampler that picks the loader's indices, whatever batches them (unlike find_sampler)."""
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, ResumableSampler):
        return sampler
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return inner if isinstance(inner, ResumableSampler) else None


def length(loader: Any) -> int | None:
    """len(loader), or None when it has no length."""
    try:
        return len(loader)
    except TypeError:
        return None


def prepared_by_accelerate(loader: Any) -> str | None:
    """The class name of a loader Accelerate made (``accelerator.prepare(loader)``), else None.

    Such a loader cannot be replayed exactly: Accelerate replaces its sampler and makes the epoch's iterator lazily
    in a generator of its own, after the run has set up each sample's random stream and the random state for it.
    Recognised by the class's module, without importing Accelerate.
    """
    cls = type(loader)
    return cls.__name__ if cls.__module__.split(".")[0] == "accelerate" else None
