"""Fresh host memory made resident before a checkpoint needs it: the staging buffers' first touch.

A buffer allocated and never written has no pages yet; its first write takes one page fault per page, each
trapping into the kernel, which finds a zeroed page and maps it. The staging buffers are touched once, in the
background, so that a checkpoint's copy into them faults nothing (``preempt.checkpoint.staging``). Where the kernel
has ``MADV_POPULATE_WRITE`` (Linux 5.14), one call per 64 MiB maps every page writable without a trap per page and
without writing the memory a second time; elsewhere the buffer is filled with zeros, as before. A save that cannot
wait (a stop) stops the touching between two calls: its copy faults the rest. Populating is no slower than
filling, and the copy into the buffer afterwards costs the same either way (``bench/README.md``, "Figures once kept
in docstrings").
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading

import torch

MADV_POPULATE_WRITE = 23  # linux/mman.h
PAGE = 4096


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


STEP = 64 << 20
"""Bytes made resident per ``madvise`` call: between two, a save that cannot wait stops the touching."""


def touch(data: torch.Tensor, stop: threading.Event | None = None) -> str:
    """Makes every page of ``data`` (a contiguous CPU tensor of bytes) resident and writable; returns how:
    ``"populated"`` (``madvise``, :data:`STEP` bytes a call), ``"filled"`` (zeros written: an older kernel, or memory
    it refuses), or ``"stopped"``: ``stop`` was set, and the pages not touched yet are faulted by their first write."""
    size = data.numel() * data.element_size()
    if size == 0:
        return "populated"
    madvise = _madvise()
    ptr = data.data_ptr()
    start = ptr - ptr % PAGE  # the page that holds the first byte: mapped, as it is part of the allocation
    end = ptr + size
    if madvise is not None:
        at = start
        while at < end:
            if stop is not None and stop.is_set():
                return "stopped"
            n = min(STEP, end - at)
            if madvise(at, n, MADV_POPULATE_WRITE) != 0:
                break
            at += n
        else:
            return "populated"
        data = data[max(0, at - ptr) :]  # the kernel refused: what is left is filled
    for begin in range(0, data.numel(), STEP):
        if stop is not None and stop.is_set():
            return "stopped"
        data[begin : begin + STEP].fill_(0)
    return "filled"
