"""The atomic commit of a checkpoint directory, and hashed file I/O.

Every checkpoint directory is made here, by the protocol below; the other files of a
``save_dir`` (the lock, the completion marker, quarantined and recycled checkpoints)
are written by their own modules with the same primitives. It knows nothing of torch
or of signals: it moves bytes, digests and directory entries.

Layout of ``save_dir``::

    step_000000120/               a committed checkpoint; manifest.json inside
    .tmp-step_000000120-<tag>/    a checkpoint being written
    .replaced-step_000000120-<tag>/  the previous checkpoint of the same step,
                                  while a newer save of that step replaces it
    .trash-<tag>/                 a pruned checkpoint being deleted
    .recycle-<tag>/               the files of a pruned checkpoint, kept for the next save
                                  to write over in place (see "Recycling" below)
    quarantine/                   corrupt or incomplete checkpoints, moved aside
    quarantined-step_000000120-<tag>/  the same, set aside in place where quarantine/ cannot be used
    superseded/                   checkpoints of an abandoned timeline, moved aside
    complete.json                 the run finished

The commit protocol, in this exact order (:func:`write_checkpoint`):

1. ``mkdir save_dir/.tmp-step_N-<tag>``, or rename a ``.recycle-`` directory to that name
   (:mod:`preempt.checkpoint.recycle`).
2. Each data file: write, hash with xxh3-128 while writing
   (a recycled file of the same name is written over, then truncated to its new size);
   or, for a file carried unchanged from the previous checkpoint (:mod:`preempt.checkpoint.carry`),
   ``link`` the previous checkpoint's durable file under the new name (:func:`link_file`): its
   bytes are durable already, the new entry becomes durable with step 4. A recycled file with
   another name (``st_nlink > 1``: a carried file of a kept checkpoint) is never written into.
3. ``manifest.json`` (sizes and digests of every data file, and a checksum of
   itself): write. The manifest is always the last file written.
4. ``fdatasync`` every file written in steps 2-3 and ``fsync`` the temporary directory, all at
   once (:func:`sync_together`): the device gets one flush for them rather than one each in a row.
   Nothing is renamed before every one of them has returned. (Files that other ranks wrote into
   the directory are made durable by them before the commit.)
5. If ``step_N`` already exists (a later save at the same global step, e.g. the
   final save right after a periodic one), rename it to
   ``.replaced-step_N-<tag>``.
6. Rename the temporary directory to ``step_N``.
7. ``fsync(save_dir)``. From here on the checkpoint is durable; only now may
   anything older be deleted (pruning runs after this, off the loop's path).

What a reader concludes from each leftover (:func:`recover`, run at start):

* ``.tmp-*``: a write that never reached step 6; its content is not trusted.
  Deleted.
* ``.replaced-step_N-*`` and ``step_N`` present: the replacement committed.
  The old copy is deleted.
* ``.replaced-step_N-*`` and ``step_N`` absent: the process died between
  steps 5 and 6. The old copy is renamed back to ``step_N``: it was valid.
* ``.trash-*``: pruning was interrupted. Deleted.
* ``.recycle-*``: files kept for the next save (:mod:`preempt.checkpoint.recycle`); never
  read; tidied by the manager.
* ``step_N`` without ``manifest.json``, or whose files do not match the
  manifest: not made by a completed commit (or damaged since). The manager
  moves it to ``quarantine/`` when it meets it (never deletes it), so that a
  later save of the same step does not collide with it.

Rename within one filesystem is atomic on POSIX; a crash leaves either the old
name or the new one, never a mix.

Recycling (``.recycle-*``, step 1 with a recycled directory, writing over a
file in place) is :mod:`preempt.checkpoint.recycle`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import mmap
import os
import queue
import re
import secrets
import shutil
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from .. import _testing
from . import direct_io, readahead, safe_io

MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"  # the model's state_dict (without BASE_FILE's tensors)
BASE_FILE = "base.safetensors"  # the model's frozen parameters that no optimizer holds (likely unchanged: carried)
SHARD_BASE = "base_{rank:05d}.safetensors"  # sharded state: rank r's pieces of that base (preempt.cluster.sharded)
SHARD_PIECES = "pieces_{rank:05d}.safetensors"  # sharded state: rank r's pieces of the model's and optimizer's rest
STATE_FILE = "state.safetensors"  # every other tensor
STATE_JSON = "state.json"  # everything else (no pickle)
COMPLETE = "complete.json"
QUARANTINE = "quarantine"
QUARANTINED = "quarantined-"  # a broken checkpoint set aside in place, where quarantine/ cannot be used
SUPERSEDED = "superseded"
TMP_PREFIX = ".tmp-"  # step 1's hidden directories
_REPLACED = ".replaced-"
_TRASH = ".trash-"
_STEP_RE = re.compile(r"step_([0-9]+)", re.ASCII)  # used with fullmatch

WRITE_CHUNK = 64 << 20  # bytes per write(2) call; also bounds a partial write
LOAD_CHUNK = 8 << 20  # bytes per read(2) of a file a restore keeps: hashed while still in the CPU's cache
KEEP_SHARE = 0.5  # a file a restore keeps is read into memory when it takes at most this share of what is available
_COALESCE = 4 << 20  # small pieces are gathered up to this size before writing


# The boundaries of the commit protocol, in order, where a fault can be injected.
STAGES = (
    "after_tensor_files",  # step 2: the tensor files are durable, the JSON files not written yet
    "before_manifest",  # step 2 done: every data file durable, no manifest yet
    "before_tmp_fsync",  # step 3 done: the manifest is written, the temporary directory not fsynced
    "before_rename",  # step 4 done: ready to rename
    "after_replace",  # step 5: an older step_N was moved aside, the new one not renamed yet
    "before_dir_fsync",  # step 6 done: renamed, save_dir not fsynced
    "committed",  # step 7 done: durable; nothing older deleted yet
)


def is_shard_file(name: str) -> bool:
    """``name`` is one of some rank's files of pieces (:data:`SHARD_BASE`, :data:`SHARD_PIECES`)."""
    return re.fullmatch(r"(base|pieces)_\d{5,}\.safetensors", name) is not None


def stage(name: str) -> None:
    """Marks a protocol boundary (see :data:`STAGES`), a fault point of :mod:`preempt._testing`.

    Before the rename, a write running under :func:`cancellable` whose event is set stops here.
    """
    if name in _CANCEL_POINTS:
        check_cancelled()
    _testing.reach("commit", name, _cancel_event())


class WriteCancelled(Exception):
    """A write under :func:`cancellable` was cancelled before its rename; its directory is recycled or removed."""


_CANCEL_POINTS = frozenset({"after_tensor_files", "before_manifest", "before_tmp_fsync", "before_rename"})
_cancel = threading.local()


@contextlib.contextmanager
def cancellable(event: threading.Event) -> Iterator[None]:
    """Within the block, this thread's writes stop with :class:`WriteCancelled` once ``event`` is set.

    They look at every 64 MiB written and at each stage before the rename; after the rename the checkpoint
    is committed and the write completes.
    """
    _cancel.event = event
    try:
        yield
    finally:
        _cancel.event = None


def _cancel_event() -> threading.Event | None:
    """The event that cancels this thread's write (None outside :func:`cancellable`)."""
    return getattr(_cancel, "event", None)


def check_cancelled() -> None:
    event = _cancel_event()
    if event is not None and event.is_set():
        raise WriteCancelled("the write was cancelled")


MAX_STEP = 10**15 - 1  # the largest step a checkpoint holds: 15 digits; the writer, the names and manifests agree


def checkpoint_name(step: int) -> str:
    """``120`` -> ``"step_000000120"`` (sorts by step up to 10**9 steps).

    Raises:
        ValueError: ``step`` is negative or beyond :data:`MAX_STEP` (no reader would accept that checkpoint).
    """
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step {step}: a checkpoint's step is in [0, {MAX_STEP}]")
    return f"step_{step:09d}"


def parse_checkpoint_name(name: str) -> int | None:
    """The step of a checkpoint directory name, or None for other names: only the one name each step has
    (``step_4``, ``step_0000000004`` or a step beyond :data:`MAX_STEP` are not checkpoints, so that no two
    directories stand for one step)."""
    m = _STEP_RE.fullmatch(name)
    if m is None or len(m.group(1)) > 15:
        return None
    step = int(m.group(1))
    return step if checkpoint_name(step) == name else None


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
    with ThreadPoolExecutor(min(len(jobs), _SYNCERS), thread_name_prefix="preempt-sync") as pool:
        done = [pool.submit(fsync_dir if is_dir else _sync_file, path) for path, is_dir in jobs]
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
    path: str | os.PathLike[str], pieces: Iterable[Any], *, recycle: bool = False, sync: bool = True
) -> FileDigest:
    """Writes the pieces (bytes-like) to a new file, hashing them on the way, then fdatasyncs (unless not ``sync``:
    the caller makes it durable with others, :func:`sync_together`).

    Small pieces are gathered into one buffer so that a state of thousands of
    small tensors does not cost one system call each. A large piece whose
    memory is aligned as the file is (a staged snapshot's arena) bypasses the
    page cache (:mod:`preempt.checkpoint.direct_io`).

    Args:
        path: The file; an existing one is an error (FileExistsError), unless ``recycle``.
        pieces: The content.
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

        for piece in pieces:
            view = memoryview(piece).cast("B")
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
      this process's own and hashed piece by piece as it lands (:func:`direct_io.read_whole`): the device writes
      the memory the bytes end in, nothing is copied, and no page cache grows. On the VM of ``bench/README.md`` a
      cold restore of 1 GiB took 1.32 s so, 1.61 s mapped (one run). A file in the page cache (read ahead by
      ``preempt prefetch``, or by another rank) is mapped: that was faster there (0.40 s against 0.76 s read into
      new memory), and so is a file larger than :data:`KEEP_SHARE` of the memory available
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
    with open(safe_io.open_fd(path), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if expected_size is not None and size != expected_size:
            raise ValueError(f"size {size} bytes, manifest says {expected_size}")
        if size == 0:
            return np.zeros(0, dtype=np.uint8), FileDigest(0, xxhash.xxh3_128_hexdigest(b""))
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
    return buf, FileDigest(size, xxhash.xxh3_128_hexdigest(buf.data))


def keeps_in_memory(size: int, available: int | None) -> bool:
    """Whether a file of ``size`` bytes kept by a restore is read into memory (True) or mapped: into memory unless
    it takes more than :data:`KEEP_SHARE` of the memory ``available`` (None: unknown, read into memory)."""
    return available is None or size <= available * KEEP_SHARE


def is_mapping(buf: np.ndarray) -> bool:
    """Whether ``buf`` (from :func:`read_file`) views a mapping of its file rather than memory of its own."""
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
    (``defrag`` set to ``madvise``, its default), reading 700 MB into such memory in a process that had just built a
    1 GiB model took 4-7 s on the VM of ``bench/README.md`` (3.7-4.8 s of it in the kernel), against 0.5-2.3 s
    without huge pages (measured while this was written, 2-6 runs each).
    """
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0) | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    try:
        return np.frombuffer(_Memory(-1, size, flags=flags), dtype=np.uint8)
    except OSError as e:  # ENOMEM: as np.empty would
        raise MemoryError(f"{size} bytes: {e.strerror}") from None


class _Memory(mmap.mmap):
    """Anonymous memory: told apart from a mapping of a file by :func:`is_mapping`."""


def _read_direct(fd: int, size: int) -> tuple[np.ndarray, FileDigest]:
    """``read_file`` of a file not in the page cache: read ``O_DIRECT`` into new memory, hashed piece by piece."""
    whole = -(-size // direct_io.BLOCK) * direct_io.BLOCK
    buf = _fresh(whole, populate=False)  # the device writes every page: nothing to fault in beforehand
    digest = xxhash.xxh3_128()
    for piece in direct_io.read_whole(fd, buf.data, size):
        digest.update(piece)
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


def dumps_json(obj: Any) -> bytes:
    """Canonical JSON: sorted keys, no spaces, NaN and infinities allowed."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def tag() -> str:
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:40]
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"


def tmp_dir_path(save_dir: Path, name: str) -> Path:
    """The name of step 1's hidden directory for checkpoint ``name`` (unique to this process and call)."""
    return save_dir / f"{TMP_PREFIX}{name}-{tag()}"


def new_tmp_dir(save_dir: Path, name: str) -> Path:
    """Step 1 of the protocol: a fresh hidden directory inside ``save_dir``."""
    tmp = tmp_dir_path(save_dir, name)
    tmp.mkdir()
    return tmp


def commit_dir(
    save_dir: Path, tmp: Path, name: str, unsynced: Iterable[str | os.PathLike[str]] = ()
) -> tuple[Path, Path | None]:
    """Steps 4-7: makes ``tmp`` the durable checkpoint ``name``.

    ``unsynced``: files of ``tmp`` written but not yet durable (the manifest, and the data files of a checkpoint
    written by this process): they are synced together with ``tmp``'s entries (:func:`sync_together`), before
    the rename.

    Returns:
        The final path, and the path of the replaced checkpoint of the same
        name (to be deleted by the caller, off the critical path) or None.
    """
    stage("before_tmp_fsync")
    sync_together(unsynced, [tmp])
    stage("before_rename")
    final = save_dir / name
    replaced = None
    if final.exists():
        replaced = save_dir / f"{_REPLACED}{name}-{tag()}"
        os.rename(final, replaced)
    try:
        if replaced is not None:
            stage("after_replace")
        os.rename(tmp, final)
    except BaseException:
        if replaced is not None:  # put the valid older copy back rather than leave the name empty
            os.rename(replaced, final)
        raise
    stage("before_dir_fsync")
    fsync_dir(save_dir)
    stage("committed")
    return final, replaced


def write_atomic(path: Path, pieces: Iterable[Any], *, replace: bool = True) -> FileDigest:
    """Writes a file atomically: a temporary file beside it, fdatasync, rename, fsync(dir).

    Args:
        path: The file.
        pieces: Its content (bytes-like pieces, as for :func:`write_file`).
        replace: False never replaces an existing file, not even one created
            meanwhile: the last step is ``link``, which fails when ``path`` exists.

    Raises:
        FileExistsError: ``replace`` is False and ``path`` exists.
    """
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{tag()}")
    try:
        digest = write_file(tmp, pieces)
        if replace:
            os.rename(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:  # a filesystem without hard links: check, then rename
                if path.exists():
                    raise FileExistsError(errno.EEXIST, "exists", str(path)) from None
                os.rename(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)  # gone after a rename; after a link, the second name
    return digest


def trash(save_dir: Path, path: Path) -> Path:
    """Renames a directory to a ``.trash-`` name (invisible to discovery) for later deletion."""
    target = save_dir / f"{_TRASH}{path.name}-{tag()}"
    os.rename(path, target)
    return target


def remove_tree(path: Path) -> None:
    """Deletes a directory tree; a file or an already-missing path is fine too."""
    if path.is_dir() and not path.is_symlink():

        def gone_already(func: Any, p: str, exc: Any) -> None:
            # Another process may be cleaning the same leftover (a run that starts while its
            # predecessor's deleter is still busy): what is gone is gone.
            err = exc if isinstance(exc, BaseException) else exc[1]
            if not isinstance(err, FileNotFoundError):
                raise err

        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=gone_already)
        else:
            shutil.rmtree(path, onerror=gone_already)
    else:
        path.unlink(missing_ok=True)


@dataclasses.dataclass
class Recovery:
    """What :func:`recover` found: restored names and paths left to delete."""

    restored: list[str] = dataclasses.field(default_factory=list)
    to_delete: list[Path] = dataclasses.field(default_factory=list)


def recover(save_dir: Path) -> Recovery:
    """Interprets the leftovers of interrupted writes (see the module docstring).

    Renames happen here; the deletions are returned so that the caller can do
    them in the background (deleting a large tree is slow).
    """
    out = Recovery()
    if not save_dir.is_dir():
        return out
    entries = sorted(os.listdir(save_dir))

    def renamed_at(entry: str) -> int:
        return os.stat(save_dir / entry, follow_symlinks=False).st_ctime_ns

    # Newest replaced copy first: if a replacement is interrupted twice, the later copy is the one to restore.
    for entry in sorted((e for e in entries if e.startswith(_REPLACED)), key=renamed_at, reverse=True):
        name = entry[len(_REPLACED) :].split("-", 1)[0]
        if parse_checkpoint_name(name) is not None and not (save_dir / name).exists():
            os.rename(save_dir / entry, save_dir / name)
            out.restored.append(name)
        else:
            out.to_delete.append(save_dir / entry)
    if out.restored:
        fsync_dir(save_dir)
    for entry in entries:
        if entry.startswith((TMP_PREFIX, _TRASH)):
            out.to_delete.append(save_dir / entry)
    return out


class Deleter:
    """A named daemon thread that deletes directory trees handed to it.

    Failures are logged and kept in :attr:`errors` (a failed deletion costs
    disk space, never data, so it does not stop training).
    """

    def __init__(self) -> None:
        self._queue: queue.Queue[Path | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    def submit(self, paths: Iterable[Path]) -> None:
        for p in paths:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="preempt-deleter", daemon=True)
                self._thread.start()
            self._queue.put(p)

    def _run(self) -> None:
        while (path := self._queue.get()) is not None:
            try:
                remove_tree(path)
            except OSError as e:
                self.errors.append(f"{path}: {e}")
                logging.getLogger("preempt").warning("could not delete %s: %s", path, e)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def close(self, timeout: float | None = None) -> bool:
        """Lets the thread finish what it was given, then end; False if it is still busy after ``timeout``.

        A thread still deleting when the process exits dies with it (it is a
        daemon); the leftover ``.trash-`` directories are deleted at the next start.
        """
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        self._queue.put(None)
        thread.join(timeout)
        return not thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until every submitted path is gone; False on timeout."""
        if self._thread is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True
