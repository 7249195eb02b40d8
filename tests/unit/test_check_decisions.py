"""``preempt check``'s pure parts: the stops it picks, the steps it compares, the first divergence, the words it uses,
the verdict; the spec a check hands the run, and the options the run takes inside one. No processes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from preempt.cli import check
from preempt.cluster.environment import CheckSpec, Environment
from preempt.run.config import RunConfig, checked_config


def test_choose_stops_mid_epoch_the_step_after_and_the_epoch_end():
    assert check.choose_stops(30, 12) == [6, 7, 12]
    assert check.choose_stops(30, None) == [10, 11]  # no epochs known: a third of the way
    assert check.choose_stops(30, 100) == [10, 11]  # an epoch longer than the check
    assert check.choose_stops(3, 2) == [1, 2]
    assert check.choose_stops(2, None) == [1]


def test_default_last():
    assert check.default_last([]) == check.DEFAULT_STEPS
    assert check.default_last([4, 9]) == 9 + check.AFTER_LAST_STOP


def test_compared_steps_every_step_from_the_first_stop_or_a_window():
    assert check.compared_steps([5], 12) == list(range(5, 13))
    steps = check.compared_steps([10, 500], 1000, window=40)
    assert steps[0] == 10 and steps[-1] == 1000
    for s in (10, 500):  # each stop and the steps right after it
        assert set(range(s, s + check.AFTER_STOP + 1)) <= set(steps)
    assert len(steps) <= 40 + 2 * (check.AFTER_STOP + 1)
    assert steps == sorted(set(steps))


def test_first_divergence_leaves_out_only_what_the_references_disagree_on():
    diffs = [(5, []), (6, ["rng.now.python.state"]), (7, ["rng.now.python.state", "model.w"])]
    assert check.first_divergence(diffs, ["rng.now.python.state"]) == (7, ["model.w"])
    assert check.first_divergence(diffs, []) == (6, ["rng.now.python.state"])
    assert check.first_divergence([(5, []), (6, [])], []) is None


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("model.fc.weight", "model.fc.weight"),
        ("optimizer.state.0.exp_avg", "optimizer state"),
        ("optimizer.param_groups.0.lr", "optimizer settings (param_groups)"),
        ("rng.now.torch", "the global torch RNG"),
        ("rng.now.python.state", "Python's global random"),
        ("rng.now.numpy.key", "NumPy's global RNG"),
        ("rng.epoch_start.torch", "the global torch RNG at the epoch's start"),
        ("tracked.counter.n", "tracked.counter"),
        ("user.seen", "user_state.seen"),
        ("scheduler.last_epoch", "the LR scheduler"),
        ("data.loader.0.pos", "the data cursor"),
        ("rank 1: rng.now.torch", "rank 1: the global torch RNG"),
    ],
)
def test_label_says_what_differs_in_a_users_words(path, said):
    assert check.label(path) == said


def test_labels_counts_the_models_tensors_and_the_rest():
    paths = ["model.a", "model.b", "model.c", "optimizer.state.0.x", "optimizer.state.1.x", "rng.now.torch"]
    assert check.labels(paths) == "model.a and 2 more of the model's tensors, optimizer state, the global torch RNG"
    assert check.labels([f"tracked.t{i}.v" for i in range(6)], most=2) == "tracked.t0, tracked.t1 and 4 more"


def test_hint_names_the_first_step_after_a_resume():
    assert "first step after the resume at step 5" in check.hint(6, [5])
    assert "3 steps after the resume at step 5" in check.hint(8, [5])
    assert "before any resume" in check.hint(4, [5])


def test_judge():
    same = [(5, []), (6, [])]
    assert check.judge(same, [], [5]).code == check.EXACT
    noted = check.judge(same, ["user.clock"], [5])  # nondeterminism outside the model: reported, still exact
    assert (noted.code, noted.verdict, noted.nondeterministic) == (check.EXACT, "exact", ("user.clock",))
    nd = check.judge(same, ["model.w"], [5])
    assert (nd.code, nd.verdict) == (check.NOT_EXACT, "nondeterministic")
    bad = check.judge([(5, []), (6, ["model.w", "rng.now.torch"])], ["rng.now.torch"], [5])
    assert (bad.code, bad.verdict, bad.step, bad.since) == (check.NOT_EXACT, "not exact", 6, 5)
    assert bad.differs == ("model.w",)
    assert "first step after the resume" in (bad.hint or "")


def test_differing_compares_tensors_exactly_and_json_values_by_type():
    a = {"model.w": torch.tensor([1.0, float("nan")]), "x": 1, "y": 0.5, "only_a": 1}
    b = {"model.w": torch.tensor([1.0, float("nan")]), "x": 1.0, "y": 0.5, "only_b": 2}
    assert check.differing(a, b) == ["x", "only_a", "only_b"]
    assert check.differing({"t": torch.tensor([1.0])}, {"t": torch.tensor([1.0 + 1e-7])}) == ["t"]
    assert check.differing({"t": torch.tensor([1.0])}, {"t": torch.tensor([1.0], dtype=torch.float64)}) == ["t"]


def test_flatten_walks_dicts_and_lists():
    out: dict = {}
    check.flatten({"a": {"b": [1, {"c": 2}], "e": []}}, "", out)
    assert out == {"a.b.0": 1, "a.b.1.c": 2, "a.e": []}


def test_check_spec_round_trips_through_the_environment():
    spec = CheckSpec(save_dir="/s", saves=frozenset({5, 6}), stops=frozenset({5}), kill=True, last=9)
    assert Environment.from_env({"PREEMPT_CHECK": spec.to_env()}).check == spec
    assert Environment.from_env({}).check is None


@pytest.mark.parametrize(
    "value",
    [
        "not json",
        json.dumps({"save_dir": "/s"}),
        json.dumps({"save_dir": "", "saves": [], "stops": [], "kill": False, "last": 3}),
        json.dumps({"save_dir": "/s", "saves": [0], "stops": [], "kill": False, "last": 3}),
        json.dumps({"save_dir": "/s", "saves": [], "stops": [3], "kill": False, "last": 3}),
        json.dumps({"save_dir": "/s", "saves": [], "stops": [], "kill": 1, "last": 3}),
    ],
)
def test_a_malformed_check_spec_is_an_error_not_ignored(value):
    # ignored, it would leave the run writing into the script's own save_dir
    with pytest.raises(ValueError, match="PREEMPT_CHECK"):
        Environment.from_env({"PREEMPT_CHECK": value})


def test_inside_a_check_the_run_keeps_everything_and_touches_nothing_of_the_users():
    user = RunConfig(
        keep_last=1,
        keep_every_steps=10,
        checkpoint_interval=5.0,
        checkpoint_every_steps=3,
        mirror="s3://bucket/x",
        loggers=["tensorboard"],
        time_limit=100.0,
        auto_resume=False,
        monitor_gpu=True,
    )
    c = checked_config(user)
    assert (c.keep_last, c.keep_best, c.keep_every_steps, c.recycle_files) == (None, 0, None, False)
    assert (c.checkpoint_interval, c.checkpoint_every_steps, c.checkpoints_per_epoch) == (None, None, None)
    assert (c.mirror, tuple(c.loggers or ()), c.monitor_gpu, c.time_limit, c.requeue) == (None, (), None, None, False)
    assert (c.async_save, c.auto_resume) == (False, True)
    assert c.retention().keep_last is None
    # the rest is the user's
    assert dataclasses.replace(c, **{f: getattr(user, f) for f in ("exit_code", "signals")}) == c


def _doc(**over):
    doc = {
        "verdict": "exact",
        "steps": 9,
        "stops": [5],
        "signal": "TERM",
        "compared_steps": [5, 6, 7, 8, 9],
        "first_diverging_step": None,
        "equal_until": None,
        "differs_paths": [],
        "nondeterministic_paths": [],
        "hint": None,
    }
    return {**doc, **over}


def test_render_a_table_and_a_last_line_that_says_exact_or_not():
    exact = check.render(_doc()).splitlines()
    assert exact[0].split()[:2] == ["run", "stops"] and "trial" in exact[3] and "TERM at 5" in exact[3]
    assert exact[-1].startswith("exact: stopped (TERM) at step 5") and "steps 5 to 9" in exact[-1]
    bad = check.render(
        _doc(
            verdict="not exact",
            first_diverging_step=6,
            equal_until=5,
            differs_paths=["model.w", "rng.now.torch"],
            hint="the first step after the resume at step 5 already differs",
        )
    ).splitlines()
    assert bad[-1] == "not exact: the resumed run first differs at step 6: model.w, the global torch RNG"
    assert bad[-2].startswith("hint: the first step after the resume")
    gap = check.render(_doc(verdict="not exact", first_diverging_step=9, equal_until=7, differs_paths=["model.w"]))
    assert "a step after 7, by step 9" in gap.splitlines()[-1]
    noisy = check.render(_doc(nondeterministic_paths=["user.clock"])).splitlines()
    assert "nondeterministic: user_state.clock" in noisy[2] and noisy[-1].endswith("user_state.clock")
