"""One checkpoint file read and checked against its manifest entry: regular files only, the size, the xxh3 digest,
the format.

Nothing is followed or opened before ``lstat`` says it is a regular file (a symlink could point out of the
checkpoint; opening a FIFO blocks forever). Used by :mod:`preempt.checkpoint.manager` (load, verify, list) and the
checkpoint commands.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CorruptCheckpointError
from . import commit, safe_io
from .commit import MANIFEST, FileDigest
from .manifest import MAX_MANIFEST_BYTES, Manifest

if TYPE_CHECKING:
    import torch


def read_manifest(path: Path) -> Manifest:
    """Reads and validates one manifest.

    Raises:
        FileNotFoundError: There is none.
        CorruptCheckpointError: It does not parse or fails its checksum.
    """
    regular_file(path)
    try:
        data = safe_io.read_bytes(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise
    except safe_io.UnsafeFileError as e:
        raise CorruptCheckpointError(str(e)) from None
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        return Manifest.from_json(data, str(path))
    except ValueError as e:
        raise CorruptCheckpointError(str(e)) from None


def read_verified(path: Path, expected: FileDigest) -> Any:
    """The bytes of a checkpoint file, after checking size and digest."""
    try:
        regular_file(path)
        buf, got = commit.read_file(path, expected.size)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: missing") from None
    except ValueError as e:
        raise CorruptCheckpointError(f"{path}: {e}") from None
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    _compare(path, expected, got)
    return buf


def _compare(path: Path, expected: FileDigest, got: FileDigest) -> None:
    """Raises CorruptCheckpointError naming ``path`` and both sizes or both full digests."""
    if got.size != expected.size:
        raise CorruptCheckpointError(f"{path}: size {got.size} bytes, manifest says {expected.size}")
    if got.xxh3_128 != expected.xxh3_128:
        raise CorruptCheckpointError(
            f"{path}: xxh3 mismatch (manifest {expected.xxh3_128}, file {got.xxh3_128}; {got.size} bytes)"
        )


def check_tensors(buf: Any, path: Path) -> None:
    """Raises CorruptCheckpointError unless ``buf`` is a well-formed safetensors file (torch is not needed)."""
    from . import tensorfile

    try:
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
        return "unreadable", f"{path}: cannot be read ({e.strerror or e})", None
    if size != expected.size:  # a truncated or grown file: no need to hash it
        return "size", f"{path}: size {size} bytes, manifest says {expected.size}", size
    return None


def present(path: Path, expected: FileDigest) -> str | None:
    """None when ``path`` is a regular file of the listed size, else what is wrong (no hashing: a stat)."""
    absent = _absent(path, expected)
    return None if absent is None else absent[1]


def check_file(path: Path, expected: FileDigest) -> FileCheck:
    def bad(status: str, message: str, found: FileDigest | None = None) -> FileCheck:
        return FileCheck(path.name, path, expected, status, found, message)

    absent = _absent(path, expected)
    if absent is not None:
        status, message, size = absent
        return bad(status, message, None if size is None else FileDigest(size, ""))
    try:
        buf, got = commit.read_file(path)
    except OSError as e:
        return bad("unreadable", f"{path}: cannot be read ({e.strerror or e})")
    try:
        _compare(path, expected, got)
    except CorruptCheckpointError as e:
        return bad("digest", str(e), got)
    try:
        if path.suffix == ".safetensors":
            check_tensors(buf, path)  # the header and every extent, without building tensors (no torch)
        elif path.suffix == ".json" and path.name != MANIFEST:  # the manifest was parsed to get here
            try:
                from . import codec

                codec.loads(buf, str(path))
            except ValueError as e:
                raise CorruptCheckpointError(str(e)) from None
    except CorruptCheckpointError as e:
        return bad("format", str(e), got)
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
        commit.remove_tree(tmp)
    except OSError as e:
        logging.getLogger("preempt").warning(
            "could not remove the partial checkpoint %s: %s (removed at the next start)", tmp, e
        )
