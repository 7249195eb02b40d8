"""One rule for every file the library opens inside a save_dir, which someone else may have planted.

A save_dir often sits on a shared filesystem, where a colleague's or an
attacker's symlink, FIFO, device or giant file can stand where the run expects
one of its own files. Every file the run and the command-line tools open there
goes through this module:

* no symlink is followed (``O_NOFOLLOW``);
* only regular files are read or written: a FIFO is opened without blocking
  and refused, a device or socket too;
* a file opened for writing has one name (``st_nlink == 1``): ``O_NOFOLLOW``
  stops symlinks, not hard links, and a log or lock that is a hard link to a
  file elsewhere (a ``cp -al`` copy of a run directory) would be appended to or
  truncated there. Such a file is first replaced by a copy of its own, with a
  warning (:func:`open_fd`); its other names keep their content and are never
  written. The lock alone takes the file as it is and replaces it under its
  record lock (:mod:`preempt.checkpoint.lock`);
* a read is capped before anything is read;
* JSON from disk is checked for nesting depth before it is parsed, and for
  its top-level type after: one boundary for every JSON document;
* text bound for a terminal has control characters and lone surrogates escaped
  (:func:`printable`), and timestamps are range-checked before formatting.

Reading can also fail for a reason of the environment rather than of the
bytes (permission denied, out of memory, too many open files, an I/O error):
:func:`resource_error` is the one place that tells the two apart.

Each refusal is an :class:`UnsafeFileError` (an ``OSError``, so code that
handles an unreadable file handles it too) naming the path, what was expected
and what was found. No torch here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import logging
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
MAX_DEPTH = 64  # JSON nesting: our documents need fewer than 10 levels
SMALL = 1 << 20  # caps for small documents (lock, complete.json, a history line)
# A JSON string, matched in memory that does not grow with its length: the loop unrolled and every quantifier
# possessive. (``"(?:[^"\\]|\\.)*"`` kept a backtracking frame per character: the memory of `preempt verify` grew
# with the longest string of a checkpoint's user state, many times its length.)
_STRINGS = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_YEAR_2200 = 7258118400.0  # the latest time a file of ours may record (seconds since the epoch)


class UnsafeFileError(OSError):
    """A file inside a save_dir is not what the library writes there (a symlink, a FIFO, too large, ...)."""

    def __init__(self, path: str | os.PathLike[str], expected: str, found: str) -> None:
        super().__init__(errno.EINVAL, f"expected {expected}, found {found}", os.fspath(path))
        self.path, self.expected, self.found = os.fspath(path), expected, found

    def __str__(self) -> str:
        return f"{printable(self.path)}: expected {self.expected}, found {self.found}"


# Reading failed because of the environment, which may change (permissions, memory, descriptors, the device, a
# network filesystem): the bytes may be fine. Every other OSError on a checkpoint's file is taken as damage.
_RESOURCE_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EACCES",
        "EPERM",
        "ENOMEM",
        "EMFILE",
        "ENFILE",
        "EIO",
        "EAGAIN",
        "EINTR",
        "EBUSY",
        "ENOBUFS",
        "ETIMEDOUT",
        "ESTALE",
        "ENOLCK",
        "ENODEV",
        "ENOTCONN",
        "ECONNRESET",
        "ECONNABORTED",
        "EHOSTDOWN",
        "EHOSTUNREACH",
        "ENETDOWN",
        "ENETUNREACH",
        "EREMOTEIO",
        "ENOMEDIUM",
        "ETXTBSY",
    )
    if hasattr(errno, name)
)


def resource_error(error: BaseException) -> bool:
    """True when a read failed for a reason of the environment, not of the file's content.

    Permission denied (``EACCES``/``EPERM``), memory (``ENOMEM``, :class:`MemoryError`), descriptors
    (``EMFILE``/``ENFILE``), the device or a network filesystem (``EIO``, ``ESTALE``, ``ETIMEDOUT``, ...): the
    same read may succeed later, so what failed is reported as such and never taken for damage. A missing
    file, a symlink or a FIFO where a file should be (:class:`UnsafeFileError`), and any other error, are
    about what is on disk: False.
    """
    if isinstance(error, MemoryError):
        return True
    if isinstance(error, UnsafeFileError) or not isinstance(error, OSError):
        return False
    return error.errno in _RESOURCE_ERRNOS


def kind(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words."""
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return name
    return "a file of unknown kind"


def open_fd(path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o644, *, linked: str = "copy") -> int:
    """``os.open`` of a regular file that follows no symlink and never blocks on a FIFO.

    Opened for writing (``O_WRONLY``/``O_RDWR``), a file with other names (a hard link) is not written: with
    ``linked="copy"`` the name is first given a copy of its own (:func:`unshare`, logged); ``linked="keep"``
    returns it as it is, for a caller that replaces it itself (the lock, under its record lock).

    Raises:
        UnsafeFileError: ``path`` is a symlink, a FIFO, a device, a directory or a socket; or still has other
            names after the copy (someone links it again as fast).
        OSError: As ``os.open`` (missing file, no permission, no space).
    """
    if linked not in ("copy", "keep"):
        raise ValueError(f"linked: expected 'copy' or 'keep', got {linked!r}")
    fd = _open_regular(path, flags, mode)
    if not flags & (os.O_WRONLY | os.O_RDWR) or linked == "keep" or _links(fd) == 1:
        return fd
    try:
        unshare(path, fd)
    finally:
        os.close(fd)
    fd = _open_regular(path, flags, mode)
    links = _links(fd)
    if links == 1:
        return fd
    os.close(fd)
    raise UnsafeFileError(path, "a file with one name", f"a hard link with {links} names")


def _links(fd: int) -> int:
    """``st_nlink`` of an open file; the descriptor is closed when fstat fails."""
    try:
        return os.fstat(fd).st_nlink
    except BaseException:
        os.close(fd)
        raise


def unshare(path: str | os.PathLike[str], fd: int) -> None:
    """Replaces ``path`` (open as ``fd``), a file with other names, by a copy of its own; logs a warning.

    The copy (content and permission bits) is written beside it under a ``.tmp-`` name (a leftover of a
    crash is deleted at the next start, :func:`preempt.checkpoint.commit.recover`) and renamed over
    ``path``; the file's other names keep their content and are never written again. A file this process
    may not read is replaced by an empty one.

    Raises:
        OSError: The copy cannot be written or renamed (a full disk, a read-only directory).
    """
    st = os.fstat(fd)
    p = os.fspath(path)
    head, name = os.path.split(p)
    tmp = os.path.join(head, f".tmp-{name}-unshared-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        src: int | None = _open_regular(p, os.O_RDONLY)
    except OSError:
        src = None  # not readable by us: its content is left to its other names
    try:
        new = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, stat.S_IMODE(st.st_mode))
        try:
            offset = 0
            while src is not None and (chunk := os.pread(src, 1 << 20, offset)):
                os.write(new, chunk)
                offset += len(chunk)
        finally:
            os.close(new)
        os.rename(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        if src is not None:
            os.close(src)
    kept = "a copy of its content" if src is not None else "an empty file (its content is not readable here)"
    logging.getLogger("preempt").warning(
        "%s: had %d names (a hard link, as a cp -al copy of a run directory makes); replaced by %s, so that its"
        " other names are never written",
        path_text(p),
        st.st_nlink,
        kept,
    )


def _open_regular(path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    try:
        fd = os.open(path, flags | NOFOLLOW | os.O_NONBLOCK | CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFileError(path, "a regular file", "a symbolic link") from None
        if e.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO opened for writing without a reader; a directory
            found = kind(os.lstat(path).st_mode) if os.path.lexists(path) else "something else"
            raise UnsafeFileError(path, "a regular file", found) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(path, "a regular file", kind(st.st_mode))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: str | os.PathLike[str], limit: int) -> bytes:
    """The whole of a regular file of at most ``limit`` bytes.

    Raises:
        UnsafeFileError: Not a regular file, or larger than ``limit``.
        OSError: As ``os.open``/``read``.
    """
    with io.FileIO(open_fd(path), "rb", closefd=True) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise UnsafeFileError(path, f"at most {limit} bytes", f"{size} bytes")
        chunks, total = [], 0
        while chunk := f.read(min(1 << 20, limit + 1 - total)):  # a file that grows while read stops at limit + 1
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise UnsafeFileError(path, f"at most {limit} bytes", "a file that kept growing while read")
    return b"".join(chunks)


class TooManyValues(ValueError):
    """A JSON document holds more values than its reader accepts (counted before parsing, :func:`load_json`)."""


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text (strings skipped); no recursion."""
    return _depth(_STRINGS.sub(b"", data))


def _values(bare: bytes) -> int:
    """At most how many values a JSON text with its strings taken out holds (each but a container's first follows
    a comma): what parsing it would make, counted before it is parsed."""
    return bare.count(b",") + bare.count(b"[") + bare.count(b"{") + 1


def _depth(bare: bytes) -> int:
    brackets = bare.translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for b in brackets:
        if b in b"[{":
            depth += 1
            if depth > deepest:
                deepest = depth
        else:
            depth -= 1
    return deepest


def load_json(
    data: bytes | str,
    where: str,
    *,
    expect: type | None = dict,
    max_depth: int = MAX_DEPTH,
    max_values: int | None = None,
) -> Any:
    """Parses a JSON document from disk: nesting (and, with ``max_values``, how many values it holds: a compact
    ``[{}, {}, ...]`` costs many times its text in memory) checked first, then the top-level type.

    Raises:
        ValueError: Bad UTF-8 or syntax, nested deeper than ``max_depth``, more than ``max_values`` values, or not of
            type ``expect``; the message names ``where``.
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    bare = _STRINGS.sub(b"", raw)
    depth = _depth(bare)
    if depth > max_depth:
        raise ValueError(f"{printable(where)}: JSON nested {depth} levels deep; at most {max_depth} expected")
    if max_values is not None and (values := _values(bare)) > max_values:
        raise TooManyValues(f"{printable(where)}: JSON of up to {values} values; at most {max_values} expected")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{printable(where)}: not valid JSON ({type(e).__name__}: {e})") from None
    if expect is not None and not isinstance(doc, expect):
        raise ValueError(f"{printable(where)}: expected a JSON {_name(expect)}, found {_name(type(doc))}")
    return doc


def read_json(path: str | os.PathLike[str], limit: int = SMALL, *, expect: type | None = dict) -> Any:
    """:func:`read_bytes` then :func:`load_json`; any refusal is a ValueError or an OSError naming ``path``."""
    return load_json(read_bytes(path, limit), os.fspath(path), expect=expect)


def printable(text: object) -> str:
    """``text`` safe for a terminal: control characters, escape sequences and lone surrogates escaped."""
    s = text if isinstance(text, str) else str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii") for c in s)


class TerminalText:
    """A text stream that writes through :func:`printable`, line by line: newlines and tabs pass, nothing else
    that a terminal would act on (an ESC sequence planted in a manifest, a lone surrogate) reaches it."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        if not text.isprintable():
            text = "\n".join("\t".join(printable(p) for p in line.split("\t")) for line in text.split("\n"))
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def plausible_time(value: object) -> float | None:
    """A timestamp read from disk as a float, or None when it is not a finite time between 1970 and 2200."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        t = float(value)
    except OverflowError:
        return None
    return t if math.isfinite(t) and 0.0 <= t <= _YEAR_2200 else None


def within(path: str | os.PathLike[str], directory: str | os.PathLike[str]) -> bool:
    """Whether writing ``path`` would write inside ``directory`` (or at it), symlinks resolved on both sides.

    Both the place the name is in (a rename over ``path`` replaces the entry there) and where a symlink at
    ``path`` leads count. For the commands that write a file the user names (``export --out``, ``report
    --plot``): inside a save_dir every name belongs to the run (a checkpoint's file, the lock).
    """
    p = Path(path)
    d = Path(directory).resolve()
    return any(c == d or d in c.parents for c in (p.parent.resolve() / p.name, p.resolve()))


def describe_error(path: str | os.PathLike[str], error: OSError) -> str:
    """``<path>: <what went wrong>`` for an OSError that may or may not name its file."""
    if isinstance(error, UnsafeFileError):
        return str(error)
    return f"{path_text(path)}: {error.strerror or error}"


def path_text(path: str | os.PathLike[str] | Path) -> str:
    """A path for messages and logs, whatever bytes its name holds."""
    return printable(os.fsdecode(os.fspath(path)))


def _name(t: type) -> str:
    return {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        t, "null" if t is type(None) else t.__name__
    )
