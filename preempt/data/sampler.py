"""A sampler whose order is a pure function of (seed, epoch) and that resumes mid-epoch in O(1).

Restoring the global RNG and then skipping batches replays a different
permutation (the order was drawn from the RNG at the start of the epoch, not
at the checkpoint). Here each epoch's permutation comes from a private
generator seeded from ``(seed, epoch)`` alone, so any process can compute
epoch 7's order without having seen epochs 0 to 6, and resuming at sample
``s`` starts the index stream at position ``s``: no batch is loaded or
replayed to get there.

Positions are global: with ``num_replicas`` ranks, an iteration that starts at
position ``s`` gives rank ``r`` the positions ``s + r``, ``s + r + num_replicas``,
..., so the ranks together consume the rest of the epoch exactly once, and a
cursor counted in global samples is meaningful on any number of ranks.

**Whose epoch.** A sampler a run made (``run.sampler()``) takes its epoch from the run alone
(:meth:`ResumableSampler.hold_epoch`). Frameworks and wrapper loaders call ``set_epoch`` with their own count of
iterations in this process (Lightning Fabric's loader, Accelerate's, a user's wrapper), and a resumed process counts
from 0 again: obeyed, its epoch 1 would replay epoch 0's order and per-sample draws. Such a call, once the run holds
the epoch, changes nothing, and the first from each caller is logged (logger ``preempt``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from .. import _log

log = _log.log
_MASK64 = (1 << 64) - 1


def mix(seed: int, epoch: int) -> int:
    """A 64-bit generator seed from (seed, epoch); splitmix64 so that nearby pairs do not collide."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch + 0x632BE59BD9B4E019) & _MASK64
    for _ in range(2):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
    return z


class ResumableSampler(Sampler[int]):
    """Yields dataset indices in an order fixed by (seed, epoch); resumable at any sample.

    Args:
        data_source: The dataset (or its length).
        shuffle: Permute each epoch; False gives 0, 1, 2, ...
        seed: Base seed of the order (independent of the global RNG).
        drop_last: With several replicas, drop the tail that does not divide
            evenly instead of padding it with repeated indices (as
            ``DistributedSampler`` does). No effect with one replica.
        num_replicas: Number of ranks sharing the epoch.
        rank: This process's rank.
        per_sample_rng: When a DataLoader draws from this sampler, seed the
            random generators of the process that fetches each sample from
            (seed, epoch, index) just before it is fetched, so that random
            augmentation inside the dataset replays exactly after a resume,
            with any number of workers (see :mod:`preempt.data.replay`).
            False leaves the workers' generators as torch seeds them.
    """

    def __init__(
        self,
        data_source: Sized | int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
        per_sample_rng: bool = True,
    ) -> None:
        n = data_source if isinstance(data_source, int) else len(data_source)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"data_source: expected a sized dataset or a length >= 0, got {data_source!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed: expected an integer, got {seed!r}")
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas: expected an integer >= 1, got {num_replicas!r}")
        if not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"rank: expected an integer in [0, {num_replicas}), got {rank!r}")
        self.dataset_len = n
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.num_replicas = num_replicas
        self.rank = rank
        self.per_sample_rng = bool(per_sample_rng)
        self.epoch = 0
        self._start = 0
        self._held = False  # the run sets the epoch (hold_epoch); set_epoch from elsewhere changes nothing
        self._ignored: set[str] = set()  # callers whose set_epoch was ignored, each logged once

    @property
    def total(self) -> int:
        """Global positions in one epoch (after padding or dropping for the replicas)."""
        n, w = self.dataset_len, self.num_replicas
        return (n // w) * w if self.drop_last else -(-n // w) * w

    def __len__(self) -> int:
        """Indices this rank yields in a whole epoch (a resumed epoch yields fewer)."""
        return self.total // self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose order the next iteration yields, unless a run holds the epoch.

        Once :meth:`hold_epoch` was called, a call naming another epoch than the held one changes nothing: the
        caller (a framework's or a wrapper's loader counting its own iterations) is logged once, on its first such
        call, with the epoch it asked for and the run's (at INFO for an earlier epoch than the run's, a count that
        started again; at DEBUG for a later one, a framework setting the next epoch before the run opens it).
        """
        _check_epoch(epoch)
        if not self._held:
            self.epoch = epoch
        elif epoch != self.epoch:
            frame = sys._getframe(1)
            code = frame.f_code
            caller = f"{frame.f_globals.get('__name__', '?')}.{getattr(code, 'co_qualname', code.co_name)}"
            if caller not in self._ignored:
                self._ignored.add(caller)
                # an earlier epoch: a count that started again (a resumed process), worth a line; a later one: a
                # framework that sets the next epoch before the run opens it (Lightning's fit loop), which the run
                # then holds itself
                log.log(
                    logging.INFO if epoch < self.epoch else logging.DEBUG,
                    "run.sampler(): set_epoch(%d) from %s ignored; the run's epoch %d holds (a loader or framework"
                    " that counts its own iterations counts from 0 again in a resumed process); said once per caller",
                    epoch,
                    caller,
                    self.epoch,
                )

    def hold_epoch(self, epoch: int) -> None:
        """The run's way to set the epoch: sets it, and from now on :meth:`set_epoch` no longer changes it."""
        _check_epoch(epoch)
        self._held = True
        self.epoch = epoch

    @property
    def held(self) -> bool:
        """A run sets the epoch (:meth:`hold_epoch`); ``set_epoch`` from elsewhere is ignored."""
        return self._held

    def start_at(self, sample: int) -> None:
        """Makes the next iteration (only) begin at global position ``sample`` of the epoch."""
        if not isinstance(sample, int) or sample < 0:
            raise ValueError(f"sample: expected an integer >= 0, got {sample!r}")
        self._start = sample

    def order(self, epoch: int | None = None) -> torch.Tensor:
        """The epoch's global order: ``total`` dataset indices (int64)."""
        epoch = self.epoch if epoch is None else epoch
        n = self.dataset_len
        if self.shuffle and n > 1:
            g = torch.Generator()
            g.manual_seed(mix(self.seed, epoch))
            idx = torch.randperm(n, generator=g)
        else:
            idx = torch.arange(n)
        total = self.total
        if total <= n:
            return idx[:total]
        reps = -(-total // max(n, 1))
        return idx.repeat(reps)[:total]

    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0  # consumed now, not at the first next()
        return _ints(self.order()[start + self.rank :: self.num_replicas])

    def state_dict(self) -> dict[str, Any]:
        """The parameters that fix the order (the run keeps the cursor)."""
        return {
            "dataset_len": self.dataset_len,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "num_replicas": self.num_replicas,
            "epoch": self.epoch,
            "per_sample_rng": self.per_sample_rng,
        }


def _check_epoch(epoch: int) -> None:
    if not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch: expected an integer >= 0, got {epoch!r}")


def _ints(indices: torch.Tensor, chunk: int = 1 << 16) -> Iterator[int]:
    """Python ints from an index tensor, converted a chunk at a time.

    ``tolist()`` of a whole epoch holds a Python int and its list slot per
    index for the whole epoch (gigabytes for a dataset of 100M samples).
    Chunks bound that to one chunk's.
    """
    for part in indices.split(chunk):
        yield from part.tolist()
