"""History.record (one history.jsonl line per step) against what it is made of, in the same run.

    python bench/bench_history.py                 # 7 rounds of 20000 records each
    python bench/bench_history.py --records 50000 --rounds 9

Each round times ``--records`` calls of each way of writing a step's line, alternating, so that load on a shared
machine falls on all alike: ``History.record`` (preempt), the floor it is built on (``json.dumps`` of the same
record and one ``os.write`` to an ``O_APPEND`` file), and a ``logging.FileHandler`` writing the same JSON (what a
run that logs its metrics through logging pays). Prints the median microseconds per record of each and the ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

from preempt.health.history import History

METRICS = {"loss": 2.345678, "acc": 0.5, "grad_norm": 1.25}
GPU = {"allocated": 4 << 30, "reserved": 5 << 30}


def time_history(d: Path, n: int) -> float:
    with History(d / "h") as h:
        t0 = time.perf_counter()
        for i in range(n):
            h.record(i, 0, METRICS, lr=3e-4, step_time_s=0.21, gpu_mem=GPU)
        return (time.perf_counter() - t0) / n


def time_floor(d: Path, n: int) -> float:
    fd = os.open(d / "floor.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            line = {"t": time.time(), "step": i, "epoch": 0, **METRICS, "lr": 3e-4, "step_time_s": 0.21, "gpu": GPU}
            os.write(fd, (json.dumps(line) + "\n").encode())
        return (time.perf_counter() - t0) / n
    finally:
        os.close(fd)


def time_logging(d: Path, n: int) -> float:
    logger = logging.getLogger("bench_history")
    logger.propagate = False
    handler = logging.FileHandler(d / "logging.jsonl")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            line = {"t": time.time(), "step": i, "epoch": 0, **METRICS, "lr": 3e-4, "step_time_s": 0.21, "gpu": GPU}
            logger.info(json.dumps(line))
        return (time.perf_counter() - t0) / n
    finally:
        logger.removeHandler(handler)
        handler.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    ways = {"History.record": time_history, "json.dumps + write(2)": time_floor, "logging.FileHandler": time_logging}
    times: dict[str, list[float]] = {name: [] for name in ways}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for way in ways.values():  # warm up
            way(d, 500)
        for _ in range(args.rounds):
            for name, way in ways.items():
                times[name].append(way(d, args.records))
    median = {name: statistics.median(t) for name, t in times.items()}
    ours = median["History.record"]
    print(f"{args.rounds} rounds of {args.records} records, median per record:")
    for name, t in median.items():
        print(f"  {name:24s} {t * 1e6:6.2f} us   History.record / this = {ours / t:.2f}x")


if __name__ == "__main__":
    main()
