"""A tracked object whose state first exists inside the run (the batch a loop draws before ``run.step()``) is no
error when the run starts: it is read at the first checkpoint. State that can never be saved still fails at the
start, before any training."""

from __future__ import annotations

import logging

import pytest
import torch

from preempt import PreemptibleRun
from preempt.errors import UnsupportedStateError


class NextBatch:
    """Holds the loop's next batch once the loop has drawn one."""

    def state_dict(self):
        return {"x": self.x}  # AttributeError until the loop sets it

    def load_state_dict(self, state):
        self.x = state["x"]


def test_a_state_that_exists_only_inside_the_run_is_read_at_the_first_checkpoint(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="preempt")
    model = torch.nn.Linear(2, 2)
    held = NextBatch()
    with PreemptibleRun(tmp_path, model=model, track={"batch": held}, checkpoint_interval=None, log_file=False) as run:
        assert any("tracked 'batch': its state cannot be read yet (AttributeError" in m for m in caplog.messages)
        held.x = torch.arange(4.0)
        run.step()
    resumed = NextBatch()
    with PreemptibleRun(
        tmp_path, model=model, track={"batch": resumed}, exit_if_complete=False, checkpoint_interval=None
    ) as run:
        assert run.resumed_from is not None
        assert torch.equal(resumed.x, torch.arange(4.0))


def test_a_state_still_unreadable_at_the_first_checkpoint_fails_there(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(AttributeError, match="x"):
        with PreemptibleRun(tmp_path, model=model, track={"batch": NextBatch()}, checkpoint_interval=None) as run:
            run.step()


class Unsaveable:
    def state_dict(self):
        return {"handle": object()}

    def load_state_dict(self, state):
        pass


def test_a_state_that_can_never_be_saved_fails_at_the_start(tmp_path):
    with pytest.raises(UnsupportedStateError, match="tracked.bad.handle"):
        with PreemptibleRun(tmp_path, model=torch.nn.Linear(2, 2), track={"bad": Unsaveable()}):
            pytest.fail("the run must not start")
