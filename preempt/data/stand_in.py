"""A training loader's stand-in, for a framework that iterates the loader itself: each epoch's batches from the run.

Lightning and the Hugging Face Trainer create each epoch's iterator themselves. For an exact resume the run must
create it (it restores the random state from just before it, seeds each sample's draws and starts at the saved
batch: :mod:`preempt.run.data_cursor`). The integrations hand the framework a :class:`RunBatches` instead of the
user's loader: it has the loader's length, dataset, sampler and batch size, and its ``iter()`` asks the run for the
epoch's batches at the first ``next()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any


class RunBatches:
    """Stands for the user's training loader in Lightning; each epoch's batches come from the run.

    ``iter()`` returns a lazy iterator: the run opens the epoch at its first ``next()``, so an ``iter()`` that
    Lightning makes only to check the loader is iterable (its ``_check_dataloader_iterable``) opens nothing.

    Args:
        loader: The user's loader, processed by Lightning (``_process_dataloader``).
        open_epoch: Called with ``loader`` when an epoch's first batch is asked for; returns that epoch's iterator.
    """

    def __init__(self, loader: Iterable[Any], open_epoch: Callable[[Iterable[Any]], Iterator[Any]]) -> None:
        self.loader = loader
        self._open_epoch = open_epoch

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]  # a TypeError says "no length", as Lightning expects

    def __iter__(self) -> Iterator[Any]:
        return _Epoch(self.loader, self._open_epoch)

    @property
    def sampler(self) -> Any:
        return getattr(self.loader, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        return getattr(self.loader, "batch_sampler", None)

    @property
    def dataset(self) -> Any:
        return getattr(self.loader, "dataset", None)

    @property
    def batch_size(self) -> Any:
        return getattr(self.loader, "batch_size", None)

    @property
    def num_workers(self) -> int:
        return int(getattr(self.loader, "num_workers", 0))


class _Epoch:
    """One epoch's iterator, opened at the first ``next()``."""

    def __init__(self, loader: Iterable[Any], open_epoch: Callable[[Iterable[Any]], Iterator[Any]]) -> None:
        self._loader = loader
        self._open_epoch = open_epoch
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._it = self._open_epoch(self._loader)
        return next(self._it)
