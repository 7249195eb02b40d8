#!/usr/bin/env python
"""Sharded fine-tuning checkpoints: what a LoRA run under FSDP2 writes, stalls and costs at a stop.

Run from the repository root::

    python bench/bench_fsdp_finetune.py                 # 2 gloo ranks, a 1 GiB frozen fp32 base + LoRA r=16
    python bench/bench_fsdp_finetune.py --base_gib 0.06 # a smoke run (~1 min)
    python bench/bench_fsdp_finetune.py --nproc 2 --base_gib 2 --saves 4

Re-launches itself under ``torch.distributed.run --standalone``. The model is a stack of bias-free square linear
layers (``--dim`` wide), frozen, each with a LoRA adapter beside it (``a``: r x dim, ``b``: dim x r, trained),
sharded by FSDP2 (``fully_shard`` on a CPU mesh); AdamW holds the adapters. A training step here is an optimizer
step on random gradients (the forward pass changes nothing a checkpoint holds, and would all-gather the base).

The same state is checkpointed four ways, each in a directory of its own, ``--saves`` checkpoints after a first:

1. preempt writing everything (``carry_unchanged=False``: every rank's pieces of the base written again each time);
2. preempt carrying the base (the default: each rank's pieces of it in a file of its own, linked while unchanged);
3. DCP ``save`` of ``get_state_dict(model, optimizer)`` (the whole sharded state);
4. DCP ``save`` with ``StateDictOptions(ignore_frozen_params=True)`` (what trains; the base must be found elsewhere).

Per way: bytes written per checkpoint after the first (files whose inode the previous checkpoint does not hold:
a hard link writes nothing), the loop's wait at the save step (the slowest rank), and the time to durable. For
the preempt ways, SIGTERM -> durable: rank 0 signals every rank with a real SIGTERM between two steps, and the
time runs until the last rank has its stop checkpoint durable (the run raises ``Preempted`` after it). The
reference figures: the bytes that changed between checkpoints (adapters and their AdamW state) and a raw write of
that many bytes (each rank its share, written and fsynced at once; the slowest rank).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
LORA_R = 16


def build(base_gib: float, dim: int) -> Any:
    import torch

    class Adapted(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = torch.nn.Linear(dim, dim, bias=False)
            self.base.requires_grad_(False)
            self.a = torch.nn.Parameter(torch.randn(LORA_R, dim) / dim**0.5)
            self.b = torch.nn.Parameter(torch.zeros(dim, LORA_R))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + (x @ self.a.t()) @ self.b.t()

    layers = max(1, round(base_gib * GIB / (dim * dim * 4)))
    return torch.nn.Sequential(*(Adapted() for _ in range(layers)))


def slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def shared_dir(root: str) -> str:
    import torch.distributed as dist

    box = [tempfile.mkdtemp(dir=root) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def new_bytes(ckpt: Path, before: Path | None) -> int:
    """The bytes of ``ckpt``'s files whose inode ``before`` (the previous checkpoint) does not hold."""
    held = {os.stat(f).st_ino for f in before.iterdir()} if before is not None else set()
    return sum(st.st_size for f in ckpt.iterdir() if (st := os.stat(f)).st_ino not in held)


def train_step(model: Any, opt: Any) -> None:
    import torch

    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)


def preempt_way(model: Any, opt: Any, root: str, saves: int, carry: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from preempt import PreemptibleRun
    from preempt.errors import Preempted

    d = shared_dir(root)
    kw = dict(checkpoint_interval=None, checkpoint_every_steps=1, keep_last=2, exit_if_complete=False)
    written, stalls, durable = [], [], []
    previous = None
    with PreemptibleRun(d, model=model, optimizer=opt, carry_unchanged=carry, **kw) as run:
        for i in range(saves + 1):
            train_step(model, opt)
            dist.barrier()
            t0 = time.perf_counter()
            run.step()
            stall = slowest(time.perf_counter() - t0)
            run.wait_for_checkpoint()
            done = slowest(time.perf_counter() - t0)
            ckpt = run.last_checkpoint
            nbytes = new_bytes(ckpt, previous) if dist.get_rank() == 0 and ckpt is not None else 0
            previous = ckpt
            if i:
                written.append(nbytes)
                stalls.append(stall)
                durable.append(done)
        pids = [None] * dist.get_world_size()
        dist.all_gather_object(pids, os.getpid())
        train_step(model, opt)
        dist.barrier()
        t0 = time.time()
        if dist.get_rank() == 0:
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
        while not run.stop_requested:  # the signal has landed on this rank
            time.sleep(0.001)
        try:
            run.step()  # the ranks agree to stop, save and leave
        except Preempted:
            ended = time.time()
    stop = slowest(ended - t0)
    return {"written": written, "stall": stalls, "durable": durable, "sigterm": stop}


def dcp_way(model: Any, opt: Any, root: str, saves: int, frozen: bool) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    d = Path(shared_dir(root))
    options = StateDictOptions(ignore_frozen_params=not frozen)
    written, stalls = [], []
    for i in range(saves + 1):
        train_step(model, opt)
        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt, options=options)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(d / f"c{i}"))
        took = slowest(time.perf_counter() - t0)
        if i:
            written.append(sum(f.stat().st_size for f in (d / f"c{i}").iterdir()))
            stalls.append(took)
    return {"written": written, "stall": stalls, "durable": stalls, "sigterm": None}


def raw_write(nbytes: int, root: str) -> float:
    """Each rank writes and fsyncs its share of ``nbytes`` at once; the slowest rank's seconds (median of 5)."""
    import torch.distributed as dist

    share = max(1, nbytes // dist.get_world_size())
    data = os.urandom(share)
    out = []
    for _ in range(5):
        path = Path(root) / f"raw.{dist.get_rank()}"
        dist.barrier()
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        out.append(slowest(time.perf_counter() - t0))
        path.unlink()
    return statistics.median(out)


def worker(base_gib: float, dim: int, saves: int, root: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build(base_gib, dim)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    train_step(model, opt)  # AdamW's moments exist
    base = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    changed = 3 * trained  # the adapters and their two moments (the step counts are 8 bytes each)
    rows = {
        "1. preempt, carry_unchanged=False": preempt_way(model, opt, root, saves, carry=False),
        "2. preempt, the base carried (default)": preempt_way(model, opt, root, saves, carry=True),
        "3. DCP save, get_state_dict(model, opt)": dcp_way(model, opt, root, saves, frozen=True),
        "4. DCP save, ignore_frozen_params=True": dcp_way(model, opt, root, saves, frozen=False),
    }
    raw = raw_write(changed, root)
    if rank == 0:
        head = f"FSDP2 on {world} gloo ranks, torch {torch.__version__}: a frozen base of {base / GIB:.2f} GiB"
        head += f", LoRA r={LORA_R} ({trained / MIB:.2f} MiB trained), AdamW; medians of {saves} checkpoints after"
        head += f" a first. Changed per checkpoint: {changed / MIB:.2f} MiB; a raw write of it: {raw * 1e3:.0f} ms"
        print(f"\n{head}\n")
        print("| way | written per checkpoint | / changed | loop waits | durable after | SIGTERM -> durable |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, r in rows.items():
            w, stall, durable = (statistics.median(r[k]) for k in ("written", "stall", "durable"))
            stop = "" if r["sigterm"] is None else f"{r['sigterm']:.2f} s ({r['sigterm'] / raw:.1f}x raw)"
            cells = [name, f"{w / MIB:.2f} MiB", f"{w / changed:.2f}x", f"{stall * 1e3:.0f} ms", f"{durable:.2f} s"]
            print("| " + " | ".join([*cells, stop]) + " |")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--base_gib", type=float, default=1.0)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory in bench/)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.nproc < 2 or args.base_gib <= 0 or args.dim < 16 or args.saves < 1:
        p.error("--nproc >= 2, --base_gib > 0, --dim >= 16, --saves >= 1")
    if args.worker:
        worker(args.base_gib, args.dim, args.saves, args.dir)
        return
    with tempfile.TemporaryDirectory(dir=args.dir or os.path.dirname(os.path.abspath(__file__))) as root:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
        cmd += [__file__, "--worker", "--base_gib", str(args.base_gib), "--dim", str(args.dim)]
        cmd += ["--saves", str(args.saves), "--dir", root]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PREEMPT_LOG_LEVEL": "WARNING"}
        sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
