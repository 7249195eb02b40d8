"""One checkpoint file read and checked against its manifest entry: regular files only, the size, the xxh3 digest,
the format.

Damage is content that does not match its digest or its format (or a file missing, or not a regular file). A read
that fails for a reason of the environment (:func:`safe_io.resource_error`: permission denied, out of memory, too
many open files, an I/O error) is not damage: it is a :class:`~preempt.errors.CheckpointUnreadableError`, or the
status ``"unreadable"``, never a reason to move a checkpoint aside. A file whose mapping is refused is hashed
streamed (:func:`preempt.checkpoint.hashed_io.hash_file`), so that a file larger than memory still verifies.

Nothing is followed or opened before ``lstat`` says it is a regular file (a symlink could point out of the
checkpoint; opening a FIFO blocks forever). Used by :mod:`preempt.checkpoint.manager` (load, verify, list) and the
checkpoint commands.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import errno
import logging
import os
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import _testing
from ..errors import CheckpointUnreadableError, CorruptCheckpointError
from . import commit, deleter, hashed_io, readahead, safe_io
from .hashed_io import FileDigest
from .manifest import MAX_MANIFEST_BYTES, Manifest
from .names import MANIFEST

if TYPE_CHECKING:
    import torch

READERS = 4  # files of one checkpoint read at once by a restore


# Where a restore's files may come from before they are read from the disk (reading_from): given the checkpoint
# directory, its manifest's entries and the names of the files to keep, those it has: each one's bytes and the size
# and digest computed over them in this process ({} for none). It raises as read_all.
Source = Callable[[Path, Mapping[str, FileDigest], Sequence[str]], Mapping[str, tuple[Any, FileDigest]]]


_SOURCE: contextvars.ContextVar[Source | None] = contextvars.ContextVar("preempt_read_source", default=None)


@contextlib.contextmanager
def reading_from(source: Source) -> Iterator[None]:
    """Within it, :func:`read_all` takes the files it keeps from ``source`` first, and reads the others.

    The ranks of a run restore together this way (:mod:`preempt.cluster.shared_read`: each reads a share, they
    exchange the rest) under the manager's choice and fallback, which stay as for a process alone. Every file from
    ``source`` is still checked against its manifest entry: its size and digest, computed over its bytes in this
    process.
    """
    token = _SOURCE.set(source)
    try:
        yield
    finally:
        _SOURCE.reset(token)


def read_manifest(path: Path) -> Manifest:
    """Reads and validates one manifest.

    Raises:
        FileNotFoundError: There is none.
        CorruptCheckpointError: It does not parse or fails its checksum, or is not a regular file.
        CheckpointUnreadableError: It cannot be read for a reason of the environment (permission, memory, I/O).
    """
    _testing.reach("load", path)
    try:
        regular_file(path)
        data = safe_io.read_bytes(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise
    except safe_io.UnsafeFileError as e:
        raise CorruptCheckpointError(str(e)) from None
    except (OSError, MemoryError) as e:
        raise read_error(path, e) from None
    try:
        return Manifest.from_json(data, str(path))
    except ValueError as e:
        raise CorruptCheckpointError(str(e)) from None


def read_verified(path: Path, expected: FileDigest, *, direct: bool = False) -> Any:
    """The bytes of a checkpoint file, after checking size and digest: mapped, or, with ``direct``, read past the
    page cache into memory of this process's own when large and cold (:func:`hashed_io.read_file`).

    Raises:
        CorruptCheckpointError: Missing, not a regular file, another size or digest.
        CheckpointUnreadableError: It cannot be read for a reason of the environment (permission, memory, I/O).
    """
    try:
        regular_file(path)
        buf, got = hashed_io.read_file(path, expected.size, direct=direct)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: missing") from None
    except ValueError as e:
        raise CorruptCheckpointError(f"{path}: {e}") from None
    except (OSError, MemoryError) as e:
        raise read_error(path, e) from None
    compare(path, expected, got)
    return buf


def read_all(
    where: Path,
    files: Mapping[str, FileDigest],
    kept: Sequence[str],
    checked: Sequence[str] = (),
    *,
    direct: bool = True,
) -> dict[str, Any]:
    """Reads and verifies files of the checkpoint directory ``where``, several side by side; the bytes of ``kept``.

    The bytes of the files of ``kept`` are returned by name: a large one not in the page cache read ``O_DIRECT``
    into memory of this process's own (with ``direct``), any other mapped
    (:func:`preempt.checkpoint.hashed_io.read_file`). Those of ``checked`` are mapped, and dropped once verified. What
    is mapped is asked of the disk before the first file is read (:func:`preempt.checkpoint.readahead.warm`). Up to
    :data:`READERS` files are read at once, the largest first: the reads and the hashing let go of the GIL, so the
    disk reads one file while another is hashed, and a disk that serves several reads at once gets them.

    Raises:
        CorruptCheckpointError: A file is missing from the manifest or from the disk, or has another size or
            digest. When several fail, the error is the first one's in the order of ``checked``, then ``kept``,
            whatever order the reads end in.
        CheckpointUnreadableError: As :func:`read_verified`.
    """
    order = [(name, False) for name in checked] + [(name, True) for name in kept]
    for name, _ in order:
        if name not in files:
            raise CorruptCheckpointError(f"{where / MANIFEST}: lists no {name}")
    source = _SOURCE.get()
    given = {} if source is None else dict(source(where, files, list(kept)))
    taken = {}
    for name, (buf, got) in given.items():
        compare(where / name, files[name], got)
        taken[name] = buf
    order = [(name, keep) for name, keep in order if name not in taken]
    if not order:
        return taken
    readahead.warm(where / name for name, keep in order if not (keep and direct))  # those read direct: not cached

    def one(item: tuple[str, bool]) -> Any:
        name, keep = item
        return read_verified(where / name, files[name], direct=keep and direct)

    if len(order) == 1:
        buf = one(order[0])
        return {**taken, order[0][0]: buf} if order[0][1] else taken
    largest = sorted(order, key=lambda item: -files[item[0]].size)
    with ThreadPoolExecutor(min(READERS, len(order)), thread_name_prefix="preempt-read") as readers:
        futures = {item: readers.submit(one, item) for item in largest}
        try:
            bufs = {item: futures[item].result() for item in order}
        except BaseException:
            for future in futures.values():
                future.cancel()
            raise
    return {**taken, **{name: buf for (name, keep), buf in bufs.items() if keep}}


def read_error(path: Path, error: OSError | MemoryError) -> CorruptCheckpointError | CheckpointUnreadableError:
    """The error for a file that could not be read: a resource error, or damage (:func:`safe_io.resource_error`)."""
    if safe_io.resource_error(error):
        return CheckpointUnreadableError(unreadable(path, error))
    return CorruptCheckpointError(f"{path}: cannot be read ({_reason(error)})")


def unreadable(path: Path, error: BaseException) -> str:
    """``<path>: cannot be read (<cause>): not damage ...``: the message of a resource error, naming what to do."""
    return (
        f"{path}: cannot be read ({_reason(error)}); this is not damage: nothing is moved aside or deleted."
        " Fix the cause (permissions, memory, open files, the disk) and run again"
    )


def _reason(error: BaseException) -> str:
    if isinstance(error, MemoryError):
        return "out of memory: larger than the memory left to this process"
    if isinstance(error, OSError) and error.strerror:
        name = errno.errorcode.get(error.errno or 0)
        return f"{error.strerror}, {name}" if name else error.strerror
    return str(error) or type(error).__name__


def compare(path: Path, expected: FileDigest, got: FileDigest) -> None:
    """Raises CorruptCheckpointError naming ``path`` and both sizes or both full digests."""
    if got.size != expected.size:
        raise CorruptCheckpointError(f"{path}: size {got.size} bytes, manifest says {expected.size}")
    if got.xxh3_128 != expected.xxh3_128:
        raise CorruptCheckpointError(
            f"{path}: xxh3 mismatch (manifest {expected.xxh3_128}, file {got.xxh3_128}; {got.size} bytes)"
        )


def check_tensors(buf: Any, path: Path) -> None:
    """Raises CorruptCheckpointError unless ``buf`` is a well-formed safetensors file (torch is not needed).

    ``buf`` is the file in memory, or its path: then only its header is read (the same checks, constant memory).

    Raises:
        CorruptCheckpointError: Malformed.
        OSError: ``buf`` is a path that cannot be read.
    """
    from . import tensorfile

    try:
        if isinstance(buf, Path):
            tensorfile.read_header(buf)
        else:
            tensorfile.validate(buf, str(path))
    except ValueError as e:
        raise CorruptCheckpointError(str(e)) from None


def parse_tensors(buf: Any, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        from . import tensorfile  # torch, only when tensors are parsed

        return tensorfile.parse(buf, str(path))
    except ValueError as e:
        raise CorruptCheckpointError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class FileCheck:
    """What verification found for one file of a checkpoint.

    ``status`` is ``"ok"``, ``"missing"``, ``"not_regular"`` (a symlink, FIFO or
    directory), ``"size"``, ``"digest"``, ``"format"`` (the digest matches but
    the content does not parse) or ``"unreadable"``; ``found`` holds the size
    (and digest, when hashed) of what is there; ``message`` is None when ok.
    """

    name: str
    path: Path
    expected: FileDigest
    status: str
    found: FileDigest | None = None
    message: str | None = None


def _absent(path: Path, expected: FileDigest) -> tuple[str, str, int | None] | None:
    """The cheap half of a file's check: (status, message, size found) unless it is a regular file of its size."""
    try:
        regular_file(path)
        size = os.lstat(path).st_size
    except FileNotFoundError:
        return "missing", f"{path}: missing (manifest says {expected.size} bytes, xxh3 {expected.xxh3_128})", None
    except CorruptCheckpointError as e:
        return "not_regular", str(e), None
    except OSError as e:
        return _status(path, e), _message(path, e), None
    if size != expected.size:  # a truncated or grown file: no need to hash it
        return "size", f"{path}: size {size} bytes, manifest says {expected.size}", size
    return None


def _status(path: Path, error: BaseException) -> str:
    return "unreadable" if safe_io.resource_error(error) else "not_regular"


def _message(path: Path, error: BaseException) -> str:
    return unreadable(path, error) if safe_io.resource_error(error) else f"{path}: cannot be read ({_reason(error)})"


def present(path: Path, expected: FileDigest) -> str | None:
    """None when ``path`` is a regular file of the listed size, else what is wrong (no hashing: a stat).

    Raises:
        CheckpointUnreadableError: It cannot even be stat'ed for a reason of the environment (a directory that
            may not be searched).
    """
    absent = _absent(path, expected)
    if absent is not None and absent[0] == "unreadable":
        raise CheckpointUnreadableError(absent[1])
    return None if absent is None else absent[1]


def check_file(path: Path, expected: FileDigest) -> FileCheck:
    """Hashes and parses one file: its status, ``"unreadable"`` (a resource error) apart from the kinds of damage.

    A file whose mapping is refused (larger than the address space left) is hashed streamed and its format
    checked from its header (:func:`preempt.checkpoint.tensorfile.read_header`), in constant memory.
    """

    def bad(status: str, message: str, found: FileDigest | None = None) -> FileCheck:
        return FileCheck(path.name, path, expected, status, found, message)

    absent = _absent(path, expected)
    if absent is not None:
        status, message, size = absent
        return bad(status, message, None if size is None else FileDigest(size, ""))
    buf = None
    try:
        try:
            buf, got = hashed_io.read_file(path)
        except MemoryError:  # neither mapped nor read whole: stream it
            got = hashed_io.hash_file(path)
    except (OSError, MemoryError) as e:
        return bad(_status(path, e), _message(path, e))
    try:
        compare(path, expected, got)
    except CorruptCheckpointError as e:
        return bad("digest", str(e), got)
    try:
        if path.suffix == ".safetensors":
            check_tensors(path if buf is None else buf, path)  # the header and every extent, no torch
        elif path.suffix == ".json" and path.name != MANIFEST:  # the manifest was parsed to get here
            try:
                from . import codec

                codec.loads(safe_io.read_bytes(path, got.size) if buf is None else buf, str(path))
            except ValueError as e:
                raise CorruptCheckpointError(str(e)) from None
    except CorruptCheckpointError as e:
        return bad("format", str(e), got)
    except (OSError, MemoryError) as e:
        return bad(_status(path, e), _message(path, e), got)
    return FileCheck(path.name, path, expected, "ok", got)


def regular_file(path: Path) -> None:
    """Raises CorruptCheckpointError unless ``path`` is a regular file; never follows a link or opens anything.

    A symlink could point out of the checkpoint; opening a FIFO blocks forever;
    a directory or a device is not a checkpoint file either.

    Raises:
        FileNotFoundError: Nothing is there.
    """
    st = os.lstat(path)
    if stat.S_ISREG(st.st_mode):
        return
    kinds = ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"))
    kind = next((name for test, name in kinds if test(st.st_mode)), "not a regular file")
    raise CorruptCheckpointError(f"{path}: is {kind}; checkpoint files must be regular files")


def discard_tmp(tmp: Path) -> None:
    """Removes a partial checkpoint's temporary directory; what cannot be removed now goes at the next start."""
    commit.stage("discard")  # not a stage of the protocol: where tests kill a failed or cancelled write's cleanup
    try:
        deleter.remove_tree(tmp)
    except OSError as e:
        logging.getLogger("preempt").warning(
            "could not remove the partial checkpoint %s: %s (removed at the next start)", tmp, e
        )
