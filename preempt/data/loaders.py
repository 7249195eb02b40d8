"""What the run needs to know and do about a DataLoader.

Two things:

* Find the :class:`~preempt.data.sampler.ResumableSampler` inside a loader, so a
  resumed epoch can start at the right sample without loading anything.
* Keep stop signals away from DataLoader workers. ``timeout`` signals the
  whole process group and SLURM signals every process of the job, so workers
  get the SIGTERM too. torch installs a handler in each worker that dies on
  SIGTERM, and the main process then raises "DataLoader worker ... is killed
  by signal" from its SIGCHLD handler, at an arbitrary point, possibly in the
  middle of the checkpoint write. With the shield, workers ignore the stop
  signals and leave when the main process shuts them down (or dies: workers
  watch their parent).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable
from typing import Any

from torch.utils.data import BatchSampler

from .sampler import ResumableSampler


class ShieldedWorkerInit:
    """A ``worker_init_fn`` that ignores stop signals, then calls the user's own.

    A module-level class so that it pickles for the spawn and forkserver start methods.
    """

    def __init__(self, signals: Iterable[int], inner: Callable[[int], Any] | None) -> None:
        self.signals = tuple(int(s) for s in signals)
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        for s in self.signals:
            signal.signal(s, signal.SIG_IGN)
        if self.inner is not None:
            self.inner(worker_id)


def shield_workers(loader: Any, signals: Iterable[int]) -> Any:
    """Makes the loader's future workers ignore ``signals``; returns the loader.

    Takes effect for iterators created afterwards. Idempotent.
    """
    if getattr(loader, "num_workers", 0) and not isinstance(loader.worker_init_fn, ShieldedWorkerInit):
        loader.worker_init_fn = ShieldedWorkerInit(signals, loader.worker_init_fn)
    return loader


def shutdown_workers(loader: Any) -> None:
    """Stops the persistent workers a DataLoader keeps between epochs (``persistent_workers=True``).

    Shielded workers ignore SIGTERM, and at interpreter exit multiprocessing
    stops its daemon children with SIGTERM and then waits for them: a loader
    still referenced at that point (one made at module level) would hang the
    exit forever. So the run shuts them down itself when it ends. Uses the
    iterator's own ``_shutdown_workers`` (private torch API; absent: nothing to do).
    """
    it = getattr(loader, "_iterator", None)
    stop = getattr(it, "_shutdown_workers", None)
    if callable(stop):
        stop()
        loader._iterator = None


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
