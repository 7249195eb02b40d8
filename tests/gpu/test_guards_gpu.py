"""The guards on a real GPU: a real CUDA out-of-memory error, CUDA losses, a fused optimizer. Needs an NVIDIA GPU."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from preempt.errors import OOM_EXIT_CODE
from preempt.health.guards import NonFiniteGuard, OOMGuard, OutOfMemoryStreak, scale_lr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


def forward_that_runs_out() -> None:
    activations = torch.empty(1 << 28, device="cuda")  # 1 GiB, alive in this frame when the next line fails
    activations.fill_(1.0)
    torch.empty(1 << 50, device="cuda")  # 4 PiB


def test_real_cuda_oom_is_skipped_and_memory_freed() -> None:
    gc.collect()  # an earlier test's garbage on the GPU, which the guard's own collection would free below
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    g = OOMGuard(max_in_a_row=3)
    for _ in range(2):
        with g.step() as s:
            forward_that_runs_out()
        assert s.skipped
        assert isinstance(g.last_error, torch.OutOfMemoryError)
        assert torch.cuda.memory_allocated() == base  # the failed forward's activations are gone
        assert torch.cuda.memory_reserved() <= base + (2 << 20)  # and its cached blocks went back to the driver
    with g.step() as s:
        x = torch.ones(1024, device="cuda") * 2  # a step that fits resets the streak
    assert not s.skipped and g.in_a_row == 0 and x.sum().item() == 2048
    for _ in range(2):
        with g.step():
            forward_that_runs_out()
    with pytest.raises(OutOfMemoryStreak) as e:
        with g.step():
            forward_that_runs_out()
    assert e.value.code == OOM_EXIT_CODE and isinstance(e.value.__cause__, torch.OutOfMemoryError)
    assert "CUDA out of memory" in str(e.value)


def test_nonfinite_cuda_losses() -> None:
    g = NonFiniteGuard(max_in_a_row=2)
    assert g.check(torch.tensor(1.0, device="cuda"))
    assert not g.check(torch.tensor(float("nan"), device="cuda", dtype=torch.bfloat16))
    assert not g.check(torch.tensor([1.0, float("inf")], device="cuda"))
    assert g.exhausted and g.last_value is None  # the last one was not a scalar


@pytest.mark.parametrize("fused", [False, True])
def test_scale_lr_cuda_adamw(fused: bool) -> None:
    torch.manual_seed(0)
    model_a = torch.nn.Linear(64, 64).cuda()
    opt_a = torch.optim.AdamW(model_a.parameters(), lr=1e-2, fused=fused)
    sched_a = torch.optim.lr_scheduler.CosineAnnealingLR(opt_a, T_max=10)
    x = torch.randn(32, 64, device="cuda")

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    step(model_a, opt_a)
    sched_a.step()
    model_b, opt_b, sched_b = copy.deepcopy((model_a, opt_a, sched_a))
    scale_lr(opt_a, sched_a, 0.5)
    for _ in range(3):
        lr_b = opt_b.param_groups[0]["lr"]
        for group in opt_b.param_groups:
            group["lr"] = lr_b * 0.5  # by hand: the unscaled schedule, halved
        step(model_a, opt_a)
        step(model_b, opt_b)
        for group in opt_b.param_groups:
            group["lr"] = lr_b
        sched_a.step()
        sched_b.step()
        assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"] * 0.5
        for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
            assert torch.equal(pa, pb)
