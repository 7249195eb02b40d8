"""Hashed file I/O: every byte of a checkpoint written or read here is hashed (xxh3-128) on its way.

Writes (:func:`write_file`: coalesced, page cache bypassed for an aligned arena, a recycled file written over in
place), hard links of carried files (:func:`link_file`), reads (:func:`read_file`: mapped, or read ``O_DIRECT`` into
memory of this process's own, or read plainly where a mapping is refused; :func:`hash_file` in constant memory),
the digests of bytes already in memory (:func:`digest_of`, chunk by chunk: :func:`update`) and syncs issued together
(:func:`sync_together`). The order in which a checkpoint's files are written, synced and renamed is the protocol's
(:mod:`preempt.checkpoint.commit`); a write stops when cancelled (:mod:`preempt.checkpoint.cancel`). No torch, no
signals.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import mmap
import os
import stat
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from .. import _testing
from . import direct_io, readahead, safe_io
from .cancel import check_cancelled
from .deleter import remove_tree

if TYPE_CHECKING:
    import numpy as np  # imported where a file is read: `preempt ls` and `verify` start without it

WRITE_CHUNK = 64 << 20  # bytes per write(2) call; also bounds a partial write
LOAD_CHUNK = 8 << 20  # bytes per read(2) of a file a restore keeps: hashed while still in the CPU's cache
KEEP_FRACTION = 0.5  # a file a restore keeps is read into memory when it takes at most this of what is available
_COALESCE = 4 << 20  # small chunks are gathered up to this size before writing


@dataclasses.dataclass(frozen=True)
class FileDigest:
    """Size in bytes and xxh3-128 hex digest of one file.

    ``carried_from``: the step whose save wrote these bytes, when this checkpoint's file is a hard link to them
    (carried unchanged, :mod:`preempt.checkpoint.carry`); None for a file this checkpoint wrote. Not compared:
    the same bytes are the same file to every check.
    """

    size: int
    xxh3_128: str
    carried_from: int | None = dataclasses.field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"size": self.size, "xxh3_128": self.xxh3_128}
        if self.carried_from is not None:  # absent rather than null: an older reader sees the entry it knows
            doc["carried_from"] = self.carried_from
        return doc


def _fdatasync(fd: int) -> None:
    getattr(os, "fdatasync", os.fsync)(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Makes the entries of a directory (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_together(files: Iterable[str | os.PathLike[str]], dirs: Iterable[str | os.PathLike[str]] = ()) -> None:
    """Makes the written ``files`` and the entries of ``dirs`` durable, every sync issued at once.

    Each ``fdatasync`` ends in a flush of the device's cache; issued one after another, a checkpoint of four files
    and its directory waits for five flushes in a row. Issued together from threads (they let go of the GIL), the
    kernel sends the device the flushes that wait at the same time as one. Nothing is durable until all are: the
    caller renames nothing before this returns.

    Raises:
        OSError: A sync failed (the first one's error, in the order given; the others were waited for).
    """
    jobs = [(path, False) for path in files] + [(path, True) for path in dirs]
    if len(jobs) <= 1:
        for path, is_dir in jobs:
            fsync_dir(path) if is_dir else _sync_file(path)
        return
    with ThreadPoolExecutor(min(len(jobs), _SYNCERS), thread_name_prefix="preempt-sync") as syncers:
        done = [syncers.submit(fsync_dir if is_dir else _sync_file, path) for path, is_dir in jobs]
    for future in done:
        future.result()


_SYNCERS = 8  # syncs issued at once by sync_together


def _sync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        _fdatasync(fd)
    finally:
        os.close(fd)


def write_file(
    path: str | os.PathLike[str], chunks: Iterable[Any], *, recycle: bool = False, sync: bool = True
) -> FileDigest:
    """Writes the chunks (bytes-like) to a new file, hashing them on the way, then fdatasyncs (unless not ``sync``:
    the caller makes it durable with others, :func:`sync_together`).

    Small chunks are gathered into one buffer so that a state of thousands of
    small tensors does not cost one system call each. A large chunk whose
    memory is aligned as the file is (a staged snapshot's arena) bypasses the
    page cache (:mod:`preempt.checkpoint.direct_io`).

    Args:
        path: The file; an existing one is an error (FileExistsError), unless ``recycle``.
        chunks: The content.
        recycle: ``path`` is in a checkpoint's temporary directory, which may be
            a recycled one: a plain file of ours already there is written over in
            place, anything else there is replaced (:mod:`preempt.checkpoint.recycle`).
    """
    digest = xxhash.xxh3_128()
    size = 0
    pending = bytearray()
    fd, recycled = _open_for_write(path) if recycle else (_create(path), False)
    try:
        sink = direct_io.Sink(fd)

        def put(view: memoryview) -> None:
            while view:
                check_cancelled()
                n = sink.write(view[:WRITE_CHUNK])
                view = view[n:]

        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            digest.update(view)
            size += view.nbytes
            if view.nbytes < _COALESCE:
                pending += view
                if len(pending) >= _COALESCE:
                    put(memoryview(pending))
                    pending.clear()
                continue
            if pending:
                put(memoryview(pending))
                pending.clear()
            put(view)
        if pending:
            put(memoryview(pending))
        if recycled:
            os.ftruncate(fd, size)  # what the old file held beyond the new content
        if sync:
            _fdatasync(fd)
    finally:
        os.close(fd)
    if sink.direct_bytes:
        logging.getLogger("preempt").debug("%s: %d of %d bytes bypassed the page cache", path, sink.direct_bytes, size)
        _testing.emit("direct_write", path=str(path), direct_bytes=sink.direct_bytes, size=size)
    return FileDigest(size, digest.hexdigest())


def _open_for_write(path: str | os.PathLike[str]) -> tuple[int, bool]:
    """A new file at ``path``, or a recycled one already there that is safe to write over (and True).

    Safe: a regular file, ours, with no other name (a hard link planted in a
    pool would make us write into the file it shares). Anything else there is
    removed and a new file created; a symlink is never followed.
    """
    try:
        return _create(path), False
    except FileExistsError:
        pass
    flags = os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
    try:  # O_NONBLOCK: opening a FIFO for writing must fail, not wait for a reader
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        fd = -1
    if fd >= 0:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid():
            os.set_blocking(fd, True)
            return fd, True
        os.close(fd)
    remove_tree(Path(path))
    return _create(path), False


def link_file(source: str | os.PathLike[str], path: str | os.PathLike[str], expected_size: int) -> None:
    """Step 2 for a carried file: ``path`` becomes another name of ``source`` (a hard link), no byte copied.

    Whatever a recycled directory holds at ``path`` is removed first (never written into: it may be another
    checkpoint's inode). ``source`` must be a regular file of ``expected_size`` bytes (a stat, no hashing: its
    digest was checked when it was written or loaded). The link is durable with the directory's fsync (step 4).

    Raises:
        OSError: The link cannot be made (EXDEV, EPERM, ENOTSUP, EMLINK, ENOENT: the source was pruned) or the
            source is not what it should be (ESTALE); the caller writes the file instead.
    """
    st = os.stat(source, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode) or st.st_size != expected_size:
        raise OSError(errno.ESTALE, f"not a regular file of {expected_size} bytes", str(source))
    remove_tree(Path(path))
    check_cancelled()
    os.link(source, path, follow_symlinks=False)


def _create(path: str | os.PathLike[str]) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)


def read_file(
    path: str | os.PathLike[str], expected_size: int | None = None, *, direct: bool = False
) -> tuple[np.ndarray, FileDigest]:
    """The whole file as a writable uint8 array, and its digest.

    Two ways:

    * A private copy-on-write mapping of the file. Hashing it reads the page cache (or the disk) directly, with no
      copy into fresh memory, much faster than ``readinto`` a new buffer once the file is cached
      (``bench/bench_verify.py``). Writes to the array never reach the file. The mapping pins the file's pages,
      and a file truncated by someone else while mapped would fault on access: callers that keep tensors beyond
      loading copy them (:func:`preempt.checkpoint.state.apply`).
    * With ``direct`` (a restore, whose tensors become the optimizer's state as they are), a file of
      at least :data:`direct_io.MIN_DIRECT` bytes that is not in the page cache is read ``O_DIRECT`` into memory of
      this process's own and hashed chunk by chunk as it lands (:func:`direct_io.read_whole`): the device writes
      the memory the bytes end in, nothing is copied, and no page cache grows: faster than mapping a cold file
      (``bench/README.md``, "A restart's restore"). A file in the page cache (read ahead by ``preempt prefetch``,
      or by another rank) is mapped: that was faster than reading it into new memory (``bench/README.md``,
      "Figures once kept in docstrings"), and so is a file larger than :data:`KEEP_FRACTION` of the memory available
      (:func:`keeps_in_memory`), whose pages can be dropped and read again under pressure.

    Where the mapping is refused (``ENOMEM`` under an address-space limit, a filesystem without mmap), the file is
    read into memory instead; a file larger than the memory left is then a :class:`MemoryError` (a resource error,
    :func:`safe_io.resource_error`, never damage). :func:`hash_file` checks such a file in constant memory.

    Args:
        path: The file (never followed if a symlink, never opened if a FIFO: :func:`safe_io.open_fd`).
        expected_size: When given, a file of another size is not read at all.
        direct: The caller keeps the bytes (a process alone restoring): a large file not in the page cache is read
            ``O_DIRECT``. False where other processes of this machine read the file next (the other ranks find it
            in the page cache), or where it is only checked.

    Raises:
        OSError: The file cannot be opened or read.
        MemoryError: Neither mapped nor read: larger than the memory left.
        ValueError: The size is not the expected one (the message says both).
    """
    import numpy as np

    with open(safe_io.open_fd(path), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if expected_size is not None and size != expected_size:
            raise ValueError(f"size {size} bytes, manifest says {expected_size}")
        if size == 0:
            empty = np.zeros(0, dtype=np.uint8)
            return empty, digest_of(empty)
        if direct and size >= direct_io.MIN_DIRECT and not direct_io.cached(f.fileno(), size):
            if keeps_in_memory(size, readahead.host_memory_available()):
                try:
                    return _read_direct(f.fileno(), size)
                except direct_io.DirectRefused:
                    pass
            if hasattr(os, "posix_fadvise"):  # mapped: asked of the disk whole, at once
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
        try:
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        except OSError:  # a mapping refused (ENOMEM, EINVAL, ENODEV, ...): read it instead
            return _read_into_memory(f, size, path)
    if hasattr(mapped, "madvise"):
        mapped.madvise(mmap.MADV_SEQUENTIAL)
    buf = np.frombuffer(mapped, dtype=np.uint8)
    return buf, digest_of(buf)


def keeps_in_memory(size: int, available: int | None) -> bool:
    """Whether a file of ``size`` bytes kept by a restore is read into memory (True) or mapped: into memory unless
    it takes more than :data:`KEEP_FRACTION` of the memory ``available`` (None: unknown, read into memory)."""
    return available is None or size <= available * KEEP_FRACTION


def is_mapping(buf: np.ndarray) -> bool:
    """Whether ``buf`` (from :func:`read_file`) views a mapping of its file rather than memory of its own."""
    import numpy as np

    base: Any = buf
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return isinstance(base, mmap.mmap) and not isinstance(base, _Memory)


def _fresh(size: int, *, populate: bool = True) -> np.ndarray:
    """``size`` bytes of memory of this process's own, page-aligned; with ``populate``, its pages faulted in at once
    where the system can (for ``read`` to copy into; a direct read's device writes every page itself).

    Not ``np.empty``: NumPy asks for transparent huge pages, and where the kernel compacts memory to find them
    (``defrag`` set to ``madvise``, its default), a read into such memory in a process that had just built a large
    model spent seconds in the kernel (``bench/README.md``, "Figures once kept in docstrings").
    """
    import numpy as np

    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0) | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    try:
        return np.frombuffer(_Memory(-1, size, flags=flags), dtype=np.uint8)
    except OSError as e:  # ENOMEM: as np.empty would
        raise MemoryError(f"{size} bytes: {e.strerror}") from None


class _Memory(mmap.mmap):
    """Anonymous memory: told apart from a mapping of a file by :func:`is_mapping`."""


def _read_direct(fd: int, size: int) -> tuple[np.ndarray, FileDigest]:
    """``read_file`` of a file not in the page cache: read ``O_DIRECT`` into new memory, hashed chunk by chunk."""
    whole = -(-size // direct_io.BLOCK) * direct_io.BLOCK
    buf = _fresh(whole, populate=False)  # the device writes every page: nothing to fault in beforehand
    digest = xxhash.xxh3_128()
    for chunk in direct_io.read_whole(fd, buf.data, size):
        digest.update(chunk)
    return buf[:size], FileDigest(size, digest.hexdigest())


def _read_into_memory(f: Any, size: int, path: str | os.PathLike[str]) -> tuple[np.ndarray, FileDigest]:
    """``read_file`` without a mapping: the file read into a new array, each chunk hashed as it lands."""
    buf = _fresh(size)
    view = buf.data
    digest = xxhash.xxh3_128()
    done = 0
    while done < size:
        n = f.readinto(view[done : done + LOAD_CHUNK])
        if not n:
            raise OSError(errno.EIO, f"the file ended at {done} of {size} bytes while being read", os.fspath(path))
        digest.update(view[done : done + n])  # xxhash lets go of the GIL: other files are read meanwhile
        done += n
    return buf, FileDigest(size, digest.hexdigest())


def hash_file(path: str | os.PathLike[str]) -> FileDigest:
    """Size and digest of a file, streamed (constant memory). The caller checks first that it is a regular file."""
    digest = xxhash.xxh3_128()
    size = 0
    buf = bytearray(WRITE_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            size += n
    return FileDigest(size, digest.hexdigest())


def update(digest: Any, view: memoryview, chunk: int = LOAD_CHUNK) -> None:
    """Hashes the bytes of ``view`` into ``digest`` (an ``xxhash.xxh3_128``), ``chunk`` bytes at a time: each chunk
    while it is in the CPU's cache, the GIL let go of by xxhash for each."""
    for at in range(0, view.nbytes, chunk):
        digest.update(view[at : at + chunk])


def digest_of(buf: np.ndarray | memoryview) -> FileDigest:
    """Size and digest of the bytes of ``buf`` (a file read into memory), hashed chunk by chunk (:func:`update`)."""
    view = (buf if isinstance(buf, memoryview) else buf.data).cast("B") if buf.nbytes else memoryview(b"")
    digest = xxhash.xxh3_128()
    update(digest, view)
    return FileDigest(view.nbytes, digest.hexdigest())


def digests_of(bufs: Sequence[np.ndarray | memoryview], threads: int = 2) -> list[FileDigest]:
    """:func:`digest_of` each of ``bufs``, in their order, up to ``threads`` hashed at once (xxhash lets go of the
    GIL)."""
    if len(bufs) <= 1 or threads <= 1:
        return [digest_of(b) for b in bufs]
    with ThreadPoolExecutor(min(threads, len(bufs)), thread_name_prefix="preempt-hash") as hashers:
        return list(hashers.map(digest_of, bufs))


def dumps_json(obj: Any) -> bytes:
    """Canonical JSON: sorted keys, no spaces, NaN and infinities allowed."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
