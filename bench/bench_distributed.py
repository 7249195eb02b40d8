#!/usr/bin/env python
"""What the ranks' agreement costs per ``run.step()``: torchrun with N gloo ranks on this machine.

    python bench/bench_distributed.py [--nproc 2] [--steps 2000] [--gib 0.5] [--saves 4]

Re-launches itself under ``torch.distributed.run --standalone``; rank 0 prints, per row, the median of 3
timings of ``--steps`` calls: a bare ``dist.all_reduce`` of 3 int64 on a gloo group (the floor), and
``run.step()`` with ``sync_every_steps`` 1 and 10 (nothing due).

A second table: what a checkpoint of a DDP state of ``--gib`` GiB (bench_checkpoint's GPT-like model and
AdamW moments, replicated on every rank) costs the loop, ``async_save`` on and off, ``--saves`` checkpoints
each after one warm-up: the median of the longest ``run.step()`` among the ranks at a save step (every rank
waits for the others there), and the median time to durable (rank 0's ``run.last_save``).

A third table: the same state sharded by FSDP2 (``fully_shard`` on a CPU mesh), saved by preempt in the
background and synchronously, and by DCP's ``async_save`` with a reused stager, of the same tensors.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any


def timed(fn, n: int) -> float:
    out = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def preempt_saves(
    model: Any, opt: Any, saves: int, *, every_rank_stages: bool, change: Callable[[], None] | None = None
) -> list[tuple[str, float, float]]:
    """``async_save`` off and on: (mode, median loop time of a save step, max over ranks; median seconds to durable).

    ``every_rank_stages``: every rank sizes staging buffers at the start (sharded state), else rank 0 alone.
    ``change``: changes the state before each save, untimed, as a training step would, and rank 0 checks that its
    checkpoint wrote every file (a replicated state; a sharded one is written whole by DCP every time).
    """
    import torch
    import torch.distributed as dist
    from bench_checkpoint import require_written

    from preempt import PreemptibleRun

    rows = []
    for mode in ("sync", "async"):
        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(__file__))) as d:
            shared = [d]
            dist.broadcast_object_list(shared, src=0)
            kw = dict(checkpoint_interval=None, checkpoint_every_steps=1, keep_last=1, exit_if_complete=False)
            stalls, durable = [], []
            with PreemptibleRun(shared[0], model=model, optimizer=opt, async_save=mode == "async", **kw) as run:
                if mode == "async" and (every_rank_stages or dist.get_rank() == 0):  # buffers sized at the start
                    while run.staging_prepare_s is None:
                        time.sleep(0.05)
                        run.wait_for_checkpoint()
                for i in range(saves + 1):
                    run.wait_for_checkpoint()  # the previous write ends outside the timing: no postponement
                    if change is not None:
                        if i and dist.get_rank() == 0 and run.last_checkpoint is not None:
                            require_written(run.last_checkpoint)
                        change()
                    dist.barrier()
                    t0 = time.perf_counter()
                    run.step()
                    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)
                    run.wait_for_checkpoint()
                    if i:  # the first is the warm-up
                        stalls.append(float(took))
                        if run.last_save is not None and run.last_save.write_s is not None:
                            durable.append(run.last_save.write_s)
            dist.barrier()
        rows.append((mode, statistics.median(stalls), statistics.median(durable) if durable else float("nan")))
    return rows


def save_costs(gib: float, saves: int) -> list[tuple[str, float, float]]:
    """The replicated (DDP-like) state: :func:`preempt_saves` with rank 0 writing in the background."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_checkpoint import build_state, change_every_tensor

    model, opt = build_state(gib)
    return preempt_saves(model, opt, saves, every_rank_stages=False, change=lambda: change_every_tensor(model, opt))


def sharded_costs(gib: float, saves: int) -> list[tuple[str, float, float]]:
    """The same state sharded by FSDP2 (``fully_shard`` on a CPU mesh): per method, the median of the longest wait
    among the ranks at a save and the median seconds to durable. preempt's background save (every rank copies its
    shards, the writers commit on their own group) and its synchronous one; DCP's ``async_save`` with a reused
    ``DefaultStager`` (staging before it returns), on a gloo group of its own, of the very tensors preempt writes."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_checkpoint import build_model

    from preempt.cluster import sharded

    torch.manual_seed(0)
    model = build_model(gib)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # both moments exist
    for p in model.parameters():
        p.grad = None

    def slowest(t0: float) -> float:
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took)

    # The copy floor: this rank's pieces copied into buffers allocated and touched before (the slowest rank).
    local = [v.to_local() if hasattr(v, "to_local") else v for v in sharded.split_state(model, opt)[0].values()]
    bufs = [torch.empty_like(t).fill_(0) for t in local]
    floors = []
    for _ in range(saves + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for b, t in zip(bufs, local, strict=True):
            b.copy_(t)
        floors.append(slowest(t0))
    del bufs
    rows = [("copy floor: each rank's pieces into touched buffers", statistics.median(floors[1:]), float("nan"))]
    for mode, stall, durable in preempt_saves(model, opt, saves, every_rank_stages=True):
        rows.append((f"preempt, async_save={mode == 'async'}", stall, durable))
    group = dist.new_group(backend="gloo")  # async_save's collectives run in its thread: not on the loop's group
    options = StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                             use_non_blocking_copy=False)  # fmt: skip
    stager = DefaultStager(options)
    tensors = sharded.split_state(model, opt)[0]
    stalls, durable = [], []
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(__file__))) as d:
        shared = [d]
        dist.broadcast_object_list(shared, src=0)
        for i in range(saves + 1):
            dist.barrier()
            t0 = time.perf_counter()
            resp = dcp.async_save(tensors, checkpoint_id=f"{shared[0]}/c{i}", async_stager=stager, process_group=group)
            if hasattr(resp, "staging_completion"):
                resp.staging_completion.result()
                took = slowest(t0)
                resp.upload_completion.result()
            else:
                took = slowest(t0)
                resp.result()
            done = slowest(t0)
            if i:
                stalls.append(took)
                durable.append(done)
        dist.barrier()
    rows.append(("DCP async_save, reused DefaultStager", statistics.median(stalls), statistics.median(durable)))
    return rows


def worker(steps: int, gib: float, saves: int) -> None:
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
    costs = save_costs(gib, saves) if gib > 0 else []
    shard_costs = sharded_costs(gib, saves) if gib > 0 else []
    if rank == 0:
        print(f"\n{dist.get_world_size()} ranks, gloo, torch {torch.__version__}, medians of 3 x {steps} calls\n")
        print("| what | per call |\n|---|---:|")
        for what, sec in rows:
            print(f"| {what} | {sec * 1e6:.1f} us |")
    if rank == 0 and costs:
        print(f"\ncheckpoint of a replicated {gib:g} GiB state (model + AdamW), medians of {saves}\n")
        print("| async_save | loop waits at the save step (slowest rank) | durable after (rank 0) |\n|---|---:|---:|")
        for mode, stall, durable in costs:
            print(f"| {mode} | {stall * 1e3:.0f} ms | {durable:.2f} s |")
        sync, asyn = costs[0][1], costs[1][1]
        print(f"\nasync / sync loop wait: {asyn / sync:.3f}x")
    if rank == 0 and shard_costs:
        print(f"\ncheckpoint of the same {gib:g} GiB state sharded by FSDP2 over the ranks, medians of {saves}\n")
        print("| method | loop waits (slowest rank) | durable after |\n|---|---:|---:|")
        for what, stall, durable in shard_costs:
            print(f"| {what} | {stall * 1e3:.0f} ms | {'' if durable != durable else f'{durable:.2f} s'} |")
        floor, sync, ours, theirs = (row[1] for row in shard_costs)
        print(f"\npreempt background loop wait: {ours / floor:.2f}x the copy floor,"
              f" {ours / theirs:.3f}x DCP async_save, {ours / sync:.3f}x preempt synchronous")  # fmt: skip
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--gib", type=float, default=0.5, help="state size of the checkpoint rows (0: leave them out)")
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.nproc < 2 or args.steps < 1 or args.gib < 0 or args.saves < 1:
        p.error("--nproc >= 2, --steps >= 1, --gib >= 0, --saves >= 1")
    if args.worker:
        worker(args.steps, args.gib, args.saves)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    cmd += [__file__, "--worker", "--steps", str(args.steps), "--gib", str(args.gib), "--saves", str(args.saves)]
    sys.exit(subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "PREEMPT_LOG_LEVEL": "WARNING"}))


if __name__ == "__main__":
    main()
