"""The walltime keeper's arithmetic (preempt.run.stopping.Walltime) and its place in decide(), without a clock."""

from __future__ import annotations

import math

import pytest

from preempt.run.due import Decision, Reason, SaveFacts, SavePolicy, decide, next_due
from preempt.run.stopping import Walltime


def facts(**kw) -> SaveFacts:
    base = dict(
        now=100.0,
        step=10,
        epoch=0,
        batch=10,
        batches_per_epoch=None,
        last_save_time=0.0,
        last_save_step=0,
        last_save_epoch=0,
        last_save_batch=0,
    )
    base.update(kw)
    return SaveFacts(**base)


def test_stop_at_the_deadline_saves_when_dirty_and_stops():
    policy = SavePolicy(interval_s=None)
    assert decide(policy, facts(stop_at=100.0)) == Decision(True, True, Reason.WALLTIME)
    assert decide(policy, facts(stop_at=100.0, dirty=False)) == Decision(False, True, Reason.WALLTIME)
    assert decide(policy, facts(stop_at=100.5)) == Decision(False, False, None)
    # a signal and the deadline together: the signal is the reason (it is what the log and SLURM rule need)
    assert decide(policy, facts(stop_at=50.0, stop_requested=True)).reason == Reason.PREEMPT
    # the deadline before a periodic save that is also due
    assert decide(SavePolicy(interval_s=10.0), facts(stop_at=50.0)).reason == Reason.WALLTIME


def test_next_due_never_passes_stop_at():
    assert next_due(SavePolicy(interval_s=300.0), facts(stop_at=150.0)).time == 150.0
    assert next_due(SavePolicy(interval_s=30.0), facts(stop_at=150.0)).time == 30.0
    assert next_due(SavePolicy(interval_s=None), facts()).time == math.inf


def test_margin_from_prior_then_measured_save():
    w = Walltime(deadline=1000.0, prior_save_s=Walltime.prior_save_s(2 * 10**9), now=0.0, step=0)
    assert w.save_s == pytest.approx(20.5)  # 2 GB at 100 MB/s, plus 0.5 s
    assert w.stop_at() == pytest.approx(1000.0 - (1.5 * 20.5 + Walltime.SLACK_S))
    w.saved(3.0, now=10.0, step=5)  # the first timed save replaces the prior
    assert w.save_s == 3.0
    w.saved(2.0, now=20.0, step=8)  # later ones only raise it
    assert w.save_s == 3.0
    w.saved(4.0, now=30.0, step=9)
    assert w.save_s == 4.0


def test_gap_is_the_longest_non_step_stretch_and_enters_the_margin():
    w = Walltime(deadline=1000.0, prior_save_s=1.0, now=0.0, step=0)
    w.gap(4.0)
    w.gap(2.0)
    assert w.gap_s == 4.0
    assert w.margin() == pytest.approx(1.5 * (0.0 + 4.0 + 1.0) + Walltime.SLACK_S)


def test_step_time_is_the_longest_window_average_and_saves_are_excluded():
    w = Walltime(deadline=1000.0, prior_save_s=0.5, now=0.0, step=0)
    w.observe(10.0, 10)  # 1 s per step
    assert w.step_s == 1.0
    w.observe(12.0, 10)  # no step: the window stays open
    w.observe(16.0, 12)  # (16 - 10) / 2: the end-of-epoch code between counts
    assert w.step_s == 3.0
    w.saved(5.0, now=30.0, step=12)  # a save restarts the window after it
    w.observe(31.0, 13)
    assert w.step_s == 3.0


def test_reviews_halve_the_time_left_and_end_on_stop_at():
    w = Walltime(deadline=1000.0, prior_save_s=0.5, now=0.0, step=0)
    stop = w.stop_at()
    now, reviews = 0.0, 0
    while now < stop:
        nxt = w.review_at(now)
        assert now < nxt <= stop
        now, reviews = nxt, reviews + 1
    assert now == stop and reviews <= math.ceil(math.log2(1000)) + 2


def simulate(deadline, step_s, save_s, save_every=300.0, epoch_every=0, epoch_s=0.0):
    """The run's use of Walltime with a fake clock and periodic saves; returns (stop, its save's end, reviews)."""
    w = Walltime(deadline=deadline, prior_save_s=Walltime.prior_save_s(10**6), now=0.0, step=0)
    now, step, reviews, last_save = 0.0, 0, 0, 0.0
    due = min(w.review_at(now), save_every)
    while True:
        now += step_s
        step += 1
        if epoch_every and step % epoch_every == 0:
            # the epoch's end: a safe point after the end-of-epoch code, which the run times
            now += epoch_s
            w.gap(epoch_s)
            w.observe(now, step)
            if now >= w.stop_at():
                return now, now + save_s, reviews
        if now >= due:  # run.step(): the only clock comparison per step
            reviews += 1
            w.observe(now, step)
            if now >= w.stop_at():
                return now, now + save_s, reviews
            if now >= last_save + save_every:
                now += save_s
                last_save = now
                w.saved(save_s, now, step)
            due = min(w.review_at(now), last_save + save_every)


@pytest.mark.parametrize(
    "deadline, step_s, save_s",
    [(3600.0, 0.05, 0.01), (3600.0, 2.0, 0.3), (60.0, 0.55, 0.01), (86400.0, 0.3, 5.0), (600.0, 30.0, 0.2)],
)
def test_simulated_runs_stop_in_time_and_not_too_early(deadline, step_s, save_s):
    stop, saved, reviews = simulate(deadline, step_s, save_s)
    assert saved < deadline, (stop, saved)
    # not long before the end either: within twice the margin plus a step
    assert deadline - stop < 2 * (1.5 * (step_s + max(save_s, 0.51)) + Walltime.SLACK_S) + step_s, stop
    assert reviews <= math.log2(deadline) + 12 + deadline / 300.0


@pytest.mark.parametrize("deadline", [3600.0 + 7 * k for k in range(25)])
def test_simulated_slow_epoch_ends_are_foreseen(deadline):
    # 1 s steps, 100 steps per epoch, 40 s of evaluation at each epoch end, the deadline at every phase of an
    # epoch: the timed epoch end is in the margin, so an evaluation that starts right before stop_at still
    # leaves time for the save
    stop, saved, _ = simulate(deadline, 1.0, 1.0, epoch_every=100, epoch_s=40.0)
    assert saved < deadline, (stop, saved)
    assert deadline - stop < 2 * (1.5 * (1.0 + 40.0 + 1.0) + Walltime.SLACK_S) + 41.0
