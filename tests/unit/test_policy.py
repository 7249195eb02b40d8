"""Unit tests for preempt.run.due: save decisions, the next_due prefilter, retention."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from preempt.checkpoint.retention import Kept, RetentionPolicy, select_kept
from preempt.run.due import NOTHING, Decision, Due, Reason, SaveFacts, SavePolicy, decide, next_due


def facts(**kw) -> SaveFacts:
    """SaveFacts with harmless defaults: nothing due, state dirty, no stop."""
    base = dict(
        now=0.0,
        step=0,
        epoch=0,
        batch=0,
        batches_per_epoch=None,
        last_save_time=0.0,
        last_save_step=0,
        last_save_epoch=0,
        last_save_batch=0,
    )
    base.update(kw)
    return SaveFacts(**base)


NO_CLOCK = SavePolicy(interval_s=None)


# ------------------------------------------------------------------ decide


def test_preempt_dirty_saves_and_stops():
    """A pending stop with changed state saves and stops, whatever else holds."""
    d = decide(SavePolicy(), facts(stop_requested=True, dirty=True))
    assert d == Decision(True, True, Reason.PREEMPT)


def test_preempt_not_dirty_stops_without_saving():
    """A pending stop with nothing new since the last save or load stops without a write."""
    d = decide(SavePolicy(), facts(stop_requested=True, dirty=False, best_improved=True, now=1e9))
    assert d == Decision(False, True, Reason.PREEMPT)


def test_not_dirty_never_saves():
    """Without changes nothing is saved, even when every periodic trigger is due."""
    policy = SavePolicy(interval_s=1.0, every_steps=5, per_epoch=2, milestone_steps=10)
    f = facts(now=100.0, step=10, batch=10, batches_per_epoch=10, best_improved=True, dirty=False)
    assert decide(policy, f) is NOTHING
    assert NOTHING == Decision(False, False, None)


def test_nothing_due_is_nothing():
    """Fresh state with no trigger reached yields NOTHING."""
    policy = SavePolicy(interval_s=10.0, every_steps=5, per_epoch=2, milestone_steps=10)
    d = decide(policy, facts(now=9.0, step=4, batch=4, batches_per_epoch=10))
    assert d == NOTHING


def test_best_improved_saves():
    """An improved metric saves with reason BEST and does not stop."""
    assert decide(NO_CLOCK, facts(best_improved=True)) == Decision(True, False, Reason.BEST)


@pytest.mark.parametrize("step, saves", [(10, True), (20, True), (15, False), (9, False)])
def test_milestone_at_multiples(step, saves):
    """milestone_steps saves exactly at multiples of the global step."""
    d = decide(SavePolicy(interval_s=None, milestone_steps=10), facts(step=step, last_save_step=1))
    assert d == (Decision(True, False, Reason.MILESTONE) if saves else NOTHING)


@pytest.mark.parametrize(
    "step, last_save_step, saves",
    [(5, 3, True), (10, 8, True), (8, 3, False), (6, 1, False), (5, 5, False)],
)
def test_every_steps_uses_global_multiples(step, last_save_step, saves):
    """every_steps fires at multiples of the global step (not of steps since the last save), once per step."""
    d = decide(SavePolicy(interval_s=None, every_steps=5), facts(step=step, last_save_step=last_save_step))
    assert d == (Decision(True, False, Reason.STEPS) if saves else NOTHING)


def test_step_triggers_do_not_refire_at_the_saved_step():
    """A step that was already saved (last_save_step == step) does not save again for milestone/steps."""
    policy = SavePolicy(interval_s=None, every_steps=5, milestone_steps=10)
    assert decide(policy, facts(step=10, last_save_step=10)) == NOTHING


@pytest.mark.parametrize(
    "per_epoch, bpe, slots",
    [
        (2, 10, {5, 10}),
        (3, 10, {4, 7, 10}),
        (4, 10, {3, 5, 8, 10}),
        (1, 7, {7}),
        (10, 3, {1, 2, 3}),  # more slots than batches: every batch is a slot boundary
    ],
)
def test_per_epoch_slots(per_epoch, bpe, slots):
    """per_epoch saves when the batch cursor enters a new one of per_epoch evenly spaced slots."""
    policy = SavePolicy(interval_s=None, per_epoch=per_epoch)
    saved_at = set()
    last = 0
    for b in range(1, bpe + 1):
        d = decide(policy, facts(batch=b, batches_per_epoch=bpe, last_save_batch=last))
        if d.save:
            assert d == Decision(True, False, Reason.PER_EPOCH)
            saved_at.add(b)
            last = b
    assert saved_at == slots


def test_per_epoch_reference_resets_in_a_new_epoch():
    """A save in an earlier epoch counts as batch 0 of the current one."""
    policy = SavePolicy(interval_s=None, per_epoch=2)
    old = dict(epoch=3, last_save_epoch=2, last_save_batch=9, batches_per_epoch=10)
    assert decide(policy, facts(batch=4, **old)) == NOTHING
    assert decide(policy, facts(batch=5, **old)).reason == Reason.PER_EPOCH
    # Saved in this epoch at batch 7 (slot 1): batch 9 is still in slot 1.
    same_epoch = dict(epoch=3, last_save_epoch=3, last_save_batch=7, batches_per_epoch=10)
    assert decide(policy, facts(batch=9, **same_epoch)) == NOTHING


def test_per_epoch_needs_a_length():
    """Without batches_per_epoch (or with 0), per_epoch never fires."""
    policy = SavePolicy(interval_s=None, per_epoch=4)
    assert decide(policy, facts(batch=1000, batches_per_epoch=None)) == NOTHING
    assert decide(policy, facts(batch=1000, batches_per_epoch=0)) == NOTHING


@pytest.mark.parametrize("now, saves", [(129.9, False), (130.0, True), (500.0, True)])
def test_interval(now, saves):
    """The clock trigger fires when now - last_save_time >= interval_s."""
    d = decide(SavePolicy(interval_s=30.0), facts(now=now, last_save_time=100.0))
    assert d == (Decision(True, False, Reason.INTERVAL) if saves else NOTHING)


def test_interval_none_disables_clock():
    assert decide(NO_CLOCK, facts(now=1e12)) == NOTHING


@pytest.mark.parametrize(
    "kw, reason",
    [
        (dict(stop_requested=True, best_improved=True), Reason.PREEMPT),
        (dict(best_improved=True), Reason.BEST),
        (dict(), Reason.MILESTONE),
    ],
)
def test_priority_with_everything_due(kw, reason):
    """Priority: preempt > best > milestone > steps > per_epoch > interval."""
    policy = SavePolicy(interval_s=1.0, every_steps=5, per_epoch=2, milestone_steps=10)
    f = facts(now=50.0, step=20, batch=10, batches_per_epoch=10, last_save_step=1, **kw)
    assert decide(policy, f).reason == reason


def test_priority_lower_tiers():
    """With the higher triggers off, steps beats per_epoch beats interval."""
    due_all = dict(now=50.0, step=5, batch=10, batches_per_epoch=10, last_save_step=1)
    assert decide(SavePolicy(interval_s=1.0, every_steps=5, per_epoch=2), facts(**due_all)).reason == Reason.STEPS
    assert decide(SavePolicy(interval_s=1.0, every_steps=3, per_epoch=2), facts(**due_all)).reason == Reason.PER_EPOCH
    assert decide(SavePolicy(interval_s=1.0, every_steps=3), facts(**due_all)).reason == Reason.INTERVAL


# ------------------------------------------------------------------ next_due


def test_next_due_values():
    """next_due gives the next step multiple, the next slot's first batch and last save + interval."""
    policy = SavePolicy(interval_s=30.0, every_steps=5, milestone_steps=7, per_epoch=4)
    due = next_due(policy, facts(now=101.0, step=3, batch=1, batches_per_epoch=10, last_save_time=100.0))
    assert due == Due(step=5, batch=3, time=130.0)
    due = next_due(policy, facts(step=5, batch=3, batches_per_epoch=10, last_save_batch=3))
    assert due.step == 7  # min(10, 7)
    assert due.batch == 5  # slot 1 -> next slot 2 starts at ceil(2 * 10 / 4) = 5


def test_next_due_all_disabled_is_infinite():
    due = next_due(NO_CLOCK, facts(step=3, batch=2, batches_per_epoch=10))
    assert due == Due(math.inf, math.inf, math.inf)


def _random_policy(rng: random.Random) -> SavePolicy:
    def maybe(make):
        return None if rng.random() < 0.4 else make()

    return SavePolicy(
        # Quarter seconds: sums and differences of these are exact in binary floating point,
        # so this test checks the logic; test_next_due_interval_is_exact_in_floats checks rounding.
        interval_s=maybe(lambda: rng.randint(1, 80) / 4),
        every_steps=maybe(lambda: rng.randint(1, 9)),
        per_epoch=maybe(lambda: rng.randint(1, 12)),
        milestone_steps=maybe(lambda: rng.randint(1, 25)),
    )


def _near(rng: random.Random, lo: float, target: float, spread: float, hi: float | None = None) -> float:
    """A value >= lo, often at or just around ``target`` (where the prefilter matters most)."""
    r = rng.random()
    if math.isfinite(target) and r < 0.6:
        v = target + rng.choice((-2, -1, -1, 0, 0, 0, 1)) * spread
    else:
        v = lo + rng.randint(0, 60) * spread
    v = max(lo, v)
    if hi is not None:
        v = min(v, hi)
    return v


def test_next_due_is_conservative_randomized():
    """Whenever decide() saves (no stop, no best) at a later safe point, a threshold of next_due was reached.

    Contract: next_due is computed after each decision at a safe point E; the
    later point L shares E's last_save_* values (no save happened in between),
    its epoch and loader length, and has step, batch and clock no smaller than
    at E. If decide(E) had saved, last_save_* would have moved, so E is either a
    point where decide() did not save or the point right after a save (last
    save == E, dirty False).
    """
    rng = random.Random(20240607)
    checked = saves = 0
    reasons = set()
    for _ in range(6000):
        policy = _random_policy(rng)
        bpe = rng.choice((None, rng.randint(1, 40)))
        epoch = rng.randint(0, 3)
        ls_epoch = rng.randint(0, epoch)
        ls_step = rng.randint(0, 60)
        ls_time = rng.randint(0, 8000) / 8
        limit = bpe if bpe is not None else 50
        ls_batch = rng.randint(0, limit)
        e_batch = rng.randint(ls_batch if ls_epoch == epoch else 0, limit)
        if ls_epoch == epoch and e_batch < ls_batch:
            continue
        e = facts(
            now=ls_time + rng.randint(0, 800) / 8,
            step=ls_step + rng.randint(0, 30),
            epoch=epoch,
            batch=e_batch,
            batches_per_epoch=bpe,
            last_save_time=ls_time,
            last_save_step=ls_step,
            last_save_epoch=ls_epoch,
            last_save_batch=ls_batch,
        )
        if rng.random() < 0.25:
            # Right after a save at E: the save's values are E's own.
            e = dataclasses.replace(
                e,
                last_save_time=e.now + rng.randint(0, 4) / 8,
                last_save_step=e.step,
                last_save_epoch=e.epoch,
                last_save_batch=e.batch,
                dirty=False,
            )
        elif decide(policy, e).save:
            continue  # the save would change last_save_*; no prefilter spans it
        due = next_due(policy, e)
        for _ in range(5):
            later = dataclasses.replace(
                e,
                now=_near(rng, e.now, due.time, 0.125),
                step=int(_near(rng, e.step, due.step, 1)),
                batch=int(_near(rng, e.batch, due.batch, 1, hi=bpe)),
                dirty=True,
            )
            d = decide(policy, later)
            checked += 1
            if not d.save:
                continue
            saves += 1
            reasons.add(d.reason)
            assert later.step >= due.step or later.batch >= due.batch or later.now >= due.time, (
                f"decide() saves ({d.reason}) below every threshold of next_due()\n"
                f"policy={policy}\nearlier={e}\nlater={later}\ndue={due}"
            )
    assert checked > 10000
    assert saves > 1000
    assert reasons == {Reason.MILESTONE, Reason.STEPS, Reason.PER_EPOCH, Reason.INTERVAL}


def test_next_due_interval_is_exact_in_floats():
    """decide() saves on the interval exactly from next_due().time on, to the last bit.

    Both must compute ``last_save_time + interval_s``: ``now - last_save_time >=
    interval_s`` rounds differently by an ulp for some values (these ones),
    and then the prefilter says "not due" while decide() would save.
    """
    policy = SavePolicy(interval_s=22.527938848328404)
    earlier = facts(now=7.0, last_save_time=6.418755263041502)
    due = next_due(policy, earlier)
    at = dataclasses.replace(earlier, now=due.time)
    just_before = dataclasses.replace(earlier, now=math.nextafter(due.time, -math.inf))
    assert decide(policy, at) == Decision(True, False, Reason.INTERVAL)
    assert decide(policy, just_before) == NOTHING
    # the value where the two formulas disagree: now - last >= interval, yet now < last + interval
    odd = dataclasses.replace(earlier, now=28.946694111369904)
    assert odd.now - odd.last_save_time >= policy.interval_s and odd.now < due.time
    assert decide(policy, odd) == NOTHING


# ------------------------------------------------------------------ SavePolicy validation


def test_save_policy_defaults():
    p = SavePolicy()
    assert (p.interval_s, p.every_steps, p.per_epoch, p.milestone_steps) == (300.0, None, None, None)
    with pytest.raises(TypeError):
        SavePolicy(300.0)  # keyword-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.interval_s = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "300"])
def test_save_policy_rejects_bad_interval(value):
    """A bad interval names the argument (checkpoint_interval) and the value."""
    with pytest.raises(ValueError, match="checkpoint_interval") as e:
        SavePolicy(interval_s=value)
    assert repr(value) in str(e.value)


def test_save_policy_rejects_bool_interval():
    """interval_s=True is not a number of seconds (the int fields reject bools explicitly)."""
    with pytest.raises(ValueError, match="checkpoint_interval"):
        SavePolicy(interval_s=True)


@pytest.mark.parametrize(
    "field, label",
    [
        ("every_steps", "checkpoint_every_steps"),
        ("per_epoch", "checkpoints_per_epoch"),
        ("milestone_steps", "keep_every_steps"),
    ],
)
@pytest.mark.parametrize("value", [0, -3, 2.5, True, "4"])
def test_save_policy_rejects_bad_counts(field, label, value):
    """Step counts must be positive ints; the message names the user-facing argument and the value."""
    with pytest.raises(ValueError, match=label) as e:
        SavePolicy(**{field: value})
    assert repr(value) in str(e.value)


def test_save_policy_accepts_valid():
    p = SavePolicy(interval_s=0.5, every_steps=1, per_epoch=3, milestone_steps=1000)
    assert p.per_epoch == 3
    assert SavePolicy(interval_s=7).interval_s == 7


# ------------------------------------------------------------------ RetentionPolicy


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(keep_last=0), "keep_last"),
        (dict(keep_last=-1), "keep_last"),
        (dict(keep_last=1.5), "keep_last"),
        (dict(keep_last=True), "keep_last"),
        (dict(keep_every_steps=0), "keep_every_steps"),
        (dict(keep_best=-1, metric="loss"), "keep_best"),
        (dict(keep_best=True, metric="loss"), "keep_best"),
        (dict(keep_best=1.0, metric="loss"), "keep_best"),
        (dict(mode="avg"), "best_mode"),
        (dict(metric=""), "best_metric"),
        (dict(metric=3), "best_metric"),
        (dict(keep_best=2), "best_metric"),
    ],
)
def test_retention_policy_validation_names_field(kw, field):
    with pytest.raises(ValueError, match=field):
        RetentionPolicy(**kw)


def test_retention_policy_better():
    """better(): strict improvement in the policy's direction; NaN never improves; anything beats None or NaN."""
    lo = RetentionPolicy(mode="min")
    hi = RetentionPolicy(mode="max")
    assert lo.better(1.0, 2.0) and not lo.better(2.0, 1.0) and not lo.better(1.0, 1.0)
    assert hi.better(2.0, 1.0) and not hi.better(1.0, 2.0) and not hi.better(1.0, 1.0)
    assert lo.better(5.0, None) and lo.better(5.0, math.nan)
    assert not lo.better(math.nan, None) and not hi.better(math.nan, 1.0)


# ------------------------------------------------------------------ select_kept


def _shuffled(items):
    items = list(items)
    random.Random(3).shuffle(items)
    return items


def test_select_kept_empty():
    assert select_kept(RetentionPolicy(), []) == set()


def test_select_kept_keep_last():
    """keep_last keeps the N highest steps, whatever the input order."""
    cps = _shuffled(Kept(s) for s in (10, 20, 30, 40, 50))
    assert select_kept(RetentionPolicy(keep_last=2), cps) == {40, 50}
    assert select_kept(RetentionPolicy(keep_last=1), cps) == {50}
    assert select_kept(RetentionPolicy(keep_last=9), cps) == {10, 20, 30, 40, 50}


def test_select_kept_keep_last_none_keeps_all():
    cps = [Kept(s) for s in range(0, 100, 7)]
    assert select_kept(RetentionPolicy(keep_last=None), cps) == set(range(0, 100, 7))


def test_select_kept_keep_best_min_and_max():
    """keep_best keeps the N best values among best checkpoints, in the policy's direction, plus the last ones."""
    cps = _shuffled(
        [
            Kept(10, 0.9),
            Kept(20, 0.3),
            Kept(30, 0.5),
            Kept(40, 0.1),
            Kept(50),  # not a best checkpoint
            Kept(60),
            Kept(70),
        ]
    )
    assert select_kept(RetentionPolicy(keep_last=1, keep_best=2, metric="loss"), cps) == {70, 40, 20}
    assert select_kept(RetentionPolicy(keep_last=1, keep_best=2, metric="acc", mode="max"), cps) == {70, 10, 30}
    assert select_kept(RetentionPolicy(keep_last=2, keep_best=10, metric="loss"), cps) == {60, 70, 10, 20, 30, 40}


def test_select_kept_best_ignores_nan():
    """A NaN best value never ranks (and does not disturb the ranking of the others)."""
    cps = _shuffled([Kept(10, math.nan), Kept(20, 3.0), Kept(30, math.nan), Kept(40, 1.0), Kept(50, 2.0), Kept(60)])
    assert select_kept(RetentionPolicy(keep_last=1, keep_best=1, metric="m"), cps) == {60, 40}
    assert select_kept(RetentionPolicy(keep_last=1, keep_best=2, metric="m", mode="max"), cps) == {60, 20, 50}
    assert select_kept(RetentionPolicy(keep_last=1, keep_best=5, metric="m"), cps) == {60, 20, 40, 50}


def test_select_kept_keep_every_steps():
    """Milestones at multiples of keep_every_steps survive forever, next to keep_last."""
    cps = _shuffled(Kept(s) for s in range(0, 1001, 50))
    kept = select_kept(RetentionPolicy(keep_last=2, keep_every_steps=300), cps)
    assert kept == {0, 300, 600, 900, 950, 1000}


def test_select_kept_newest_always_kept():
    """The newest valid checkpoint survives under every policy, even when it is a bad 'best'."""
    cps = [Kept(10, 0.1), Kept(20, 0.2), Kept(30, 9.0)]
    for policy in (
        RetentionPolicy(keep_last=1),
        RetentionPolicy(keep_last=1, keep_best=1, metric="loss"),
        RetentionPolicy(keep_last=1, keep_every_steps=7),
    ):
        assert 30 in select_kept(policy, cps)
    assert select_kept(RetentionPolicy(keep_last=1, keep_best=1, metric="loss"), cps) == {30, 10}
