"""The suite's rendezvous ports (helpers.distributed.free_port): below the ephemeral range, one slice per worker."""

from __future__ import annotations

import itertools
import socket

import pytest
from helpers import distributed, free_port, port_slice


def test_the_workers_slices_are_disjoint_and_below_the_ephemeral_range() -> None:
    slices = [port_slice(f"gw{i}", 2, 32768) for i in range(2)]
    assert slices[0] == range(20000, 26384) and slices[1] == range(26384, 32768)
    assert not set(slices[0]) & set(slices[1])
    assert port_slice(None, 1, 32768) == range(20000, 32768)  # not under xdist: the whole room
    assert port_slice("gw3", 2, 32768).stop <= 32768  # a worker index past the count still fits


def test_no_room_below_the_ephemeral_range_gives_an_empty_slice() -> None:
    assert len(port_slice("gw0", 2, 1024)) == 0


def test_free_port_skips_a_port_in_use(monkeypatch) -> None:
    with socket.socket() as held, socket.socket() as probe:
        held.bind(("", 0))
        held.listen()
        probe.bind(("", 0))  # a second port known to be free once the probe closes
        taken, free = held.getsockname()[1], probe.getsockname()[1]
        probe.close()
        monkeypatch.setattr(distributed, "_ports", [taken, free])
        monkeypatch.setattr(distributed, "_turns", itertools.count(0))
        port = free_port()
    assert port == free
    with socket.socket() as s:
        s.bind(("", port))  # free now, as promised


def test_free_port_comes_from_this_workers_slice() -> None:
    if not len(distributed._ports):
        pytest.skip(f"this machine's ephemeral range starts at {distributed._ephemeral_low()}: no room below it")
    assert free_port() in distributed._ports
    assert free_port() < distributed._ephemeral_low()
