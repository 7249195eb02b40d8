"""Exact replay of what a DataLoader hands out: per-sample random streams and iterable-dataset positions.

A resumed epoch gets new DataLoader workers. Their generators start from the
epoch's seed, so random augmentation drawn inside ``Dataset.__getitem__``
restarts: after a mid-epoch resume, batches 7, 8, 9 would get the draws of
batches 1, 2, 3. And a worker's place in a stream (an ``IterableDataset``)
lives only in the worker. This module removes both dependencies on the
worker, without any change to the user's loop:

* **Map-style datasets** whose loader samples from a
  :class:`~preempt.data.sampler.ResumableSampler` (``per_sample_rng=True``, the
  default): just before sample ``i`` of epoch ``e`` is fetched, the global
  generators of the process that fetches it (Python's ``random``, NumPy's
  global ``np.random``, torch's CPU generator) are seeded from
  ``(data seed, e, i)`` (:func:`sample_seed`; the data seed is the sampler's
  seed). A sample's draws are then a pure function of those three numbers:
  the same whichever worker fetches it, however many workers there are, with
  or without ``persistent_workers``, and wherever the run resumed. A
  ``collate_fn`` that draws continues from the batch's last sample, so it
  replays too.
* **Iterable datasets**: each batch carries the state of the worker that made
  it (its ``dataset.state_dict()`` and how many samples it has yielded this
  epoch). The run keeps the state of each worker's latest batch the loop
  received, and a checkpoint stores them. On resume every new worker loads its
  state and continues; since torch's round-robin starts at worker 0 again,
  new worker ``j`` takes the identity (``get_worker_info().id``) and the state
  of old worker ``(j + next) % num_workers``, where ``next`` is the worker
  whose batch the loop would have received next, so batches come in the same
  order. Inside workers each sample is seeded from (run seed, epoch, worker,
  count), so random draws replay as well. A dataset without
  ``state_dict``/``load_state_dict`` is replayed from the epoch's start.
* **The run's own generators** are left alone: ``iter(loader)`` (which draws
  the workers' base seed from torch's generator, but only on the first epoch
  of persistent workers) runs between a capture and a restore of the
  generators, and with ``num_workers=0`` so does every batch fetched in the
  main process. The loop's own draws (dropout) are then the same with any
  number of workers.

How: while ``iter(loader)`` creates its iterator, the loader's ``dataset``
(and, for iterable datasets, its ``collate_fn``) is replaced by a wrapper,
which the iterator (and its workers) keep; the user's loader is put back as
it was at once. The epoch reaches persistent workers through a shared-memory
integer, and an iterable dataset with ``set_epoch`` has it called with the
epoch in the main process and in every worker at the start of each epoch's
iteration (before a saved state is loaded): persistent workers keep their own
copy of the dataset, which a call in the main process would not reach.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import multiprocessing
import random
import weakref
from collections import namedtuple
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .. import _log, _torch_compat
from .loaders import index_sampler, shutdown_workers
from .sampler import mix

log = _log.log

_SAMPLE_SALT = 0x5EED_5A3F_1E5D_0A7A  # keeps the per-sample streams apart from the sampler's order
_STREAM_SALT = 0x57E4_3A11_0B0E_F00D  # the same for iterable datasets' per-worker streams
_MASK32 = 0xFFFFFFFF

# A batch of an iterable dataset as it leaves a worker: the batch, which worker made it, and the
# worker's state after it. A namedtuple, so that pin_memory pins the batch inside it.
Stated = namedtuple("Stated", ["batch", "worker", "state"])


def sample_seed(data_seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed of sample ``index`` in ``epoch``: a pure function of the three."""
    return mix(mix(data_seed ^ _SAMPLE_SALT, epoch), index)


def stream_seed(run_seed: int, epoch: int, worker: int, count: int) -> int:
    """The 64-bit seed of the ``count``-th sample an iterable dataset's ``worker`` yields in ``epoch``."""
    return mix(mix(mix(run_seed ^ _STREAM_SALT, epoch), worker), count)


def reseed(seed: int) -> None:
    """Seeds Python's ``random``, NumPy's global generator and torch's CPU generator from one 64-bit seed.

    ``torch.default_generator.manual_seed`` rather than ``torch.manual_seed``:
    the latter also seeds every accelerator (far slower), and augmentation in a
    DataLoader runs on the CPU. NumPy's legacy seeding takes 32 bits (the 64 are folded).
    """
    random.seed(seed)
    np.random.seed((seed ^ (seed >> 32)) & _MASK32)
    torch.default_generator.manual_seed(seed)


def _capture() -> tuple[Any, Any, torch.Tensor]:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _restore(saved: tuple[Any, Any, torch.Tensor]) -> None:
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


@contextlib.contextmanager
def _generators_kept() -> Iterator[None]:
    saved = _capture()
    try:
        yield
    finally:
        _restore(saved)


class _Wrapper:
    """Shared by both wrappers: attribute reads go to the user's dataset (a ``worker_init_fn`` may read them)."""

    inner: Any

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):  # during unpickling, and no dunder lookups
            raise AttributeError(name)
        return getattr(inner, name)


class SeededDataset(_Wrapper, torch.utils.data.Dataset):
    """A map-style dataset whose every sample is fetched with generators seeded by (data seed, epoch, index)."""

    def __init__(self, inner: Any, data_seed: int, epoch: Any) -> None:
        self.inner = inner
        self.data_seed = data_seed
        self.epoch = epoch  # a multiprocessing RawValue: persistent workers see the main process's epoch
        self._epoch_key: tuple[int, int] = (-1, 0)

    def _seed(self, index: Any) -> None:
        e = self.epoch.value
        if self._epoch_key[0] != e:
            self._epoch_key = (e, mix(self.data_seed ^ _SAMPLE_SALT, e))
        reseed(mix(self._epoch_key[1], int(index)))

    def __getitem__(self, index: Any) -> Any:
        self._seed(index)
        return self.inner[index]

    def __getitems__(self, indices: Any) -> list[Any]:
        # torch's fetcher calls this with a batch's indices. Each sample is seeded on its own, so a
        # dataset's batched __getitems__ is called one index at a time.
        many = getattr(self.inner, "__getitems__", None)
        out = []
        for i in indices:
            self._seed(i)
            out.append(many([i])[0] if many else self.inner[i])
        return out

    def __len__(self) -> int:
        return len(self.inner)


@dataclasses.dataclass(frozen=True)
class WorkersResume:
    """Where each worker of an iterable dataset continues in the resumed epoch.

    Attributes:
        epoch: The epoch it applies to (later epochs start fresh).
        first: The old worker whose batch comes next; new worker ``j`` acts as old ``(j + first) % n``.
        workers: Old worker id -> its state after its latest batch the loop received.
    """

    epoch: int
    first: int
    workers: dict[int, Any]


class StatefulIterable(_Wrapper, IterableDataset):
    """An iterable dataset whose workers report their state with each batch and resume from a saved one."""

    def __init__(self, inner: Any, run_seed: int | None, epoch: Any, stateful: bool) -> None:
        self.inner = inner
        self.run_seed = run_seed  # None: no per-sample seeding in the workers
        self.epoch = epoch
        self.stateful = stateful
        self.resume: WorkersResume | None = None
        self._real: int | None = None  # this copy's worker id as torch numbered it (set in the worker)
        self._worker = 0
        self._count = 0

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        epoch = self.epoch.value
        set_epoch(self.inner, epoch)  # in each worker: persistent ones keep their own copy from epoch to epoch
        resume = self.resume if self.resume is not None and self.resume.epoch == epoch else None
        worker = 0
        if info is not None:
            if self._real is None:  # the first epoch of this worker: torch's own numbering
                self._real = info.id
            worker = self._real if resume is None else (self._real + resume.first) % info.num_workers
            _torch_compat.act_as_worker(worker)
        count = 0
        saved = resume.workers.get(worker) if resume is not None else None
        if saved is not None:
            if self.stateful:
                self.inner.load_state_dict(saved["dataset"])
            count = int(saved["count"])
        self._worker, self._count = worker, count
        seed = self.run_seed if info is not None else None  # per-sample streams in the workers only
        it = iter(self.inner)
        while True:
            if seed is not None:
                reseed(stream_seed(seed, epoch, worker, count))
            try:
                item = next(it)
            except StopIteration:
                return
            count += 1
            self._count = count
            yield item

    def snapshot(self) -> tuple[int, dict[str, Any]]:
        """This worker's id and its state after the samples it has yielded."""
        return self._worker, {
            "dataset": self.inner.state_dict() if self.stateful else None,
            "count": self._count,
        }


def set_epoch(dataset: Any, epoch: int) -> None:
    """``dataset.set_epoch(epoch)`` when the dataset has one (the convention of DistributedSampler and HF datasets)."""
    method = getattr(dataset, "set_epoch", None)
    if callable(method):
        method(epoch)


class CollateWithState:
    """A ``collate_fn`` that returns the batch with the state of the worker that made it."""

    def __init__(self, collate: Callable[[Any], Any], dataset: StatefulIterable) -> None:
        self.collate = collate
        self.dataset = dataset  # the main process's copy (num_workers=0)

    def __call__(self, samples: Any) -> Stated:
        batch = self.collate(samples)
        info = get_worker_info()
        dataset = cast(StatefulIterable, info.dataset) if info is not None else self.dataset  # a worker's: the wrapper
        worker, state = dataset.snapshot()
        return Stated(batch, worker, state)


class LoaderFeed:
    """One DataLoader as the run iterates it: the wrappers it needs, and what its iterable workers have reached.

    Args:
        loader: The DataLoader (anything else is iterated as it is).
        run_seed: The run's seed for iterable datasets' per-sample streams.
        inner: The DataLoader inside ``loader`` when ``loader`` wraps one and makes its iterator lazily, at its first
            batch (Accelerate's prepared loaders, :mod:`preempt.data.prepared`; Lightning Fabric's, which is no
            DataLoader itself): its dataset is the one wrapped, and ``loader``'s first batch is taken while the
            generators are kept.
    """

    def __init__(self, loader: Any, run_seed: int, inner: Any = None) -> None:
        self._inner = inner
        if not isinstance(loader, DataLoader) and isinstance(inner, DataLoader):
            loader = inner  # what it is made of is the inner DataLoader's (Fabric's wrapper copies its attributes)
        self.kind = "plain"
        self.stateful = False
        self.dataset_name = type(getattr(loader, "dataset", None)).__name__  # for messages
        self.is_loader = isinstance(loader, DataLoader)
        self.num_workers = int(getattr(loader, "num_workers", 0) or 0)
        self._epoch = multiprocessing.RawValue("q", 0)
        self._wrapper: SeededDataset | StatefulIterable | None = None
        self._workers: dict[int, Any] = {}
        self._next = 0
        self._current = -1
        self._iterator: weakref.ref[Any] | None = None  # the latest epoch's, while it lives
        if not isinstance(loader, DataLoader):
            return
        dataset = loader.dataset
        if isinstance(dataset, IterableDataset):
            self.kind = "iterable"
            self.stateful = callable(getattr(dataset, "state_dict", None)) and callable(
                getattr(dataset, "load_state_dict", None)
            )
            self._wrapper = StatefulIterable(dataset, run_seed, self._epoch, self.stateful)
            return
        sampler = index_sampler(loader)
        if sampler is not None and sampler.per_sample_rng:
            self.kind = "seeded"
            self._wrapper = SeededDataset(dataset, sampler.seed, self._epoch)

    @property
    def wraps(self) -> bool:
        """The loader's iteration goes through this module's wrappers."""
        return self._wrapper is not None

    def iterate(self, loader: Any, epoch: int, saved: Any = None) -> Iterator[Any]:
        """The epoch's iterator; for an iterable dataset, ``saved`` (from :meth:`state`) says where to continue."""
        self._current = epoch
        if self._wrapper is None:
            if self._inner is not None:
                with _generators_kept():
                    return _started(self._keep(iter(loader)))
            return self._keep(iter(loader))
        self._epoch.value = epoch
        if self.kind == "iterable":
            set_epoch(loader.dataset, epoch)  # the main process's copy, which new workers are made from
        self._workers, self._next = {}, 0
        if isinstance(self._wrapper, StatefulIterable):
            resume = self.workers_resume(saved, epoch)
            self._wrapper.resume = resume
            if resume is not None:
                self._workers, self._next = dict(resume.workers), resume.first
        with _generators_kept(), _swapped(loader if self._inner is None else self._inner, self._wrapper):
            it = self._keep(iter(loader))
            if self._inner is not None:
                it = _started(it)
        if self.kind == "seeded":
            return _kept_per_batch(it) if self.num_workers == 0 else it
        return self._received(it)

    def _keep(self, it: Iterator[Any]) -> Iterator[Any]:
        try:
            self._iterator = weakref.ref(it)
        except TypeError:  # a generator of the user's, say: no workers of torch's to stop
            self._iterator = None
        return it

    def stop_workers(self, loader: Any) -> None:
        """Stops the workers of the latest iterator and the persistent ones.

        Workers ignore stop signals (:func:`preempt.data.shield.shield_workers`),
        and at interpreter exit multiprocessing stops its daemon children with
        SIGTERM and then waits for them: an iterator still referenced then (by
        the traceback of an exception that ended the loop, or a loader made at
        module level) would hang the exit. So the run stops them when it ends.
        """
        it = self._iterator() if self._iterator is not None else None
        _torch_compat.shutdown_iterator(it)  # not torch's iterator: nothing to stop
        shutdown_workers(loader if self._inner is None else self._inner)

    def workers_resume(self, saved: Any, epoch: int) -> WorkersResume | None:
        """Where each worker continues after ``saved``, when it is of this epoch and this many workers; else None."""
        if self._mismatch(saved, epoch) is not None:
            return None
        n = max(self.num_workers, 1)
        return WorkersResume(epoch, int(saved.get("next", 0)) % n, {int(k): v for k, v in saved["workers"].items()})

    def can_seek(self, saved: Any, epoch: int) -> str | None:
        """None when the epoch can continue from ``saved`` without replaying batches, else why not."""
        if self.kind != "iterable":
            return "not an iterable dataset"
        if not self.stateful:
            return "the IterableDataset has no state_dict()/load_state_dict()"
        return self._mismatch(saved, epoch)

    def _mismatch(self, saved: Any, epoch: int) -> str | None:
        """Why ``saved`` positions do not apply to this epoch of this loader; None when they do."""
        if not isinstance(saved, dict) or saved.get("epoch") != epoch or not isinstance(saved.get("workers"), dict):
            return "the checkpoint holds no position of its workers"
        if saved.get("num_workers") != self.num_workers:
            return (
                f"its positions were saved with num_workers={saved.get('num_workers')},"
                f" the loader now has {self.num_workers}"
            )
        return None

    def _received(self, it: Iterator[Any]) -> Iterator[Any]:
        n = max(self.num_workers, 1)
        for item in it:
            if type(item) is Stated:
                self._workers[item.worker] = item.state
                self._next = (item.worker + 1) % n
                item = item.batch
            yield item

    def state(self) -> dict[str, Any] | None:
        """Where the iterable dataset's workers stand after the batches the loop received; for another DataLoader,
        its epoch and number of workers (None: nothing to save)."""
        if not self.is_loader or self._current < 0:
            return None
        if self.kind != "iterable":
            return {"epoch": self._current, "num_workers": self.num_workers}
        return {
            "epoch": self._current,
            "num_workers": self.num_workers,
            "next": self._next,
            "workers": dict(self._workers),
        }


@contextlib.contextmanager
def _swapped(loader: DataLoader, wrapper: SeededDataset | StatefulIterable) -> Iterator[None]:
    """The loader's dataset (and collate_fn, for an iterable) replaced while its iterator is created.

    DataLoader refuses to set ``dataset`` after construction (to protect a
    running iterator); the iterator made here keeps the wrapper, and the
    loader gets its own dataset back before anything else sees it.
    """
    dataset, collate = loader.dataset, loader.collate_fn
    _torch_compat.set_dataset(loader, wrapper)
    if isinstance(wrapper, StatefulIterable):
        loader.collate_fn = CollateWithState(collate, wrapper)
    try:
        yield
    finally:
        _torch_compat.set_dataset(loader, dataset)
        loader.collate_fn = collate


def _started(it: Iterator[Any]) -> Iterator[Any]:
    """``it`` with its first item taken now: a generator that makes the DataLoader's iterator at its first batch (it
    draws the workers' seed from torch's generator, and Accelerate's synchronises generators) does it here."""
    try:
        first = next(it)
    except StopIteration:
        return iter(())
    return itertools.chain((first,), it)


def _kept_per_batch(it: Iterator[Any]) -> Iterator[Any]:
    """Batches fetched in this process (num_workers=0) leave its generators as they were."""
    while True:
        saved = _capture()
        try:
            item = next(it)
        except StopIteration:
            return
        finally:
            _restore(saved)
        yield item
