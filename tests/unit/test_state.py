"""Unit tests for preempt.checkpoint.state: matching saved state to live objects, strict or not, all or nothing."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch

from preempt import IncompatibleStateError
from preempt.checkpoint import codec, state
from preempt.checkpoint.state import Components, Loaded

WHERE = "runs/x/step_000000007"


def net(hidden: int = 5, extra_layer: bool = False) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Linear(6, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3)]
    if extra_layer:
        layers.append(torch.nn.Linear(3, 3))
    return torch.nn.Sequential(*layers)


def trained(seed: int = 0, optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW, **kwargs: Any):
    """A model and an optimizer that has taken a step (so its per-parameter state exists)."""
    torch.manual_seed(seed)
    model = net(**kwargs)
    opt = optimizer(model.parameters(), lr=1e-2)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.randn(4, 6)).pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return model, opt


def captured(components: Components) -> Loaded:
    """What a checkpoint of ``components`` holds once read back (tensors copied, as a load gives them)."""
    payload = state.capture(components, {"user": {}})
    model_tensors = {k: v.clone() for k, v in payload.tensor_files[state.MODEL_FILE][0].items()}
    tree = copy.deepcopy(payload.json_files[state.STATE_JSON])
    tensors = {k: v.clone() for k, v in payload.tensor_files[state.STATE_FILE][0].items()}
    return Loaded(WHERE, model_tensors, codec.decode(tree, tensors, WHERE))


def snapshot(*objs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, obj in enumerate(objs):
        sd = obj.state_dict()
        if isinstance(obj, torch.optim.Optimizer):
            for p, s in sd["state"].items():
                out.update({f"{i}.{p}.{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
            out[f"{i}.groups"] = copy.deepcopy(sd["param_groups"])
        else:
            out.update(
                {f"{i}.{k}": v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in sd.items()}
            )
    return out


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    changed = [
        k
        for k in before
        if not (torch.equal(before[k], after[k]) if isinstance(before[k], torch.Tensor) else before[k] == after[k])
    ]
    assert changed == []


# ------------------------------------------------------------------ model: the listing


def test_every_difference_is_counted_and_listed_by_kind():
    loaded = captured(Components(net(hidden=5)))
    diff = state.compare_model(net(hidden=4, extra_layer=True), loaded.model)
    assert diff.shapes == (("0.bias", (5,), (4,)), ("0.weight", (5, 6), (4, 6)), ("2.weight", (3, 5), (3, 4)))
    assert diff.missing == ("3.bias", "3.weight") and diff.unexpected == ()
    assert set(diff.weights) == {"2.bias"}  # only what fits
    with pytest.raises(IncompatibleStateError) as e:
        state.load_model(net(hidden=4, extra_layer=True), loaded)
    assert str(e.value) == (
        f"{WHERE}/model.safetensors: the model does not match the checkpoint"
        " (3 of another shape, 2 missing in checkpoint)\n"
        "  shape: 0.bias: checkpoint (5,), model (4,); 0.weight: checkpoint (5, 6), model (4, 6);"
        " 2.weight: checkpoint (3, 5), model (3, 4)\n"
        "  missing in checkpoint: 3.bias, 3.weight"
    )


def test_long_listings_show_twenty_and_count_the_rest():
    big = torch.nn.ModuleDict({f"m{i:02d}": torch.nn.Linear(1, 1) for i in range(30)})
    diff = state.compare_model(big, {})
    assert len(diff.missing) == 60  # complete here ...
    with pytest.raises(IncompatibleStateError) as e:
        state.load_model(big, Loaded(WHERE, {}, {}))
    message = str(e.value)
    assert "(60 missing in checkpoint)" in message and "... and 40 more" in message  # ... and readable there
    assert message.count(".weight") + message.count(".bias") == 20


@pytest.mark.parametrize("saved_prefix, model_prefix, how", [("backbone.", "", "carry"), ("", "backbone.", "lack")])
def test_a_prefix_difference_is_pointed_out(saved_prefix, model_prefix, how):
    saved = {f"{saved_prefix}{k}": v for k, v in net().state_dict().items()}
    model = torch.nn.Module()
    if model_prefix:
        model.backbone = net()
    else:
        model = net()
    with pytest.raises(IncompatibleStateError, match=rf"hint: the checkpoint's keys {how} a prefix 'backbone\.'"):
        state.load_model(model, Loaded(WHERE, saved, {}))


# ------------------------------------------------------------------ model: strict=False


def test_non_strict_loads_what_fits_and_reports_what_it_skipped(caplog):
    source = net(hidden=5)
    loaded = captured(Components(source))
    loaded.model["extra.weight"] = torch.ones(2)  # in the checkpoint, not in the model
    del loaded.model["2.bias"]  # in the model, not in the checkpoint
    target = net(hidden=5)
    kept_bias = target[2].bias.detach().clone()
    with caplog.at_level(logging.WARNING, logger="preempt"):
        skipped = state.load_model(target, loaded, strict=False)
    assert skipped == state.SkippedKeys(missing=("2.bias",), unexpected=("extra.weight",))
    assert torch.equal(target[0].weight, source[0].weight) and torch.equal(target[2].weight, source[2].weight)
    assert torch.equal(target[2].bias, kept_bias)
    assert f"{WHERE}/model.safetensors: loaded 3 of the model's tensors (strict=False)" in caplog.text
    assert "not in the checkpoint: 2.bias" in caplog.text and "not in the model: extra.weight" in caplog.text
    with pytest.raises(IncompatibleStateError, match="missing in checkpoint: 2.bias"):
        state.load_model(net(hidden=5), loaded)  # strict stays the default


def test_non_strict_still_refuses_another_shape_and_changes_nothing():
    loaded = captured(Components(net(hidden=5)))
    target = net(hidden=4)
    before = snapshot(target)
    with pytest.raises(IncompatibleStateError) as e:
        state.load_model(target, loaded, strict=False)
    assert "even with strict=False" in str(e.value) and "0.weight: checkpoint (5, 6), model (4, 6)" in str(e.value)
    assert_unchanged(before, snapshot(target))
    with pytest.raises(IncompatibleStateError, match="even with strict=False"):
        state.load_model(target, Loaded(WHERE, loaded.model, {}), strict=False)


def test_the_comparison_keeps_only_the_matching_weights():
    weights = dict(net().state_dict(), surplus=torch.zeros(1))
    del weights["0.bias"]
    diff = state.compare_model(net(), weights)
    assert set(diff.weights) == {"0.weight", "2.weight", "2.bias"}
    assert diff.missing == ("0.bias",) and diff.unexpected == ("surplus",) and not diff.shapes


def test_apply_non_strict_with_an_optimizer_for_the_same_parameters():
    model, opt = trained(0)
    loaded = captured(Components(model, opt))
    loaded.model["surplus"] = torch.zeros(2)
    model2, opt2 = trained(1)
    skipped = state.apply(Components(model2, opt2), loaded, strict=False)
    assert skipped == state.SkippedKeys((), ("surplus",))
    assert torch.equal(model2[0].weight, model[0].weight)


class WithExtra(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.note = "fresh"

    def get_extra_state(self) -> Any:
        return {"note": self.note}

    def set_extra_state(self, s: Any) -> None:
        self.note = s["note"]


def test_extra_state_is_restored_and_checked():
    source = WithExtra()
    source.note = "saved"
    loaded = captured(Components(source))
    target = WithExtra()
    state.apply(Components(target), loaded)
    assert target.note == "saved"
    loaded.tree["model_extra"] = {}
    with pytest.raises(IncompatibleStateError, match="missing in checkpoint: _extra_state"):
        state.apply(Components(WithExtra()), loaded)
    state.load_model(WithExtra(), loaded)  # weights only: there is no extra state to compare


# ------------------------------------------------------------------ optimizer


def test_per_parameter_state_of_another_shape_is_refused_naming_group_and_index():
    model, opt = trained(0)
    loaded = captured(Components(model, opt))
    loaded.tree["optimizer"]["state"][2]["exp_avg"] = torch.zeros(7)  # 2.weight is (3, 5)
    model2, opt2 = trained(1)
    before = snapshot(model2, opt2)
    with pytest.raises(IncompatibleStateError) as e:
        state.apply(Components(model2, opt2), loaded)
    assert str(e.value) == (
        f"{WHERE}/state.json: the optimizer state does not fit the parameters (1 buffer(s) of another shape;"
        " were the parameters passed in another order?): group 0 parameter 2 exp_avg: checkpoint (7,), parameter (3, 5)"
    )
    assert_unchanged(before, snapshot(model2, opt2))


def test_parameters_in_another_order_across_groups_are_refused():
    model, _ = trained(0)
    opt = torch.optim.SGD(
        [{"params": [model[0].weight, model[0].bias]}, {"params": [model[2].weight, model[2].bias]}],
        lr=0.1,
        momentum=0.9,
    )
    model(torch.ones(1, 6)).sum().backward()
    opt.step()
    loaded = captured(Components(model, opt))
    swapped = torch.optim.SGD(
        [{"params": [model[0].bias, model[0].weight]}, {"params": [model[2].weight, model[2].bias]}],
        lr=0.1,
        momentum=0.9,
    )
    with pytest.raises(IncompatibleStateError) as e:
        state.apply(Components(optimizer=swapped), loaded)
    message = str(e.value)
    assert "group 0 parameter 0 momentum_buffer: checkpoint (5, 6), parameter (5,)" in message
    assert "group 0 parameter 1 momentum_buffer: checkpoint (5,), parameter (5, 6)" in message
    assert "group 1" not in message


@pytest.mark.parametrize(
    "optimizer",
    [torch.optim.Adafactor, torch.optim.LBFGS, torch.optim.Adam, torch.optim.RMSprop, torch.optim.Rprop]
    if hasattr(torch.optim, "Adafactor")
    else [torch.optim.LBFGS, torch.optim.Adam, torch.optim.RMSprop, torch.optim.Rprop],
    ids=lambda o: o.__name__,
)
def test_optimizers_whose_state_has_other_shapes_by_design_still_round_trip(optimizer):
    """Adafactor's factored row_var/col_var and LBFGS's flat vectors are not mistaken for misfits."""
    model, opt = trained(0, optimizer)
    loaded = captured(Components(model, opt))
    model2, opt2 = trained(1, optimizer)
    state.apply(Components(model2, opt2), loaded)
    assert_unchanged(snapshot(model, opt), snapshot(model2, opt2))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda o: o.update(state=[1]), "must hold a param_groups list and a state dict"),
        (lambda o: o["param_groups"][0].update(params=4), "each group must be an object with a params list"),
        (lambda o: o["param_groups"][0].update(params=["a", "b", "c", "d"]), "parameter ids must be distinct integers"),
        (lambda o: o["param_groups"][0].update(params=[0, 0, 1, 2]), "parameter ids must be distinct integers"),
        (lambda o: o["state"].update({0: [1, 2]}), "optimizer state of group 0 parameter 0: expected an object"),
        (lambda o: o["param_groups"].append({"params": []}), r"1 parameter group\(s\) with \[4\] parameters"),
    ],
    ids=["state-a-list", "params-an-int", "params-strings", "params-repeated", "entry-a-list", "extra-group"],
)
def test_malformed_optimizer_state_is_an_incompatible_state_error(edit, message):
    model, opt = trained(0)
    loaded = captured(Components(model, opt))
    edit(loaded.tree["optimizer"])
    model2, opt2 = trained(1)
    before = snapshot(model2, opt2)
    with pytest.raises(IncompatibleStateError, match=message):
        state.apply(Components(model2, opt2), loaded)
    assert_unchanged(before, snapshot(model2, opt2))


# ------------------------------------------------------------------ apply: all checks before any change


class Refuses:
    def state_dict(self) -> Any:
        return {"n": 1}

    def load_state_dict(self, s: Any) -> None:
        raise AssertionError("not my state")  # any exception, not only the usual four


def test_a_tracked_object_that_refuses_leaves_model_and_optimizer_untouched():
    model, opt = trained(0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    loaded = captured(Components(model, opt, sched, tracked={"odd": Refuses()}))
    model2, opt2 = trained(1)
    before = snapshot(model2, opt2)
    with pytest.raises(IncompatibleStateError, match=r"tracked object 'odd' does not load its state: AssertionError"):
        state.apply(Components(model2, opt2, tracked={"odd": Refuses()}), loaded)
    assert_unchanged(before, snapshot(model2, opt2))


def test_an_empty_scaler_state_is_refused_before_anything_loads():
    """GradScaler.state_dict() of a disabled scaler is {}; an enabled one raises RuntimeError on it, mid-way."""
    model, opt = trained(0)
    loaded = captured(Components(model, opt, scaler=torch.amp.GradScaler("cpu", enabled=False)))
    assert loaded.tree["scaler"] == {}
    model2, opt2 = trained(1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=3)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=8.0)
    before = snapshot(model2, opt2, sched2, scaler2)
    with pytest.raises(IncompatibleStateError, match=r"empty scaler state \(saved from a disabled GradScaler\?\)"):
        state.apply(Components(model2, opt2, scaler=scaler2), loaded)
    assert_unchanged(before, snapshot(model2, opt2, sched2, scaler2))


@pytest.mark.parametrize(
    "tree_edit, message",
    [
        (lambda t: t.update(scheduler=[1, 2]), "scheduler state: expected an object, found list"),
        (lambda t: t["scheduler"].update(step=3), "scheduler state holds step, which this StepLR does not save"),
        (lambda t: t.update(tracked=["odd"]), "tracked: expected an object, found list"),
        (lambda t: t.update(model_extra=[]), "model_extra: expected an object, found list"),
        (lambda t: t.pop("optimizer"), "the run has a optimizer but the checkpoint holds no optimizer state"),
    ],
    ids=["scheduler-a-list", "scheduler-shadows-a-method", "tracked-a-list", "model-extra-a-list", "no-optimizer"],
)
def test_malformed_state_json_changes_nothing(tree_edit, message):
    model, opt = trained(0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    loaded = captured(Components(model, opt, sched))
    tree_edit(loaded.tree)
    model2, opt2 = trained(1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=5)
    before = snapshot(model2, opt2, sched2)
    with pytest.raises(IncompatibleStateError, match=message):
        state.apply(Components(model2, opt2, sched2), loaded)
    assert_unchanged(before, snapshot(model2, opt2, sched2))
