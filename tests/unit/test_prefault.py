"""The staging buffers' first touch (preempt.checkpoint.prefault): every page resident before a checkpoint copies."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import numpy as np
import pytest
import torch

from preempt.checkpoint import prefault

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and MADV_POPULATE_WRITE are Linux's")


def resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(pages of ``t``'s bytes that are resident, pages it spans), from mincore on the process's own memory."""
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    size = t.data_ptr() + t.numel() - start
    pages = -(-size // page)
    vec = (ctypes.c_ubyte * pages)()
    assert mincore(ctypes.c_void_p(start), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
    return int((np.frombuffer(bytes(vec), dtype=np.uint8) & 1).sum()), pages


def kernel() -> tuple[int, ...]:
    release = os.uname().release.split("-")[0]
    return tuple(int(x) for x in release.split(".")[:2] if x.isdigit())


@linux
def test_fresh_memory_has_every_page_resident_after_one_touch():
    data = torch.empty(64 << 20, dtype=torch.uint8)  # large enough to be a fresh mapping: no page yet
    before, pages = resident_pages(data)
    assert before < pages
    how = prefault.touch(data)
    assert how == ("populated" if kernel() >= (5, 14) else "filled")  # one madvise where the kernel has it
    assert resident_pages(data) == (pages, pages)


def test_where_the_kernel_cannot_populate_the_buffer_is_filled_with_zeros(monkeypatch):
    monkeypatch.setattr(prefault, "_madvise", lambda: None)
    data = torch.full((1 << 20,), 7, dtype=torch.uint8)
    assert prefault.touch(data) == "filled"
    assert not data.any()


def test_an_empty_buffer_needs_nothing():
    assert prefault.touch(torch.empty(0, dtype=torch.uint8)) == "populated"


@linux
def test_a_stop_ends_the_touching_between_two_steps_and_leaves_the_rest_to_the_first_write():
    import threading

    data = torch.empty(4 * prefault.STEP, dtype=torch.uint8)  # a fresh mapping of four steps
    stop = threading.Event()
    stop.set()
    assert prefault.touch(data, stop) == "stopped"
    touched, pages = resident_pages(data)
    assert touched < pages  # nothing made resident after the stop
    data.fill_(1)  # the first write faults what is left
    assert resident_pages(data) == (pages, pages)
