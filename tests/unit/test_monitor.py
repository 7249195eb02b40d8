"""GPUMonitor against a fake NVML: samples, summary numbers, errors, stopping, and the machine without a GPU."""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from preempt.health.monitor import FIELDS, SAMPLES, SUMMARY, THREAD_NAME, GPUMonitor

GiB = 1 << 30
# Per sampling round n (cycled): what the fake GPUs report.
UTIL = [10, 50, 30, 90, 20, 70]
MEM_USED = [1 * GiB, 3 * GiB, 2 * GiB, 5 * GiB, 4 * GiB, 6 * GiB]
POWER_MW = [100_000, 250_500, 180_000, 300_000, 120_000, 200_000]


class FakeNVML:
    """The part of the pynvml API the monitor uses, with the real pynvml exception classes.

    GPU 0 supports everything. GPU 1 ("old board") has no power sensor
    (NotSupported), returns its name as bytes (old pynvml), and its temperature
    fails with a GPU-is-lost error in rounds 1 and 2, then recovers.
    """

    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_FunctionNotFound = pynvml.NVMLError_FunctionNotFound
    NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
    NVMLError_DriverNotLoaded = pynvml.NVMLError_DriverNotLoaded
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM

    def __init__(self, count: int = 2, init_error: BaseException | None = None) -> None:
        self.count = count
        self.init_error = init_error
        self.initialised = 0
        self.calls: Counter[tuple[str, int]] = Counter()
        self._cond = threading.Condition()

    def _round(self, name: str, h: int) -> int:
        with self._cond:
            n = self.calls[(name, h)]
            self.calls[(name, h)] += 1
            self._cond.notify_all()
            return n

    def wait_rounds(self, k: int, timeout: float = 10.0) -> None:
        """Blocks until GPU 0's memory has been read ``k`` times (read_memory calls count too)."""
        with self._cond:
            assert self._cond.wait_for(lambda: self.calls[("mem", 0)] >= k, timeout), dict(self.calls)

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        assert 0 <= i < self.count
        return i

    def nvmlDeviceGetName(self, h: int) -> str | bytes:
        return "Fake H100" if h == 0 else b"Fake K80"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-fake-{h}"

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        n = self._round("util", h)
        return SimpleNamespace(gpu=UTIL[n % 6] + h, memory=UTIL[n % 6] // 2)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        n = self._round("mem", h)
        return SimpleNamespace(used=MEM_USED[n % 6] + h, total=80 * GiB, free=80 * GiB - MEM_USED[n % 6])

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        n = self._round("temp", h)
        if h == 1 and n in (1, 2):
            raise pynvml.NVMLError_GpuIsLost()
        return 40 + n

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        n = self._round("power", h)
        if h == 1:
            raise pynvml.NVMLError_NotSupported()
        return POWER_MW[n % 6]

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        assert clock == self.NVML_CLOCK_SM
        self._round("clock", h)
        return 1980


def counter_clock(start: float = 1000.0) -> Callable[[], float]:
    """A unix clock that moves one second per call."""
    t = [start - 1.0]

    def clock() -> float:
        t[0] += 1.0
        return t[0]

    return clock


def read_lines(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(start events, samples) of a gpu_stats.jsonl."""
    docs = [json.loads(line) for line in path.read_text().splitlines()]
    return [d for d in docs if d.get("event") == "start"], [d for d in docs if "gpu" in d]


def monitor_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


@pytest.fixture
def info_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="preempt")
    return caplog


def test_samples_and_summary_with_unsupported_and_failing_fields(tmp_path, info_logs):
    nv = FakeNVML()
    mon = GPUMonitor(tmp_path, interval=0.01, nvml=nv, clock=counter_clock())
    assert mon.available and mon.reason == ""
    assert mon.gpus == [
        {"gpu": 0, "name": "Fake H100", "uuid": "GPU-fake-0"},
        {"gpu": 1, "name": "Fake K80", "uuid": "GPU-fake-1"},
    ]
    mon.start()
    try:
        (thread,) = monitor_threads()
        assert thread.daemon and mon.running
        nv.wait_rounds(5)
    finally:
        mon.stop()
    assert not thread.is_alive() and not mon.running and mon.error is None
    assert nv.initialised == 0, "nvmlShutdown must balance nvmlInit"

    starts, samples = read_lines(tmp_path / SAMPLES)
    (start,) = starts
    assert start["t"] == 1000.0 and start["interval"] == 0.01 and start["gpus"] == mon.gpus
    rounds = len(samples) // 2
    assert rounds >= 5 and len(samples) == 2 * rounds
    gpu0 = [s for s in samples if s["gpu"] == 0]
    gpu1 = [s for s in samples if s["gpu"] == 1]
    for n, (s0, s1) in enumerate(zip(gpu0, gpu1, strict=True)):
        assert set(s0) == {"t", "gpu", *FIELDS} == set(s1)
        assert s0["t"] == s1["t"] == 1001.0 + n  # one clock reading per round, shared by the GPUs
        assert s0["util_gpu_pct"] == UTIL[n % 6] and s0["util_mem_pct"] == UTIL[n % 6] // 2
        assert s0["mem_used_bytes"] == MEM_USED[n % 6] and s0["mem_total_bytes"] == 80 * GiB
        assert s0["power_w"] == POWER_MW[n % 6] / 1000 and s0["sm_clock_mhz"] == 1980 and s0["temp_c"] == 40 + n
        assert s1["power_w"] is None  # not supported on this board
        assert s1["temp_c"] is None if n in (1, 2) else s1["temp_c"] == 40 + n  # failed mid-run, then recovered
    assert nv.calls[("power", 1)] == 1, "an unsupported field is not asked again"
    lost = [r for r in info_logs.records if "GpuIsLost" in r.getMessage()]
    assert len(lost) == 1 and lost[0].levelno == logging.WARNING, "an error is logged once"
    assert "GPU 1: reading temperature failed" in lost[0].getMessage()

    doc = json.loads((tmp_path / SUMMARY).read_text())
    (session,) = doc["sessions"]
    assert doc["format"] == 1 and session["started"] == 1000.0 and session["interval"] == 0.01
    g0, g1 = session["gpus"]
    assert (g0["gpu"], g0["name"], g0["uuid"], g1["name"]) == (0, "Fake H100", "GPU-fake-0", "Fake K80")
    assert g0["samples"] == g1["samples"] == rounds
    assert (g0["first"], g0["last"]) == (1001.0, 1000.0 + rounds)
    util = [UTIL[n % 6] for n in range(rounds)]
    mem = [MEM_USED[n % 6] for n in range(rounds)]
    watts = [POWER_MW[n % 6] / 1000 for n in range(rounds)]
    assert g0["mean"]["util_gpu_pct"] == pytest.approx(sum(util) / rounds) and g0["max"]["util_gpu_pct"] == max(util)
    assert g0["mean"]["mem_used_bytes"] == pytest.approx(sum(mem) / rounds) and g0["max"]["mem_used_bytes"] == max(mem)
    assert g0["mean"]["power_w"] == pytest.approx(sum(watts) / rounds) and g0["max"]["power_w"] == max(watts)
    assert g0["max"]["mem_total_bytes"] == 80 * GiB and g0["mean"]["sm_clock_mhz"] == 1980
    assert "power_w" not in g1["mean"] and "power_w" not in g1["max"], "a field with no value is left out"
    temps1 = [40 + n for n in range(rounds) if n not in (1, 2)]  # the failed rounds do not count
    assert g1["mean"]["temp_c"] == pytest.approx(sum(temps1) / len(temps1)) and g1["max"]["temp_c"] == max(temps1)
    assert g1["max"]["mem_used_bytes"] == max(mem) + 1
    assert not list(tmp_path.glob(".tmp-*")), "the atomic write leaves no temporary file"


def test_stop_is_prompt_and_idempotent(tmp_path):
    nv = FakeNVML(count=1)
    mon = GPUMonitor(tmp_path, interval=60.0, nvml=nv).start()
    nv.wait_rounds(1)  # the first round is taken at once, not after 60 s
    t0 = time.monotonic()
    mon.stop()
    # stop() wakes the thread: it does not wait out the 60 s interval (a bound far from any machine's speed)
    assert time.monotonic() - t0 < 30.0, "stop() waited out the interval instead of waking the thread"
    assert not monitor_threads()
    mon.stop()
    mon.close()
    assert nv.initialised == 0
    _, samples = read_lines(tmp_path / SAMPLES)
    assert len(samples) == 1
    with pytest.raises(RuntimeError, match="already stopped; create a new GPUMonitor"):
        mon.start()


def test_context_manager_and_appending_across_restarts(tmp_path):
    out = tmp_path / "run" / "stats"  # created on start
    with GPUMonitor(out, interval=60.0, nvml=FakeNVML(count=1), clock=counter_clock(1000.0)) as mon:
        assert mon.running and out.is_dir()
        assert mon.start() is mon and len(monitor_threads()) == 1, "start() while running is a no-op"
    assert not mon.running
    with open(out / SAMPLES, "ab") as f:
        f.write(b'{"t":1500.0,"gpu":0,"util_')  # a predecessor killed mid-line
    with GPUMonitor(out, interval=60.0, nvml=FakeNVML(count=1), clock=counter_clock(2000.0)):
        pass
    lines = (out / SAMPLES).read_text().splitlines()
    assert lines[-3] == '{"t":1500.0,"gpu":0,"util_', "the torn line stays alone on its line"
    docs = [json.loads(line) for i, line in enumerate(lines) if i != len(lines) - 3]
    assert [d["t"] for d in docs if d.get("event") == "start"] == [1000.0, 2000.0]
    sessions = json.loads((out / SUMMARY).read_text())["sessions"]
    assert [s["started"] for s in sessions] == [1000.0, 2000.0]
    assert all(s["gpus"][0]["samples"] == 1 for s in sessions)


def test_devices_selects_gpus_and_read_memory(tmp_path):
    nv = FakeNVML(count=2)
    mon = GPUMonitor(tmp_path, interval=60.0, nvml=nv, devices=[1])
    assert [g["gpu"] for g in mon.gpus] == [1]
    assert mon.read_memory() == {1: MEM_USED[0] + 1}  # works before start, too
    with mon:
        now = mon.read_memory()
        assert list(now) == [1] and now[1] - 1 in MEM_USED
    assert mon.read_memory() == {}, "NVML is shut down after stop"
    _, samples = read_lines(tmp_path / SAMPLES)
    assert {s["gpu"] for s in samples} == {1}


def test_an_unexpected_failure_of_the_thread_is_kept_and_logged_not_raised(tmp_path, info_logs):
    calls = [0]

    def clock() -> float:
        calls[0] += 1
        if calls[0] == 3:  # the header, round 1, then this
            raise RuntimeError("clock broke")
        return 1000.0 + calls[0]

    mon = GPUMonitor(tmp_path, interval=0.01, nvml=FakeNVML(count=1), clock=clock).start()
    deadline = time.monotonic() + 10
    while mon.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not mon.running and isinstance(mon.error, RuntimeError)
    assert any("sampling stopped after an unexpected error" in r.getMessage() for r in info_logs.records)
    mon.stop()  # does not raise: monitoring never takes the training down
    (session,) = json.loads((tmp_path / SUMMARY).read_text())["sessions"]
    assert session["gpus"][0]["samples"] == 1


def test_an_unreadable_summary_is_replaced_with_a_warning(tmp_path, info_logs):
    (tmp_path / SUMMARY).write_text("{not json")
    with GPUMonitor(tmp_path, interval=60.0, nvml=FakeNVML(count=1)):
        pass
    assert len(json.loads((tmp_path / SUMMARY).read_text())["sessions"]) == 1
    assert any(f"{tmp_path / SUMMARY}: unreadable" in r.getMessage() for r in info_logs.records)


def test_pynvml_is_imported_only_when_a_monitor_is_made():
    import preempt.health.monitor

    assert "pynvml" not in vars(preempt.health.monitor), "no top-level `import pynvml` in preempt.health.monitor"


def _no_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda mp: FakeNVML(init_error=pynvml.NVMLError_LibraryNotFound()), "libnvidia-ml.so.1) was not found"),
        (lambda mp: FakeNVML(init_error=pynvml.NVMLError_DriverNotLoaded()), "the NVIDIA driver is not loaded"),
        (lambda mp: FakeNVML(init_error=OSError("odd")), "nvmlInit failed: OSError: odd"),
        (lambda mp: FakeNVML(count=0), "NVML lists no GPU"),
        (_no_module, "the pynvml module is not installed"),
    ],
    ids=["library-not-found", "driver-not-loaded", "other-error", "no-gpu", "no-module"],
)
def test_without_nvml_or_gpu_the_monitor_is_off_quietly(tmp_path, info_logs, monkeypatch, make, why):
    nv = make(monkeypatch)
    out = tmp_path / "run"
    mon = GPUMonitor(out, interval=1.0, nvml=nv)
    assert not mon.available and why in mon.reason
    (line,) = [r for r in info_logs.records if r.name == "preempt"]
    assert line.levelno == logging.INFO and line.getMessage().startswith("GPU monitor off: ")
    assert why in line.getMessage()
    with mon:
        assert not mon.running and not monitor_threads()
        assert mon.read_memory() == {} and mon.gpus == []
    assert not out.exists(), "no directory, no file"
    if nv is not None:
        assert nv.initialised == 0


def _nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_nvml_works(), reason="NVML works on this machine; tests/gpu/test_monitor_gpu.py covers it")
def test_the_real_pynvml_on_a_machine_without_gpu(tmp_path, info_logs):
    mon = GPUMonitor(tmp_path / "run", interval=1.0)
    assert not mon.available and mon.reason
    mon.start()
    assert not monitor_threads()
    mon.stop()
    assert not (tmp_path / "run").exists()
    assert any(r.getMessage().startswith("GPU monitor off: ") for r in info_logs.records)


@pytest.mark.parametrize("interval", [0, -1.0, math.nan, math.inf, "10", True, None])
def test_a_bad_interval_is_refused(tmp_path, interval):
    with pytest.raises(ValueError, match=rf"GPUMonitor interval: expected a number of seconds > 0, found {interval!r}"):
        GPUMonitor(tmp_path, interval=interval, nvml=FakeNVML())


def test_out_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "stats"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match=rf"GPUMonitor out_dir {f}: expected a directory, found a file"):
        GPUMonitor(f, nvml=FakeNVML())
    with pytest.raises(NotADirectoryError):  # checked even where there is no GPU, so CI catches it
        GPUMonitor(f, nvml=FakeNVML(init_error=pynvml.NVMLError_LibraryNotFound()))
    assert f.read_text() == "x"


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ([], r"expected None or a non-empty list of GPU indices >= 0, found \[\]"),
        ([0, -1], r"expected None or a non-empty list of GPU indices >= 0, found \[0, -1\]"),
        (["0"], r"expected None or a non-empty list of GPU indices >= 0, found \['0'\]"),
        ([0, 5, 2], r"expected NVML indices 0..1 \(NVML lists 2 GPUs\), found \[5, 2\]"),
    ],
)
def test_bad_devices_are_refused(tmp_path, devices, message):
    nv = FakeNVML(count=2)
    with pytest.raises(ValueError, match=rf"GPUMonitor devices: {message}"):
        GPUMonitor(tmp_path, nvml=nv, devices=devices)
    assert nv.initialised == 0
