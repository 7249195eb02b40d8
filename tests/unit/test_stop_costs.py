"""What a stop does between its signal and its durable checkpoint, counted: the peers' collectives, the syncs, the
work done once rather than at every save. No timing: each test counts or compares what a stop does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from preempt import Preempted, PreemptibleRun
from preempt.run.peers import Agreement, Alone
from preempt.run.save_policy import Reason


class CountingPeers(Alone):
    """A process alone that counts what the run asks of its peers."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def agree(self, stop: bool, save: Reason | None, *, walltime_stop: bool = False) -> Agreement:
        self.calls.append("agree")
        return super().agree(stop, save, walltime_stop=walltime_stop)

    def broadcast(self, obj: Any) -> Any:
        self.calls.append("broadcast")
        return obj

    def all(self, flag: bool) -> bool:
        self.calls.append("all")
        return flag

    def gather(self, obj: Any) -> list[Any] | None:
        self.calls.append("gather")
        return [obj]

    def barrier(self) -> None:
        self.calls.append("barrier")


@pytest.mark.parametrize("async_save", [False, True])
def test_a_stop_is_one_agreement_when_its_save_is_taken_there(tmp_path, async_save):
    """The stop's save is synchronous: every rank learns its outcome in the commit, so the ranks need not ask rank 0
    again whether the state is saved (it was one agreement and one broadcast)."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(Preempted) as info:
        with PreemptibleRun(
            tmp_path, model=model, optimizer=opt, checkpoint_interval=None, async_save=async_save
        ) as run:
            for _ in range(2):
                opt.step()
                run.step()
            peers = run.peers = CountingPeers()  # the stop's safe point asks these
            opt.step()
            run.request_stop()
            run.step()
    assert info.value.checkpoint is not None and info.value.checkpoint.endswith("step_000000003")
    assert peers.calls == ["agree"]
