"""Reading a checkpoint ahead: its files asked of the disk before anyone reads them. No torch.

A restart pays for the restore's reads after the process has started (importing torch alone takes seconds), and a
restore that reads its files one after the other leaves the disk idle while it hashes. :func:`ask` tells the kernel
that a file will be read whole (``posix_fadvise(WILLNEED)``: it starts reading it into the page cache and returns);
:func:`warm` does it for every file of a checkpoint, then, when asked, reads them through, so that they are in
memory when it returns. The restore asks for all its files before it reads the first
(:meth:`preempt.checkpoint.manager.CheckpointManager.read`); ``preempt prefetch DIR`` and ``preempt supervise`` warm
the newest valid checkpoint (:func:`preempt.checkpoint.manager.newest_files`) before the training process has
imported torch.

Nothing here can damage or change a checkpoint: files are opened read-only through :func:`safe_io.open_fd` (no
symlink followed, no FIFO opened), and an error is a file not warmed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path

from . import safe_io

CHUNK = 8 << 20  # a read of warm(): the page cache, not this buffer, keeps what is read


@dataclasses.dataclass(frozen=True)
class Warmed:
    """What :func:`warm` did: the files asked for (and read through, when it read), their bytes, the files it could
    not open."""

    files: int = 0
    nbytes: int = 0
    failed: tuple[str, ...] = ()


def host_memory_available() -> int | None:
    """The kernel's estimate of memory available to new allocations (Linux's ``MemAvailable``, read with psutil),
    bytes; None where unknown."""
    import psutil  # here, not at the top: `preempt ls` and `verify` start without it

    try:
        return int(psutil.virtual_memory().available)
    except (OSError, RuntimeError, ValueError, AttributeError):
        return None


def ask(path: str | os.PathLike[str]) -> int:
    """Asks the kernel to read ``path`` whole into the page cache, without waiting; its size, or -1 when it cannot
    be opened (missing, not a regular file). A system without ``posix_fadvise`` reads nothing ahead."""
    try:
        fd = safe_io.open_fd(path)
    except OSError:
        return -1
    try:
        size = os.fstat(fd).st_size
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        return size
    except OSError:
        return -1
    finally:
        os.close(fd)


def warm(paths: Iterable[str | os.PathLike[str]], *, read: bool = False, fraction: float = 0.5) -> Warmed:
    """Asks for the files of ``paths`` at once (:func:`ask`), then, with ``read``, reads each through (the call
    returns with them in the page cache). Only as many as fit in ``fraction`` of the memory available: a checkpoint
    larger than memory would push out what is read first, and what the process needs."""
    budget = host_memory_available()
    asked: list[tuple[Path, int]] = []
    for p in paths:
        size = _size(p)
        if budget is not None and size > 0:
            if size > budget * fraction:
                break
            budget -= size
        asked.append((Path(p), ask(p)))
    failed = tuple(str(p) for p, size in asked if size < 0)
    ok = [(p, size) for p, size in asked if size >= 0]
    if read:
        buf = bytearray(CHUNK)
        for p, _ in ok:
            try:
                with open(safe_io.open_fd(p), "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass
            except OSError:
                failed += (str(p),)
    return Warmed(len(ok), sum(size for _, size in ok), failed)


def _size(path: str | os.PathLike[str]) -> int:
    try:
        return os.stat(path, follow_symlinks=False).st_size
    except OSError:
        return -1
