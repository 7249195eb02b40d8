"""Unit tests for the checks of restored values: what every generator, optimizer, scheduler and scaler
accepts, decided by pure functions (preempt.data.rng.from_tree, preempt.checkpoint.hyperparams,
preempt.run.restore.check_restored, preempt.checkpoint.completion).

Two halves for each: every state a real object produces passes (a false alarm would quarantine a valid
checkpoint), and each forged value is refused with CorruptCheckpointError naming the file, the field, what was
expected and what was found.
"""

from __future__ import annotations

import copy
import json
import math
import random
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from preempt import CorruptCheckpointError, IncompatibleStateError
from preempt.checkpoint import codec, completion, hyperparams
from preempt.checkpoint.manager import CheckpointInfo, CheckpointManager
from preempt.checkpoint.manifest import Cursor, Manifest
from preempt.data import rng
from preempt.run.restore import check_restored

WHERE = "runs/x/step_000000007/state.json"


def through_codec(tree: Any) -> Any:
    """``tree`` as a checkpoint gives it back: encoded to JSON and tensors, and decoded."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = codec.encode(tree, "", tensors)
    return codec.decode(json.loads(codec.dumps(skeleton)), tensors, WHERE)


def refused(fn: Callable[[], Any], expected: str) -> str:
    with pytest.raises(CorruptCheckpointError) as e:
        fn()
    message = str(e.value)
    assert message.startswith(f"{WHERE}: "), message
    assert expected in message, f"{expected!r} not in {message!r}"
    return message


# ---------------------------------------------------------------- the generators


def rng_tree() -> dict[str, Any]:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    random.gauss(0, 1)  # a cached Gaussian in Python's state
    np.random.standard_normal()  # and in NumPy's (has_gauss 1)
    torch.randn(1)  # and torch's cached normal sample
    return through_codec(rng.to_tree(rng.capture()))


def test_every_state_the_generators_produce_passes_and_restores_exactly():
    tree = rng_tree()
    draws = (random.random(), np.random.random(), torch.rand(1))
    state = rng.from_tree(tree, WHERE, "rng.now")
    rng.restore(state)
    assert (random.random(), np.random.random(), torch.rand(1)) == draws
    for pos in (0, 624):  # the bounds numpy's own get_state gives
        t = copy.deepcopy(tree)
        t["numpy"]["pos"] = pos
        rng.from_tree(t, WHERE)


def _python_word(i: int, value: int) -> Callable[[dict[str, Any]], None]:
    def edit(t: dict[str, Any]) -> None:
        t["python"]["state"][i] = value

    return edit


def _torch_bytes(offset: int, fmt: str, *values: Any) -> Callable[[dict[str, Any]], None]:
    def edit(t: dict[str, Any]) -> None:
        raw = bytearray(t["torch"].numpy().tobytes())
        raw[offset : offset + struct.calcsize(fmt)] = struct.pack(fmt, *values)
        t["torch"] = torch.frombuffer(raw, dtype=torch.uint8).clone()

    return edit


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(t: dict[str, Any]) -> None:
        *head, last = path.split(".")
        for key in head:
            t = t[key]
        t[last] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (_set("numpy.pos", 10**9), "rng.now.numpy.pos: expected an integer in 0..624, found 1000000000"),
        (_set("numpy.pos", -1), "rng.now.numpy.pos: expected an integer in 0..624, found -1"),
        (_set("numpy.pos", 3.0), "rng.now.numpy.pos: expected an integer in 0..624, found 3.0"),
        (_set("numpy.has_gauss", 2), "rng.now.numpy.has_gauss: expected an integer in 0..1, found 2"),
        (_set("numpy.cached_gaussian", math.nan), "rng.now.numpy.cached_gaussian: expected a finite number, found nan"),
        (_set("numpy.kind", "PCG64"), "rng.now.numpy.kind: expected 'MT19937' (np.random.get_state(legacy=True))"),
        (_set("numpy.key", torch.zeros(624, dtype=torch.int64)), "rng.now.numpy.key: expected a Mersenne Twister key"),
        (_set("numpy.key", torch.zeros(623, dtype=torch.int64)), "rng.now.numpy.key: expected an int64 tensor of"),
        (_set("numpy.key", torch.full((624,), -1)), "rng.now.numpy.key[0]: expected a 32-bit word"),
        (_set("numpy.key", torch.ones(624, dtype=torch.float64)), "found a torch.float64 tensor of shape (624,)"),
        (_set("python.version", 2), "rng.now.python.version: expected an integer in 3..3, found 2"),
        (_python_word(624, 625), "rng.now.python.state[624]: expected an index in 0..624, found 625"),
        (_python_word(5, 2**32), "rng.now.python.state[5]: expected a 32-bit word (0..4294967295), found 4294967296"),
        (_set("python.gauss_next", "x"), "rng.now.python.gauss_next: expected null or a finite float, found 'x'"),
        (_set("python.gauss_next", math.inf), "rng.now.python.gauss_next: expected null or a finite float, found inf"),
        (_set("python", [3]), "rng.now.python: expected a dict, found [3]"),
        (_set("torch", torch.zeros(5055, dtype=torch.uint8)), "rng.now.torch: expected a state torch.set_rng_state"),
        (_torch_bytes(8, "<i", 0), "Invalid mt19937 state"),  # left
        (_torch_bytes(24, "<Q", 2**40), "rng.now.torch Mersenne Twister key[0]: expected a 32-bit word"),
        (_torch_bytes(5016, "<3d", math.nan, 1.0, 1.0), "rng.now.torch cached normal sample: expected finite"),
        (_torch_bytes(5048, "<f?", math.inf, True), "rng.now.torch cached float normal sample"),
        (_set("cuda", [torch.zeros(15, dtype=torch.uint8)]), "rng.now.cuda.0: expected a uint8 tensor of shape (16,)"),
        (_set("cuda", [torch.tensor([0] * 8 + [2] + [0] * 7, dtype=torch.uint8)]), "rng.now.cuda.0 Philox offset"),
        (_set("cuda", {}), "rng.now.cuda: expected a list, found {}"),
    ],
)
def test_a_forged_generator_state_is_refused_naming_the_field(edit, expected):
    tree = rng_tree()
    edit(tree)
    refused(lambda: rng.from_tree(tree, WHERE, "rng.now"), expected)


def test_a_torch_state_with_every_key_word_zero_is_refused():
    tree = rng_tree()
    _torch_bytes(24, "<624Q", *([0] * 624))(tree)
    refused(lambda: rng.from_tree(tree, WHERE), "rng.torch Mersenne Twister key: expected a Mersenne Twister key")


def test_a_cuda_state_as_torch_gives_it_passes():
    tree = rng_tree()
    tree["cuda"] = [torch.tensor([7] + [0] * 7 + [4] + [0] * 7, dtype=torch.uint8)]  # seed 7, offset 4
    assert len(rng.from_tree(tree, WHERE).cuda) == 1


# ---------------------------------------------------------------- optimizers


def stepped(cls: type[torch.optim.Optimizer], **kwargs: Any) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 2, bias=False))
    opt = cls(model.parameters(), **kwargs)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.randn(3, 4)).pow(2).sum()
        loss.backward()
        return loss

    for _ in range(2):
        opt.step(closure)
    return opt


def name_of(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


OPTIMIZERS = [
    (torch.optim.Adam, {"lr": 1e-3, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": torch.tensor(1e-3)}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01}),
    (torch.optim.Adadelta, {}),
    (torch.optim.Adamax, {}),
    (torch.optim.ASGD, {}),
    (torch.optim.NAdam, {}),
    (torch.optim.RAdam, {}),
    (torch.optim.RMSprop, {"centered": True, "momentum": 0.5}),
    (torch.optim.Rprop, {}),
    (torch.optim.LBFGS, {"lr": 0.5}),
]
if hasattr(torch.optim, "Adafactor"):
    OPTIMIZERS.append((torch.optim.Adafactor, {}))  # eps is (None, 1e-3), beta2_decay is negative
if hasattr(torch.optim, "Muon"):
    OPTIMIZERS.append((torch.optim.Muon, {"lr": 0.02}))


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS, ids=lambda v: getattr(v, "__name__", ""))
def test_the_state_of_every_torch_optimizer_passes(cls, kwargs):
    opt = stepped(cls, **kwargs)
    hyperparams.check_optimizer(through_codec(opt.state_dict()), WHERE, name_of(opt))


def adam_state() -> dict[str, Any]:
    return through_codec(stepped(torch.optim.Adam, lr=1e-3).state_dict())


ADAM = "torch.optim.adam.Adam"


def _group(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(s: dict[str, Any]) -> None:
        s["param_groups"][0][key] = value

    return edit


def _param(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(s: dict[str, Any]) -> None:
        s["state"][1][key] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (_group("lr", "fast"), "optimizer.param_groups[0].lr: expected a finite number >= 0, found 'fast'"),
        (_group("lr", math.nan), "optimizer.param_groups[0].lr: expected a finite number >= 0, found nan"),
        (_group("lr", -0.1), "optimizer.param_groups[0].lr: expected a finite number >= 0, found -0.1"),
        (_group("lr", torch.tensor(math.inf)), "lr: expected a finite number >= 0, found a torch.float32 tensor"),
        (_group("lr", True), "optimizer.param_groups[0].lr: expected a finite number >= 0, found True"),
        (_group("betas", (0.9, 0.999, 0.5)), "betas: expected a pair of numbers in [0, 1), found (0.9, 0.999, 0.5)"),
        (_group("betas", (1.0, 0.999)), "betas: expected a pair of numbers in [0, 1), found (1.0, 0.999)"),
        (_group("eps", -1e-8), "optimizer.param_groups[0].eps: expected a finite number >= 0, found -1e-08"),
        (_group("weight_decay", math.inf), "weight_decay: expected a finite number >= 0, found inf"),
        (_group("maximize", "no"), "optimizer.param_groups[0].maximize: expected true or false, found 'no'"),
        (_group("foreach", 1), "optimizer.param_groups[0].foreach: expected null, true or false, found 1"),
        (_group("amsgrad", True), "optimizer.state.0: expected max_exp_avg_sq, which amsgrad=true"),
        (_group("custom", [1.0, math.nan]), "optimizer.param_groups[0].custom[1]: expected a number, found nan"),
        (_param("step", torch.tensor(-1.0)), "optimizer.state.1.step: expected a whole number >= 0"),
        (_param("step", torch.tensor(2.5)), "optimizer.state.1.step: expected a whole number >= 0"),
        (_param("step", torch.tensor(True)), "optimizer.state.1.step: expected a whole number >= 0"),
        (_param("step", "2"), "optimizer.state.1.step: expected a whole number >= 0 (a count of steps), found '2'"),
        (_param("exp_avg", torch.zeros(2, 4, dtype=torch.int64)), "optimizer.state.1.exp_avg: expected a floating"),
    ],
)
def test_a_forged_adam_state_is_refused_naming_the_field(edit, expected):
    s = adam_state()
    edit(s)
    refused(lambda: hyperparams.check_optimizer(s, WHERE, ADAM), expected)


def test_another_librarys_optimizer_is_held_to_the_learning_rate_alone():
    s = adam_state()
    s["param_groups"][0].update(betas=(3.0, 4.0), eps=-1, custom=math.nan, foreach="any")
    s["state"][0]["step"] = "two"
    hyperparams.check_optimizer(s, WHERE, "mylib.optim.Fancy")
    s["param_groups"][0]["lr"] = math.inf
    refused(lambda: hyperparams.check_optimizer(s, WHERE, "mylib.optim.Fancy"), "lr: expected a finite number >= 0")


# ---------------------------------------------------------------- schedulers and scalers


def schedulers() -> list[tuple[str, Any]]:
    def opt() -> torch.optim.Optimizer:
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)

    lr = torch.optim.lr_scheduler
    o = opt()
    made = [
        lr.StepLR(opt(), step_size=2, gamma=0.5),
        lr.MultiStepLR(opt(), milestones=[2, 4]),
        lr.CosineAnnealingLR(opt(), T_max=10),
        lr.CosineAnnealingWarmRestarts(opt(), T_0=3),
        lr.OneCycleLR(opt(), max_lr=0.1, total_steps=20),
        lr.CyclicLR(opt(), base_lr=0.01, max_lr=0.1),
        lr.LinearLR(opt()),
        lr.ReduceLROnPlateau(opt()),  # best is inf until a metric comes
        lr.SequentialLR(o, [lr.ConstantLR(o), lr.ExponentialLR(o, gamma=0.9)], milestones=[2]),
        lr.PolynomialLR(opt()),
    ]
    for s in made:
        for _ in range(3):
            s.optimizer.step()
            s.step(1.0) if isinstance(s, lr.ReduceLROnPlateau) else s.step()
    return [(type(s).__name__, s) for s in made]


@pytest.mark.parametrize(("_name", "sched"), schedulers(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_state_of_every_torch_scheduler_passes(_name, sched):
    hyperparams.check_scheduler(through_codec(sched.state_dict()), WHERE, name_of(sched))


STEP_LR = "torch.optim.lr_scheduler.StepLR"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("step_size", 0, "scheduler.step_size: expected an integer >= 1, found 0"),
        ("last_epoch", "2", "scheduler.last_epoch: expected an integer >= -1, found '2'"),
        ("last_epoch", -5, "scheduler.last_epoch: expected an integer >= -1, found -5"),
        ("_step_count", 1.5, "scheduler._step_count: expected an integer >= 0, found 1.5"),
        ("base_lrs", [math.inf], "scheduler.base_lrs: expected a list of finite numbers >= 0, found [inf]"),
        ("_last_lr", 0.1, "scheduler._last_lr: expected a list of finite numbers >= 0, found 0.1"),
        ("gamma", math.nan, "scheduler.gamma: expected a finite number, found nan"),
    ],
)
def test_a_forged_scheduler_state_is_refused_naming_the_field(key, value, expected):
    s = through_codec(torch.optim.lr_scheduler.StepLR(stepped(torch.optim.SGD, lr=0.1), step_size=2).state_dict())
    s[key] = value
    refused(lambda: hyperparams.check_scheduler(s, WHERE, STEP_LR), expected)
    hyperparams.check_scheduler(s, WHERE, "mylib.Warmup")  # another library's: its names may mean other things


def test_a_forged_scheduler_inside_a_sequence_is_named():
    s = dict(schedulers())["SequentialLR"].state_dict()
    s["_schedulers"][1]["gamma"] = math.inf
    refused(
        lambda: hyperparams.check_scheduler(s, WHERE, "torch.optim.lr_scheduler.SequentialLR"),
        "scheduler._schedulers[1].gamma: expected a finite number, found inf",
    )


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("scale", math.nan, "scaler.scale: expected a finite number > 0, found nan"),
        ("scale", 0.0, "scaler.scale: expected a finite number > 0, found 0.0"),
        ("growth_factor", 0.5, "scaler.growth_factor: expected a finite number > 1, found 0.5"),
        ("backoff_factor", 1.0, "scaler.backoff_factor: expected a number in (0, 1), found 1.0"),
        ("growth_interval", 0, "scaler.growth_interval: expected an integer >= 1, found 0"),
    ],
)
def test_a_forged_scaler_state_is_refused_naming_the_field(key, value, expected):
    scaler = torch.amp.GradScaler("cpu")
    s = through_codec(scaler.state_dict())
    hyperparams.check_scaler(s, WHERE, name_of(scaler))
    hyperparams.check_scaler({}, WHERE, name_of(scaler))  # a disabled scaler's
    s[key] = value
    refused(lambda: hyperparams.check_scaler(s, WHERE, name_of(scaler)), expected)


# ---------------------------------------------------------------- the boundary


CLASSES = {"optimizer": ADAM, "scheduler": STEP_LR, "scaler": None}


def restored_tree() -> dict[str, Any]:
    tree = {"rng": {"now": rng_tree(), "epoch_start": rng_tree()}, "optimizer": adam_state()}
    tree.update(user={}, data={"seed": 3, "loader": None}, lr_scale=1.0)
    return tree


def test_the_boundary_returns_both_rng_states_of_a_good_tree():
    now, epoch = check_restored(restored_tree(), WHERE, CLASSES)
    assert epoch is not None and now.numpy[2] == epoch.numpy[2]


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda t: t["rng"]["epoch_start"]["numpy"].update(pos=700), "rng.epoch_start.numpy.pos: expected"),
        (lambda t: t["rng"].pop("now"), "rng.now: expected an object, found None"),
        (lambda t: t.update(rng=[1]), "rng: expected an object, found list"),
        (lambda t: t.update(user=[1]), "user: expected an object, found list"),
        (lambda t: t.update(lr_scale=math.inf), "lr_scale: expected a finite number > 0, found inf"),
        (lambda t: t.update(lr_scale=0), "lr_scale: expected a finite number > 0, found 0"),
        (lambda t: t["optimizer"]["param_groups"][0].update(lr=None), "optimizer.param_groups[0].lr: expected"),
        (lambda t: t.update(scheduler={"step_size": -1}), "scheduler.step_size: expected an integer >= 1"),
        (lambda t: t.update(epoch={"epoch": 0, "seconds": 1.0, "processes": -1}), "epoch.processes: expected an"),
    ],
)
def test_the_boundary_refuses_each_part(edit, expected):
    tree = restored_tree()
    edit(tree)
    refused(lambda: check_restored(tree, WHERE, CLASSES), expected)


def test_a_checkpoint_without_rng_state_is_incompatible_not_damaged():
    tree = restored_tree()
    del tree["rng"]
    with pytest.raises(IncompatibleStateError, match="no RNG state; was it written by PreemptibleRun"):
        check_restored(tree, WHERE, CLASSES)


def test_the_manager_falls_back_past_a_checkpoint_its_check_refuses(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=None)
    for step in (1, 2):
        m.save_state(step=step, user_state={"bad": step == 2})

    def check(info: CheckpointInfo, loaded: Any) -> None:
        if loaded.tree["user"]["bad"]:
            raise CorruptCheckpointError(f"{info.path}/state.json: user.bad: expected false, found true")

    info, _ = m.load(check=check)
    assert info.step == 1
    assert [p.name for p in (tmp_path / "quarantine").iterdir()] == ["step_000000002"]


# ---------------------------------------------------------------- complete.json


def infos(tmp_path: Path) -> list[CheckpointInfo]:
    m = Manifest(step=5, cursor=Cursor(epoch=2), reason="final", created=1700000000.25, files={})
    return [CheckpointInfo(tmp_path / "step_000000005", 5, "valid", m)]


def test_a_marker_the_run_writes_is_believed(tmp_path):
    found = infos(tmp_path)
    doc = json.loads(json.dumps(completion.record(found[0], 1.0)))
    assert completion.problem(doc, found) is None


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({}, "expected the checkpoint's name, step and creation time"),
        ({"checkpoint_created": None}, "found checkpoint='step_000000005', step=5, checkpoint_created=None"),
        ({"step": True}, "expected the checkpoint's name, step and creation time"),
        ({"checkpoint": "step_000000009", "step": 9}, "names 'step_000000009', which is not there"),
        ({"step": 4}, "names step_000000005 at step 4, but that checkpoint is of step 5"),
        ({"checkpoint_created": 1.5}, "names step_000000005 created at 1.5, but that checkpoint was created at"),
    ],
)
def test_a_marker_that_does_not_name_its_checkpoint_is_not_believed(tmp_path, change, expected):
    found = infos(tmp_path)
    doc = {**completion.record(found[0], 1.0), **change} if change else {}
    assert expected in (completion.problem(doc, found) or "")


def test_a_marker_naming_a_corrupt_checkpoint_is_not_believed(tmp_path):
    good = infos(tmp_path)[0]
    doc = completion.record(good, 1.0)
    bad = CheckpointInfo(good.path, 5, "corrupt", problem="manifest checksum mismatch")
    assert completion.problem(doc, [bad]) == "names step_000000005, which is corrupt: manifest checksum mismatch"
    assert completion.problem([doc], [good]) == "expected an object, found list"
