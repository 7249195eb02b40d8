"""PeerLost: the failure of a collective (another rank is gone) becomes exit code 80 with a message."""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

from preempt.cluster.distributed import Coordinator, lost_peer
from preempt.errors import PEER_LOST_EXIT_CODE, PeerLost
from preempt.run.peers import Alone, Ranks

GLOO = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5005. This is "
    "typically caused by a remote worker crashing.\nsecond line"
)


def coordinator(rank: int, world_size: int) -> Coordinator:
    """A Coordinator's error handling without a process group (its __init__ needs one)."""
    c = Coordinator.__new__(Coordinator)
    c.rank, c.world_size = rank, world_size
    return c


def test_peer_lost_is_a_system_exit_with_code_80_and_says_what_to_do():
    lost = PeerLost(1, 4, "a barrier", RuntimeError(GLOO))
    assert isinstance(lost, SystemExit) and lost.code == PEER_LOST_EXIT_CODE == 80
    text = str(lost)
    assert text.startswith("rank 1 of 4 lost the other ranks during a barrier (RuntimeError: [")
    assert "Connection closed by peer" in text and "second line" not in text
    assert text.endswith("the last checkpoint stands and a rerun of all ranks continues from it (exit code 80)")


def test_a_long_or_empty_error_keeps_the_message_bounded():
    assert len(str(PeerLost(0, 2, "x", RuntimeError("y" * 10_000)))) < 600
    assert "(RuntimeError: ): a rank died" in str(PeerLost(0, 2, "x", RuntimeError("")))


def test_a_failed_collective_becomes_peer_lost_logged_at_error(caplog):
    c = coordinator(0, 2)
    with caplog.at_level(logging.ERROR, logger="preempt"), pytest.raises(PeerLost) as caught:
        with c._peers("the agreement at a safe point"):
            raise RuntimeError(GLOO)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert caught.value.during == "the agreement at a safe point" and caught.value.rank == 0
    assert [r.getMessage() for r in caplog.records] == [str(caught.value)]


def test_other_errors_pass_through_unchanged():
    c = coordinator(1, 2)
    with pytest.raises(ValueError, match="not a collective's"), c._peers("a barrier"):
        raise ValueError("not a collective's")


# What DDP's all-reduce inside loss.backward() raised on rank 0 when rank 1 was SIGKILLed (a CI run, torch 2.13).
GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:54492: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
)
GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv"
NCCL_REMOTE = "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error"


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(GLOO),
        RuntimeError(GLOO_RESET),
        RuntimeError(GLOO_TIMEOUT),
        dist.DistBackendError(NCCL_REMOTE),
        dist.DistBackendError("[PG 0 Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)"),
        dist.DistNetworkError("Connection refused"),
        dist.DistStoreError("Socket Timeout"),
    ],
)
def test_the_backends_words_for_a_lost_peer_are_recognised(error):
    assert lost_peer(error)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x16 and 32x2)"),
        dist.DistBackendError("NCCL error: invalid usage (run with NCCL_DEBUG=WARN for details)"),
        ValueError("Connection reset by peer"),  # not an error a collective raises
        OSError("Connection reset by peer"),
        PeerLost(0, 2, "a barrier", RuntimeError(GLOO)),  # already said
    ],
)
def test_other_errors_are_not_a_lost_peer(error):
    assert not lost_peer(error)


def ranks(rank: int, world_size: int) -> Ranks:
    """Ranks without a process group (its __init__ creates one)."""
    r = Ranks.__new__(Ranks)
    r.coord = coordinator(rank, world_size)
    r.rank, r.world_size = rank, world_size
    return r


def test_an_error_of_the_loops_own_collective_becomes_peer_lost_from_it(caplog):
    error = RuntimeError(GLOO_RESET)
    with caplog.at_level(logging.ERROR, logger="preempt"):
        lost = ranks(0, 2).lost(error)
    assert isinstance(lost, PeerLost) and lost.code == PEER_LOST_EXIT_CODE and lost.__cause__ is error
    assert str(lost).startswith("rank 0 of 2 lost the other ranks during a collective of the training loop")
    assert [r.getMessage() for r in caplog.records] == [str(lost)]


def test_no_peer_lost_for_other_errors_nor_alone():
    assert ranks(1, 2).lost(RuntimeError("shapes cannot be multiplied")) is None
    assert ranks(1, 2).lost(None) is None
    assert Alone().lost(RuntimeError(GLOO_RESET)) is None
