"""preempt/data/replay.py and the step beacon: pure seeds, the wrappers, the feed's plans, in one process."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from preempt import PreemptibleRun
from preempt.checkpoint.lock import StepBeacon
from preempt.data.replay import LoaderFeed, WorkersResume, reseed, sample_seed, stream_seed
from preempt.data.sampler import ResumableSampler


class Draws(Dataset):
    """Each sample is (index, a draw from torch, one from NumPy, one from random)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(torch.rand(())), float(np.random.rand()), random.random()])


def epoch_of(loader: DataLoader, feed: LoaderFeed, epoch: int, saved=None) -> list[list[float]]:
    loader.sampler.set_epoch(epoch) if isinstance(loader.sampler, ResumableSampler) else None
    return [row.tolist() for batch in feed.iterate(loader, epoch, saved) for row in batch]


def test_seeds_are_pure_and_distinct():
    assert sample_seed(7, 2, 5) == sample_seed(7, 2, 5)
    seeds = {sample_seed(s, e, i) for s in (0, 1) for e in range(4) for i in range(100)}
    assert len(seeds) == 800
    assert all(0 <= x < 2**64 for x in seeds)
    assert stream_seed(3, 0, 1, 9) != stream_seed(3, 0, 0, 9) != stream_seed(3, 1, 1, 9)


def test_reseed_fixes_all_three_generators():
    def draw() -> tuple[float, float, float]:
        return float(torch.rand(())), float(np.random.rand()), random.random()

    reseed(2**63 + 12345)
    a = draw()
    reseed(2**63 + 12345)
    assert draw() == a
    reseed(2**63 + 12346)
    assert draw() != a


def test_a_sample_draws_the_same_whatever_the_order_and_the_workers():
    """Sample i of epoch e gets the same draws shuffled or not, with 0 or 2 workers; another epoch, others."""
    rows = {}
    for shuffle, workers in ((False, 0), (True, 0), (True, 2)):
        data = Draws()
        loader = DataLoader(data, batch_size=5, sampler=ResumableSampler(data, shuffle=shuffle), num_workers=workers)
        got = epoch_of(loader, LoaderFeed(loader, run_seed=0), epoch=3)
        rows[(shuffle, workers)] = {int(r[0]): r for r in got}
    assert rows[(False, 0)] == rows[(True, 0)] == rows[(True, 2)]
    data = Draws()
    loader = DataLoader(data, batch_size=5, sampler=ResumableSampler(data, shuffle=False))
    other = {int(r[0]): r for r in epoch_of(loader, LoaderFeed(loader, run_seed=0), epoch=4)}
    assert all(other[i][1:] != rows[(False, 0)][i][1:] for i in range(12))


def test_iterating_leaves_the_callers_generators_and_the_loader_alone():
    data = Draws()
    loader = DataLoader(data, batch_size=4, sampler=ResumableSampler(data))
    collate = loader.collate_fn
    torch.manual_seed(1)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    epoch_of(loader, LoaderFeed(loader, run_seed=0), epoch=0)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert (np.random.get_state()[1] == before[1]).all() and random.getstate() == before[2]
    assert loader.dataset is data and loader.collate_fn is collate


def test_per_sample_rng_off_iterates_the_loader_as_it_is():
    data = Draws()
    loader = DataLoader(data, batch_size=4, sampler=ResumableSampler(data, per_sample_rng=False))
    feed = LoaderFeed(loader, run_seed=0)
    assert not feed.wraps and feed.kind == "plain"
    torch.manual_seed(1)
    before = torch.get_rng_state()
    epoch_of(loader, feed, 0)
    assert not torch.equal(torch.get_rng_state(), before)  # the dataset drew from the caller's generator


class Counting(IterableDataset):
    """Yields 0..n-1 (sharded over workers); seekable through state_dict/load_state_dict."""

    def __init__(self, n: int) -> None:
        self.n, self.pos, self._start = n, 0, 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, k = (info.id, info.num_workers) if info else (0, 1)
        shard = range(w, self.n, k)
        start, self._start = self._start, 0
        for j in range(start, len(shard)):
            self.pos = j + 1
            yield self.item(w, shard[j])

    def item(self, worker: int, k: int):
        return k

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self._start = state["pos"]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop_after", [1, 2, 3])
def test_iterable_feed_continues_where_the_loop_stood(workers, stop_after):
    """Stopped after k batches: a new feed with the saved state yields exactly the rest, in the same order."""
    reference = DataLoader(Counting(20), batch_size=3, num_workers=workers)
    whole = [b.tolist() for b in LoaderFeed(reference, 0).iterate(reference, 0)]
    loader = DataLoader(Counting(20), batch_size=3, num_workers=workers)
    feed = LoaderFeed(loader, 0)
    it = feed.iterate(loader, 0)
    head = [next(it).tolist() for _ in range(stop_after)]
    saved = feed.state()
    del it
    assert saved is not None and saved["next"] == stop_after % max(workers, 1)
    fresh = DataLoader(Counting(20), batch_size=3, num_workers=workers)
    again = LoaderFeed(fresh, 0)
    assert again.can_seek(saved, 0) is None
    rest = [b.tolist() for b in again.iterate(fresh, 0, saved)]
    assert head + rest == whole


def test_iterable_workers_resume_refuses_another_epoch_or_worker_count():
    loader = DataLoader(Counting(8), batch_size=2, num_workers=2)
    feed = LoaderFeed(loader, 0)
    saved = {"epoch": 1, "num_workers": 2, "next": 1, "workers": {0: {"dataset": {"pos": 1}, "count": 1}}}
    assert feed.workers_resume(saved, 1) == WorkersResume(1, 1, {0: {"dataset": {"pos": 1}, "count": 1}})
    assert feed.workers_resume(saved, 2) is None
    assert "num_workers=2, the loader now has 1" in LoaderFeed(DataLoader(Counting(8), num_workers=1), 0).can_seek(
        saved, 1
    )

    class Plain(IterableDataset):
        def __iter__(self):
            yield from range(3)

    assert "no state_dict()" in LoaderFeed(DataLoader(Plain()), 0).can_seek(saved, 1)


def test_the_run_leaves_a_users_loader_as_it_was(tmp_path):
    data = Draws()
    with PreemptibleRun(tmp_path / "run", model=torch.nn.Linear(1, 1), checkpoint_interval=None) as run:
        loader = DataLoader(data, batch_size=4, sampler=run.sampler(data), num_workers=0)
        for _ in run.epochs(1):
            for _ in run.batches(loader):
                assert loader.dataset is data
                run.step()


def test_step_beacon_survives_only_an_unclean_exit(tmp_path):
    beacon = StepBeacon(tmp_path)
    assert beacon.read() is None
    beacon.open(5)
    beacon.view[0] = 17  # what run.step() does
    assert StepBeacon(tmp_path).read() == 17  # what a successor reads if this process dies now
    beacon.close()
    assert StepBeacon(tmp_path).read() is None  # a clean exit


def test_step_beacon_follows_no_symlink_and_reads_no_fifo(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "lock.step").symlink_to(outside)
    beacon = StepBeacon(tmp_path / "run")
    beacon.open(3)
    beacon.view[0] = 4
    beacon.close()
    assert outside.read_bytes() == b"precious"
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "lock.step")
    assert StepBeacon(tmp_path / "fifo").read() is None  # no hang


def test_a_resume_that_toggles_per_sample_rng_says_so(tmp_path, caplog):
    data = Draws()

    def one_step(per_sample_rng: bool) -> None:
        with PreemptibleRun(tmp_path / "run", model=torch.nn.Linear(1, 1), checkpoint_interval=None) as run:
            loader = DataLoader(data, batch_size=4, sampler=run.sampler(data, per_sample_rng=per_sample_rng))
            for _ in run.epochs(1):
                for _ in run.batches(loader):
                    run.request_stop()
                    run.step()  # saves mid-epoch and leaves by Preempted

    with pytest.raises(SystemExit):
        one_step(True)
    caplog.set_level("WARNING", logger="preempt")
    with pytest.raises(SystemExit):
        one_step(False)
    assert "sampler per_sample_rng was True, now False" in caplog.text


def test_spawned_persistent_workers_see_each_epoch():
    """The wrapper and its shared epoch pickle for the spawn start method; persistent workers follow the epoch."""
    by_context = {}
    for context, persistent in ((None, False), ("spawn", True)):
        data = Draws()
        loader = DataLoader(
            data,
            batch_size=5,
            sampler=ResumableSampler(data),
            num_workers=2,
            multiprocessing_context=context,
            persistent_workers=persistent,
        )
        feed = LoaderFeed(loader, run_seed=0)
        by_context[context] = [sorted(epoch_of(loader, feed, e)) for e in (0, 1)]
        feed.stop_workers(loader)
    assert by_context[None] == by_context["spawn"]
    assert by_context[None][0] != by_context[None][1]  # another epoch, other draws


def test_malformed_positions_replay_instead_of_starting_over_silently():
    loader = DataLoader(Counting(8), batch_size=2, num_workers=0)
    feed = LoaderFeed(loader, 0)
    saved = {"epoch": 0, "num_workers": 0, "next": 0, "workers": ["not", "a", "dict"]}
    assert feed.workers_resume(saved, 0) is None
    assert feed.can_seek(saved, 0) == "the checkpoint holds no position of its workers"


class EpochTagged(Counting):
    """Yields (epoch it was told, worker id, k) for k in its shard; seekable."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.epoch = -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def item(self, worker: int, k: int):
        return torch.tensor([self.epoch, worker, k])


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
def test_an_iterable_dataset_is_told_the_epoch_in_every_worker(workers, persistent):
    """set_epoch reaches the copy each worker holds, persistent ones included (they keep theirs between epochs), and
    the main process's; a resumed epoch is told its epoch before its saved position is loaded."""
    data = EpochTagged(12)
    loader = DataLoader(data, batch_size=2, num_workers=workers, persistent_workers=persistent)
    feed = LoaderFeed(loader, 0)
    for epoch in (0, 1, 2):
        rows = torch.cat(list(feed.iterate(loader, epoch)))
        assert rows[:, 0].tolist() == [epoch] * 12 and sorted(rows[:, 2].tolist()) == list(range(12))
        assert data.epoch == epoch
    it = feed.iterate(loader, 3)
    next(it)
    saved = feed.state()
    del it
    fresh = DataLoader(EpochTagged(12), batch_size=2, num_workers=workers, persistent_workers=persistent)
    rest = torch.cat(list(LoaderFeed(fresh, 0).iterate(fresh, 3, saved)))
    assert rest[:, 0].tolist() == [3] * 10
    feed.stop_workers(loader)
