"""Accelerate's prepared loaders (``accelerator.prepare(loader)``) with preempt's order, exact on resume.

A loader Accelerate prepared is a ``DataLoaderShard`` (each process iterates its part of the batches through a
``BatchSamplerShard``, or the plain batches alone) or a ``DataLoaderDispatcher`` (process 0 reads groups of batches and
each process takes its slice of them); both move the batches to ``accelerator.device`` and tell Accelerate's gradient
state when the data runs out (``accelerator.accumulate`` synchronises the gradients at the epoch's last batch). The
run keeps all of that and changes one thing, once per loader (:func:`take_over`): the batch sampler inside the loader
becomes :class:`ShardedBatches`, whose indices come from a :class:`~preempt.data.sampler.ResumableSampler` (a pure
function of seed and epoch) and which yields exactly the index lists Accelerate's own sharding would, but can start
at any batch of the epoch in O(1), without loading, reading or replaying what comes before. The run then iterates the
prepared loader itself (``DataLoaderShard.__iter__``), with the per-sample random streams and the workers' shield of a
plain DataLoader (:mod:`preempt.data.replay`) set on the DataLoader inside it.

**The order.** A ``RandomSampler`` becomes ``ResumableSampler(shuffle=True, seed=0)`` and a ``SequentialSampler``
``shuffle=False`` (``run.sampler()``'s default seed, the same on every process without any exchange); Accelerate's
``SeedableRandomSampler`` keeps its seed (``DataLoaderConfiguration(data_seed=...)``), and a ``ResumableSampler`` the
user gave is kept as it is. Accelerate's synchronisation of random generators at the start of each epoch
(``rng_types``) runs, and is undone at once with every other draw of the loader's start: the order needs none of it.

**What is refused, at the first ``run.batches()``, with the reason:** an ``IterableDataset`` (its position lives in
its workers and in Accelerate's buffers of ``IterableDatasetShard``), torchdata's ``StatefulDataLoader`` (it keeps a
position of its own), a batch sampler other than torch's ``BatchSampler`` (bucketing groups indices in its own
order), a sampler other than the four above or one that draws with replacement, a ``ResumableSampler`` sharded by
rank (Accelerate shards the batches itself: the order must be the whole epoch's), a loader made by
``skip_first_batches`` (the run skips by itself), and a ``DataLoaderDispatcher`` of several processes whose last group
of batches does not divide among them while ``drop_last=False``: it completes that group with the first samples of
the iteration, which a resumed epoch does not begin with.

**Why here, by duck typing.** ``import preempt`` never imports Accelerate (the import-linter contract
"no-framework"), and ``run.batches()`` is the run's: a part above the run (beside :mod:`preempt.hf`) would have the
run call upward to reach it. What the run needs of a prepared loader is a handful of attributes Accelerate documents
(``base_dataloader``, ``set_epoch``, ``split_batches``, the shard's ``num_processes``/``process_index``), so the
loader is recognised by its class's module and name (:func:`~preempt.data.loaders.prepared_by_accelerate`) and
driven through those; ``tests/unit/test_accelerate_loader.py`` checks every index list against Accelerate's own
``BatchSamplerShard`` on the installed version.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler

from .. import _torch_compat
from ..errors import PreemptError
from .loaders import prepared_by_accelerate
from .sampler import ResumableSampler

SUPPORTED = ("DataLoaderShard", "DataLoaderDispatcher")


class ShardedBatches:
    """The index lists one process takes of an epoch, as Accelerate's ``BatchSamplerShard`` over a ``BatchSampler``
    over ``sampler`` makes them; with one process, the ``BatchSampler``'s own. :meth:`start_at` makes the next
    iteration begin at a given batch of this process without computing the ones before.

    Args:
        sampler: The epoch's order (the whole epoch's: one replica).
        batch_size: Samples per batch of the ``BatchSampler`` (before a split).
        drop_last: The ``BatchSampler``'s: drop a last batch that is not full.
        num_processes: The processes sharing the batches (1: no sharding).
        process_index: This process's index.
        split_batches: Each batch is split among the processes, instead of each process taking whole batches.
        even_batches: Complete the last batches with the epoch's first samples, so every process gets as many.
    """

    def __init__(
        self,
        sampler: ResumableSampler,
        batch_size: int,
        drop_last: bool,
        *,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        if num_processes > 1 and split_batches and batch_size % num_processes:
            raise ValueError(f"split_batches: batch_size {batch_size} is not a multiple of {num_processes} processes")
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self._start = 0

    def start_at(self, batch: int) -> None:
        """The next iteration (only) begins at this process's ``batch``-th batch of the epoch."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
            raise ValueError(f"batch: expected an integer >= 0, got {batch!r}")
        self._start = batch

    def _batches(self) -> int:
        """The ``BatchSampler``'s number of batches in the epoch."""
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __len__(self) -> int:
        m, w = self._batches(), self.num_processes
        if w == 1 or self.split_batches:
            return m
        if m % w == 0 or self.drop_last:
            return m // w
        if self.even_batches:
            return m // w + 1
        return m // w + (self.process_index < m % w)

    def __iter__(self) -> Iterator[list[int]]:
        # A generator: the start is consumed at the first batch, not by an iterator made and dropped unused (torch's
        # DataLoader with workers makes its batch sampler's iterator twice and keeps the second).
        start, self._start = self._start, 0
        order = self.sampler.order()
        if self.num_processes == 1:
            yield from self._plain(order, start)
        elif self.split_batches:
            yield from self._split(order, start)
        else:
            yield from self._whole(order, start)

    def _batch(self, order: torch.Tensor, i: int) -> list[int]:
        bs = self.batch_size
        return order[i * bs : (i + 1) * bs].tolist()

    def _plain(self, order: torch.Tensor, start: int) -> Iterator[list[int]]:
        for i in range(start, self._batches()):
            yield self._batch(order, i)

    def _split(self, order: torch.Tensor, start: int) -> Iterator[list[int]]:
        """``BatchSamplerShard._iter_with_split``: this process's slice of every full batch; the last one completed
        with the first batch's samples (``even_batches``) or sliced as it is."""
        bs, m, n = self.batch_size, self._batches(), len(order)
        part = bs // self.num_processes
        lo = part * self.process_index
        full = n // bs
        for i in range(start, min(full, m)):
            yield order[i * bs + lo : i * bs + lo + part].tolist()
        if self.drop_last or m == 0 or full == m or start > full:
            return
        first = self._batch(order, 0)
        last = first if m == 1 else self._batch(order, m - 1)  # one list, as in Accelerate, when it is the only one
        if not self.even_batches:
            if len(last) > lo:
                yield last[lo : lo + part]
            return
        while len(first) < bs:
            first += first
        yield (last + first)[lo : lo + part]

    def _whole(self, order: torch.Tensor, start: int) -> Iterator[list[int]]:
        """``BatchSamplerShard._iter_with_no_split``: batch ``g * W + p`` of each group of ``W`` whose last batch is
        full; then the rest, completed with the epoch's first batches (``even_batches``) or as it is."""
        bs, w, p, m = self.batch_size, self.num_processes, self.process_index, self._batches()
        n = len(order)
        last_full = m * bs <= n
        groups = (m if last_full else m - 1) // w
        for g in range(start, groups):
            yield self._batch(order, g * w + p)
        if self.drop_last or m == 0:
            return
        tail = self._tail(order, groups, last_full)
        yield from tail[max(0, start - groups) :]

    def _tail(self, order: torch.Tensor, groups: int, last_full: bool) -> list[list[int]]:
        """What follows the full groups, as Accelerate computes it (at most a few batches)."""
        bs, w, p, m = self.batch_size, self.num_processes, self.process_index, self._batches()
        mine = groups * w + p
        own = self._batch(order, mine) if mine < m else None
        out: list[list[int]] = []
        if not self.even_batches:
            return [own] if own else []
        if own is not None and len(own) == bs:
            out.append(own)
        initial: list[int] = []
        for i in range(min(w, m)):
            initial += self._batch(order, i)
        while len(initial) < w * bs:
            initial += initial
        idx, batch = m - 1, self._batch(order, m - 1)
        if last_full:
            idx, batch = m, []
        cycle = 0
        while idx % w != 0 or batch:
            end = cycle + bs - len(batch)
            batch = batch + initial[cycle:end]
            if idx % w == p:
                out.append(batch)
            cycle, batch, idx = end, [], idx + 1
        return out


@dataclasses.dataclass
class Prepared:
    """A prepared loader the run drives: the DataLoader inside it, the order, the batches and what a batch holds.

    Attributes:
        loader: Accelerate's loader (what the loop iterates).
        base: The DataLoader inside it (its dataset is wrapped for per-sample streams, its workers shielded).
        sampler: The epoch's order.
        batches: The batch sampler now inside ``base``.
        samples_per_batch: Positions of the epoch's order one batch of this process stands for (all processes').
        skip_factor: The ``batches``' batches per batch of this process (a dispatcher's process 0 reads ``W``).
    """

    loader: Any
    base: Any
    sampler: ResumableSampler
    batches: ShardedBatches
    samples_per_batch: int
    skip_factor: int = 1

    def begin_epoch(self, epoch: int, start: int = 0) -> None:
        """The next iteration is ``epoch``'s, from this process's batch ``start``.

        Accelerate's loader counts its iterations and sets that count as the sampler's epoch at each one; the run's
        epoch is set in its place (a resumed process begins at another): held first, so that what the loader passes
        on to the sampler is the same epoch."""
        self.sampler.hold_epoch(epoch)
        self.loader.set_epoch(epoch)
        self.batches.start_at(start * self.skip_factor)


def _refuse(name: str, why: str) -> PreemptError:
    return PreemptError(
        f"run.batches(): Accelerate's {name} (accelerator.prepare(loader)) cannot resume exactly: {why}"
    )


def take_over(loader: Any) -> Prepared:
    """Puts a :class:`ShardedBatches` of preempt's order inside Accelerate's prepared ``loader``.

    Raises:
        PreemptError: A configuration that cannot resume exactly (the message says which, and what to change).
    """
    name = prepared_by_accelerate(loader) or type(loader).__name__
    if name not in SUPPORTED:
        raise _refuse(name, f"only {' and '.join(SUPPORTED)} are driven by the run")
    base = getattr(loader, "base_dataloader", None)
    if base is None or not hasattr(base, "batch_sampler"):
        raise _refuse(name, "it holds no DataLoader (base_dataloader)")
    if getattr(loader, "use_stateful_dataloader", False):
        raise _refuse(name, "torchdata's StatefulDataLoader keeps a position of its own; prepare it without one")
    if getattr(loader, "skip_batches", 0) or type(base.batch_sampler).__name__ == "SkipBatchSampler":
        raise _refuse(name, "it was made by skip_first_batches(); give run.batches() the loader itself")
    dataset = base.dataset
    if isinstance(dataset, IterableDataset):
        raise _refuse(
            name,
            f"its dataset is an IterableDataset ({type(dataset).__name__}), whose position lives in its workers"
            " and in Accelerate's buffers; give it a map-style dataset",
        )
    if isinstance(base.sampler, BatchSampler):
        raise _refuse(name, "its sampler is a BatchSampler (DataLoader(sampler=BatchSampler(...), batch_size=None))")
    shard = base.batch_sampler
    dispatcher = name == "DataLoaderDispatcher"
    processes, index, split, even = 1, 0, False, True
    inner = shard
    if type(shard).__name__ == "BatchSamplerShard" and type(shard).__module__.split(".")[0] == "accelerate":
        processes, index = int(shard.num_processes), int(shard.process_index)
        split, even = bool(shard.split_batches), bool(shard.even_batches)
        inner = shard.batch_sampler
    if type(inner) is not BatchSampler:
        raise _refuse(
            name,
            f"its batch sampler is {type(inner).__name__}, not torch's BatchSampler: it may group the indices in an"
            " order of its own",
        )
    sampler = _order(name, inner.sampler, len(dataset))
    batch_size, drop_last = int(inner.batch_size), bool(inner.drop_last)
    factor = 1
    if dispatcher:
        state = loader.state
        w = int(state.num_processes)
        split = bool(loader.split_batches)
        if w > 1 and not drop_last:
            _check_dispatched_tail(name, len(dataset), batch_size, w, split)
        batches = ShardedBatches(sampler, batch_size, drop_last)
        factor = 1 if split else w
        per_batch = batch_size * factor
    else:
        batches = ShardedBatches(
            sampler,
            batch_size,
            drop_last,
            num_processes=processes,
            process_index=index,
            split_batches=split,
            even_batches=even,
        )
        per_batch = batch_size if split else batch_size * processes
    _torch_compat.set_samplers(base, sampler, batches)
    return Prepared(loader, base, sampler, batches, per_batch, factor)


def _order(name: str, sampler: Any, n: int) -> ResumableSampler:
    """The ResumableSampler that takes the place of the loader's ``sampler``."""
    if isinstance(sampler, ResumableSampler):
        if sampler.num_replicas != 1:
            raise _refuse(
                name,
                f"its ResumableSampler is sharded ({sampler.num_replicas} replicas) and Accelerate shards the batches"
                " as well; make it with num_replicas=1 (run.sampler() shards by rank under torch.distributed)",
            )
        return sampler
    if type(sampler).__name__ == "SeedableRandomSampler":
        seed = int(getattr(sampler, "initial_seed", 0))
        return ResumableSampler(n, shuffle=True, seed=seed)
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler.num_samples != n:
            raise _refuse(name, "its RandomSampler draws with replacement or another number of samples than the data")
        return ResumableSampler(n, shuffle=True, seed=0)
    if isinstance(sampler, SequentialSampler):
        return ResumableSampler(n, shuffle=False)
    raise _refuse(
        name,
        f"its sampler is {type(sampler).__name__}; give the DataLoader shuffle=True/False or"
        " sampler=ResumableSampler(dataset, seed=...)",
    )


def _check_dispatched_tail(name: str, n: int, batch_size: int, processes: int, split: bool) -> None:
    """A dispatcher completes a last group that does not divide among the processes with the first samples of its
    iteration: a resumed epoch's are not the epoch's."""
    if split:
        rest = n % batch_size
    else:
        group = batch_size * processes
        rest = n % group
    if rest % processes:
        raise _refuse(
            name,
            f"with {n} samples, batches of {batch_size} and {processes} processes, its last group of {rest} samples is"
            " completed with the first samples of the iteration, which a resumed epoch does not begin with; give the"
            " DataLoader drop_last=True, or prepare it without dispatch_batches",
        )
