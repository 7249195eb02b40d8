#!/usr/bin/env python
"""What one background thread's work on a copy of the state costs a training loop that runs meanwhile.

    python bench/bench_interference.py [--gib 1.5] [--cycles 12] [--every 3] [--variants none,copy,...]

The loop of ``bench_lazy.py`` (an MLP whose parameters and AdamW moments come to ``--gib`` GiB, a real forward,
backward and ``optimizer.step()`` per step, torch on one thread) runs while a second thread, at the niceness of
preempt's writer, does one part of a background checkpoint's work on buffers of the state's size (one
page-aligned arena, as preempt stages):

- ``none``: nothing (what the estimate reads where nothing happens);
- ``copy``: copy the parameters and moments into the arena (the lazy copy);
- ``hash``: xxh3-128 over the arena;
- ``direct``: write the arena to a new file with ``O_DIRECT``, then ``fdatasync``;
- ``buffered``: the same write through the page cache;
- ``all``: copy, hash, direct write (what a lazy checkpoint's writer does);
- ``all_buffered``: copy, hash, buffered write (before the page cache was bypassed).

Per cycle and variant (interleaved, so that the machine's drift touches every variant alike): the loop runs at
least ``--every`` steps and until the thread ends, then ``--every`` quiet steps. Cost = the time of the first
steps minus as many steps at the mean rate of the quiet windows before and after. The children keep their freed
memory (``GLIBC_TUNABLES``, as ``bench_lazy.py --reuse-memory``), so the loop itself does not page-fault.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

VARIANTS = ("none", "copy", "hash", "direct", "buffered", "all", "all_buffered")
REUSE_MEMORY = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
GIB = 1 << 30
CHUNK = 64 << 20  # bytes per write(2), as preempt's writer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.5)
    p.add_argument("--cycles", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS), help="a comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--dir", default=None, help="where the files are written (default: bench/results)")
    args = p.parse_args()
    variants = args.variants.split(",")
    if args.every < 1 or args.cycles < 2 or args.gib <= 0 or not set(variants) <= set(VARIANTS):
        p.error(f"--every >= 1, --cycles >= 2, --gib > 0, --variants among {','.join(VARIANTS)}")
    if os.environ.get("GLIBC_TUNABLES") != REUSE_MEMORY or os.environ.get("OMP_NUM_THREADS") != "1":
        env = {**os.environ, "GLIBC_TUNABLES": REUSE_MEMORY, "OMP_NUM_THREADS": "1"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)  # malloc reads its tunables at start
    root = Path(args.dir) if args.dir else Path(__file__).resolve().parent / "results"
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as d:
        measure(args, variants, Path(d))


def measure(args: argparse.Namespace, variants: list[str], work: Path) -> None:
    import torch
    import xxhash

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_lazy import build

    torch.set_num_threads(1)
    model, opt, x = build(args.gib, 16)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    step()  # the moments exist from here
    sources = [t for t in model.parameters()] + [v for s in opt.state.values() for v in s.values() if v.dim()]
    total = sum(t.nbytes for t in sources)
    raw = torch.empty(total + 4096, dtype=torch.uint8)
    arena = raw[-raw.data_ptr() % 4096 :][:total]
    arena.fill_(0)
    buffers, offset = [], 0
    for t in sources:
        buffers.append(arena[offset : offset + t.nbytes].view(t.dtype).view(t.shape))
        offset += t.nbytes
    data = arena.numpy()

    def copy() -> None:
        with torch.no_grad():
            for src, buf in zip(sources, buffers, strict=True):
                buf.copy_(src)

    def digest() -> None:
        xxhash.xxh3_128(data).hexdigest()

    def write(direct: bool) -> None:
        path = work / "state"
        path.unlink(missing_ok=True)  # a new file each time, as bench_lazy's runs write
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o644)
        try:
            view = memoryview(data)[: total - total % 4096]
            for i in range(0, view.nbytes, CHUNK):
                os.write(fd, view[i : i + CHUNK])
            os.fdatasync(fd)
        finally:
            os.close(fd)

    jobs: dict[str, Any] = {
        "none": None,
        "copy": copy,
        "hash": digest,
        "direct": lambda: write(True),
        "buffered": lambda: write(False),
        "all": lambda: (copy(), digest(), write(True)),
        "all_buffered": lambda: (copy(), digest(), write(False)),
    }

    def quiet() -> float:
        t0 = time.perf_counter()
        for _ in range(args.every):
            step()
        return (time.perf_counter() - t0) / args.every

    costs: dict[str, list[float]] = {v: [] for v in variants}
    took: dict[str, list[float]] = {v: [] for v in variants}
    before = quiet()
    for _ in range(args.cycles):
        for v in variants:
            box: dict[str, float] = {}

            def background(job: Any = jobs[v], box: dict[str, float] = box) -> None:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # as preempt's writer
                t = time.perf_counter()
                job()
                box["s"] = time.perf_counter() - t

            thread = threading.Thread(target=background) if jobs[v] is not None else None
            t0 = time.perf_counter()
            if thread is not None:
                thread.start()
            steps = 0
            while steps < args.every or (thread is not None and thread.is_alive()):
                step()
                steps += 1
            busy = time.perf_counter() - t0
            if thread is not None:
                thread.join()
            after = quiet()
            costs[v].append(busy - steps * (before + after) / 2)
            took[v].append(box.get("s", 0.0))
            before = after
    print(f"\n{total / GIB:.2f} GiB state, {args.cycles} cycles, interleaved; quiet windows of {args.every} steps")
    print("\n| background work | cost to the loop (mean +- s.e.) | median | the thread's own time |")
    print("|---|---:|---:|---:|")
    for v in variants:
        c = costs[v]
        se = statistics.stdev(c) / len(c) ** 0.5
        print(
            f"| {v} | {statistics.mean(c) * 1e3:.0f} +- {se * 1e3:.0f} ms | {statistics.median(c) * 1e3:.0f} ms"
            f" | {statistics.median(took[v]) * 1e3:.0f} ms |"
        )


if __name__ == "__main__":
    main()
