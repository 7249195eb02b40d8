"""What a resumed epoch says about its loader: which loader, what was replayed, and whether the result is exact.

:func:`resume_notice` is pure: facts in, a log level and a line out (or nothing to say). The run's
:mod:`~preempt.run.data_cursor` gathers the facts where it rebuilds the epoch's iterator.

Exact or not, by the kind of loader (:class:`~preempt.data.replay.LoaderFeed`):

* a map-style dataset whose loader samples from the run's sampler with per-sample random streams (``seeded``): the
  sampler starts at the saved sample and each sample's draws are a pure function of (seed, epoch, index), whichever
  worker fetches it: exact with any ``num_workers``, nothing replayed;
* an ``IterableDataset``: its shards and its per-sample seeds depend on the worker (its id and how many there are).
  With the same ``num_workers`` and ``state_dict``/``load_state_dict`` each worker continues where it stood; without
  them the epoch's batches are replayed from its start, exact when the stream yields the same samples each time.
  With another ``num_workers`` the batches are not those the run trained on: not exact;
* another loader (no ResumableSampler): the epoch's batches are replayed from its start; exact when the loader
  yields the same batches again, and not for random draws in its workers when ``num_workers`` changed.
"""

from __future__ import annotations

import dataclasses
import logging


@dataclasses.dataclass(frozen=True)
class ResumeFacts:
    """What the resumed epoch knows about its loader.

    Attributes:
        loader: Which loader, for people (``describe``).
        kind: ``"seeded"``, ``"iterable"`` or ``"plain"`` (:attr:`preempt.data.replay.LoaderFeed.kind`).
        stateful: An iterable dataset with ``state_dict``/``load_state_dict``.
        saved_workers: ``num_workers`` when the checkpoint was taken; None when the checkpoint does not say.
        workers: ``num_workers`` now.
        epoch: The resumed epoch.
        batch: The batch it continues at: the batches replayed, when it replays.
        positions: The checkpoint holds where each worker of this epoch's iterable dataset stood.
    """

    loader: str
    kind: str
    stateful: bool
    saved_workers: int | None
    workers: int
    epoch: int
    batch: int
    positions: bool = False


def describe(kind: str, dataset: str, workers: int, is_loader: bool = True) -> str:
    """``the loader of run.batches() (a DataLoader over Stream, an IterableDataset, 3 workers)``."""
    if not is_loader:
        return f"the iterable of run.batches() ({dataset})"
    what = "an IterableDataset" if kind == "iterable" else "a map-style dataset"
    return f"the loader of run.batches() (a DataLoader over {dataset}, {what}, {workers} worker(s))"


def saved_workers(saved: object) -> int | None:
    """``num_workers`` as a checkpoint's loader entry records it; None when absent or not an integer."""
    n = saved.get("num_workers") if isinstance(saved, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def resume_notice(f: ResumeFacts) -> tuple[int, str] | None:
    """The line to log when the epoch's iterator is rebuilt at a resume point, and its level; None: nothing to say."""
    changed = f.saved_workers is not None and f.saved_workers != f.workers
    was = f"num_workers was {f.saved_workers} when the checkpoint was taken, now {f.workers}"
    replay = f"replaying {f.batch} batch(es) of epoch {f.epoch} from its start to reach the resume point"
    if f.kind == "seeded":
        if not changed:
            return None
        return logging.INFO, (
            f"{f.loader}: {was}; still exact: each sample's random draws are seeded from (seed, epoch, index),"
            f" whichever worker fetches it; epoch {f.epoch} continues at batch {f.batch}, no batch replayed"
        )
    if f.kind == "iterable":
        if changed:
            head = replay if f.batch else f"epoch {f.epoch} starts with {f.workers} worker(s)"
            rest = " and the rest of the epoch may repeat or skip samples" if f.batch else ""
            return logging.WARNING, (
                f"{f.loader}: {was}: {head}; NOT exact: an IterableDataset's shards and per-sample random seeds"
                f" depend on the worker (its id and how many there are), so the batches from here on are not those"
                f" of a run with {f.saved_workers} worker(s){rest}"
            )
        if not f.batch:
            return None
        if f.stateful and f.positions:
            return logging.INFO, (
                f"{f.loader}: the IterableDataset's {max(f.workers, 1)} worker(s) continue where each stood at batch"
                f" {f.batch} (no batch replayed); exact"
            )
        why = "has no state_dict()/load_state_dict()" if not f.stateful else "the checkpoint holds no worker positions"
        return logging.WARNING, (
            f"{f.loader}: {why}: {replay}; exact when the stream yields the same samples in the same order each time"
        )
    if not f.batch:
        return None
    draws = (
        f"; {was}: random draws in its workers are not those of the run so far"
        if changed
        else " and its workers draw the same random numbers"
    )
    return logging.WARNING, (
        f"{f.loader}: its batches do not come from a ResumableSampler (use run.sampler()): {replay}; exact when the"
        f" loader yields the same batches in the same order again{draws}"
    )
