#!/usr/bin/env python
"""What the GPU monitor costs the training loop: step time with ``GPUMonitor`` sampling vs without it.

    python bench/bench_monitor.py [--rounds 7] [--seconds 2] [--intervals 10,1,0.1]

A training step (an MLP, forward + backward + AdamW; on the GPU with a synchronize per step when CUDA is
there, else on the CPU) runs for about ``--seconds`` per trial. Each round runs one trial per variant in a
rotating order: no monitor, then a monitor started with each ``--intervals`` (10 s is the run's default;
0.1 s is a stress case, 100x the default rate). The table gives the median step time per variant, its
ratio to the median without a monitor, and the paired per-round ratios' spread. A second table times
one sampling round (``GPUMonitor._sample``, every field of every GPU, one JSON line each, flushed) in
the main thread: the thread's own cost per round.

NVML: the real one (``pynvml`` from nvidia-ml-py) when it answers; otherwise, on a machine without an
NVIDIA GPU, a stand-in that answers at once, so only preempt's own sampling code (Python, the GIL, the
file writes) is measured, not the driver's latency. The header says which.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any


class InstantNVML:
    """The part of the pynvml API the monitor reads, answering constant values with no driver call."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    class NVMLError(Exception):
        pass

    NVMLError_NotSupported = NVMLError_FunctionNotFound = NVMLError

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return "instant stand-in"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return "GPU-stand-in"

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=50, memory=20)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(used=1 << 30, total=80 << 30, free=79 << 30)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 40

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return 200_000

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        return 1980


def make_step() -> tuple[Any, str]:
    import torch

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    width, batch = (4096, 512) if cuda else (512, 64)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width), torch.nn.GELU()
    ).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=dev)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()

    what = f"MLP {width}x{width} x2, batch {batch}, AdamW, on {torch.cuda.get_device_name() if cuda else 'the CPU'}"
    return step, what


def trial(step: Any, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seconds", type=float, default=2.0, help="per trial")
    p.add_argument("--intervals", default="10,1,0.1", help="monitor intervals (s), comma-separated")
    args = p.parse_args()
    intervals = [float(s) for s in args.intervals.split(",")]
    if args.rounds < 1 or args.seconds <= 0 or not intervals or min(intervals) <= 0:
        p.error("--rounds >= 1, --seconds > 0 and every interval > 0")
    if len(set(intervals)) != len(intervals):
        p.error(f"--intervals: expected distinct values, found {args.intervals!r}")

    import torch

    from preempt.health.monitor import GPUMonitor

    step, what = make_step()
    with tempfile.TemporaryDirectory() as d:
        probe = GPUMonitor(d, interval=1.0)
        nvml, source = (None, "real NVML (pynvml)") if probe.available else (InstantNVML(), "instant stand-in")
        if not probe.available:
            source += f" (no real one: {probe.reason})"
        for _ in range(20):
            step()  # warm-up
        t_one = trial(step, 20)
        n = max(10, int(args.seconds / t_one))
        variants: list[float | None] = [None, *intervals]
        times: dict[float | None, list[float]] = {v: [] for v in variants}
        sampled: dict[float | None, int] = {v: 0 for v in variants}
        for r in range(args.rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for v in order:
                if v is None:
                    times[v].append(trial(step, n))
                    continue
                out = os.path.join(d, f"v{v}_{r}")
                mon = GPUMonitor(out, interval=v, nvml=nvml).start()
                try:
                    times[v].append(trial(step, n))
                finally:
                    mon.stop()
                with open(os.path.join(out, "gpu_stats.jsonl")) as f:
                    sampled[v] += sum(1 for line in f if '"event"' not in line)
        for v in intervals:
            if sampled[v] == 0:
                raise SystemExit(f"bench: the monitor at {v} s wrote no sample; the comparison would mean nothing")

        mon = GPUMonitor(os.path.join(d, "direct"), interval=3600.0, nvml=nvml).start()
        try:
            rounds = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(200):
                    mon._sample()
                rounds.append((time.perf_counter() - t0) / 200)
            gpus = len(mon.gpus)
        finally:
            mon.stop()

    base = statistics.median(times[None])
    print(f"\nGPU monitor vs none: {what}; torch {torch.__version__}; NVML: {source}")
    print(f"{args.rounds} rounds x {len(variants)} trials of {n} steps (~{n * t_one:.1f} s each), rotating order\n")
    print("| monitor | samples written | median step | vs none | paired ratios min..max |")
    print("|---|---:|---:|---:|---:|")
    for v in variants:
        med = statistics.median(times[v])
        paired = [a / b for a, b in zip(times[v], times[None], strict=True)]
        label = "none" if v is None else f"every {v:g} s"
        count = "-" if v is None else str(sampled[v])
        print(f"| {label} | {count} | {med * 1e3:.3f} ms | {med / base:.4f}x | {min(paired):.3f}..{max(paired):.3f} |")
    per = statistics.median(rounds)
    print(f"\none sampling round ({gpus} GPU(s), every field, one flushed JSON line each): {per * 1e6:.1f} us")
    print(f"  = {per / 10.0:.1e} of the default 10 s interval on the monitor's thread")


if __name__ == "__main__":
    sys.exit(main())
