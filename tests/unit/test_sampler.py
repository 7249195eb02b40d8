"""Unit tests for preempt.data.sampler.ResumableSampler: order fixed by (seed, epoch), O(1) mid-epoch resume."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from preempt.data.sampler import ResumableSampler


def test_order_depends_only_on_seed_epoch_and_length():
    """Two instances agree; the global RNG and iteration history do not matter."""
    torch.manual_seed(1)
    a = ResumableSampler(100, seed=7)
    first = list(a)
    torch.manual_seed(999)
    torch.rand(10)
    b = ResumableSampler(range(100), seed=7)
    assert list(b) == first
    assert list(a) == first  # iterating again gives the same order
    assert a.order().dtype == torch.int64
    assert a.order().tolist() == first


def test_iteration_does_not_touch_the_global_rng():
    s = ResumableSampler(50, seed=3)
    state = torch.get_rng_state()
    list(s)
    s.order(5)
    assert torch.equal(torch.get_rng_state(), state)


def test_epochs_and_seeds_give_different_permutations():
    s = ResumableSampler(200, seed=0)
    orders = set()
    for epoch in range(8):
        s.set_epoch(epoch)
        order = list(s)
        assert sorted(order) == list(range(200))
        orders.add(tuple(order))
        assert order == s.order(epoch).tolist()
    assert len(orders) == 8
    assert ResumableSampler(200, seed=1).order(0).tolist() != ResumableSampler(200, seed=0).order(0).tolist()
    assert tuple(range(200)) not in orders


def test_order_of_any_epoch_without_the_earlier_ones():
    """Epoch 7's order is computable directly, and equals what an instance that lived through 0..6 yields."""
    lived = ResumableSampler(64, seed=11)
    for e in range(8):
        lived.set_epoch(e)
        got = list(lived)
    fresh = ResumableSampler(64, seed=11)
    fresh.set_epoch(7)
    assert list(fresh) == got


@pytest.mark.parametrize("n", [0, 1, 2, 17, 1000])
def test_every_index_exactly_once_per_epoch(n):
    s = ResumableSampler(n, seed=5)
    for epoch in (0, 3):
        s.set_epoch(epoch)
        out = list(s)
        assert len(out) == len(s) == s.total == n
        assert sorted(out) == list(range(n))


def test_shuffle_false_gives_range():
    s = ResumableSampler(10, shuffle=False, seed=123)
    s.set_epoch(4)
    assert list(s) == list(range(10))
    s.start_at(6)
    assert list(s) == [6, 7, 8, 9]


@pytest.mark.parametrize("k", [0, 1, 5, 12, 13, 30])
def test_start_at_affects_only_the_next_iteration(k):
    s = ResumableSampler(13, seed=2)
    s.set_epoch(1)
    full = s.order().tolist()
    s.start_at(k)
    assert list(s) == full[k:]
    assert list(s) == full


def test_start_at_survives_set_epoch():
    """start_at then set_epoch (or the reverse) resumes the selected epoch at the position."""
    s = ResumableSampler(20, seed=4)
    s.start_at(5)
    s.set_epoch(3)
    assert list(s) == s.order(3).tolist()[5:]


def test_resume_continues_the_interrupted_stream():
    """Consumed prefix + resumed suffix == the uninterrupted epoch."""
    s = ResumableSampler(37, seed=9)
    s.set_epoch(2)
    full = list(s)
    consumed = []
    it = iter(s)
    for _ in range(15):
        consumed.append(next(it))
    resumed = ResumableSampler(37, seed=9)
    resumed.set_epoch(2)
    resumed.start_at(len(consumed))
    assert consumed + list(resumed) == full


@pytest.mark.parametrize("n", [8, 9, 10, 11])
def test_two_replicas_cover_the_epoch(n):
    """Rank r takes global positions p with p % 2 == r; together they are the epoch's order."""
    ranks = [ResumableSampler(n, seed=1, num_replicas=2, rank=r) for r in range(2)]
    order = ranks[0].order().tolist()
    parts = [list(s) for s in ranks]
    assert parts[0] == order[0::2] and parts[1] == order[1::2]
    assert len(parts[0]) == len(parts[1]) == len(ranks[0]) == -(-n // 2)
    assert set(parts[0]) | set(parts[1]) == set(range(n))
    assert order[:n] == ResumableSampler(n, seed=1).order().tolist()  # same base permutation as one rank


def test_odd_length_pads_with_the_start_of_the_order():
    s0 = ResumableSampler(7, seed=3, num_replicas=2, rank=0)
    s1 = ResumableSampler(7, seed=3, num_replicas=2, rank=1)
    order = s0.order().tolist()
    assert s0.total == 8 and len(order) == 8
    assert order[7] == order[0]
    assert sorted(order[:7]) == list(range(7))
    combined = sorted(list(s0) + list(s1))
    assert combined == sorted(list(range(7)) + [order[0]])


def test_drop_last_truncates():
    s0 = ResumableSampler(7, seed=3, num_replicas=2, rank=0, drop_last=True)
    s1 = ResumableSampler(7, seed=3, num_replicas=2, rank=1, drop_last=True)
    base = ResumableSampler(7, seed=3).order().tolist()
    assert s0.total == 6 and len(s0) == len(s1) == 3
    assert s0.order().tolist() == base[:6]
    both = list(s0) + list(s1)
    assert len(set(both)) == 6 and sorted(both) == sorted(base[:6])


def test_drop_last_has_no_effect_with_one_replica():
    assert list(ResumableSampler(7, seed=3, drop_last=True)) == list(ResumableSampler(7, seed=3))


def test_tiny_dataset_many_replicas():
    """Fewer samples than ranks: padding repeats the order so every rank gets one index."""
    parts = [list(ResumableSampler(2, seed=0, num_replicas=5, rank=r)) for r in range(5)]
    assert all(len(p) == 1 for p in parts)
    assert {p[0] for p in parts} == {0, 1}
    assert [len(list(ResumableSampler(2, num_replicas=5, rank=r, drop_last=True))) for r in range(5)] == [0] * 5
    assert list(ResumableSampler(0, num_replicas=3, rank=2)) == []


@pytest.mark.parametrize("replicas, n", [(2, 10), (2, 11), (3, 10), (4, 7)])
def test_replicas_resume_at_a_global_position_cover_the_rest(replicas, n):
    """After start_at(k) on every rank, the ranks together yield exactly the positions k.. of the order."""
    order = ResumableSampler(n, seed=6, num_replicas=replicas).order().tolist()
    total = len(order)
    for k in range(0, total + 1):
        parts = []
        for r in range(replicas):
            s = ResumableSampler(n, seed=6, num_replicas=replicas, rank=r)
            s.start_at(k)
            parts.extend(list(s))
        assert sorted(parts) == sorted(order[k:]), k


def test_state_dict():
    s = ResumableSampler(range(30), shuffle=False, seed=42, drop_last=True, num_replicas=4, rank=3)
    s.set_epoch(5)
    s.start_at(8)
    assert s.state_dict() == {
        "dataset_len": 30,
        "shuffle": False,
        "seed": 42,
        "drop_last": True,
        "num_replicas": 4,
        "epoch": 5,
        "per_sample_rng": True,
    }


@pytest.mark.parametrize(
    "args, kwargs, field",
    [
        ((-1,), {}, "data_source"),
        ((True,), {}, "data_source"),
        ((10,), dict(seed=1.5), "seed"),
        ((10,), dict(seed=True), "seed"),
        ((10,), dict(seed="0"), "seed"),
        ((10,), dict(num_replicas=0), "num_replicas"),
        ((10,), dict(num_replicas=2.0), "num_replicas"),
        ((10,), dict(num_replicas=2, rank=2), "rank"),
        ((10,), dict(rank=-1), "rank"),
        ((10,), dict(num_replicas=2, rank=1.0), "rank"),
    ],
)
def test_constructor_validation(args, kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        ResumableSampler(*args, **kwargs)


def test_keyword_only_options():
    with pytest.raises(TypeError):
        ResumableSampler(10, False)  # type: ignore[misc]


@pytest.mark.parametrize("bad", [-1, 1.0, "2", None])
def test_set_epoch_and_start_at_validation(bad):
    s = ResumableSampler(10)
    with pytest.raises(ValueError, match="^epoch:"):
        s.set_epoch(bad)
    with pytest.raises(ValueError, match="^sample:"):
        s.start_at(bad)
    with pytest.raises(ValueError, match="^epoch:"):
        s.hold_epoch(bad)
    assert s.epoch == 0 and not s.held
    assert list(s) == s.order().tolist()  # a rejected start_at leaves no cursor behind


@pytest.mark.parametrize("n, batch_size", [(23, 4), (24, 4), (5, 4), (0, 4)])
def test_dataloader_batches_are_slices_of_the_order(n, batch_size):
    s = ResumableSampler(n, seed=8)
    s.set_epoch(3)
    order = s.order().tolist()
    loader = DataLoader(list(range(n)), batch_size=batch_size, sampler=s)
    batches = [b.tolist() for b in loader]
    assert batches == [order[i : i + batch_size] for i in range(0, n, batch_size)]
    assert len(loader) == len(batches)


def test_dataloader_resumes_at_a_batch_boundary():
    """start_at(batches * batch_size) makes the loader yield the remaining batches of the epoch."""
    s = ResumableSampler(30, seed=8)
    s.set_epoch(1)
    loader = DataLoader(list(range(30)), batch_size=4, sampler=s)
    full = [b.tolist() for b in loader]
    s.start_at(3 * 4)
    assert [b.tolist() for b in loader] == full[3:]
    assert [b.tolist() for b in loader] == full


def test_iteration_does_not_hold_the_whole_epoch_as_python_ints():
    """A 5M-sample epoch as one list of ints takes ~200 MB of Python objects; chunks keep it small."""
    import tracemalloc

    s = ResumableSampler(5_000_000, seed=1)
    tracemalloc.start()
    try:
        it = iter(s)
        first = [next(it) for _ in range(1000)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert first == s.order()[:1000].tolist()
    assert peak < 20 << 20, f"{peak / 2**20:.0f} MiB of Python objects to start an epoch"


# ------------------------------------------------------------------ whose epoch: the run's, once it holds it


class CountingLoader:
    """A wrapper loader as frameworks write them (Lightning Fabric's, Accelerate's): at each iteration it sets its own
    count of iterations in this process as the sampler's epoch, then iterates the DataLoader."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader, self.count = loader, 0

    def __iter__(self):
        self.loader.sampler.set_epoch(self.count)
        self.count += 1
        return iter(self.loader)


def ignored(caplog) -> list[tuple]:
    """What each log record about an ignored set_epoch said: (asked epoch, caller, the run's epoch)."""
    return [r.args for r in caplog.records if r.name == "preempt" and "set_epoch" in r.msg]


def resumed_in_epoch_1(sampler: ResumableSampler, hold: bool) -> list[list[int]]:
    """A process resumed in epoch 1 (of 3): at each epoch the run sets its epoch, then the wrapper iterates."""
    loader = CountingLoader(DataLoader(list(range(24)), batch_size=4, sampler=sampler))
    epochs = []
    for epoch in (1, 2):
        if hold:
            sampler.hold_epoch(epoch)
        else:
            sampler.set_epoch(epoch)
        epochs.append([i for b in loader for i in b.tolist()])
    return epochs


def test_a_held_epoch_is_the_run_s_whatever_a_wrapper_loader_sets(caplog):
    """The run holds the epoch: the wrapper's count (0, 1 in a process resumed in epoch 1) changes nothing, and one
    line (not one per epoch) says so."""
    caplog.set_level("INFO", logger="preempt")
    s = ResumableSampler(24, seed=5)
    assert resumed_in_epoch_1(s, hold=True) == [s.order(1).tolist(), s.order(2).tolist()]
    assert s.held and s.epoch == 2
    [(asked, caller, kept)] = ignored(caplog)
    assert (asked, kept) == (0, 1) and caller.endswith("CountingLoader.__iter__"), caller


def test_without_the_hold_a_wrapper_loader_replays_the_earlier_epochs_orders(caplog):
    """What the hold prevents (the sampler's behaviour before it, and a sampler no run made): the wrapper's count
    wins, so the resumed process runs epoch 1 in epoch 0's order and epoch 2 in epoch 1's."""
    caplog.set_level("INFO", logger="preempt")
    s = ResumableSampler(24, seed=5)
    assert resumed_in_epoch_1(s, hold=False) == [s.order(0).tolist(), s.order(1).tolist()]
    assert not s.held and not ignored(caplog)


def test_set_epoch_with_the_held_epoch_says_nothing_and_each_caller_is_said_once(caplog):
    caplog.set_level("INFO", logger="preempt")
    s = ResumableSampler(10)
    s.hold_epoch(3)
    s.set_epoch(3)  # a framework whose count agrees with the run's (a fresh run)
    assert not ignored(caplog)

    def framework_a(epoch: int) -> None:
        s.set_epoch(epoch)

    def framework_b(epoch: int) -> None:
        s.set_epoch(epoch)

    for e in range(3):
        framework_a(e)
        framework_b(e)
    assert s.epoch == 3
    said = ignored(caplog)
    assert [(a, k) for a, _, k in said] == [(0, 3), (0, 3)]
    assert [c.rsplit(".", 1)[-1] for _, c, _ in said] == ["framework_a", "framework_b"]


def test_a_framework_ahead_of_the_run_is_said_at_debug_only(caplog):
    """Lightning's fit loop sets the next epoch before the run opens it: nothing replays, so no line at INFO."""
    caplog.set_level("INFO", logger="preempt")
    s = ResumableSampler(10)
    s.hold_epoch(0)
    s.set_epoch(1)
    assert s.epoch == 0 and not ignored(caplog)
    caplog.set_level("DEBUG", logger="preempt")
    s = ResumableSampler(10)
    s.hold_epoch(1)
    s.set_epoch(2)
    assert [(a, k) for a, _, k in ignored(caplog)] == [(2, 1)]


def test_the_run_s_samplers_hold_their_epoch_from_the_start():
    """run.sampler() (the run's data cursor) makes a sampler whose epoch is the loop's, held from the start."""
    from preempt.run.data_cursor import DataCursor

    cursor = DataCursor(())
    s = cursor.make_sampler(range(12), epoch=2, shuffle=True, seed=1)
    assert s.held and s.epoch == 2
    s.set_epoch(0)
    cursor.set_epoch(3)
    assert s.epoch == 3 and list(s) == s.order(3).tolist()
