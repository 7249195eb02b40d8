"""GPU monitor: a daemon thread that samples NVML into ``gpu_stats.jsonl`` and summarises it in ``gpu_stats.json``.

:class:`GPUMonitor` reads, for every selected GPU, every ``interval`` seconds:

===================  =========================================  =================================
field                meaning                                    NVML call
===================  =========================================  =================================
``util_gpu_pct``     % of the interval a kernel ran             ``nvmlDeviceGetUtilizationRates``
``util_mem_pct``     % of the interval memory was read/written  ``nvmlDeviceGetUtilizationRates``
``mem_used_bytes``   device memory in use (all processes)       ``nvmlDeviceGetMemoryInfo``
``mem_total_bytes``  device memory in all                       ``nvmlDeviceGetMemoryInfo``
``temp_c``           GPU core temperature, Celsius              ``nvmlDeviceGetTemperature``
``power_w``          board power draw, watts                    ``nvmlDeviceGetPowerUsage``
``sm_clock_mhz``     SM clock, MHz                              ``nvmlDeviceGetClockInfo``
===================  =========================================  =================================

Files in ``out_dir`` (both survive restarts of the job):

* ``gpu_stats.jsonl``: appended, one JSON object per line, flushed per
  sampling round. A session begins with an event line
  ``{"t": ..., "event": "start", "host": ..., "pid": ..., "interval": ...,
  "gpus": [{"gpu": 0, "name": ..., "uuid": ...}]}``; every other line is a
  sample ``{"t": <unix seconds>, "gpu": <NVML index>, <field>: <value>, ...}``.
  A field the GPU does not support (power on some boards) or that failed in
  that round is ``null``.
* ``gpu_stats.json``: written atomically (:func:`preempt.checkpoint.commit.write_atomic`)
  when the monitor stops. ``{"format": 1, "sessions": [...]}``, one session
  per monitored process (a preempted job that is requeued adds one), each
  with per GPU ``samples``, ``first``/``last`` (unix seconds), and ``mean``
  and ``max`` of every field that had a value; a field that never had one is
  left out.

Without NVML (no ``pynvml`` module, no driver, no GPU) the monitor is
unavailable: :attr:`GPUMonitor.available` is False, :attr:`GPUMonitor.reason`
says why (also logged once at INFO), no thread starts and no file is written.
Monitoring never stops a training: errors while sampling are logged once per
kind and the field is null; an unexpected failure of the thread is logged
with its traceback and kept in :attr:`GPUMonitor.error` (it is not re-raised
by :meth:`GPUMonitor.stop`, unlike a failed checkpoint write, because a lost
statistic is not lost work).

``pynvml`` comes from the ``nvidia-ml-py`` distribution and is imported only
when a monitor is created, never by ``import preempt``.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .. import _log
from .._log import duration, log
from ..checkpoint import commit, safe_io

SAMPLES = "gpu_stats.jsonl"
SUMMARY = "gpu_stats.json"
THREAD_NAME = "preempt-gpu-monitor"
SUMMARY_FORMAT = 1


def _utilization(nv: Any, handle: Any) -> tuple[float, float]:
    u = nv.nvmlDeviceGetUtilizationRates(handle)
    return u.gpu, u.memory


def _memory(nv: Any, handle: Any) -> tuple[int, int]:
    m = nv.nvmlDeviceGetMemoryInfo(handle)
    return m.used, m.total


def _temperature(nv: Any, handle: Any) -> tuple[float]:
    return (nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU),)


def _power(nv: Any, handle: Any) -> tuple[float]:
    return (nv.nvmlDeviceGetPowerUsage(handle) / 1000.0,)  # NVML reports milliwatts


def _sm_clock(nv: Any, handle: Any) -> tuple[float]:
    return (nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM),)


# (group, the fields one NVML call fills, the call). A group that a GPU does not support is not asked again.
_READERS: tuple[tuple[str, tuple[str, ...], Callable[[Any, Any], tuple[Any, ...]]], ...] = (
    ("utilization", ("util_gpu_pct", "util_mem_pct"), _utilization),
    ("memory", ("mem_used_bytes", "mem_total_bytes"), _memory),
    ("temperature", ("temp_c",), _temperature),
    ("power", ("power_w",), _power),
    ("sm clock", ("sm_clock_mhz",), _sm_clock),
)
FIELDS: tuple[str, ...] = tuple(f for _, fields, _ in _READERS for f in fields)


def _import_pynvml() -> Any:
    import pynvml  # from nvidia-ml-py; imported here so that `import preempt` never needs it

    return pynvml


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _why_no_nvml(nv: Any, e: BaseException) -> str:
    if isinstance(e, getattr(nv, "NVMLError_LibraryNotFound", ())):
        return "the NVML library (libnvidia-ml.so.1) was not found: no NVIDIA driver on this machine"
    if isinstance(e, getattr(nv, "NVMLError_DriverNotLoaded", ())):
        return "the NVIDIA driver is not loaded"
    return f"nvmlInit failed: {type(e).__name__}: {e}"


class _Stats:
    """Count, first/last time, and sum and max of every field, for one GPU."""

    def __init__(self) -> None:
        self.samples = 0
        self.first: float | None = None
        self.last: float | None = None
        self.count: dict[str, int] = {}
        self.sum: dict[str, float] = {}
        self.max: dict[str, float] = {}

    def add(self, t: float, values: dict[str, Any]) -> None:
        self.samples += 1
        self.first = t if self.first is None else self.first
        self.last = t
        for name, v in values.items():
            if v is None:
                continue
            self.count[name] = self.count.get(name, 0) + 1
            self.sum[name] = self.sum.get(name, 0) + v
            self.max[name] = v if name not in self.max else max(self.max[name], v)

    def summary(self) -> dict[str, Any]:
        names = [f for f in FIELDS if f in self.count]  # a field with no value at all is left out
        return {
            "samples": self.samples,
            "first": self.first,
            "last": self.last,
            "mean": {f: self.sum[f] / self.count[f] for f in names},
            "max": {f: self.max[f] for f in names},
        }


class GPUMonitor:
    """Samples NVML in a named daemon thread (``preempt-gpu-monitor``) until stopped.

    Use it as a context manager or call :meth:`start` and :meth:`stop`::

        with GPUMonitor("runs/exp1", interval=10.0) as mon:
            train()
            print(mon.read_memory())  # {0: 12345678, ...}: bytes in use per GPU, now

    NVML is probed when the monitor is created: :attr:`available` and
    :attr:`reason` are known at once, and an unavailable monitor is a no-op.

    Args:
        out_dir: Directory of ``gpu_stats.jsonl`` and ``gpu_stats.json``;
            created at :meth:`start` if missing.
        interval: Seconds between two sampling rounds (> 0). The first round
            is taken as soon as the thread starts.
        nvml: The NVML binding, an object with the ``pynvml`` API (a fake in
            tests). None: ``import pynvml`` (from ``nvidia-ml-py``).
        devices: NVML indices of the GPUs to watch. None: every GPU NVML
            sees. NVML numbers GPUs by PCI bus and ignores
            ``CUDA_VISIBLE_DEVICES``; on a shared node pass the job's GPUs.
        clock: Source of the unix times written as ``t``.

    Raises:
        ValueError: ``interval`` is not a finite number > 0, ``devices`` is
            empty or not made of indices >= 0, or names a GPU that NVML does
            not list.
        NotADirectoryError: ``out_dir`` exists and is not a directory.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        interval: float = 10.0,
        *,
        nvml: Any = None,
        devices: Sequence[int] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not (0 < interval < math.inf):
            raise ValueError(f"GPUMonitor interval: expected a number of seconds > 0, found {interval!r}")
        if devices is not None:
            devices = list(devices)
            if not devices or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices):
                raise ValueError(
                    f"GPUMonitor devices: expected None or a non-empty list of GPU indices >= 0, found {devices!r}"
                )
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise NotADirectoryError(f"GPUMonitor out_dir {self.out_dir}: expected a directory, found a file")
        self.interval = float(interval)
        self.samples_path = self.out_dir / SAMPLES
        self.summary_path = self.out_dir / SUMMARY
        self.available = False
        self.reason = ""
        self.error: BaseException | None = None
        _log.setup()  # the INFO line on why the monitor is off must be seen without any logging setup
        self._clock = clock
        self._nv: Any = None
        self._handles: dict[int, Any] = {}
        self._gpus: list[dict[str, Any]] = []
        self._stats: dict[int, _Stats] = {}
        self._unsupported: set[tuple[int, str]] = set()
        self._unsupported_errors: tuple[type[BaseException], ...] = ()
        self._reported: set[tuple[Any, ...]] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _stats (the thread writes, stop() may read) and NVML vs shutdown
        self._thread: threading.Thread | None = None
        self._file: Any = None
        self._started_at: float | None = None
        self._stopped = False
        self._probe(nvml, devices)

    # -- setup -------------------------------------------------------------------------------------------------

    def _probe(self, nvml: Any, devices: list[int] | None) -> None:
        nv = nvml
        if nv is None:
            try:
                nv = _import_pynvml()
            except ImportError as e:
                self._off(f"the pynvml module is not installed (pip install nvidia-ml-py): {e}")
                return
        try:
            nv.nvmlInit()
        except Exception as e:  # any failure here means "no NVML", never a crash of the training
            self._off(_why_no_nvml(nv, e))
            return
        try:
            count = int(nv.nvmlDeviceGetCount())
            if count == 0:
                self._shutdown(nv)
                self._off("NVML lists no GPU on this machine")
                return
            wanted = devices if devices is not None else list(range(count))
            missing = [d for d in wanted if d >= count]
            if missing:
                self._shutdown(nv)
                raise ValueError(
                    f"GPUMonitor devices: expected NVML indices 0..{count - 1} (NVML lists {count} GPU"
                    f"{'s' if count != 1 else ''}), found {missing}"
                )
            handles = {i: nv.nvmlDeviceGetHandleByIndex(i) for i in wanted}
        except ValueError:
            raise
        except Exception as e:
            self._shutdown(nv)
            self._off(f"NVML could not list the GPUs: {type(e).__name__}: {e}")
            return
        self._nv = nv
        # NotSupported: the board lacks the sensor; FunctionNotFound: the driver lacks the call. Neither will change.
        kinds = (getattr(nv, "NVMLError_NotSupported", None), getattr(nv, "NVMLError_FunctionNotFound", None))
        self._unsupported_errors = tuple(c for c in kinds if c is not None)
        self._handles = handles
        self._stats = {i: _Stats() for i in handles}
        self._gpus = [{"gpu": i, "name": self._info(i, "name"), "uuid": self._info(i, "uuid")} for i in handles]
        self.available = True

    def _info(self, gpu: int, what: str) -> str | None:
        fn = self._nv.nvmlDeviceGetName if what == "name" else self._nv.nvmlDeviceGetUUID
        try:
            return _text(fn(self._handles[gpu]))
        except Exception as e:
            self._report(gpu, what, e)
            return None

    def _off(self, reason: str) -> None:
        self.reason = reason
        log.info("GPU monitor off: %s; no %s is written", reason, SAMPLES)

    @staticmethod
    def _shutdown(nv: Any) -> None:
        try:
            nv.nvmlShutdown()
        except Exception as e:  # nothing to do about it, and nothing depends on it
            log.debug("GPU monitor: nvmlShutdown failed: %s", e)

    # -- public API --------------------------------------------------------------------------------------------

    @property
    def gpus(self) -> list[dict[str, Any]]:
        """The watched GPUs: ``[{"gpu": index, "name": ..., "uuid": ...}]`` (empty when unavailable)."""
        return [dict(g) for g in self._gpus]

    @property
    def running(self) -> bool:
        """The sampling thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> GPUMonitor:
        """Opens ``gpu_stats.jsonl`` for appending and starts the thread; a no-op when unavailable or running.

        Raises:
            RuntimeError: The monitor was stopped already (create a new one).
            OSError: ``out_dir`` cannot be created or the file cannot be opened.
        """
        if self._stopped:
            raise RuntimeError("GPUMonitor: already stopped; create a new GPUMonitor to monitor again")
        if not self.available or self._thread is not None:
            return self
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # closed by stop(); never through a symlink planted in save_dir, never into a FIFO (preempt.checkpoint.safe_io)
        self._file = os.fdopen(safe_io.open_fd(self.samples_path, os.O_RDWR | os.O_APPEND | os.O_CREAT), "a+b")
        try:
            self._file.seek(0, os.SEEK_END)
            if self._file.tell() > 0:
                self._file.seek(-1, os.SEEK_END)
                if self._file.read(1) != b"\n":  # a predecessor died mid-line: do not glue our first line to it
                    self._file.write(b"\n")
            self._started_at = self._clock()
            header = {
                "t": self._started_at,
                "event": "start",
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "interval": self.interval,
                "gpus": self._gpus,
            }
            self._write([header])
        except BaseException:
            self._file.close()
            self._file = None
            raise
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()
        names = sorted({g["name"] or "?" for g in self._gpus})
        log.info(
            "GPU monitor: sampling %d GPU%s (%s) every %s into %s",
            len(self._gpus),
            "s" if len(self._gpus) != 1 else "",
            ", ".join(names),
            duration(self.interval),
            self.samples_path,
        )
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Wakes the thread at once, joins it, writes ``gpu_stats.json`` and shuts NVML down. Idempotent.

        Never raises for a monitoring problem: a summary that cannot be
        written, or a thread still stuck in an NVML call after ``timeout``
        seconds, is logged as a warning.
        """
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        stuck = False
        if self._thread is not None:
            self._thread.join(timeout)
            stuck = self._thread.is_alive()
            if stuck:
                log.warning(
                    "GPU monitor: the sampling thread is still in an NVML call after %s; left behind (a daemon)",
                    duration(timeout),
                )
        if self._file is not None and not stuck:
            self._file.close()
            self._file = None
        if self._started_at is not None:
            self._write_summary()
        if self._nv is not None and not stuck:  # a thread still inside NVML must not see it shut down under it
            with self._lock:
                self._shutdown(self._nv)
                self._handles = {}

    def close(self) -> None:
        """Same as :meth:`stop`."""
        self.stop()

    def __enter__(self) -> GPUMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def read_memory(self) -> dict[int, int]:
        """Device memory in use now, in bytes, per watched GPU index (one cheap NVML call per GPU).

        Returns ``{}`` when unavailable or stopped; a GPU whose query fails is left out.
        """
        out: dict[int, int] = {}
        with self._lock:
            for gpu, handle in self._handles.items():
                try:
                    out[gpu] = int(self._nv.nvmlDeviceGetMemoryInfo(handle).used)
                except Exception as e:
                    self._report(gpu, "memory", e)
        return out

    def summary(self) -> dict[str, Any]:
        """This session's summary as it stands (the entry :meth:`stop` appends to ``gpu_stats.json``)."""
        with self._lock:
            gpus = [{**info, **self._stats[info["gpu"]].summary()} for info in self._gpus]
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "interval": self.interval,
            "started": self._started_at,
            "stopped": self._clock(),
            "gpus": gpus,
        }

    # -- the thread --------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            next_at = time.monotonic()
            while True:
                self._sample()
                now = time.monotonic()
                next_at += self.interval
                if next_at <= now:  # a round took longer than the interval: skip, do not sample back to back
                    next_at = now + self.interval
                if self._stop.wait(next_at - now):
                    return
        except BaseException as e:  # kept and logged; monitoring never takes the training down
            self.error = e
            log.warning("GPU monitor: sampling stopped after an unexpected error", exc_info=e)

    def _sample(self) -> None:
        t = self._clock()
        lines = []
        for gpu, handle in self._handles.items():
            values = self._read(gpu, handle)
            with self._lock:
                self._stats[gpu].add(t, values)
            lines.append({"t": t, "gpu": gpu, **values})
        self._write(lines)

    def _read(self, gpu: int, handle: Any) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for group, fields, read in _READERS:
            got: tuple[Any, ...] = (None,) * len(fields)
            if (gpu, group) not in self._unsupported:
                try:
                    got = read(self._nv, handle)
                except self._unsupported_errors:
                    self._unsupported.add((gpu, group))  # not asked again: its fields stay null
                except Exception as e:
                    self._report(gpu, group, e)
            values.update(zip(fields, got, strict=True))
        return values

    def _write(self, docs: list[dict[str, Any]]) -> None:
        data = "".join(json.dumps(d, separators=(",", ":")) + "\n" for d in docs).encode()
        try:
            self._file.write(data)
            self._file.flush()
        except OSError as e:  # disk full, say: the summary is still kept in memory
            self._report("file", e.errno, e, f"{self.samples_path}: cannot append ({e}); the summary is still kept")

    def _write_summary(self) -> None:
        session = self.summary()
        sessions: list[Any] = []
        try:
            old = safe_io.read_json(self.summary_path, 64 << 20)
            if not (isinstance(old, dict) and isinstance(old.get("sessions"), list)):
                raise ValueError(f"expected an object with a 'sessions' list, found {type(old).__name__}")
            sessions = old["sessions"]
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:  # a statistic, not a checkpoint: say so and start it afresh
            log.warning("GPU monitor: %s: unreadable, replaced by this session's summary (%s)", self.summary_path, e)
        doc = {"format": SUMMARY_FORMAT, "sessions": [*sessions, session]}
        try:
            commit.write_atomic(self.summary_path, [json.dumps(doc, indent=1).encode()])
        except OSError as e:
            log.warning("GPU monitor: %s: cannot write the summary: %s", self.summary_path, e)

    def _report(self, gpu: Any, what: Any, e: BaseException, message: str | None = None) -> None:
        """Logs a sampling error once per (GPU, what, kind of error); sampling goes on."""
        key = (gpu, what, type(e).__name__)
        if key in self._reported:
            return
        self._reported.add(key)
        if message is None:
            message = (
                f"GPU {gpu}: reading {what} failed: {type(e).__name__}: {e}; "
                "the field is null while it fails, sampling goes on (logged once)"
            )
        log.warning("GPU monitor: %s", message)
