"""NonFiniteGuard, OOMGuard and scale_lr: pure logic, on the CPU."""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler as S

from preempt.errors import NONFINITE_EXIT_CODE, OOM_EXIT_CODE
from preempt.health import guards
from preempt.health.guards import NonFiniteGuard, NonFiniteStreak, OOMGuard, OutOfMemoryStreak, is_oom, scale_lr

# ------------------------------------------------------------------------------------------------ non-finite


@pytest.mark.parametrize(
    "loss, finite",
    [
        (torch.tensor(1.5), True),
        (torch.tensor(float("nan")), False),
        (torch.tensor(float("inf")), False),
        (torch.tensor(-float("inf")), False),
        (torch.tensor([1.0, 2.0]), True),
        (torch.tensor([1.0, float("nan")]), False),
        (torch.tensor(1.0, dtype=torch.bfloat16), True),
        (torch.tensor(float("inf"), dtype=torch.float16), False),
        (1.5, True),
        (3, True),
        (float("nan"), False),
        (float("inf"), False),
        (-float("inf"), False),
    ],
)
def test_check(loss: Any, finite: bool) -> None:
    g = NonFiniteGuard()
    assert g.check(loss) is finite
    assert (g.in_a_row, g.total) == ((0, 0) if finite else (1, 1))


def test_check_tensor_with_grad() -> None:
    w = torch.ones(3, requires_grad=True)
    assert NonFiniteGuard().check((w * 2).sum())
    assert not NonFiniteGuard().check((w * float("nan")).sum())


def test_streak_reset_and_exhausted() -> None:
    g = NonFiniteGuard(max_in_a_row=3)
    for _ in range(2):
        assert not g.check(float("nan"))
    assert g.in_a_row == 2 and not g.exhausted
    assert g.check(torch.tensor(0.1))  # a finite loss ends the streak
    assert (g.in_a_row, g.total) == (0, 2)
    for _ in range(3):
        g.check(torch.tensor(float("inf")))
    assert g.exhausted and g.last_value == math.inf and (g.in_a_row, g.total) == (3, 5)
    g.reset_streak()
    assert not g.exhausted and g.total == 5
    g.load_state_dict({"in_a_row": 2, "total": 9})
    assert g.state_dict() == {"in_a_row": 2, "total": 9}


def test_raise_if_exhausted() -> None:
    g = NonFiniteGuard(max_in_a_row=2, lr_factor=2.0)
    g.check(torch.tensor(float("nan")))
    g.raise_if_exhausted(10)  # not yet
    g.check(torch.tensor(float("nan")))
    with pytest.raises(NonFiniteStreak) as e:
        g.raise_if_exhausted(11)
    assert isinstance(e.value, SystemExit) and e.value.code == NONFINITE_EXIT_CODE == 78
    msg = str(e.value)
    assert "nan 2 steps in a row up to step 11" in msg and "preempt supervise --lr" in msg and "divided by 2" in msg


def test_nonfinite_validation() -> None:
    with pytest.raises(ValueError, match="max_in_a_row"):
        NonFiniteGuard(max_in_a_row=0)
    with pytest.raises(ValueError, match="lr_factor"):
        NonFiniteGuard(lr_factor=1.0)


# ------------------------------------------------------------------------------------------------------- OOM


def real_oom() -> BaseException:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.1 GiB total)")


@pytest.fixture
def freed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = guards.free_memory
    monkeypatch.setattr(guards, "free_memory", lambda: (calls.append(1), real())[1])
    return calls


def test_torch_oom_class() -> None:
    assert issubclass(torch.OutOfMemoryError, RuntimeError)
    assert is_oom(real_oom()) and is_oom(torch.cuda.OutOfMemoryError("x"))
    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB"))
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    assert not is_oom(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_oom(MemoryError())
    assert not is_oom(ValueError("out of memory"))


@pytest.mark.parametrize("make", [real_oom, lambda: RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB")])
def test_oom_skipped_and_reset(make: Callable[[], BaseException], freed: list[int]) -> None:
    g = OOMGuard(max_in_a_row=3)
    after = []
    for _ in range(2):
        with g.step() as s:
            raise make()
        after.append(s.skipped)
    assert after == [True, True] and g.skipped and (g.in_a_row, g.total) == (2, 2) and len(freed) == 2
    assert is_oom(g.last_error)
    with g.step() as s:  # a step that finishes resets the streak
        pass
    assert not s.skipped and not g.skipped and (g.in_a_row, g.total) == (0, 2)
    with g.step():
        raise make()
    g.ok()  # the caller's own "this step worked"
    assert g.in_a_row == 0 and g.total == 3


def test_oom_streak_exits_79(freed: list[int]) -> None:
    g = OOMGuard(max_in_a_row=3)
    for _ in range(2):
        with g.step():
            raise real_oom()
    last = real_oom()
    with pytest.raises(OutOfMemoryStreak) as e:
        with g.step():
            raise last
    assert isinstance(e.value, SystemExit) and e.value.code == OOM_EXIT_CODE == 79
    assert e.value.__cause__ is last and e.value.error is last and e.value.in_a_row == 3
    msg = str(e.value)
    assert "out of memory 3 steps in a row" in msg and "batch size" in msg and "preempt supervise --batch-size" in msg
    assert "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB" in msg
    assert len(freed) == 3


def test_oom_max_one() -> None:
    with pytest.raises(OutOfMemoryStreak):
        with OOMGuard(max_in_a_row=1).step():
            raise real_oom()


@pytest.mark.parametrize(
    "exc", [RuntimeError("CUDA error: device-side assert triggered"), ValueError("bad"), KeyboardInterrupt()]
)
def test_other_exceptions_pass_through(exc: BaseException, freed: list[int]) -> None:
    g = OOMGuard(max_in_a_row=1)
    with pytest.raises(type(exc)) as e:
        with g.step():
            raise exc
    assert e.value is exc and e.value.__traceback__ is not None and e.value.__cause__ is None
    assert (g.in_a_row, g.total, g.skipped) == (0, 0, False) and freed == []


def test_oom_frees_the_failed_forward() -> None:
    """The tensors of the frames the error came through are released when the block is left."""
    refs: list[weakref.ref] = []

    def forward() -> None:
        activations = torch.empty(1 << 20)
        refs.append(weakref.ref(activations))
        raise real_oom()

    g = OOMGuard()
    with g.step() as s:
        forward()
    assert s.skipped and refs[0]() is None
    assert g.last_error is not None  # kept, with its frames' locals cleared


def test_handle_for_callers_that_catch() -> None:
    g = OOMGuard(max_in_a_row=2)
    try:
        raise real_oom()
    except RuntimeError as e:
        assert g.handle(e)
    assert not g.handle(ValueError("x")) and g.in_a_row == 1


# -------------------------------------------------------------------------------------------------- scale_lr

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]

SCHEDULERS: dict[str, SchedulerFactory] = {
    "StepLR": lambda o: S.StepLR(o, step_size=3, gamma=0.5),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=12, eta_min=0.01),
    "LambdaLR": lambda o: S.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=[1.0, 0.5], total_steps=20),
    "CyclicLR": lambda o: S.CyclicLR(o, base_lr=0.01, max_lr=[0.1, 0.2], step_size_up=4),
    "ExponentialLR": lambda o: S.ExponentialLR(o, gamma=0.9),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=5, eta_min=0.001),
    "SequentialLR": lambda o: S.SequentialLR(
        o,
        [S.LinearLR(o, start_factor=0.1, total_iters=4), S.CosineAnnealingLR(o, T_max=10, eta_min=0.02)],
        milestones=[4],
    ),
}


def make_opt(kind: str = "sgd", lr: Any = 0.1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.05}]
    if kind == "sgd":
        return model, torch.optim.SGD(groups, lr=lr, momentum=0.9)
    return model, torch.optim.AdamW(groups, lr=lr, weight_decay=0.1)


def lr_sequence(factory: SchedulerFactory, *, before: int, scale: float | None, after: int) -> list[list[float]]:
    _, opt = make_opt()
    sched = factory(opt)
    for _ in range(before):
        opt.step()
        sched.step()
    if scale is not None:
        new = scale_lr(opt, sched, scale)
        assert new == [g["lr"] for g in opt.param_groups]
        assert sched.get_last_lr() == new  # what a progress line reads is right at once
    seq = [[g["lr"] for g in opt.param_groups]]
    for _ in range(after):
        opt.step()
        sched.step()
        seq.append([g["lr"] for g in opt.param_groups])
    return seq


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scale_lr_schedule_is_scaled(name: str) -> None:
    factory = SCHEDULERS[name]
    ref = lr_sequence(factory, before=3, scale=None, after=10)
    half = lr_sequence(factory, before=3, scale=0.5, after=10)
    # A factor of 0.5 only changes the binary exponent, so every product, sum and quotient in these schedules
    # is exactly half of the unscaled one.
    assert half == [[lr * 0.5 for lr in step] for step in ref], name
    third = lr_sequence(factory, before=3, scale=1 / 1.5, after=10)
    for a, b in zip(third, ref, strict=True):
        assert all(math.isclose(x, y / 1.5, rel_tol=1e-12) for x, y in zip(a, b, strict=True)), (name, a, b)


def test_scale_lr_reduce_on_plateau_floor() -> None:
    def run(scale: float | None) -> list[float]:
        _, opt = make_opt(lr=1.0)
        sched = S.ReduceLROnPlateau(opt, factor=0.5, patience=0, min_lr=[0.125, 0.02])
        if scale is not None:
            scale_lr(opt, sched, scale)
        out = []
        for _ in range(8):
            sched.step(1.0)  # never improves: halves each step down to the floor
            out.extend(g["lr"] for g in opt.param_groups)
        return out

    ref, half = run(None), run(0.5)
    assert ref[-2:] == [0.125, 0.02]
    assert half == [x * 0.5 for x in ref]


def test_scale_lr_without_scheduler_and_validation() -> None:
    _, opt = make_opt()
    assert scale_lr(opt, None, 0.5) == [0.05, 0.025]
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="factor"):
            scale_lr(opt, None, bad)


def test_adamw_step_uses_the_new_lr() -> None:
    model_a, opt_a = make_opt("adamw", lr=1e-2)
    sched_a = S.LambdaLR(opt_a, lambda e: 1.0)
    x = torch.randn(8, 4)

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    step(model_a, opt_a)
    sched_a.step()
    model_b, opt_b = copy.deepcopy((model_a, opt_a))  # the same state, with the halved lr set by hand
    for g in opt_b.param_groups:
        g["lr"] *= 0.5
    scale_lr(opt_a, sched_a, 0.5)
    for _ in range(3):
        step(model_a, opt_a)
        sched_a.step()
        step(model_b, opt_b)
        assert [g["lr"] for g in opt_a.param_groups] == [0.005, 0.025]
        for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
            assert torch.equal(pa, pb)


def test_scale_lr_tensor_lr_in_place() -> None:
    _, opt = make_opt("adamw", lr=torch.tensor(0.01))
    lr = opt.param_groups[0]["lr"]
    sched = S.StepLR(opt, step_size=2, gamma=0.5)
    new = scale_lr(opt, sched, 0.5)
    half = torch.tensor(0.01) * 0.5
    assert opt.param_groups[0]["lr"] is lr and torch.equal(lr, half) and new == [half.item(), 0.025]
    assert torch.equal(sched.base_lrs[0], half) and sched.base_lrs[1] == 0.025
    for _ in range(2):
        opt.step()
        sched.step()
    assert torch.equal(lr, half * 0.5)
