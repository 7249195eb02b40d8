"""What a run leaves for people to read: ``train.log`` and ``history.jsonl``.

Small parts, each usable alone; none imports torch.

:class:`RunLog` copies the ``preempt`` logger into ``save_dir/train.log``
(appended across restarts, so a requeued job's whole story is in one file)::

    2025-06-01 12:34:56.789 INFO ==== start (resumed from runs/exp1/step_000000120 at step 120) pid 4242 host n17 ====
    2025-06-01 12:34:56.790 INFO resumed from runs/exp1/step_000000120: step 120, epoch 1, batch 20/100, ...
    2025-06-01 12:35:02.120 WARNING [rank 1] ...        (the [rank r] tag only when world_size > 1)

Ranks other than 0 say nothing below ERROR, neither in a file nor on the
console (all ranks would say the same thing ``world_size`` times), unless
``log_all_ranks``: rank ``r`` then writes ``train.rank{r}.log`` and keeps its
console output. An error that ends a rank still shows: as its traceback, or
as its ERROR line when it leaves with an exit code (a lost peer, 80).

:class:`History` appends one JSON object per line to ``save_dir/history.jsonl``
(rank 0 only)::

    {"t":1748774095.402,"event":"restoring","pid":4242,"proc_start":1748774090.113,"made_at":1748774095.398}
    {"t":1748774096.791,"event":"resume","step":120,"from":"runs/exp1/step_000000120","pid":4242,"proc_start":...}
    {"t":1748774100.012,"step":130,"epoch":1,"metrics":{"loss":2.31},"lr":0.0003,"step_time_s":0.21}
    {"t":1748774101.500,"event":"checkpoint","step":140,"reason":"interval","stall_s":0.17,"write_s":1.2,...}
    {"t":1748774160.003,"event":"stop","step":171,"cause":"SIGTERM","code":75,"requeued":false}
    {"t":1748774160.120,"event":"exit","pid":4242}

The run's markers (:mod:`preempt.run.reporting`) are what ``preempt report``
reads (:mod:`preempt.cli.timeline`): ``restoring`` once the process holds the
save_dir's lock, before it reads a checkpoint (a process killed in its restore
leaves only that line); ``start``/``resume`` with the process's
start time and, after a crash, how far the dead process got (``crashed``);
``checkpoint``; ``rollback``; ``stop`` (its cause), ``complete`` or
``error``; and ``exit`` when the process exits normally
(:func:`preempt.run.reporting.exit_line_at_exit`).

A record has ``t`` (unix seconds), ``step``, ``epoch``, ``metrics`` and, when
given, ``lr`` (a number, or a list with one number per parameter group),
``step_time_s`` and ``gpu_mem`` (any JSON object, e.g. bytes allocated and
reserved). The run writes in ``metrics`` only the metrics measured at the
record's step (:mod:`preempt.run.reporting`): a metric absent from a record
was not measured there, and an evaluation (``run.report()``) is a record of
its own, ``{"t":..,"step":50,"epoch":0,"metrics":{"val_loss":3.87}}``.
Histories written before (each record repeating the latest value of every
metric) read the same way; only their values between measurements repeat.
A marker has ``t``, ``event`` and its own fields. A non-finite
number (a NaN loss) is written as the string ``"nan"``, ``"inf"`` or
``"-inf"``: bare ``NaN`` is not JSON, and most readers other than Python's
reject it.

Durability: every line is one ``write(2)`` on a file opened with
``O_APPEND``: it reaches the page cache at once, survives the process being
killed (SIGKILL, an OOM kill), and is never interleaved with another
writer's line. It is not fsynced: a machine crash can lose the last lines,
which is fine for a history. A killed process can still leave a torn last
line (a write cut by a full disk); the next :class:`History` starts on a fresh
line, and :func:`read_history` skips lines that do not parse. Most of a
record's cost is ``json.dumps``, not the ``write(2)`` (``bench/bench_history.py``,
figures in ``bench/README.md``): buffering in user space would save little and
lose the last lines on a kill. A record with a NaN takes a slower path.

Reading (:func:`iter_history`, :func:`read_history`) holds at most one line
of :data:`MAX_LINE` bytes (1 MiB) and a 64 KiB read: a longer line (someone
else's 200 MB line) is counted, not kept, and skipped with a note naming the
file and the line number.

Timelines: a run killed after its checkpoint at step 120 and resumed from it
records steps 121.. again. :func:`read_history` follows the timeline: a
``resume`` marker at step N drops the earlier records with step > N (pass
``timeline=False`` for every line as written).

The progress line and the epoch summary: :mod:`preempt.health.progress`.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from .. import _log, _secrets, _testing
from ..checkpoint import safe_io

LOG_FILE = "train.log"
HISTORY_FILE = "history.jsonl"

# ---------------------------------------------------------------------------------------------------- RunLog


class _Formatter(logging.Formatter):
    """``2025-06-01 12:34:56.789 INFO [rank 1] message``; tracebacks follow on their own lines."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self._tag = tag

    def format(self, record: logging.LogRecord) -> str:
        t = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        line = f"{t}.{int(record.msecs):03d} {record.levelname} {self._tag}{record.getMessage()}"
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line = f"{line}\n{record.exc_text}"
        if record.stack_info:
            line = f"{line}\n{self.formatStack(record.stack_info)}"
        return line


class _FileHandler(logging.FileHandler):
    """A FileHandler (appends, flushes per record, one lock around each write) that complains only once.

    ``logging`` prints a full "--- Logging error ---" traceback for every
    record it cannot write; with a full disk that is one per log call.
    """

    _failed = False

    def _open(self) -> Any:
        # Appends to a regular file only: never through a symlink planted in save_dir, never into a FIFO.
        fd = safe_io.open_fd(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)

    def handleError(self, record: logging.LogRecord) -> None:
        if self._failed:
            return
        self._failed = True
        import sys
        import traceback

        err = sys.exc_info()[1]
        line = traceback.format_exception_only(type(err), err)[-1].strip() if err is not None else "unknown error"
        sys.stderr.write(f"[preempt] warning: cannot write {self.baseFilename} ({line}); not written from now on\n")

    def close(self) -> None:
        try:
            super().close()
        except OSError as e:  # the buffered rest a full disk did not take: the file is closed all the same
            if not self._failed:
                self._failed = True
                import sys

                sys.stderr.write(f"[preempt] warning: cannot write {self.baseFilename} ({e}); not written\n")


class _Silence(logging.Filter):
    """Drops every record below ERROR: set on the ``preempt`` logger of a rank that says only what ends it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


class RunLog:
    """Copies the ``preempt`` logger to ``save_dir/train.log`` (rank 0) until :meth:`close`.

    ::

        runlog = RunLog("runs/exp1", rank=rank, world_size=world)
        ...  # decide where the run resumes from
        runlog.start(resumed_from="runs/exp1/step_000000120", step=120)  # or start() for a fresh run
        ...
        runlog.close()

    The file handler appends, writes each record in one go under its lock
    (logging's handlers are thread-safe; the async checkpoint writer and the
    GPU monitor log from their threads), and flushes after each record. Two
    RunLogs on the same file never duplicate lines: a new one replaces the
    older one's handler. Records below the ``preempt`` logger's level (INFO
    by default, ``PREEMPT_LOG_LEVEL``) are not written.

    The default stderr handler of :func:`preempt._log.setup` is attached
    first when logging is not configured at all: the file handler must not
    make the console go quiet.

    Args:
        save_dir: The run's directory; created if missing (rank 0, or every
            rank with ``log_all_ranks``).
        rank: This process's rank.
        world_size: Number of ranks; above 1 every line carries ``[rank r]``.
        log_all_ranks: Ranks other than 0 also log: to the console as usual,
            and to ``train.rank{r}.log``. False: they log only errors, to the console.

    Raises:
        ValueError: ``rank`` is not in ``0..world_size-1``.
        OSError: The file cannot be opened.
    """

    def __init__(
        self, save_dir: str | os.PathLike[str], *, rank: int = 0, world_size: int = 1, log_all_ranks: bool = False
    ) -> None:
        if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"RunLog: expected 0 <= rank < world_size, found rank={rank!r}, world_size={world_size!r}")
        self.rank = rank
        self.world_size = world_size
        self.path: Path | None = None
        self._handler: _FileHandler | None = None
        self._filter: _Silence | None = None
        _log.setup()
        if rank != 0 and not log_all_ranks:
            self._filter = _Silence()
            _log.log.addFilter(self._filter)
            return
        save_dir = Path(save_dir)
        save_dir.mkdir(parents=True, exist_ok=True)
        path = save_dir / (LOG_FILE if rank == 0 else f"train.rank{rank}.log")
        try:
            _end_torn_line(path)
            handler = _FileHandler(path, mode="a", encoding="utf-8", errors="backslashreplace")
        except OSError as e:
            _log.log.warning("%s; the log is not written to a file", safe_io.describe_error(path, e))
            return
        self.path = path
        handler.setFormatter(_Formatter(f"[rank {rank}] " if world_size > 1 else ""))
        with _LOCK:
            for h in list(_log.log.handlers):
                if isinstance(h, _FileHandler) and h.baseFilename == handler.baseFilename:
                    _log.log.removeHandler(h)  # an earlier RunLog on the same file that was not closed
                    h.close()
            _log.log.addHandler(handler)
        self._handler = handler

    def start(self, resumed_from: str | os.PathLike[str] | None = None, step: int = 0) -> None:
        """Writes the marker line of this process's start, to the file only (not to the console).

        ``==== start (fresh) pid P host H ====`` or
        ``==== start (resumed from <path> at step N) pid P host H ====``.
        """
        if self._handler is None:
            return
        how = "fresh" if resumed_from is None else f"resumed from {os.fspath(resumed_from)} at step {step}"
        msg = f"==== start ({how}) pid {os.getpid()} host {socket.gethostname()} ===="
        record = _log.log.makeRecord(_log.log.name, logging.INFO, __file__, 0, msg, (), None)
        self._handler.handle(record)

    def replay(self, held: EarlyRecords) -> None:
        """Writes the records ``held`` kept before this file was open (after the start line), to the file only."""
        if self._handler is None:
            return
        for record in held.records:
            self._handler.handle(record)
        if held.dropped:
            msg = f"... and {held.dropped} more records from before this file was open, not kept"
            self._handler.handle(_log.log.makeRecord(_log.log.name, logging.WARNING, __file__, 0, msg, (), None))

    def close(self) -> None:
        """Detaches and closes the file handler (or lifts the silence of a quiet rank). Idempotent."""
        if self._filter is not None:
            _log.log.removeFilter(self._filter)
            self._filter = None
        if self._handler is not None:
            with _LOCK:
                _log.log.removeHandler(self._handler)
            self._handler.close()
            self._handler = None

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_LOCK = threading.Lock()  # around the check-then-add of handlers on the shared logger


class EarlyRecords(logging.Handler):
    """Keeps what the ``preempt`` logger says before the run's train.log can be opened.

    The run chooses its checkpoint before it opens train.log and history.jsonl
    (the "==== start (resumed from ...)" line needs the choice), and that is
    when a damaged checkpoint is quarantined and the run falls back to an older
    one. Those records reach the console at once, as always; held here as
    well, they go to the file (:meth:`RunLog.replay`) and, the warnings, into
    history.jsonl once it is open. At most ``limit`` records are kept; the
    rest are counted.
    """

    def __init__(self, limit: int = 1000) -> None:
        super().__init__(logging.NOTSET)
        self.limit = limit
        self.records: list[logging.LogRecord] = []
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < self.limit:
            self.records.append(record)
        else:
            self.dropped += 1

    def hold(self) -> EarlyRecords:
        """Starts keeping the ``preempt`` logger's records."""
        with _LOCK:
            _log.log.addHandler(self)
        return self

    def done(self) -> EarlyRecords:
        """Stops keeping them (idempotent); the records kept stay in :attr:`records`. (Not ``release``: that is
        the lock of every logging.Handler.)"""
        with _LOCK:
            _log.log.removeHandler(self)
        return self


def _end_torn_line(path: Path) -> None:
    """Appends a newline when the file ends inside a line (a predecessor was killed mid-write)."""
    fd = safe_io.open_fd(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    try:
        size = os.fstat(fd).st_size
        if size > 0 and os.pread(fd, 1, size - 1) != b"\n":
            os.write(fd, b"\n")
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------- History


def _finite(x: Any) -> Any:
    """``x`` with every non-finite float replaced by ``"nan"``/``"inf"``/``"-inf"`` (the slow path only)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))
    if isinstance(x, Mapping):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, (str, int, type(None))):
        return x
    return _finite(_plain(x))


def _plain(x: Any) -> Any:
    """A value json.dumps does not know: a 0-d tensor or numpy scalar becomes a number, anything else a string."""
    item = getattr(x, "item", None)
    if callable(item) and getattr(x, "ndim", 0) == 0:
        return item()  # a device sync for a GPU tensor: pass floats to avoid it
    tolist = getattr(x, "tolist", None)
    if callable(tolist):
        return tolist()
    return str(x)


class History:
    """Appends records and markers to ``save_dir/history.jsonl``; a no-op on ranks other than 0.

    ::

        hist = History("runs/exp1", rank=rank)
        hist.marker("resume", step=120, from_="runs/exp1/step_000000120")
        hist.record(130, 1, {"loss": 2.31}, lr=3e-4, step_time_s=0.21)
        hist.close()

    Each line is written with one ``write(2)`` to an ``O_APPEND`` file (see
    the module docstring), so there is nothing to flush; :meth:`close` only
    closes the descriptor.

    Args:
        save_dir: The run's directory; created if missing (rank 0).
        rank: This process's rank; only rank 0 writes.
        clock: Source of ``t`` (unix seconds), for tests.

    Raises:
        OSError: The file cannot be opened.
    """

    def __init__(
        self, save_dir: str | os.PathLike[str], *, rank: int = 0, clock: Callable[[], float] = time.time
    ) -> None:
        self.rank = rank
        self.path = Path(save_dir) / HISTORY_FILE
        self._clock = clock
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._failed = False
        if rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            _end_torn_line(self.path)
            self._fd = safe_io.open_fd(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except OSError as e:
            self._failed = True
            _log.log.warning("%s; no history is kept", safe_io.describe_error(self.path, e))

    @property
    def active(self) -> bool:
        """This rank writes (rank 0, not closed)."""
        return self._fd is not None

    def record(
        self,
        step: int,
        epoch: int,
        metrics: Mapping[str, Any],
        lr: float | list[float] | None = None,
        step_time_s: float | None = None,
        gpu_mem: Mapping[str, Any] | None = None,
    ) -> None:
        """Appends one record line; ``lr``, ``step_time_s`` and ``gpu_mem`` are left out when None.

        Metric values should be Python numbers: a tensor is converted with
        ``.item()``, which waits for the GPU.
        """
        if self._fd is None:
            return
        doc: dict[str, Any] = {"t": round(self._clock(), 3), "step": step, "epoch": epoch, "metrics": metrics}
        if lr is not None:
            doc["lr"] = lr
        if step_time_s is not None:
            doc["step_time_s"] = step_time_s
        if gpu_mem is not None:
            doc["gpu_mem"] = gpu_mem
        self._write(doc)

    def marker(self, kind: str, /, **fields: Any) -> None:
        """Appends ``{"t": ..., "event": kind, **fields}``.

        A trailing underscore is dropped from a field name, for names that
        are Python keywords: ``marker("resume", step=120, from_=path)`` writes
        ``"from": path``. Suggested events: ``start``, ``resume``
        (``step``, ``from``; :func:`read_history` acts on it), ``checkpoint``,
        ``stop``, ``complete``, ``skip`` (a step a guard skipped: ``step``, ``why``).
        """
        if self._fd is None:
            return
        doc = {"t": round(self._clock(), 3), "event": kind}
        for k, v in fields.items():
            doc[k[:-1] if k.endswith("_") and len(k) > 1 else k] = v
        self._write(doc)
        _testing.emit(kind, **{k: v for k, v in doc.items() if k != "event"})

    def _write(self, doc: dict[str, Any]) -> None:
        try:
            line = json.dumps(doc, separators=(",", ":"), allow_nan=False, default=_plain)
        except ValueError:  # a NaN or inf somewhere: the rare path
            line = json.dumps(_finite(doc), separators=(",", ":"), allow_nan=False)
        data = (_secrets.scrub(line) + "\n").encode()  # (a secret the run holds, by value: an error's text, a metric's)
        with self._lock:
            fd = self._fd
            if fd is None:
                return
            try:
                n = os.write(fd, data)
                while n < len(data):  # a short write (disk nearly full, a signal): finish the line
                    n += os.write(fd, data[n:])
            except OSError as e:  # a history is not worth a training: say it once, go on
                if not self._failed:
                    self._failed = True
                    _log.log.warning("cannot append to %s (%s); the history misses lines from here", self.path, e)

    def close(self) -> None:
        """Closes the file. Idempotent; records after it are dropped."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


MAX_LINE = safe_io.SMALL  # bytes in one history line: ours take a few hundred; a longer line is skipped, unread
_CHUNK = 1 << 16  # the reader's reads


def _lines(f: BinaryIO, cap: int) -> Iterator[tuple[int, bytes | None, int]]:
    """``(number, data, size)`` for each line of ``f`` (numbered from 1, without its newline); ``data`` is None
    for a line over ``cap`` bytes, which is counted but not kept. Reads ``_CHUNK`` bytes at a time and never holds
    more than ``cap + _CHUNK``: ``readline()`` would hold a line of any length."""
    number, part, size = 1, bytearray(), 0  # the line being read: what is kept of it, and its length so far
    while chunk := f.read(_CHUNK):
        at = 0
        while True:
            end = chunk.find(b"\n", at)
            span = memoryview(chunk)[at : len(chunk) if end < 0 else end]
            size += len(span)
            if size <= cap:
                part += span
            elif part:
                part = bytearray()  # over the cap: let go of what was kept
            if end < 0:
                break
            yield number, (bytes(part) if size <= cap else None), size
            number, part, size, at = number + 1, bytearray(), 0, end + 1
    if size:  # a last line without its newline (torn by a kill)
        yield number, (bytes(part) if size <= cap else None), size


def iter_history(
    path: str | os.PathLike[str], *, note: Callable[[str], None] | None = None
) -> Iterator[dict[str, Any]]:
    """The lines of one ``history.jsonl`` file, parsed, in file order, read in bounded memory.

    A line that does not parse (torn by a kill, not a JSON object, nested
    too deep) is skipped. A line over :data:`MAX_LINE` bytes is skipped
    without being held in memory, and ``note`` gets one line naming the file
    and the line number.

    Args:
        path: The file itself.
        note: Where the note of a skipped long line goes; default: a warning of the ``preempt`` logger.

    Raises:
        OSError: The file cannot be opened or read (missing, no permission,
            not a regular file: :class:`preempt.checkpoint.safe_io.UnsafeFileError`).
    """
    p = Path(path)
    say = note if note is not None else _log.log.warning
    with io.FileIO(safe_io.open_fd(p), "rb", closefd=True) as f:
        for number, raw, size in _lines(f, MAX_LINE):
            if raw is None:
                say(
                    f"{safe_io.path_text(p)} line {number}: {size} bytes, over the {_log.size(MAX_LINE)} a history"
                    " line may take; skipped"
                )
                continue
            try:
                doc = safe_io.load_json(raw, str(p))
            except ValueError:
                continue
            yield doc


def read_history(
    path: str | os.PathLike[str], *, timeline: bool = True, note: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """The lines of a ``history.jsonl``, parsed (see :func:`iter_history`: what is skipped, and ``note``).

    Args:
        path: The file (or the run's directory).
        timeline: Follow the run's timeline: a ``resume`` marker at step N
            drops the records before it with a step > N (they were made
            after the checkpoint the run went back to). False: every line.
        note: As for :func:`iter_history`.
    """
    p = Path(path)
    if p.is_dir():
        p = p / HISTORY_FILE
    out: list[dict[str, Any]] = []
    for doc in iter_history(p, note=note):
        if timeline and doc.get("event") == "resume" and isinstance(doc.get("step"), int):
            n = doc["step"]
            out = [d for d in out if "event" in d or not isinstance(d.get("step"), int) or d["step"] <= n]
        out.append(doc)
    return out


__all__ = [
    "HISTORY_FILE",
    "LOG_FILE",
    "MAX_LINE",
    "EarlyRecords",
    "History",
    "RunLog",
    "iter_history",
    "read_history",
]


def tail(path: str | os.PathLike[str], nbytes: int = 1 << 16) -> list[dict[str, Any]]:
    """The whole lines among the last ``nbytes`` of a ``history.jsonl``, parsed (what a start reads of the process
    before it: how it ended); a line that does not parse is skipped. Empty when the file cannot be read."""
    try:
        fd = safe_io.open_fd(path)
    except OSError:
        return []
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - nbytes)
        data = os.pread(fd, size - start, start)
    except OSError:
        return []
    finally:
        os.close(fd)
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]  # the first is a part of a line
    out = []
    for raw in lines:
        if not raw.strip():
            continue
        try:
            doc = safe_io.load_json(raw, str(path))
        except ValueError:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out
