#!/usr/bin/env python
"""How long a checkpoint of a CUDA-resident state blocks the training loop: preempt async vs DCP async_save.

Run on a machine with an NVIDIA GPU, from the repository root::

    python bench/bench_async_gpu.py --gib 1.5 --repeats 3

State: the GPT-like model of bench_checkpoint.py on the GPU with AdamW after one step (params + two
moments ~= --gib). Rows, all in this one process (each method writes into its own directory):

* preempt ``PreemptibleRun(async_save=True, checkpoint_every_steps=1)``: the stall is the duration of
  the ``run.step()`` that takes the checkpoint (device -> pinned host buffers, one synchronisation);
  durable is until ``run.wait_for_checkpoint()`` returns. The first checkpoint is reported apart.
* ``torch.distributed.checkpoint.async_save`` with a stager created once and reused (pinned memory,
  the accelerator's path), and with the defaults; blocking = until it returns, durable = future.result().
* ``torch.save`` + fsync, synchronous: the blocking time a plain loop pays.
* ``tensor.to("cpu")`` of every tensor into fresh memory, and ``copy_`` into preallocated pinned
  buffers (non_blocking, one synchronize): the floors.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = p.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_async_gpu.py: no CUDA device here")
    from bench_checkpoint import build_model

    from preempt import PreemptibleRun

    scratch = Path(args.dir or tempfile.mkdtemp(prefix="preempt-gpu-bench-"))
    model = build_model(args.gib, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step() -> None:  # an optimizer step over every parameter (the model has no forward)
        for p in model.parameters():
            p.grad = torch.randn_like(p).mul_(1e-3)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    train_step()
    tensors = [t for t in model.state_dict().values()] + [
        v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    rows: list[tuple[str, float, str]] = []

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    # floors
    t0 = time.perf_counter()
    [t.to("cpu") for t in tensors]
    rows.append(("to('cpu') into fresh memory (first call)", time.perf_counter() - t0, ""))
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    floor = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for b, t in zip(pinned, tensors, strict=True):
            b.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        floor.append(time.perf_counter() - t0)
    rows.append(("copy_ into preallocated pinned buffers", med(floor), "floor"))
    del pinned

    # preempt
    stalls, durable = [], []
    kw = dict(checkpoint_interval=None, checkpoint_every_steps=1, keep_last=1)
    with PreemptibleRun(scratch / "preempt", model=model, optimizer=opt, **kw) as run:
        for _ in range(args.repeats + 1):
            train_step()
            t0 = time.perf_counter()
            run.step()
            stalls.append(time.perf_counter() - t0)
            run.wait_for_checkpoint()
            durable.append(time.perf_counter() - t0)
        prepare = run.staging_prepare_s
    rows.append(("preempt async: first checkpoint stall", stalls[0], f"buffers prepared in {prepare:.3f} s"))
    rows.append(("preempt async: stall", med(stalls[1:]), ""))
    rows.append(("preempt async: durable", med(durable[1:]), ""))

    # DCP
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=False))
    except Exception as e:  # older torch
        stager = None
        print(f"DCP DefaultStager unavailable: {e!r}", file=sys.stderr)
    for label, kw in (("DCP async_save, reused stager", {"async_stager": stager}), ("DCP async_save, defaults", {})):
        if label.endswith("stager") and stager is None:
            continue
        block, done = [], []
        try:
            for i in range(args.repeats + 1):
                train_step()
                t0 = time.perf_counter()
                fut = dcp.async_save(sd, checkpoint_id=str(scratch / f"dcp_{len(rows)}_{i}"), **kw)
                block.append(time.perf_counter() - t0)
                fut.result()
                done.append(time.perf_counter() - t0)
        except Exception as e:
            rows.append((f"{label}: failed", math.nan, f"{type(e).__name__}: {e}"[:120]))
            continue
        rows.append((f"{label}: blocking", med(block[1:]), f"first {block[0]:.3f} s"))
        rows.append((f"{label}: durable", med(done[1:]), "not fsynced by DCP"))

    # torch.save
    ts = []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        with open(scratch / f"ts_{i}.pt", "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        ts.append(time.perf_counter() - t0)
    rows.append(("torch.save + fsync (synchronous)", med(ts), ""))

    gpu = torch.cuda.get_device_name()
    print(f"\n{gpu}, torch {torch.__version__}, state {nbytes / 2**30:.2f} GiB on the GPU, medians of {args.repeats}\n")
    print("| what | seconds | note |\n|---|---:|---|")
    for what, sec, note in rows:
        print(f"| {what} | {sec:.3f} | {note} |")


if __name__ == "__main__":
    main()
