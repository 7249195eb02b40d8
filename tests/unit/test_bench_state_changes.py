"""The benchmarks time writes: a checkpoint they time must write every file, not carry it.

``bench/bench_checkpoint.py`` gives the two parts every benchmark that saves one state repeatedly uses: a change of
every tensor between saves, as a training step makes, and a check that fails the benchmark when a timed checkpoint
carried a file anyway.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from preempt import CheckpointManager

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_checkpoint import carried_files, change_every_tensor, flat_tensors, require_written  # noqa: E402


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def test_the_same_state_saved_twice_is_carried_and_the_check_says_so(tmp_path: Path) -> None:
    model, opt = _state()
    model[0].requires_grad_(False)  # a frozen part no optimizer holds: the one file a checkpoint may carry
    opt = torch.optim.AdamW(model[1].parameters())
    manager = CheckpointManager(tmp_path, keep_last=None)
    manager.save_state(step=1, model=model, optimizer=opt)
    manager.save_state(step=2, model=model, optimizer=opt)
    second = tmp_path / "step_000000002"
    assert carried_files(second) == ["base.safetensors"]
    with pytest.raises(RuntimeError, match=r"step_000000002 carried \['base.safetensors'\]"):
        require_written(second)


def test_a_change_of_every_tensor_between_saves_makes_the_next_one_write_every_file(tmp_path: Path) -> None:
    model, opt = _state()
    before = {k: t.clone() for k, t in flat_tensors(model, opt).items()}
    manager = CheckpointManager(tmp_path, keep_last=None)
    manager.save_state(step=1, model=model, optimizer=opt)
    change_every_tensor(model, opt)
    manager.save_state(step=2, model=model, optimizer=opt)
    after = flat_tensors(model, opt)
    assert sorted(after) == sorted(before)
    assert all(not torch.equal(after[k], before[k]) for k in before)  # each tensor changed, in place
    assert carried_files(tmp_path / "step_000000002") == []
    require_written(tmp_path / "step_000000002")
