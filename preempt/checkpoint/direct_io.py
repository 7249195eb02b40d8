"""File writes that bypass the page cache wherever the memory and the file agree on alignment (``O_DIRECT``).

A buffered write copies every byte into the kernel's page cache, which the
kernel writes back later. For the 1.5 GiB checkpoint of ``bench/README.md``
(2-core VM) that took 0.6 to 5.4 s of kernel time per write (the page cache
growing into memory the hypervisor had never backed costs the most) and the
file was durable after ~6 s; written ``O_DIRECT``, the device reads the buffer
itself: 0.05 s of kernel time, durable after ~1 s, and no dirty pages left to
compete for memory. What either costs a training loop running meanwhile is
within the noise of that machine (``bench/bench_interference.py``,
``bench/bench_lazy.py``).

Linux asks three things of an ``O_DIRECT`` write: the buffer's address, the
file offset and the length are multiples of the device's logical block size.
:data:`BLOCK` (4096) is a multiple of every common one. A tensor file's data
starts on such a boundary (:func:`preempt.checkpoint.tensorfile.pieces` pads its header)
and the staging buffers of a file are one page-aligned arena laid out as the
file (:class:`preempt.checkpoint.staging.Stager`), so nearly all of a staged checkpoint
goes direct; the header, the last partial block and any memory that is not
aligned so (a synchronous save of live tensors) go through the page cache as
before. The switch is made per write with ``fcntl(F_SETFL)`` on one
descriptor, a block at a time: no block is written both ways, and the
``fdatasync`` that ends every file covers both kinds.

Where a filesystem refuses ``O_DIRECT`` (the flag, or a write with it: EINVAL or
EOPNOTSUPP), the file is written through the page cache from there on; nothing fails.
"""

from __future__ import annotations

import errno
import fcntl
import os

import numpy as np

BLOCK = 4096  # alignment of address, offset and length of a direct write
MIN_DIRECT = 1 << 20  # a shorter aligned span is not worth a switch of the descriptor's mode
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_REFUSED = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})  # what a filesystem says that has no O_DIRECT


def address(view: memoryview) -> int:
    """The memory address of the first byte of ``view`` (a C-contiguous buffer of bytes)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def span(pos: int, addr: int, n: int, block: int = BLOCK, min_direct: int = MIN_DIRECT) -> tuple[int, bool]:
    """How to write the next bytes: (how many in one call, directly or not).

    ``pos`` is the file position, ``addr`` the memory address of the first of
    ``n`` bytes. Memory that is not aligned as the file is (``addr - pos`` not
    a multiple of ``block``) is never direct. Otherwise the bytes up to the
    next block boundary go through the page cache, then every whole block
    directly (when there are at least ``min_direct`` bytes of them), then the
    remainder through the page cache.
    """
    if n <= 0:
        return 0, False
    if (addr - pos) % block:
        return n, False
    head = -pos % block
    if head:
        return min(head, n), False
    body = n - n % block
    if body >= min_direct:
        return body, True
    return n, False


class Sink:
    """Writes the bytes of one file in order, each span directly or through the page cache (:func:`span`).

    Args:
        fd: A descriptor open for writing at offset 0 (not ``O_APPEND``).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pos = 0
        self.direct_bytes = 0  # bytes that went to the device without the page cache
        self._usable = bool(_O_DIRECT)  # False once the filesystem refused O_DIRECT
        self._mode = False  # the descriptor has O_DIRECT set

    def write(self, view: memoryview) -> int:
        """Writes a prefix of ``view`` with one system call; returns how many bytes were written."""
        n, direct = span(self.pos, address(view), view.nbytes) if self._usable else (view.nbytes, False)
        direct = self._set_mode(direct)
        try:
            written = os.write(self.fd, view[:n])
        except OSError as e:
            if not (direct and e.errno in _REFUSED):
                raise
            self._give_up()  # a device with a larger logical block, or a filesystem that refuses at write time
            written = os.write(self.fd, view[:n])
            direct = False
        self.pos += written
        if direct:
            self.direct_bytes += written
        return written

    def _set_mode(self, direct: bool) -> bool:
        """Sets or clears O_DIRECT on the descriptor; returns whether it is set now.

        A filesystem that refuses the flag gets buffered writes from then on.
        """
        if self._mode != direct:
            flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
            try:
                fcntl.fcntl(self.fd, fcntl.F_SETFL, flags | _O_DIRECT if direct else flags & ~_O_DIRECT)
            except OSError as e:
                if not direct or e.errno not in _REFUSED:
                    raise
                self._usable = False
                return False
            self._mode = direct
        return direct

    def _give_up(self) -> None:
        self._set_mode(False)
        self._usable = False
