"""Where the loop stands in its data, and how an epoch's iterator is rebuilt there on resume.

:class:`DataCursor` owns what the run knows about the loaders of
``run.batches()``: their samplers, the samples a batch holds, the random state
from just before the epoch's iterator was made, each loader's
:class:`~preempt.data.replay.LoaderFeed`, and the resume point that a loaded
checkpoint left (:class:`Resume`) until the loop is back at its program point.
While the run is active it also shields the workers of every DataLoader
iterated in the process from stop signals (:mod:`preempt.data.shield`), and a
resumed epoch says what it replayed and whether that is exact
(:mod:`preempt.data.resume_notice`). It writes no loop counter: it says where the epoch's iterator starts, and the
run's :class:`~preempt.run.loop_state.LoopState` takes it.

**Exact resume.** The batch order comes from the sampler, a pure function of
(seed, epoch). Creating a DataLoader iterator draws from the global torch RNG
(that draw seeds the workers), so the run snapshots every global RNG just
before it creates the epoch's iterator. A checkpoint inside the batch loop
stores that snapshot and the current RNG state; on resume the run restores
the snapshot, creates the iterator (the same worker seeds are drawn), starts
the sampler at the saved sample, and then restores the current state, so the
loop's own draws (dropout, noise) continue exactly. Draws inside the loader
(augmentation in workers) are seeded per sample, and an iterable dataset's
workers continue from their saved positions: :mod:`preempt.data.replay`.
A loader Accelerate prepared gets preempt's order put inside it and is iterated itself, started at the saved batch
(:mod:`preempt.data.prepared`). A loader that wraps a DataLoader and iterates it (Lightning Fabric's
``fabric.setup_dataloaders``, timm's PrefetchLoader: :func:`preempt.data.loaders.wrapped_loader`) is iterated itself
too (its device placement is its own), with the DataLoader inside it wrapped and started as any other; Fabric's count
of epochs is set to the run's (:func:`preempt.data.loaders.fabric_epoch`).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .. import _log, _testing
from ..checkpoint.manager import CheckpointInfo
from ..checkpoint.manifest import Cursor
from ..checkpoint.names import MANIFEST
from ..data import rng
from ..data.loaders import fabric_epoch, fabric_loader, find_sampler, length, prepared_by_accelerate, wrapped_loader
from ..data.prepared import Prepared, take_over
from ..data.replay import LoaderFeed
from ..data.resume_notice import ResumeFacts, describe, resume_notice, saved_workers
from ..data.sampler import ResumableSampler
from ..data.shield import LoaderGuard, shield_workers
from ..errors import IncompatibleStateError

log = _log.log
SEED_MASK = (1 << 53) - 1  # the run's seed, kept exact by any JSON reader


@dataclasses.dataclass(frozen=True)
class Resume:
    """What a loaded checkpoint asks the loop to restore at its program point."""

    info: CheckpointInfo
    cursor: Cursor
    rng_now: rng.RngState
    rng_epoch_start: rng.RngState | None
    sampler: dict[str, Any] | None
    loader: Any = None  # where an iterable dataset's workers stood (preempt.data.replay.LoaderFeed.state)


class DataCursor:
    """The run's view of its data loaders (one per run)."""

    def __init__(self, signals: Iterable[int]) -> None:
        self.signals = tuple(signals)
        self.resume: Resume | None = None  # a loaded checkpoint's position, until the loop is back there
        self.seed: int | None = None  # seeds iterable datasets' per-sample streams (torch's seed at the start)
        self.batches_per_epoch: int | None = None
        self.samplers: list[ResumableSampler] = []
        self._sampler: ResumableSampler | None = None  # the current epoch's
        self._samples_per_batch: int | None = None  # global samples per batch, when known
        self._sample_offset = 0  # samples of the epoch done minus batch * samples per batch (after a resize)
        self._epoch_rng: rng.RngState | None = None
        # Loaders seen by open(), each with what replaying it exactly needs; their persistent workers stop at exit.
        self._feeds: weakref.WeakKeyDictionary[Any, LoaderFeed] = weakref.WeakKeyDictionary()
        self._feed: LoaderFeed | None = None  # the current epoch's
        # Accelerate's prepared loaders, each with preempt's order put inside it at its first epoch
        self._prepared: weakref.WeakKeyDictionary[Any, Prepared] = weakref.WeakKeyDictionary()
        self._boundary_workers: int | None = None  # num_workers recorded by a checkpoint at an epoch boundary
        self.guard = LoaderGuard(self.signals)  # every DataLoader iterated while the run is active: workers shielded

    def begin(self, seed: int) -> None:
        """The run is on: the data seed (unless a checkpoint gave one), every DataLoader's workers shielded."""
        if self.seed is None:
            self.seed = seed & SEED_MASK
        self.guard.start()

    def make_sampler(self, dataset: Any, *, epoch: int, **options: Any) -> ResumableSampler:
        """A ResumableSampler (one replica per rank under torch.distributed) whose epoch follows the loop's."""
        replicas, rank = 1, 0
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            replicas, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        sampler = ResumableSampler(dataset, num_replicas=replicas, rank=rank, **options)
        sampler.hold_epoch(epoch)  # its epoch is the run's: set_epoch from a loader or framework changes nothing
        self.samplers.append(sampler)
        return sampler

    def set_epoch(self, epoch: int) -> None:
        for s in self.samplers:
            s.hold_epoch(epoch)

    def resume_at_epoch(self, epoch: int) -> rng.RngState | None:
        """At an epoch boundary: the random state to restore when a checkpoint was taken at this one."""
        r = self.resume
        if r is not None and r.cursor.point == "epoch" and r.cursor.epoch == epoch:
            self.resume = None
            self._boundary_workers = saved_workers(r.loader)
            return r.rng_now
        return None

    def open(self, loader: Iterable[Any], epoch: int) -> tuple[Iterator[Any] | None, int]:
        """The epoch's iterator and the batch it starts at; None when a resumed epoch had no batch left."""
        if prepared_by_accelerate(loader) is not None:
            return self._open_prepared(loader, epoch)
        inner = wrapped_loader(loader)  # a wrapper's DataLoader (Fabric's, timm's), iterated through the wrapper
        if inner is not None and fabric_loader(loader) is not None:
            fabric_epoch(loader, inner, epoch)
        base = loader if inner is None else inner
        shield_workers(base, self.signals)
        feed = self._feed = self._feed_for(loader, inner)
        found = find_sampler(base)
        sampler, per_batch = found if found else (None, None)
        if sampler is not None:
            sampler.hold_epoch(epoch)
        self._sampler = sampler
        self._samples_per_batch = per_batch * sampler.num_replicas if sampler and per_batch else None
        self.batches_per_epoch = length(loader)
        r = self.resume
        if r is not None and r.cursor.point == "step" and r.cursor.epoch == epoch:
            self.resume = None
            return self._resume_iterator(loader, r, sampler, feed, epoch)
        self._epoch_rng = rng.capture()
        self._sample_offset = 0
        saved, self._boundary_workers = self._boundary_workers, None
        if saved is not None:
            self._say(ResumeFacts(self._describe(feed), feed.kind, feed.stateful, saved, feed.num_workers, epoch, 0))
        return feed.iterate(loader, epoch), 0

    def _open_prepared(self, loader: Any, epoch: int) -> tuple[Iterator[Any] | None, int]:
        """:meth:`open` for a loader Accelerate prepared (:mod:`preempt.data.prepared`): preempt's order inside it,
        the loader itself iterated (its device placement, sharding and end of data are Accelerate's)."""
        prep = self._prepared.get(loader)
        if prep is None:
            prep = self._prepared[loader] = take_over(loader)  # refuses at once what cannot resume exactly
        shield_workers(prep.base, self.signals)
        feed = self._feed = self._feed_for(loader, prep.base)
        self._sampler, self._samples_per_batch = prep.sampler, prep.samples_per_batch
        self.batches_per_epoch = length(loader)
        self._sample_offset = 0
        r = self.resume
        if r is None or r.cursor.point != "step" or r.cursor.epoch != epoch:
            self._epoch_rng = rng.capture()
            self._boundary_workers = None
            prep.begin_epoch(epoch)
            return feed.iterate(loader, epoch), 0
        self.resume = None
        c = r.cursor
        self._check_sampler(r, prep.sampler)
        spb = prep.samples_per_batch
        if c.batch and c.sample >= 0 and c.sample != min(c.batch * spb, prep.sampler.total):
            raise IncompatibleStateError(
                f"{r.info.path}/{MANIFEST}: batch {c.batch} ended at sample {c.sample} of the epoch, which is"
                f" {spb} samples per batch (all processes') no longer gives; Accelerate's loader changed its batch"
                " size or its number of processes, and its sharding cannot continue where it stopped"
            )
        self._epoch_rng = r.rng_epoch_start
        if self.batches_per_epoch is not None and c.batch >= self.batches_per_epoch:
            rng.restore(r.rng_now)  # the epoch was finished; nothing to iterate
            return None, c.batch
        if r.rng_epoch_start is not None:
            rng.restore(r.rng_epoch_start)
        prep.begin_epoch(epoch, c.batch)  # O(1): the batch sampler starts there, nothing before is read
        it = feed.iterate(loader, epoch)
        rng.restore(r.rng_now)
        return it, c.batch

    @staticmethod
    def _describe(feed: LoaderFeed) -> str:
        return describe(feed.kind, feed.dataset_name, feed.num_workers, feed.is_loader)

    @staticmethod
    def _say(facts: ResumeFacts) -> None:
        _testing.emit("loader_resumed", **dataclasses.asdict(facts))
        notice = resume_notice(facts)
        if notice is not None:
            log.log(*notice)

    def _feed_for(self, loader: Iterable[Any], inner: Any = None) -> LoaderFeed:
        """The loader's LoaderFeed, made at its first epoch (a list or another plain iterable gets a passing one);
        ``inner``: the DataLoader inside a prepared loader."""
        assert self.seed is not None
        try:
            feed = self._feeds.get(loader)
        except TypeError:  # not weakly referable: nothing to keep between epochs
            return LoaderFeed(loader, self.seed, inner)
        if feed is None:
            feed = self._feeds[loader] = LoaderFeed(loader, self.seed, inner)
        return feed

    def _resume_iterator(
        self, loader: Iterable[Any], r: Resume, sampler: ResumableSampler | None, feed: LoaderFeed, epoch: int
    ) -> tuple[Iterator[Any] | None, int]:
        """Recreates the epoch's iterator as it was at the checkpoint (see :mod:`preempt.run.preemptible`)."""
        c = r.cursor
        self._check_sampler(r, sampler)
        self._epoch_rng = r.rng_epoch_start
        total = self.batches_per_epoch
        start = c.batch
        self._sample_offset = 0
        spb = self._samples_per_batch
        finished = total is not None and start >= total
        if sampler is not None and spb and c.sample >= 0:
            finished = c.sample >= sampler.total  # in samples: ceil(sample / new batch) can reach len(loader) early
            if c.batch and c.sample != c.batch * spb:
                old = c.sample // c.batch
                start = -(-c.sample // spb)
                self._sample_offset = c.sample - start * spb
                log.warning(
                    "the batch size changed (%d -> %d samples per step): continuing at sample %d of the epoch,"
                    " batch %d",
                    old,
                    spb,
                    c.sample,
                    start,
                )
        if finished:
            rng.restore(r.rng_now)  # the epoch was finished; nothing to iterate
            return None, start
        if r.rng_epoch_start is not None:
            rng.restore(r.rng_epoch_start)
        seek = feed.can_seek(r.loader, epoch) is None
        skip = bool(sampler is not None and spb and c.sample >= 0)  # the sampler starts at the sample: no replay
        if skip:
            kind = "seeded" if feed.kind == "seeded" else None  # without per-sample streams: nothing to say
        else:
            kind = "iterable" if feed.kind == "iterable" else "plain"
        if skip and sampler is not None:
            sampler.start_at(c.sample)
            it = feed.iterate(loader, epoch)
        elif seek:
            it = feed.iterate(loader, epoch, r.loader)
        else:
            it = feed.iterate(loader, epoch)
            for _ in range(start):
                next(it)
        if kind is not None:
            positions = feed.workers_resume(r.loader, epoch) is not None
            workers = saved_workers(r.loader)
            self._say(
                ResumeFacts(
                    self._describe(feed), kind, feed.stateful, workers, feed.num_workers, epoch, start, positions
                )
            )
        rng.restore(r.rng_now)
        return it, start

    def _check_sampler(self, r: Resume, sampler: ResumableSampler | None) -> None:
        saved = r.sampler
        if sampler is None or not saved:
            return
        now = sampler.state_dict()
        for key in ("dataset_len", "shuffle", "seed"):
            if key in saved and saved[key] != now[key]:
                raise IncompatibleStateError(
                    f"{r.info.path}/{MANIFEST}: sampler {key} was {saved[key]!r}, now {now[key]!r};"
                    " the data order cannot continue where it stopped"
                )
        if saved.get("per_sample_rng", now["per_sample_rng"]) != now["per_sample_rng"]:
            log.warning(
                "sampler per_sample_rng was %s, now %s: random draws inside the DataLoader will not replay those of"
                " the run so far",
                saved["per_sample_rng"],
                now["per_sample_rng"],
            )

    # ------------------------------------------------------------ what a checkpoint records

    def cursor(self, step: int, epoch: int, batch: int) -> tuple[Cursor, dict[str, Any] | None]:
        """Where the loop stands, and the sampler's state."""
        r = self.resume
        if r is not None and r.info.step == step and r.cursor.epoch == epoch:
            # Not yet back at the checkpoint's program point: its cursor still describes the loop.
            return r.cursor, r.sampler
        spb = self._samples_per_batch
        sample = -1 if spb is None else batch * spb + self._sample_offset
        sampler = None
        if self._sampler is not None:
            sampler = self._sampler.state_dict()
            if sample >= 0:
                sample = min(sample, self._sampler.total)
        cursor = Cursor(
            epoch=epoch,
            batch=batch,
            sample=0 if batch == 0 else sample,
            point="epoch",
            batches_per_epoch=-1 if self.batches_per_epoch is None else self.batches_per_epoch,
        )
        return cursor, sampler

    def state(self) -> tuple[rng.RngState | None, dict[str, Any]]:
        """The random state at the epoch's start, and the checkpoint's ``data`` entry (seed, workers' positions)."""
        r = self.resume  # not yet back at its program point: its epoch start and loader position still hold
        epoch_rng = self._epoch_rng
        if epoch_rng is None and r is not None:
            epoch_rng = r.rng_epoch_start
        loader = r.loader if r is not None else (self._feed.state() if self._feed is not None else None)
        return epoch_rng, {"seed": self.seed, "loader": loader}

    def end(self) -> None:
        """The run ends: DataLoaders iterated from now on are the user's alone; the persistent workers of every
        loader of run.batches() are stopped."""
        self.guard.stop()
        for loader, feed in list(self._feeds.items()):
            try:
                feed.stop_workers(loader)
            except Exception as e:  # never mask how the run ended
                log.warning("could not stop the DataLoader's persistent workers: %s", e)
