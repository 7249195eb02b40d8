#!/usr/bin/env python
"""What the ranks' agreement costs per ``run.step()``: torchrun with N gloo ranks on this machine.

    python bench/bench_distributed.py [--nproc 2] [--steps 2000]

Re-launches itself under ``torch.distributed.run --standalone``; rank 0 prints, per row, the median of 3
timings of ``--steps`` calls: a bare ``dist.all_reduce`` of 3 int64 on a gloo group (the floor),
``run.step()`` with ``sync_every_steps`` 1 and 10 (nothing due), and a single-process ``run.step()`` for
reference (measured in the same rank, before the group is used).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def timed(fn, n: int) -> float:
    out = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def worker(steps: int) -> None:
    import torch
    import torch.distributed as dist

    from preempt import PreemptibleRun

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    buf = torch.zeros(3, dtype=torch.int64)
    rows = [("dist.all_reduce of 3 int64 (gloo)", timed(lambda: dist.all_reduce(buf, op=dist.ReduceOp.MAX), steps))]
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for every in (1, 10):
        with tempfile.TemporaryDirectory() as d:
            shared = [d]
            dist.broadcast_object_list(shared, src=0)  # one directory for all ranks
            kw = dict(checkpoint_interval=None, sync_every_steps=every, exit_if_complete=False)
            with PreemptibleRun(shared[0], model=model, optimizer=opt, **kw) as run:
                rows.append((f"run.step(), sync_every_steps={every}", timed(run.step, steps)))
            dist.barrier()
    if rank == 0:
        print(f"\n{dist.get_world_size()} ranks, gloo, torch {torch.__version__}, medians of 3 x {steps} calls\n")
        print("| what | per call |\n|---|---:|")
        for what, sec in rows:
            print(f"| {what} | {sec * 1e6:.1f} us |")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.steps)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    cmd += [__file__, "--worker", "--steps", str(args.steps)]
    sys.exit(subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "PREEMPT_LOG_LEVEL": "WARNING"}))


if __name__ == "__main__":
    main()
