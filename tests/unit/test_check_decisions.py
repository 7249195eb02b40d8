"""``preempt check``'s pure parts: the stops it picks, the steps it compares, the first divergence, the words it uses,
the verdict; the spec a check hands the run, the options the run takes inside one, and the live state it records for
each checkpoint to be held to. No processes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from preempt.checkpoint import live_record
from preempt.checkpoint.components import Components
from preempt.cli import check
from preempt.cluster.environment import CheckSpec, Environment
from preempt.run.check_record import CheckRecorder
from preempt.run.config import RunConfig, checked_config
from preempt.run.loop_state import LoopState


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


# ------------------------------------------------------------- the live state a checkpoint is held to


def _record(step: int, **tensors: torch.Tensor) -> live_record.LiveRecord:
    return live_record.LiveRecord(step=step, tensors={p: live_record.tensor_digest(t) for p, t in tensors.items()})


def test_a_tensors_digest_is_its_dtype_shape_and_bytes():
    t = torch.arange(6, dtype=torch.float32)
    assert live_record.tensor_digest(t) == live_record.tensor_digest(t.clone())
    assert live_record.tensor_digest(t)[:2] == ("float32", (6,))
    assert live_record.tensor_digest(t) != live_record.tensor_digest(t.view(2, 3))
    assert live_record.tensor_digest(t)[2] != live_record.tensor_digest(t + 1)[2]
    assert live_record.tensor_digest(t.view(2, 3).t())[2] == live_record.tensor_digest(t.view(2, 3).t().contiguous())[2]


def test_a_checkpoint_is_stale_where_its_tensor_is_not_the_live_one_of_the_same_dtype_and_shape():
    w = torch.ones(3)
    rec = _record(9, **{"model.w": w + 1, "model.b": w, "model.h": w})
    held = {
        "model.w": live_record.tensor_digest(w),  # an older value
        "model.b": live_record.tensor_digest(w),
        "model.h": live_record.tensor_digest(w.half()),  # a state_dict that converts says nothing about time
    }
    assert live_record.stale(rec, held) == ["model.w"]
    assert live_record.stale(rec, {}) == []  # a path the checkpoint does not hold (a non-persistent buffer)
    records = {7: _record(7, **{"model.w": w}), 8: _record(8, **{"model.w": w * 3}), 9: rec}
    assert live_record.live_at(records, 9, "model.w", held["model.w"][2]) == 7  # it holds step 7's value
    assert live_record.live_at(records, 9, "model.w", live_record.tensor_digest(w * 5)[2]) is None


def test_a_live_record_round_trips_through_json_and_a_bad_one_is_named(tmp_path):
    rec = live_record.LiveRecord(
        step=4, tensors={"model.w": ("float32", (2, 2), "ab")}, batch="cd", epoch_ends=((0, 3),)
    )
    live_record.write(tmp_path / "live", rec)
    assert live_record.read_all(tmp_path / "live") == {4: rec}
    assert live_record.read_all(tmp_path / "absent") == {}
    live_record.record_path(tmp_path / "live", 5).write_text(json.dumps({"step": 5}))
    with pytest.raises(ValueError, match="step_000000005.json"):
        live_record.read_all(tmp_path / "live")


@pytest.mark.parametrize(
    ("ends", "epoch", "batch", "per_epoch", "last", "steps"),
    [
        (((0, 13), (1, 26)), 2, 4, 26, 30, 13),  # 26 batches, 2 per optimizer step: 13 steps, whatever the batches
        ((), 0, 26, 26, 13, 13),  # the first epoch's last step is the check's last
        ((), 0, 20, 26, 10, None),  # the first epoch outlasts the check
        ((), 0, 0, -1, 30, None),  # no epochs (a loop of its own around run.step())
    ],
)
def test_an_epochs_length_is_counted_in_run_step_calls(ends, epoch, batch, per_epoch, last, steps):
    rec = live_record.LiveRecord(step=last, tensors={}, epoch_ends=ends)
    assert live_record.steps_per_epoch(rec, epoch, batch, per_epoch, last) == steps


def test_without_a_record_an_epochs_length_is_its_batches():
    assert live_record.steps_per_epoch(None, 1, 3, 12, 30) == 12  # a sharded model's run records nothing
    assert live_record.steps_per_epoch(None, 0, 3, -1, 30) is None


def test_default_stops_under_gradient_accumulation_land_mid_epoch_in_optimizer_steps():
    # run_clm_no_trainer's shape: 26 batches an epoch, 2 per optimizer step; stops at 13, 14, 26 in batches never
    # stopped inside an epoch
    per = live_record.steps_per_epoch(live_record.LiveRecord(step=30, tensors={}, epoch_ends=((0, 13),)), 2, 8, 26, 30)
    assert check.choose_stops(30, per) == [6, 7, 13]


def test_a_stale_checkpoint_is_the_verdict_and_names_the_checkpoint_and_the_tensor():
    stale = check.Stale(run="reference-2", step=9, paths=("model.0.weight",), of_step=8, carried=True)
    v = check.judge([(9, ["model.0.weight"])], ["model.0.weight"], [5], stale=stale)
    assert (v.code, v.verdict, v.step, v.differs) == (check.NOT_EXACT, "stale checkpoint", 9, ("model.0.weight",))
    assert v.hint is not None
    assert v.hint.startswith("step 9's checkpoint (reference-2 run) holds model.0.weight from an older step (step 8's)")
    assert "behind autograd" in v.hint
    cached = check.Stale(run="trial", step=5, paths=("model.0.weight", "model.0.bias"), carried=False)
    assert "from an older step, not the live value at step 5" in cached.says()
    assert "state_dict() it read handed out, an older copy" in cached.says()
    assert "model.0.weight and 1 more of the model's tensors" in cached.says()


def test_hint_names_an_epoch_reset_by_something_else_than_the_run():
    reset = check.hint(13, [12], check.DataFacts(batch_differs=True, epoch=1, sampler_epoch=0, epoch_start=True))
    assert reset.startswith("at step 13 the sampler is at epoch 0 while the run is in epoch 1")
    assert "set_epoch" in reset
    order = check.hint(13, [12], check.DataFacts(batch_differs=True, epoch=1, epoch_start=True))
    assert order.startswith("the data order of epoch 1 after the resume at step 12 is not the uninterrupted run's")
    mid = check.hint(8, [7], check.DataFacts(batch_differs=True, epoch=0))
    assert mid.startswith("the batches of step 8 are not the uninterrupted run's")
    same = check.hint(6, [5], check.DataFacts(batch_differs=False))  # the same batches: state carried between steps
    assert "first step after the resume at step 5" in same
    v = check.judge([(12, []), (13, ["model.w"])], [], [12], data={13: check.DataFacts(batch_differs=True, epoch=1)})
    assert v.hint is not None and v.hint.startswith("the batches of step 13")


def test_render_says_when_the_second_reference_was_not_needed_and_names_a_stale_checkpoint():
    exact = check.render(_doc(runs=["reference", "trial"])).splitlines()
    assert "not run" in exact[2] and "the trial equals the reference at step 9)" in exact[2]
    noisy = check.render(_doc(runs=["reference", "trial"], nondeterministic_paths=["rng.now.python.state"]))
    assert "but for generators two uninterrupted runs held apart from step 1" in noisy.splitlines()[2]
    assert "equals an uninterrupted run's at step 9" in exact[-1] and "holds the live state of its step" in exact[-1]
    stale = {"run": "trial", "step": 5, "labels": "model.0.weight"}
    doc = _doc(runs=["reference", "trial"], verdict="stale checkpoint", stale_checkpoint=stale, hint="step 5's ...")
    lines = check.render(doc).splitlines()
    assert lines[-1] == "stale checkpoint: step 5's ..."
    assert lines[3].endswith("step 5's checkpoint (trial run): model.0.weight")


def test_the_run_records_its_models_own_tensors_not_what_a_state_dict_hook_hands_out(tmp_path):
    model = torch.nn.Linear(2, 2)
    old = model.weight.detach().clone()

    def stale(module, state, prefix, meta):
        state[prefix + "weight"] = old

    model.register_state_dict_post_hook(stale)
    loop = LoopState()
    recorder = CheckRecorder(str(tmp_path), frozenset({1}), Components.checked(model, None, None, None, None), loop)
    with torch.no_grad():
        model.weight.add_(1.0)
    batches = list(recorder.watching(iter([(torch.ones(2), 1), (torch.zeros(2), 0)])))
    assert len(batches) == 2  # handed on unchanged
    loop.stepped()
    recorder.record(1)
    rec = live_record.read_all(tmp_path)[1]
    assert rec.tensors["model.weight"] == live_record.tensor_digest(model.weight)
    assert live_record.stale(rec, {"model.weight": live_record.tensor_digest(model.state_dict()["weight"])}) == [
        "model.weight"
    ]
    assert rec.batch is not None  # the batches step 1 consumed
    loop.stepped()  # step 2 is not one the check compares: its batches are not digested
    list(recorder.watching(iter([(torch.ones(2), 1)])))
    recorder.record(2)
    assert live_record.read_all(tmp_path)[2].batch is None


def test_the_live_record_sits_beside_the_checks_save_dir():
    spec = CheckSpec(save_dir="/s/trial", saves=frozenset(), stops=frozenset(), kill=False, last=3)
    assert spec.live_dir == "/s/trial.live"


def test_generators_two_uninterrupted_runs_held_apart_at_step_1_are_nondeterministic_without_a_second_reference():
    def at_1(**gens: str) -> live_record.LiveRecord:
        return live_record.LiveRecord(step=5, tensors={}, generators=gens)

    reference, trial = at_1(torch="a", python="b", numpy="c"), at_1(torch="a", python="x", numpy="y")
    apart = live_record.unseeded(reference, trial)
    assert apart == {"python", "numpy"}
    assert live_record.unseeded(reference, at_1()) == set()  # a resumed process saw no step 1
    differ = ["rng.now.python.state", "rng.epoch_start.numpy.key"]
    assert check.apart_from_the_start(differ, apart) == differ  # all known: exact, no second reference
    assert check.apart_from_the_start([*differ, "model.w", "rng.now.torch"], apart) == differ  # the rest: run it
    assert check.generator("rank 1: rng.now.python.state") is None  # rank 0's records only


def test_the_run_records_the_generators_at_step_1(tmp_path):
    loop = LoopState()
    recorder = CheckRecorder(str(tmp_path), frozenset({1}), Components.checked(None, None, None, None, None), loop)
    torch.manual_seed(3)
    loop.stepped()
    recorder.first_step()
    recorder.record(1)
    seeded = live_record.read_all(tmp_path)[1].generators
    assert {"torch", "python", "numpy"} <= set(seeded)
    torch.manual_seed(4)
    recorder.first_step()
    recorder.record(1)
    assert live_record.unseeded(
        live_record.LiveRecord(step=1, tensors={}, generators=seeded), live_record.read_all(tmp_path)[1]
    ) == {"torch"}
