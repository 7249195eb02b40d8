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
* preempt ``lazy_snapshot=True``: the stall of the ``run.step()`` that queues the copies on a side stream, the
  train step after it (its ``optimizer.step()`` waits on the GPU for the copies; this model has no forward or
  backward to hide them behind, see ``bench_lazy.py --device cuda`` for a loop that has), and durable.
* SIGTERM -> durable: ``os.kill(self, SIGTERM)`` before a ``run.step()`` until ``Preempted``: the stop's
  synchronous save, staged into the registered arenas and written without the page cache.
* ``torch.save`` + fsync, synchronous: the blocking time a plain loop pays.
* The staging arenas: pages registered exactly (``Stager.prepare``) against a block of the same bytes from
  torch's pinned allocator (which rounds up to a power of two), both as ``torch.cuda.host_memory_stats`` counts
  them; the copy into the arenas (``Stager.stage``) and that copy plus a raw write + fdatasync of its bytes
  (the floors of the stall and of durable).
* ``tensor.to("cpu")`` of every tensor into fresh memory, and ``copy_`` into preallocated pinned
  buffers (non_blocking, one synchronize): the floors.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

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

    from preempt import Preempted, PreemptibleRun

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
    rows = Rows()

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
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)  # the blocks freed stay pinned in torch's pool
    if empty_host_cache is not None:
        empty_host_cache()

    # pinned arenas: pages registered exactly (preempt's Stager) against a block of torch's pinned allocator
    from preempt.checkpoint import state as ckpt
    from preempt.checkpoint.staging import Stager

    payload = ckpt.capture(ckpt.Components(model, opt), {})
    p0, t0 = torch_pinned(), time.perf_counter()
    stager = Stager()
    stager.prepare(payload)
    took, arena = time.perf_counter() - t0, stager.nbytes
    note = f"{arena / 2**30:.3f} GiB locked; torch's pinned pool +{(torch_pinned() - p0) / 2**30:.3f} GiB"
    rows.append(("staging arenas: pages registered (preempt, prepared once)", took, note))
    p0, t0 = torch_pinned(), time.perf_counter()
    block = torch.empty(arena + 4096, dtype=torch.uint8, pin_memory=True).fill_(0)
    took = time.perf_counter() - t0
    note = f"torch's pinned pool +{(torch_pinned() - p0) / 2**30:.3f} GiB for {arena / 2**30:.3f} GiB asked"
    rows.append(("the same bytes from torch's pinned allocator", took, note))
    del block
    if empty_host_cache is not None:
        empty_host_cache()
    copies, durable_floor = [], []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        staged = stager.stage(payload)  # non_blocking copies into the registered arenas, one synchronisation
        t1 = time.perf_counter()
        raw_write(scratch / f"raw_{i}", [t for ts, _ in staged.tensor_files.values() for t in ts.values()])
        copies.append(t1 - t0)
        durable_floor.append(time.perf_counter() - t0)
    rows.append(("copy into the registered arenas (Stager.stage)", med(copies), "floor"))
    rows.append(("that copy + raw write + fdatasync of its bytes", med(durable_floor), "durable floor"))
    del staged, stager

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

    # preempt, lazy snapshots: run.step() queues the copies on a side stream; the next optimizer.step() waits for
    # them on the GPU. This model has no forward or backward to hide them behind: the next step pays what is left.
    kw3 = dict(checkpoint_interval=None, checkpoint_every_steps=3, keep_last=1, lazy_snapshot=True)
    stalls, nexts, quiet, durable = [], [], [], []
    t_save = None
    with PreemptibleRun(scratch / "lazy", model=model, optimizer=opt, **kw3) as run:
        for r in range(args.repeats + 2):
            for k in range(3):  # steps 3r+1, 3r+2, 3r+3: a checkpoint at 3r+3
                t0 = time.perf_counter()
                train_step()
                t1 = time.perf_counter()
                run.step()
                t2 = time.perf_counter()
                if k == 0 and t_save is not None:
                    nexts.append(t1 - t0)  # right after a checkpoint: its optimizer step waits for the copies
                    run.wait_for_checkpoint()
                    durable.append(time.perf_counter() - t_save)
                if r == args.repeats + 1:
                    break
                if k == 1:
                    quiet.append(t1 - t0)
                elif k == 2:
                    stalls.append(t2 - t1)
                    t_save = t1
        waited = run.last_save.stall_s
    rows.append(("preempt lazy: stall at the step", med(stalls[1:]), f"first {stalls[0]:.3f} s"))
    rows.append(("preempt lazy: the next train step", med(nexts[1:]), f"a quiet one {med(quiet):.3f} s"))
    rows.append(("preempt lazy: durable", med(durable[1:]), f"the loop's own count (last): {waited:.3f} s"))

    # SIGTERM -> durable: the stop's save (synchronous; staged into the registered arenas, written O_DIRECT)
    stops = []
    for i in range(args.repeats):
        with PreemptibleRun(scratch / f"stop_{i}", model=model, optimizer=opt, checkpoint_interval=None) as run:
            try:
                for _ in range(3):
                    train_step()
                    run.step()
                train_step()
                t0 = time.perf_counter()
                os.kill(os.getpid(), signal.SIGTERM)
                run.step()
            except Preempted:
                stops.append(time.perf_counter() - t0)
    rows.append(("SIGTERM -> durable (the stop's save)", med(stops), f"each: {' '.join(f'{x:.3f}' for x in stops)}"))

    # DCP
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    sd = {"model": dict(model.state_dict()), "optim": opt.state_dict()}  # plain dicts, as DCP's own examples
    optim = sd["optim"]
    gpu_steps = {  # AdamW's CPU step counts on the GPU: DCP's pinned stager failed on this state with them (2.11)
        "model": sd["model"],
        "optim": {**optim, "state": {i: {k: v.cuda() for k, v in st.items()} for i, st in optim["state"].items()}},
    }
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        def pinned_stager() -> Any:
            return DefaultStager(StagingOptions(True, False, False))  # pinned, not shared, staged in the call
    except Exception as e:  # older torch
        pinned_stager = None  # type: ignore[assignment]
        print(f"DCP DefaultStager unavailable: {e!r}", file=sys.stderr)
    ways = [("DCP async_save, defaults", None, sd)]
    if pinned_stager is not None:
        ways = [
            ("DCP async_save, reused pinned stager", pinned_stager(), sd),
            ("DCP async_save, reused pinned stager, step counts on the GPU", pinned_stager(), gpu_steps),
            *ways,
        ]
    for label, stager, state_dict in ways:
        kw = {} if stager is None else {"async_stager": stager}
        block, done = [], []
        try:
            for i in range(args.repeats + 1):
                train_step()
                t0 = time.perf_counter()
                fut = dcp.async_save(state_dict, checkpoint_id=str(scratch / f"dcp_{len(rows)}_{i}"), **kw)
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


class Rows(list):
    """The table's rows, each also said on stderr when it is measured (a failure later keeps the ones before)."""

    def append(self, row: tuple[str, float, str]) -> None:
        super().append(row)
        print(f"  {row[0]}: {row[1]:.3f} s {row[2]}", file=sys.stderr, flush=True)


def torch_pinned() -> int:
    """Bytes of pinned blocks torch's host allocator holds now (0 where it does not say)."""
    import torch

    try:
        stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return 0
    return next((v for k, v in stats.items() if k.startswith("allocated_bytes") and k.endswith(".current")), 0)


def raw_write(path: Path, tensors: list) -> None:
    """The tensors' bytes written to one file with os.write, then fdatasync: the disk's share of a durable save."""
    import torch

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            while view:
                view = view[os.write(fd, view[: 64 << 20]) :]
        os.fdatasync(fd)
    finally:
        os.close(fd)
    path.unlink()


if __name__ == "__main__":
    main()
