"""The verdict of a lazy snapshot on a GPU (preempt.checkpoint.side_stream.Verdict), decided with CPU tensors.

Whichever asks first decides: the optimizer's hook, before its step changes the tensors, or the writer once the
copies are made. What the other sees later (the optimizer's own change of the counters) must not undo it. The
streams themselves are tested on a GPU (tests/gpu/test_lazy_gpu.py).
"""

from __future__ import annotations

import torch

from preempt.checkpoint.side_stream import Verdict


def sources(*tensors: torch.Tensor) -> list[tuple[str, torch.Tensor, int]]:
    return [(f"t{i}", t, t._version) for i, t in enumerate(tensors)]


def test_no_counter_moved_before_the_first_decision_means_the_copies_hold_the_step():
    a, b = torch.zeros(3), torch.zeros(3)
    verdict = Verdict(sources(a, b))
    assert verdict.decide() is None  # the optimizer's hook, before the step
    a.add_(1.0)  # the optimizer's step
    assert verdict.decide() is None, "the step after the hook is not a torn snapshot"


def test_a_counter_moved_before_the_first_decision_names_the_tensor_and_stays_decided():
    a, b = torch.zeros(3), torch.zeros(3)
    verdict = Verdict(sources(a, b))
    b.mul_(0.5)  # a change outside the optimizer, before the copies were safe
    assert verdict.decide() == "t1"
    assert verdict.decide() == "t1"


def test_a_snapshot_of_no_tensors_is_never_torn():
    assert Verdict([]).decide() is None
