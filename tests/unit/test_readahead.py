"""The memory a read ahead, and a restore's choice between reading a file into memory and mapping it, are sized by
(``preempt.checkpoint.readahead.host_memory_available``)."""

from __future__ import annotations

import psutil

from preempt.checkpoint import readahead


def test_the_memory_available_is_some_of_the_hosts_memory():
    available = readahead.host_memory_available()
    assert available is not None and 0 < available <= psutil.virtual_memory().total


def test_unknown_where_the_system_does_not_say(monkeypatch):
    def refused() -> None:
        raise OSError("no /proc here")

    monkeypatch.setattr(psutil, "virtual_memory", refused)
    assert readahead.host_memory_available() is None
