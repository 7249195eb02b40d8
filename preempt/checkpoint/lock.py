"""One writer per save_dir: the lock a run holds for as long as it is entered.

Two processes writing one ``save_dir`` (a requeued job overlapping its
predecessor, two people starting the same command) would prune each other's
checkpoints and clean up each other's half-written ones. So a run holds
``save_dir/lock`` from ``__enter__`` to ``__exit__``, and so does
``preempt prune``.

How:

* The lock is a POSIX record lock (``fcntl.lockf``) on ``save_dir/lock``. The
  kernel drops it when the holding process dies, however it dies (SIGKILL, a
  node's OOM killer), so a lock left by a dead process is simply free: there
  is no stale lock to judge. POSIX locks also work on NFS, and they are not
  inherited by forked children, so DataLoader workers that outlive a killed
  parent for a few seconds do not keep the directory locked.
* The file's content (pid, host, since, purpose) is only there to name the
  holder in the error the second process gets. It is written after the lock
  is taken and emptied before it is released, so a non-empty file found by a
  new holder means the previous one died holding it: the run says so.
* POSIX locks belong to a process, not to a file descriptor: a second lock of
  the same file from the same process would succeed silently, and closing any
  descriptor of the file would drop the lock. So the lock files this process
  holds are known by their inode (``_OPEN``, a fact of the process, as the
  POSIX lock is) and a second attempt fails at once, its descriptor kept open
  by the holder until it lets go. Nothing finds a lock through that table: the
  run hands its :class:`DirLock` to its manager.
* The lock file names the directory it belongs to (``dir``: the save_dir's
  ``st_dev``/``st_ino``). A run directory copied with ``cp -a`` carries its
  lock file along: content naming another directory is not a holder that died
  here (no crash is reported), nor, without record locks, a holder of this
  directory. ``cp -al`` makes the copy's lock file a hard link to the
  original's: it is replaced by a file of its own, under the record lock of
  the shared one and locked before its rename, so that no two processes ever
  hold one save_dir (:meth:`DirLock._unshare`); a lock file found held by a
  run of another directory is refused with what to do.
* A holder whose directory is deleted and made again, or moved and replaced,
  under it (an orphaned process still training when a new run starts in a
  directory of the same name) finds out with :meth:`DirLock.check` (called by
  the manager the lock is handed to), two ``stat`` calls that compare the ``st_dev``/``st_ino``
  of ``save_dir`` and of ``save_dir/lock`` with what it locked, before each of
  its writes there: a checkpoint's temporary directory, the commit's rename,
  pruning, a pool of files written ahead, the completion marker. It gets
  :class:`~preempt.errors.LockLostError` (naming the path, what it locked and
  what it found) and writes nothing more, so the new run's files are never
  touched. The directory is held open while locked, so that a new directory
  cannot be given the old one's inode number.
* Where the filesystem refuses record locks (Lustre mounted without
  ``flock``/``localflock``, some FUSE filesystems), the lock falls back to
  its content: a holder on this host whose process still runs (same pid and
  start time) or a holder elsewhere whose heartbeat (the file's mtime,
  refreshed every ``HEARTBEAT_S``) is younger than ``STALE_AFTER_S`` keeps it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import socket
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import LockedError, LockLostError, PreemptError
from . import safe_io

log = logging.getLogger("preempt")

LOCK = "lock"
BEACON = "lock.step"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_RETRIES = 20  # attempts to lock a lock file that others keep replacing
# (st_dev, st_ino) of the lock files this process holds: POSIX record locks are the process's, not a descriptor's
_OPEN: dict[tuple[int, int], DirLock] = {}
_OPEN_GUARD = threading.Lock()


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (Linux's ``starttime``), to tell a reused pid apart;
    None where unknown. What the lock file's ``start`` holds, as every version has written it.

    Read with psutil, whose ``create_time`` is the boot time (whole seconds, moved by any change of the wall clock)
    plus that start: less the boot time read just before it, it is the start after boot again, an integer that no
    change of the wall clock moves, the same in every process that asks.
    """
    import psutil  # here, not at the top: `preempt ls` and `verify` start without it

    try:
        boot = psutil.boot_time()  # first: psutil 5.9 keeps the boot time it read last for create_time
        created = psutil.Process(pid).create_time()
    except (psutil.Error, OSError, RuntimeError, ValueError):  # ValueError: a pid below 1, from a lock file
        return None
    return round((created - boot) * os.sysconf("SC_CLK_TCK"))


def _alive(pid: int, start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    return start is None or _start_time(pid) in (None, start)


def describe(holder: dict[str, Any]) -> str:
    """``pid 123 on host n1 since 2026-11-22 13:01:02 (4m13s ago), training``."""
    if not holder:
        return "a process that left no details"
    since = safe_io.plausible_time(holder.get("since"))  # what a lock file says is not trusted
    when = ""
    if since is not None:
        from .._log import duration

        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
        when = f" since {stamp} ({duration(max(0.0, time.time() - since))} ago)"
    text = safe_io.printable
    purpose = f", {text(holder['purpose'])}" if holder.get("purpose") else ""
    return f"pid {text(holder.get('pid', '?'))} on host {text(holder.get('host', '?'))}{when}{purpose}"


class DirLock:
    """The lock of one save_dir; a context manager.

    Args:
        save_dir: The directory (must exist).
        purpose: Said to a second process that finds the lock held.
        timeout: Seconds to wait for a holder to let go before giving up
            (0: fail at once).
        use_record_locks: False forces the content-based fallback (for tests
            of filesystems without record locks).
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        *,
        purpose: str = "training",
        timeout: float = 0.0,
        use_record_locks: bool = True,
    ) -> None:
        if timeout < 0:
            raise ValueError(f"lock_timeout: expected seconds >= 0, got {timeout!r}")
        self.path = Path(save_dir) / LOCK
        self.purpose = purpose
        self.timeout = timeout
        self.use_record_locks = use_record_locks
        self.previous: dict[str, Any] = {}  # what a dead holder left, when we took over from one
        self.identity: dict[str, Any] = {}  # what this holder wrote in the lock file (pid, host, since), once held
        self._fd: int | None = None
        self._key: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._extra_fds: list[int] = []
        self._dir: list[int] | None = None  # the save_dir's [st_dev, st_ino], recorded in the lock file
        self._dir_fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Takes the lock or raises :class:`LockedError` naming the holder.

        Raises:
            LockedError: Held by a live process for longer than ``timeout``.
            OSError: The lock file cannot be created (the directory is not writable).
        """
        if self._fd is not None:
            raise PreemptError(f"{self.path}: already held by this DirLock")
        deadline = time.monotonic() + self.timeout
        while True:
            holder = self._try()
            if holder is None:
                return
            if time.monotonic() >= deadline:
                if holder.get("dir") not in (None, self._dir):
                    raise LockedError(
                        f"{self.path}: is a hard link to the lock file of another directory, held there by"
                        f" {describe(holder)} (a copy of a run directory made with cp -al while that run ran?)."
                        f" Nothing runs in {self.path.parent} itself: remove {self.path} (rm) and start again;"
                        " the next start makes a lock file of its own.",
                        holder,
                    )
                raise LockedError(
                    f"{self.path.parent} is in use by {describe(holder)} (lock file {self.path}). Two processes"
                    " writing one save_dir would delete each other's checkpoints. Wait for that process to end,"
                    " or give this run another save_dir.",
                    holder,
                )
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def _try(self) -> dict[str, Any] | None:
        """One attempt: None when taken, else what is known of the holder."""
        self._dir = _dir_identity(self.path.parent)
        for _ in range(_RETRIES):
            # never a symlink's target, never a FIFO; a file with other names is replaced below, under the lock
            fd = safe_io.open_fd(self.path, os.O_RDWR | os.O_CREAT, linked="keep")
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            with _OPEN_GUARD:
                other = _OPEN.get(key)
                if other is not None:
                    # Closing this descriptor would drop the other DirLock's POSIX lock: keep it open inside
                    # the holder's registry entry instead (it is closed when that holder releases).
                    other._extra_fds.append(fd)
                    return {**_read(other._fd), "purpose": f"{other.purpose} (in this same process)"}
                try:
                    locked = self._lock(fd)
                except BaseException:
                    os.close(fd)
                    raise
                if not locked:
                    holder = _read(fd)
                    os.close(fd)  # no lock of ours on this file in this process: closing drops nothing
                    return holder or {"pid": "?", "host": "?"}
                if _names(self.path) != key:  # replaced meanwhile (by a run that unshared it): lock that one
                    os.close(fd)
                    continue
                previous = _read(fd)
                try:
                    if os.fstat(fd).st_nlink > 1:
                        fd, key = self._unshare(fd)
                except BaseException:
                    os.close(fd)
                    raise
                _OPEN[key] = self
            break
        else:
            what = f"the lock file was replaced {_RETRIES} times while being locked"
            raise OSError(errno.EAGAIN, what, str(self.path))
        self._fd, self._key, self._extra_fds = fd, key, []
        self._dir_fd = _open_dir(self.path.parent)  # held: its inode number is not reused while the run holds it
        self.previous = previous
        if previous.get("dir") not in (None, self._dir):
            log.info(
                "%s: the lock file came from another directory (a copy of a run directory): its holder, %s,"
                " worked there, not here",
                self.path,
                describe(previous),
            )
            self.previous = {}
        if self.previous:
            log.warning(
                "%s: took over the lock left by %s (that process is gone)", self.path.parent, describe(self.previous)
            )
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "purpose": self.purpose}
        try:
            _write(fd, {**me, "start": _start_time(os.getpid()), "dir": self._dir})
            self.identity = {k: me[k] for k in IDENTITY}
        except OSError as e:
            self.release()
            raise OSError(e.errno, f"cannot write the lock file: {e.strerror or e}", str(self.path)) from None
        if not self.use_record_locks:
            self._stop.clear()
            self._heartbeat = threading.Thread(target=self._beat, name="preempt-lock-heartbeat", daemon=True)
            self._heartbeat.start()
        return None

    def _unshare(self, fd: int) -> tuple[int, tuple[int, int]]:
        """Replaces the lock file, held as ``fd`` but with other names (a hard link), by a new one, locked first.

        A ``cp -al`` copy of a run directory shares its lock file with the original: truncating it would empty
        the other's, and a run in one would lock out a run in the other. Held under the old file's record lock
        and locked itself before its rename, the new file is never held by two processes: one that opened the
        old file gets its lock only after this rename, and then finds the path names another file (``_try``).
        Returns the new descriptor and key; ``fd`` is closed.
        """
        links = os.fstat(fd).st_nlink
        tmp = self.path.with_name(f".tmp-{LOCK}-{os.getpid()}-{os.urandom(4).hex()}")
        new = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            if self.use_record_locks:
                fcntl.lockf(new, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, self.path)
        except BaseException:
            os.close(new)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)  # drops the old file's lock: its other names are another directory's business
        log.warning(
            "%s: had %d names (a hard link, as a cp -al copy of a run directory makes); replaced by a lock file"
            " of its own, so that the other names are never written",
            self.path,
            links,
        )
        st = os.fstat(new)
        return new, (st.st_dev, st.st_ino)

    def _lock(self, fd: int) -> bool:
        """Record lock when the filesystem has them, else the content-based check; True when taken."""
        if self.use_record_locks:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    return False
                if e.errno not in _UNSUPPORTED:
                    raise
                log.warning(
                    "%s: this filesystem refuses file locks (%s); judging the lock by its content instead",
                    self.path,
                    os.strerror(e.errno),
                )
                self.use_record_locks = False
        holder = _read(fd)
        if not holder or holder.get("dir") not in (None, self._dir):  # nobody, or the holder of another directory
            return True
        if holder.get("host") == socket.gethostname():
            pid = holder.get("pid")
            return not (isinstance(pid, int) and _alive(pid, holder.get("start")))
        return time.time() - os.fstat(fd).st_mtime > STALE_AFTER_S

    def _beat(self) -> None:
        fd = self._fd  # the file held, not whatever the path names by now
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(fd if fd is not None and os.utime in os.supports_fd else self.path)
            except OSError as e:
                log.warning("%s: could not refresh the lock's heartbeat: %s", self.path, e)

    def check(self) -> None:
        """Raises :class:`LockLostError` unless ``save_dir`` and ``save_dir/lock`` are still what this lock took.

        The save_dir was deleted and made again, moved away and replaced (``mv run run.old; cp -a run.old run``),
        or its lock file removed: another process can then take a lock of ``save_dir`` and write there too, so
        this run must write nothing more into it. Two ``stat`` calls; a no-op when not held. The directory is
        held open while locked, so that its inode number cannot be given to a new directory of the same name.

        Raises:
            LockLostError: What the run locked and what the paths name now, and what to do.
        """
        if self._key is None or self._fd is None:
            return
        found = {"lock": _names(self.path), "dir": _dir_identity(self.path.parent)}
        expected = {"lock": self._key, "dir": self._dir}
        problem = replaced(self.path, expected, found)
        if problem is None:
            return
        # never a second descriptor of the file held: closing it would drop this process's record lock
        holder = {} if found["lock"] in (None, self._key) else _read_path(self.path)
        if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            now = f"; {self.path} is a copy of this run's own lock file (the directory was copied)"
        else:
            now = f"; {self.path} names {describe(holder)}" if holder else ""
        raise LockLostError(
            f"{problem}{now}. Another process may use {self.path.parent} now, so this run writes nothing more"
            " there; its checkpoints so far are wherever the directory it locked went, or were deleted with it."
            " To continue this run, put that directory back under its name and start it again",
            holder,
            expected=_listed(expected),
            found=_listed(found),
        )

    def release(self) -> None:
        """Empties the lock file and lets go (a no-op when not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        with _OPEN_GUARD:
            if self._key is not None:
                _OPEN.pop(self._key, None)
            try:
                os.ftruncate(fd, 0)  # an empty file after a clean exit: nobody died holding it
            except OSError as e:
                log.warning("%s: could not empty the lock file: %s", self.path, e)
            for extra in self._extra_fds:
                os.close(extra)
            if self._dir_fd is not None:
                os.close(self._dir_fd)
                self._dir_fd = None
            os.close(fd)  # drops the record lock

    def __enter__(self) -> DirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class StepBeacon:
    """The holder's latest step, in an 8-byte memory-mapped file beside the lock (``save_dir/lock.step``).

    When a holder dies without stopping (SIGKILL, the OOM killer), its lock
    file is left non-empty (:attr:`DirLock.previous`), and this file says how
    far it had got, so the next holder can say how many steps since the
    checkpoint it resumes from are recomputed. Writing the step is a store into
    shared memory (no system call): the kernel keeps the page when the process
    dies. A clean exit writes -1. The file is opened without following
    symlinks and only when it is a regular file; it is information only, so any
    trouble with it is logged and the beacon is off.
    """

    def __init__(self, save_dir: str | os.PathLike[str]) -> None:
        self.path = Path(save_dir) / BEACON
        self._mm: mmap.mmap | None = None
        self.view: Any = [0]  # view[0] = step; a list while off, so that writers need no test

    def read(self) -> int | None:
        """The step the last holder wrote, or None (a clean exit, no file, not a regular 8-byte file)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != 8:
                return None
            (step,) = struct.unpack("=q", os.pread(fd, 8, 0))
        except OSError:
            return None
        finally:
            os.close(fd)
        return step if step >= 0 else None

    def open(self, step: int) -> None:
        """Maps the file (created when missing) and writes ``step``.

        A file with other names (a ``cp -al`` copy of a run directory shares it with the original, whose
        run may still write its steps there) is replaced by a file of its own first (:func:`safe_io.open_fd`).
        """
        try:
            fd = safe_io.open_fd(self.path, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            log.warning(
                "%s; the step beacon is off: a crash will not say how far it got", safe_io.describe_error(self.path, e)
            )
            return
        try:
            os.ftruncate(fd, 8)
            self._mm = mmap.mmap(fd, 8)
        except OSError as e:
            log.warning("%s: cannot map the step beacon (%s); a crash will not say how far it got", self.path, e)
            return
        finally:
            os.close(fd)
        self.view = memoryview(self._mm).cast("q")
        self.view[0] = step

    def close(self) -> None:
        """Writes -1 (a clean exit) and unmaps; writers holding the old view must have dropped it."""
        if self._mm is None:
            return
        view, self.view = self.view, [0]
        view[0] = -1
        view.release()
        self._mm.close()
        self._mm = None


def replaced(path: Path, expected: dict[str, Any], found: dict[str, Any]) -> str | None:
    """What the run locked and what the paths name now, in words, when they differ; None when they do not.

    Pure: ``expected`` and ``found`` hold ``"dir"`` (``[st_dev, st_ino]`` of the save_dir) and ``"lock"``
    (``(st_dev, st_ino)`` of ``path``, its lock file), None for a path that names nothing.
    """
    same = [list(found.get(k) or ()) == list(expected.get(k) or ()) for k in ("dir", "lock")]
    if all(same) and found.get("lock") is not None:
        return None
    had = f"it locked directory {_inode(expected.get('dir'))} and lock file {_inode(expected.get('lock'))}"
    if found.get("dir") is None:
        return f"{path.parent} was removed under this run ({had}; nothing has that name now)"
    lock = "no lock file" if found.get("lock") is None else f"lock file {_inode(found['lock'])}"
    now = f"directory {_inode(found['dir'])} with {lock}"
    return f"{path.parent} was replaced under this run ({had}; the path names {now} now)"


def _inode(identity: Any) -> str:
    """``[2049, 1234]`` -> ``"inode 1234 on device 2049"``; None -> ``"(none)"``."""
    if not identity:
        return "(none)"
    dev, ino = identity
    return f"inode {ino} on device {dev}"


def _listed(identities: dict[str, Any]) -> dict[str, list[int] | None]:
    return {k: None if v is None else [int(x) for x in v] for k, v in identities.items()}


IDENTITY = ("pid", "host", "since")  # what names a holder: the ranks of a run compare it (one save_dir for all)


def holder(save_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Who holds ``save_dir``'s lock, as its lock file says (pid, host, since), or {} (none, or unreadable).

    Never call it in the process that holds the lock: closing any descriptor of the lock file releases the
    process's record locks on it (POSIX); the holder knows its own :attr:`DirLock.identity`.
    """
    doc = _read_path(Path(save_dir) / LOCK)
    return {k: doc.get(k) for k in IDENTITY} if doc else {}


def _read_path(path: Path) -> dict[str, Any]:
    """What the lock file at ``path`` says (a regular file, no symlink followed), or {}."""
    try:
        return safe_io.read_json(path)
    except (OSError, ValueError):
        return {}


def _dir_identity(path: Path) -> list[int] | None:
    """``[st_dev, st_ino]`` of a directory (symlinks followed): a copy of it, or another directory put in its
    place, has other numbers; None when it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino]


def _open_dir(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None


def _names(path: Path) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the file the path names now (no symlink followed), or None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _read(fd: int | None) -> dict[str, Any]:
    if fd is None:
        return {}
    try:
        data = os.pread(fd, 4096, 0)
        return safe_io.load_json(data, "lock") if data.strip() else {}
    except (OSError, ValueError):
        return {}


def _write(fd: int, doc: dict[str, Any]) -> None:
    data = json.dumps(doc).encode() + b"\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)
