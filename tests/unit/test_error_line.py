"""The line an exception that escapes the loop leaves in the log says where it came from: "during an
optimizer step" only when optimizer.step() had begun and not returned; after the step and before run.step(), it says
so; between run.step() and the next batch (an evaluation) the state is a step boundary and gets its checkpoint."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from preempt import CheckpointManager, PreemptibleRun
from preempt.run.guarding import not_a_boundary
from preempt.run.loop_state import LoopState


class Boom(RuntimeError):
    pass


def train(tmp_path, where: str) -> None:
    """4 steps; at step 3 a Boom is raised at ``where``: "inside" optimizer.step(), "before" run.step() (after the
    optimizer step), "after" run.step() (an evaluation), or in a "micro" batch of gradient accumulation."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(32, 4))

    def inside(*_):
        if run.global_step + 1 == 3 and where == "inside":
            raise Boom("in the middle of the update")

    with PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_interval=None) as run:
        opt.register_step_pre_hook(inside)  # after the run's own: the step has begun
        loader = DataLoader(data, batch_size=4, sampler=run.sampler(data, shuffle=False))
        for _ in run.epochs(1):
            for (x,) in run.batches(loader):
                model(x).sum().backward()
                if where == "micro" and run.global_step + 1 == 3 and run.batch % 2:
                    raise Boom("in a micro-batch")
                opt.step()
                opt.zero_grad()
                if where == "before" and run.global_step + 1 == 3:
                    raise Boom("evaluation between optimizer.step() and run.step()")
                run.step()
                if where == "after" and run.global_step == 3:
                    raise Boom("evaluation after run.step()")


def test_an_error_after_the_optimizer_step_and_before_run_step_is_not_said_to_be_inside_it(tmp_path, caplog):
    with pytest.raises(Boom):
        train(tmp_path, "before")
    assert "during an optimizer step" not in caplog.text, caplog.text
    assert (
        "Boom escaped the training loop at step 2 after optimizer.step() and before run.step() (the weights are one"
        " step ahead of the step counter" in caplog.text
    ), caplog.text
    assert CheckpointManager(tmp_path, owner=False).list() == []  # that state is no step boundary


def test_an_error_inside_the_optimizer_step_is_said_to_be_inside_it(tmp_path, caplog):
    with pytest.raises(Boom):
        train(tmp_path, "inside")
    assert "at step 2 during an optimizer step (the state may be half-updated): no emergency" in caplog.text
    assert CheckpointManager(tmp_path, owner=False).list() == []


@pytest.mark.parametrize("where, step", [("after", 3), ("micro", 2)])
def test_an_error_at_a_step_boundary_gets_its_emergency_checkpoint(tmp_path, caplog, where, step):
    with pytest.raises(Boom):
        train(tmp_path, where)
    assert "during an optimizer step" not in caplog.text and "before run.step()" not in caplog.text, caplog.text
    assert f"Boom escaped the training loop at step {step}: emergency checkpoint" in caplog.text, caplog.text
    (info,) = CheckpointManager(tmp_path, owner=False).list()
    assert (info.step, info.manifest.reason) == (step, "emergency")


def test_the_decision_reads_the_optimizer_hooks_and_run_step():
    loop = LoopState()
    assert not_a_boundary(loop) is None
    loop.took_batch()
    assert not_a_boundary(loop) is None  # a micro-batch: the last boundary's state, its batch unwound
    loop.optimizer_stepping()
    assert "during an optimizer step" in not_a_boundary(loop)
    loop.optimizer_stepped()
    assert "after optimizer.step() and before run.step()" in not_a_boundary(loop)
    loop.stepped()
    assert not_a_boundary(loop) is None
    loop.optimizer_stepping()
    loop.batch_skipped()  # out of memory inside the step: skipped, a boundary again
    assert not_a_boundary(loop) is None
