"""PeerLost: the failure of a collective (another rank is gone) becomes exit code 80 with a message."""

from __future__ import annotations

import logging

import pytest

from preempt.distributed import Coordinator
from preempt.errors import PEER_LOST_EXIT_CODE, PeerLost

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
