"""File writes, and a restore's reads, that bypass the page cache wherever the memory and the file agree on alignment
(``O_DIRECT``).

A buffered write copies every byte into the kernel's page cache, which the kernel writes back later: kernel time
per write, dirty pages competing for memory, and durability only after the write-back. Written ``O_DIRECT``, the
device reads the buffer itself and no dirty pages are left (``bench/README.md`` measures both ways, and what either
costs a training loop running meanwhile: ``bench/bench_interference.py``, ``bench/bench_lazy.py``).

Linux asks three things of an ``O_DIRECT`` write: the buffer's address, the
file offset and the length are multiples of the device's logical block size.
:data:`BLOCK` (4096) is a multiple of every common one. A tensor file's data
starts on such a boundary (:func:`preempt.checkpoint.tensorfile.chunks` pads its header)
and the staging buffers of a file are one page-aligned arena laid out as the
file (:class:`preempt.checkpoint.staging.Stager`), so nearly all of a staged checkpoint
goes direct; the header, the last partial block and any memory that is not
aligned so (a synchronous save of live tensors) go through the page cache as
before. The switch is made per write with ``fcntl(F_SETFL)`` on one
descriptor, a block at a time: no block is written both ways, and the
``fdatasync`` that ends every file covers both kinds.

Where a filesystem refuses ``O_DIRECT`` (the flag, or a write with it: EINVAL or
EOPNOTSUPP), the file is written through the page cache from there on; nothing fails.

A restore reads the large files it keeps the same way (:func:`read_whole`, from
:func:`preempt.checkpoint.hashed_io.read_file`; a byte range of a file, for the ranks that read shares of a
checkpoint: :func:`read_range`): the device writes straight into the memory the tensors end in. A file already in
the page cache (``preempt prefetch`` read it ahead) is read from there instead (:func:`cached`), and a filesystem
that refuses ``O_DIRECT`` is read through it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from collections.abc import Iterator
from typing import Any

BLOCK = 4096  # alignment of address, offset and length of a direct write
MIN_DIRECT = 1 << 20  # a shorter aligned span is not worth a switch of the descriptor's mode
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_REFUSED = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})  # what a filesystem says that has no O_DIRECT


def address(view: memoryview) -> int:
    """The memory address of the first byte of ``view`` (a C-contiguous buffer of bytes)."""
    import numpy as np  # here, not at the top: `preempt ls` and `verify` start without numpy

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
            self._mode = set_direct(self.fd, direct)
            if direct and not self._mode:
                self._usable = False
        return self._mode

    def _give_up(self) -> None:
        self._set_mode(False)
        self._usable = False


READ_CHUNK = 32 << 20  # bytes per direct read: several of the device's largest requests in flight at once


def cached(fd: int, size: int) -> bool:
    """Whether most of the file is in the page cache (``preempt prefetch`` read it ahead, or it was just written
    through it): then it is read from there, not from the disk again. Asked with ``mincore`` of a mapping of it,
    which reads nothing (a read with ``RWF_NOWAIT`` would start reading ahead what it does not find). A system
    that cannot tell is answered False."""
    counted = _resident(fd, size)
    return counted is not None and through_cache(*counted)


def through_cache(resident: int, pages: int) -> bool:
    """A file of ``pages`` pages, ``resident`` of them in the page cache, is read through it when more than half
    are: the rest is read ahead by the kernel as the reads go."""
    return pages > 0 and resident * 2 > pages


def _resident(fd: int, size: int) -> tuple[int, int] | None:
    """(pages of the file in the page cache, pages of the file), or None where ``mincore`` is not at hand."""
    if size <= 0 or _MINCORE is None:
        return None
    import numpy as np

    try:
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_READ)  # maps; faults nothing in
    except (OSError, ValueError):
        return None
    try:
        page = mmap.PAGESIZE
        pages = -(-size // page)
        vec = (ctypes.c_ubyte * pages)()
        view = np.frombuffer(mapped, dtype=np.uint8)
        try:
            failed = _MINCORE(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
        finally:
            del view
        if failed:
            return None
        return int((np.frombuffer(bytes(vec), dtype=np.uint8) & 1).sum()), pages
    finally:
        mapped.close()


def _mincore() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


_MINCORE = _mincore()


def set_direct(fd: int, on: bool = True) -> bool:
    """Sets (or, not ``on``, clears) ``O_DIRECT`` on the descriptor ``fd``; whether it is set now. False where the
    system has no ``O_DIRECT`` or the filesystem refuses it for this file: it is read or written through the page
    cache.

    Raises:
        OSError: ``fcntl`` failed for another reason (clearing the flag never fails quietly).
    """
    if not _O_DIRECT:
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if bool(flags & _O_DIRECT) == on:
        return on
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT if on else flags & ~_O_DIRECT)
    except OSError as e:
        if on and e.errno in _REFUSED:
            return False
        raise
    return on


def read_whole(fd: int, view: memoryview, size: int, chunk: int = READ_CHUNK) -> Iterator[memoryview]:
    """Reads the file of ``fd`` (``size`` bytes) into ``view`` bypassing the page cache, yielding each chunk read.

    ``view`` starts on a page boundary and holds ``size`` rounded up to :data:`BLOCK` (the last read asks for the
    whole last block; the file's end makes it short). The device writes the memory itself: no page cache grows,
    no copy is made. The descriptor's flags are as they were when this returns.

    Raises:
        DirectRefused: The filesystem refuses ``O_DIRECT`` (read the file again, through the page cache).
        OSError: A read failed, or the file ended before ``size`` bytes.
    """
    if not _O_DIRECT:
        raise DirectRefused("no O_DIRECT on this system")
    if address(view) % BLOCK or view.nbytes < -(-size // BLOCK) * BLOCK:
        raise ValueError("the memory of a direct read starts on a block and holds whole blocks")
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if not set_direct(fd):
        raise DirectRefused("O_DIRECT refused")
    try:
        yield from read_range(fd, view, 0, size, chunk=chunk, fall_back=False)
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)


def read_range(
    fd: int, view: memoryview, offset: int, length: int, *, chunk: int = READ_CHUNK, fall_back: bool = True
) -> Iterator[memoryview]:
    """Reads ``length`` bytes of the file of ``fd`` from ``offset`` into the same bytes of ``view`` (the file's
    memory from its first byte), yielding each chunk as it lands.

    Each read asks for at most ``chunk`` bytes and no further than the end of the range's last block, which ``view``
    holds whole (the file's end makes that read short): what a descriptor set ``O_DIRECT`` (:func:`set_direct`)
    needs, with ``offset``, ``chunk`` and the address of ``view`` multiples of :data:`BLOCK`. Without the flag, the
    same reads go through the page cache.

    Args:
        fall_back: Where the filesystem refuses a read ``O_DIRECT``, clear the flag on ``fd`` (for every later read
            of it too) and go on through the page cache from there; else raise :class:`DirectRefused`.

    Raises:
        DirectRefused: Refused, and not ``fall_back``; the chunks yielded before it are read.
        OSError: A read failed, or the file ended inside the range.
    """
    end = offset + length
    last = -(-end // BLOCK) * BLOCK
    at = offset
    while at < end:
        try:
            n = os.preadv(fd, [view[at : min(at + chunk, last)]], at)
        except OSError as e:
            if e.errno not in _REFUSED or not fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT:
                raise
            if not fall_back:
                raise DirectRefused(e.strerror or "O_DIRECT refused") from None
            set_direct(fd, False)  # refused at read time: this descriptor reads through the page cache from now on
            continue
        n = min(n, end - at)
        if n <= 0:
            raise OSError(errno.EIO, f"the file ended at {at} of {end} bytes while being read")
        yield view[at : at + n]
        at += n


class DirectRefused(OSError):
    """The filesystem has no ``O_DIRECT`` for this file: read it through the page cache."""
