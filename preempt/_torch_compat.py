"""The private parts of torch that preempt relies on, each behind one function named after what it does.

torch promises nothing about these. ``tests/unit/test_torch_compat.py`` checks each one against the installed torch
and fails naming the internal when a version changes it; CI runs that test with the oldest torch the project
supports and with the newest. Where an internal is missing at run time, the function says so by its return value
(nothing to stop, nothing to release) and the caller goes on as its documentation says.

torch is imported inside the functions that need it: the checkpoint commands, which never import torch, reach
:func:`version_counter` through :mod:`preempt.checkpoint.carry`.

- ``Tensor._version``: autograd's version counter, bumped by every in-place operation (carrying, lazy copies); a
  DTensor's local tensor keeps its own, which the DTensor's in-place operations leave as it was.
- ``OptimizedModule._orig_mod``: the module under ``torch.compile``'s wrapper.
- ``torch.distributed._shard.sharded_tensor.ShardedTensor``: the older sharded tensor beside DTensor.
- ``torch.utils.data._utils.worker._worker_info``: the worker's identity, which ``get_worker_info()`` returns.
- ``DataLoader._iterator`` and the multi-process iterator's ``_shutdown_workers``, ``_shutdown``, ``_workers``,
  ``_worker_init_fn``, ``_workers_done_event`` and ``_index_queues``: the workers a loader keeps.
- ``torch.utils.data._utils.signal_handling._set_worker_signal_handlers``: what a worker installs first.
- ``DataLoader.dataset`` set after construction (DataLoader's ``__setattr__`` refuses it), and ``DataLoader.__iter__``
  replaced while a run is active.
- ``torch.distributed.checkpoint.filesystem._StorageInfo``: where a DCP item lies in its file.
- ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``: where a DTensor's local piece lies in the
  whole tensor (DCP's planner asks the same).
- DCP's ``save``/``load`` keyword ``no_dist`` and ``Metadata.version`` (public, but absent before torch 2.7).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# ----------------------------------------------------------------------------------------------- tensors and modules


VERSION_OF = "_preempt_version_of"  # set on a DTensor's local piece: the DTensor whose version counter it has


def version_counter(t: torch.Tensor) -> int | None:
    """The tensor's version counter (every in-place change through autograd's view bumps it); None for a tensor
    without one (made under ``torch.inference_mode``). A DTensor's local piece (:func:`local_piece`) has its
    DTensor's: an in-place operation on a DTensor (``optimizer.step()`` on FSDP2's parameters) runs on the local
    tensor below autograd and bumps only the DTensor's counter."""
    try:
        return int(getattr(t, VERSION_OF, t)._version)
    except RuntimeError:
        return None


def compiled_original(model: Any) -> torch.nn.Module | None:
    """The module that ``torch.compile`` wrapped, when ``model`` is its wrapper; else None."""
    if type(model).__name__ == "OptimizedModule":
        inner = getattr(model, "_orig_mod", None)
        if inner is not None:
            return inner
    return None


def sharded_tensor_types() -> tuple[type, ...]:
    """The tensor types whose values one rank cannot write alone: DTensor, and ShardedTensor where torch has it."""
    from torch.distributed.tensor import DTensor

    kinds: tuple[type, ...] = (DTensor,)
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover - a torch without it
        return kinds
    return (*kinds, ShardedTensor)


def dtensor_local(t: Any) -> torch.Tensor:
    """A DTensor's local tensor, as ``to_local()`` returns it but without its autograd function (``_local_tensor``)."""
    import torch

    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()


def local_piece(t: Any) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A tensor's local piece and where it begins in the whole tensor: a DTensor's local shard and its offset
    (``compute_local_shape_and_global_offset``); any other tensor is its own piece, at offset 0.

    Raises:
        ValueError: The DTensor's local tensor is not the piece its placements describe.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, (0,) * t.dim()
    shape, offset = _local_layout(tuple(t.shape), t.device_mesh, tuple(t.placements))
    local = dtensor_local(t)
    if tuple(local.shape) != shape:
        raise ValueError(f"a local piece of shape {tuple(local.shape)} where its placements say {shape}")
    setattr(local, VERSION_OF, t)  # its changes are counted by the DTensor (version_counter)
    return local, offset


@functools.lru_cache(maxsize=4096)
def _local_layout(
    shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, offset) of this rank's piece of a DTensor of ``shape``: one computation per layout, not per
    tensor (a stop's save asks for every DTensor of the model, most of them of a few layouts)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(int(i) for i in local), tuple(int(i) for i in offset)


def dcp_no_dist(function: Callable[..., Any], single_process: bool) -> dict[str, bool]:
    """The keyword that tells DCP's ``save``/``load`` to run in one process, where it takes one (``no_dist``, since
    torch 2.7); before, DCP decides that itself from whether torch.distributed is initialized, as this does."""
    import inspect

    return {"no_dist": single_process} if "no_dist" in inspect.signature(function).parameters else {}


def dcp_metadata(state_dict_metadata: dict[str, Any], storage_data: dict[Any, Any], version: str | None) -> Any:
    """DCP's ``Metadata`` of a checkpoint; its ``version`` only where torch's has the field (since torch 2.7)."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import Metadata

    kept: dict[str, Any] = {"version": version} if "version" in {f.name for f in dataclasses.fields(Metadata)} else {}
    return Metadata(state_dict_metadata=state_dict_metadata, storage_data=storage_data, **kept)


def dcp_metadata_version(metadata: Any) -> str | None:
    """The DCP format version a ``Metadata`` records (None where torch's has no such field)."""
    return getattr(metadata, "version", None)


def dcp_storage_info(relative_path: str, offset: int, length: int) -> Any:
    """DCP's record of where an item lies in a ``.distcp`` file (``filesystem._StorageInfo``)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


# ------------------------------------------------------------------------------------------------- DataLoader workers


def act_as_worker(worker: int) -> None:
    """Makes ``get_worker_info()`` in this DataLoader worker report ``worker`` as its id (and the seed torch would
    have given that worker). torch's WorkerInfo refuses assignment (a frozen dataclass since torch 2.8, a class with
    a guarded ``__setattr__`` before), so a new one replaces it."""
    from torch.utils.data._utils import worker as torch_worker

    info = torch_worker._worker_info
    if info is None or info.id == worker:
        return
    seed = info.seed - info.id + worker
    if dataclasses.is_dataclass(info):  # (with slots: no vars())
        torch_worker._worker_info = dataclasses.replace(info, id=worker, seed=seed)
    else:
        fields: dict[str, Any] = {k: v for k, v in vars(info).items() if not k.startswith("_")}
        torch_worker._worker_info = torch_worker.WorkerInfo(**{**fields, "id": worker, "seed": seed})


def loader_iterator(loader: Any) -> Any | None:
    """The iterator a DataLoader keeps (its persistent workers'), or None."""
    return getattr(loader, "_iterator", None)


def forget_iterator(loader: Any) -> None:
    """The DataLoader makes a new iterator (and new workers) at its next ``iter()``."""
    if hasattr(loader, "_iterator"):
        loader._iterator = None


def shutdown_iterator(it: Any) -> bool:
    """Stops an iterator's workers through torch's own shutdown; False when it has none (not torch's iterator)."""
    stop = getattr(it, "_shutdown_workers", None)
    if not callable(stop):
        return False
    stop()
    return True


def workers_running(it: Any) -> bool:
    """The iterator has worker processes and has not been shut down."""
    return it is not None and not getattr(it, "_shutdown", True) and bool(getattr(it, "_workers", None))


def worker_init_of(it: Any) -> Any:
    """The ``worker_init_fn`` an iterator started its workers with."""
    return getattr(it, "_worker_init_fn", None)


def release_workers(it: Any) -> bool:
    """Tells an iterator's workers to leave their loop, as torch's shutdown does but without joining them (which
    does nothing once the interpreter is exiting): sets ``_workers_done_event`` and puts None on each index queue.
    False when that is not possible (not torch's iterator as known here, or its queues closed)."""
    try:
        it._workers_done_event.set()
        for q in it._index_queues:
            q.put(None)
    except Exception:
        return False
    return True


def wrap_worker_signal_handlers(wrap: Callable[[Callable[[], Any]], Callable[[], Any]], kind: type) -> None:
    """Replaces the function a DataLoader worker calls first (to install torch's signal handlers) by ``wrap`` of it,
    once: nothing is done when it already is an instance of ``kind``."""
    from torch.utils.data._utils import signal_handling

    install = signal_handling._set_worker_signal_handlers
    if not isinstance(install, kind):
        signal_handling._set_worker_signal_handlers = wrap(install)


def dataloader_iter() -> Any:
    """``DataLoader.__iter__`` as DataLoader's own class holds it now."""
    from torch.utils.data import DataLoader

    return DataLoader.__dict__.get("__iter__")


def set_dataloader_iter(function: Any) -> Any:
    """Replaces ``DataLoader.__iter__`` (for every loader: the run's window shields the workers of each loader
    iterated in it); returns the one it replaced."""
    from torch.utils.data import DataLoader

    previous = DataLoader.__dict__["__iter__"]
    type.__setattr__(DataLoader, "__iter__", function)
    return previous


def set_dataset(loader: Any, dataset: Any) -> None:
    """Sets a DataLoader's dataset after construction, which DataLoader's own ``__setattr__`` refuses (it protects a
    running iterator; the caller swaps it only while making one)."""
    object.__setattr__(loader, "dataset", dataset)


def set_samplers(loader: Any, sampler: Any, batch_sampler: Any) -> None:
    """Sets a DataLoader's sampler and batch sampler after construction (refused by its ``__setattr__`` as above),
    before any iterator of it is made: the DataLoader inside a loader Accelerate prepared gets preempt's order."""
    object.__setattr__(loader, "sampler", sampler)
    object.__setattr__(loader, "batch_sampler", batch_sampler)
