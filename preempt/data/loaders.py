"""What the run needs to know and do about a DataLoader.

* Find the :class:`~preempt.data.sampler.ResumableSampler` inside a loader, so a
  resumed epoch can start at the right sample without loading anything.
* Stop the persistent workers a loader keeps, when the run ends.
* Recognise the loaders frameworks wrap around a DataLoader (Accelerate's, Lightning Fabric's) and what is inside
  Fabric's wrappers, by their classes' modules, without importing the frameworks.

Keeping stop signals away from the workers is :mod:`preempt.data.shield`.

**Lightning Fabric.** ``fabric.setup_dataloaders(loader)`` returns a ``_FabricDataLoader``: it holds the DataLoader
(``_dataloader``, after Fabric swapped a ``DistributedSampler`` in under DDP unless ``use_distributed_sampler=False``),
and its ``__iter__`` is a generator that calls ``set_epoch(n)`` on the loader's sampler with ``n`` its own count of
iterations (``_num_iter_calls``), then iterates the DataLoader, moving each batch to the device. A resumed process
counts from 0: the run sets that count to its epoch before each iteration (:func:`fabric_epoch`), so a
``DistributedSampler`` of Fabric's follows the run's epoch as a ``ResumableSampler`` does. Both attributes are private
(Lightning 2.x), pinned by tests/process/test_fabric.py.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import BatchSampler, DataLoader

from .. import _torch_compat
from ..errors import PreemptError
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
    if not hasattr(loader, "batch_sampler"):
        return None  # a wrapper that shows the sampler but not how it batches: its batches are replayed
    batches = loader.batch_sampler
    if batches is None:  # a DataLoader that does not batch: one sample per item
        return sampler, 1
    if type(batches) is BatchSampler and batches.sampler is sampler:
        return sampler, batches.batch_size
    return None


_INNER_LOADERS = ("loader", "_loader", "dataloader", "_dataloader")
"""Where wrappers of a DataLoader keep it (timm's PrefetchLoader: ``loader``)."""


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


_FABRIC_MODULES = ("lightning.fabric", "lightning_fabric")  # the package in ``lightning``, and standalone


def _from_fabric(obj: Any) -> bool:
    module = type(obj).__module__
    return any(module == m or module.startswith(m + ".") for m in _FABRIC_MODULES)


def wrapped_loader(loader: Any) -> Any | None:
    """The DataLoader inside a loader that wraps one and iterates it (Lightning Fabric's, timm's PrefetchLoader, a
    user's), else None: the run iterates the wrapper, with the DataLoader inside it set up as any other."""
    inner = fabric_loader(loader)
    if inner is not None or isinstance(loader, DataLoader):
        return inner
    return next((getattr(loader, a) for a in _INNER_LOADERS if isinstance(getattr(loader, a, None), DataLoader)), None)


def fabric_loader(loader: Any) -> Any | None:
    """The DataLoader inside Lightning Fabric's loader (``fabric.setup_dataloaders(loader)``), else None."""
    if type(loader).__name__ != "_FabricDataLoader" or not _from_fabric(loader):
        return None
    return getattr(loader, "_dataloader", None)


def fabric_epoch(loader: Any, inner: Any, epoch: int) -> None:
    """Makes Fabric's ``loader`` set ``epoch`` as its sampler's epoch at its next iteration (it counts its own).

    Raises:
        PreemptError: Fabric shards a ``ResumableSampler`` a second time (``DistributedSamplerWrapper``), which no
            resume can continue; the message says what to pass instead.
    """
    for sampler in (getattr(inner, "sampler", None), getattr(getattr(inner, "batch_sampler", None), "sampler", None)):
        wrapped = getattr(getattr(sampler, "dataset", None), "_sampler", None)
        if type(sampler).__name__ == "DistributedSamplerWrapper" and isinstance(wrapped, ResumableSampler):
            raise PreemptError(
                "run.batches(): Lightning Fabric's setup_dataloaders() put its DistributedSamplerWrapper around"
                f" run.sampler() ({wrapped.num_replicas} replica(s)): Fabric's sharding replaces the run's, and a"
                " resumed epoch cannot start at its sample; call fabric.setup_dataloaders(loader,"
                " use_distributed_sampler=False) (run.sampler() shards by rank under torch.distributed)"
            )
    if isinstance(getattr(loader, "_num_iter_calls", None), int):
        loader._num_iter_calls = epoch


def fabric_unwrapped(obj: Any) -> Any:
    """The module inside Fabric's ``_FabricModule`` or the optimizer inside its ``_FabricOptimizer``
    (``fabric.setup(model, optimizer)``), else ``obj``: the run saves, restores and hooks the objects themselves."""
    if not _from_fabric(obj):
        return obj
    name = type(obj).__name__
    if name == "_FabricModule":
        inner = getattr(obj, "_original_module", None)
    elif name.startswith("Fabric"):  # a _FabricOptimizer takes the name "Fabric<the optimizer's class>"
        inner = getattr(obj, "_optimizer", None)
    else:
        inner = None
    return obj if inner is None else inner
