#!/usr/bin/env python
"""What a checkpoint costs a loop of real training steps: lazy snapshots against eager copies and DCP.

    python bench/bench_lazy.py [--gib 1.5] [--steps 36] [--every 6] [--batch 16] [--rounds 1] [--reuse-memory]

The state is an MLP of square ``Linear`` layers whose parameters and two AdamW moments come to ``--gib`` GiB;
each step is a real forward and backward on a batch of ``--batch`` rows and ``optimizer.step()``, with torch on
one thread (the other core is the writer's). Every variant runs in a fresh process, ``--steps`` steps, a
checkpoint every ``--every`` steps (each write has that many steps to end before the next), two steps more
after the last, and reports the loop's wall time (buffers and DCP's stager sized before, outside it):

- ``none``: ``PreemptibleRun(async_save=False)`` without checkpoints (run twice, first and last: their gap is
  the noise floor);
- ``eager``: ``async_save=True, lazy_snapshot=False``: the state is copied at the step, then written;
- ``lazy``: ``async_save=True, lazy_snapshot=True``: the parameters and moments are copied by the writer
  while the next forward and backward run; the next ``optimizer.step()`` waits for what is not copied yet;
- ``dcp``: ``torch.distributed.checkpoint.async_save`` of the same tensors with a ``DefaultStager`` created once
  and reused (staging before it returns), the loop otherwise the same, no ``PreemptibleRun``.

Cost per checkpoint = (loop time of the variant - mean loop time of the two ``none`` runs) / checkpoints, as a
ratio to the copy floor: the state copied into buffers allocated and touched before, measured in each process.
The shared 2-core machine is noisy: ``--rounds`` repeats every variant, interleaved, and the medians are reported.

Each variant also reports the loop thread's time in the kernel and its minor page faults: with glibc's default
malloc every tensor above 32 MiB is a fresh mmap, so each step faults in its gradients and the optimizer's
temporaries anew (here about half of the loop's time), and the background write's page-cache work contends with
those faults. ``--reuse-memory`` runs the children with ``GLIBC_TUNABLES`` that keep freed memory in the process
(``mmap_max=0``, a high ``trim_threshold``): the loop then faults almost nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

VARIANTS = ("none", "eager", "lazy", "dcp", "none2")
REUSE_MEMORY = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
GIB = 1 << 30


def build(gib: float, batch: int) -> tuple[Any, Any, Any]:
    """An MLP of ``width``-square layers sized for ``gib`` GiB of params + 2 moments, its AdamW, one batch."""
    import torch

    torch.manual_seed(0)
    width, layers = 4096, max(1, round(gib * GIB / 12 / (4096 * 4096)))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(batch, width)
    return model, opt, x


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    model, opt, x = build(args.gib, args.batch)

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    train_step()  # step 1: the moments exist from here
    tensors = {f"p{i}": p for i, p in enumerate(model.parameters())}
    tensors.update({f"s{i}.{k}": v for i, s in enumerate(opt.state.values()) for k, v in s.items()})
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    bufs = {k: torch.empty_like(t).fill_(0) for k, t in tensors.items()}
    floors = []
    for _ in range(3):
        t0 = time.perf_counter()
        for k, t in tensors.items():
            bufs[k].copy_(t)
        floors.append(time.perf_counter() - t0)
    del bufs
    work = Path(args.dir) / args.variant
    tid = threading.get_native_id()
    last = args.steps + 1  # one step after the last checkpoint: its copies are paid inside the loop too
    taken = 0
    if args.variant == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(False, False, False, False))
        warm = dcp.async_save(tensors, checkpoint_id=str(work / "warm"), async_stager=stager, no_dist=True)
        (warm.upload_completion if hasattr(warm, "upload_completion") else warm).result()  # the stager's buffers
        pending = None
        k0, t0 = kernel(tid), time.perf_counter()
        for i in range(2, last + 1):
            train_step()
            if i % args.every == 0 and i <= args.steps:
                if pending is not None:
                    pending.result()  # one write in flight, as preempt
                resp = dcp.async_save(tensors, checkpoint_id=str(work / f"c{i}"), async_stager=stager, no_dist=True)
                if hasattr(resp, "staging_completion"):
                    resp.staging_completion.result()
                    pending = resp.upload_completion
                else:
                    pending = resp
                taken += 1
        loop_s, k1 = time.perf_counter() - t0, kernel(tid)
        if pending is not None:
            pending.result()
    else:
        from preempt import PreemptibleRun

        saving = not args.variant.startswith("none")
        # New files for every checkpoint, as DCP writes (no pool written ahead, nothing recycled)
        kw: dict[str, Any] = dict(checkpoint_interval=None, keep_last=1, log_file=False, progress_every_s=None)
        kw.update(recycle_files=False)
        kw.update(async_save=saving, lazy_snapshot=args.variant == "lazy")
        if saving:
            kw.update(checkpoint_every_steps=args.every)
        with PreemptibleRun(work, model=model, optimizer=opt, **kw) as run:
            while saving and run.staging_prepare_s is None:
                time.sleep(0.05)  # the buffers are sized at the start (the moments exist), outside the timing
                run.wait_for_checkpoint()
            run.step()  # step 1, trained above
            steps_seen: set[int] = set()
            k0, t0 = kernel(tid), time.perf_counter()
            for _ in range(2, last + 1):
                train_step()
                run.step()
                if run.last_save is not None:
                    steps_seen.add(run.last_save.step)
            loop_s, k1 = time.perf_counter() - t0, kernel(tid)
            run.wait_for_checkpoint()
            taken = len(steps_seen)
    shutil.rmtree(work, ignore_errors=True)
    return {
        "variant": args.variant,
        "loop_s": loop_s,
        "checkpoints": taken,
        "floor_s": min(floors),
        "bytes": nbytes,
        "kernel_s": k1[0] - k0[0],
        "faults": k1[1] - k0[1],
    }


def kernel(tid: int) -> tuple[float, int]:
    """(seconds in the kernel, minor page faults) of thread ``tid`` of this process so far (Linux)."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[12]) / os.sysconf("SC_CLK_TCK"), int(fields[7])
    except (OSError, ValueError, IndexError):
        return float("nan"), 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.5)
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--every", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--reuse-memory", action="store_true", help="children keep freed memory (GLIBC_TUNABLES)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one under bench/results)")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(child(args)))
        return
    if args.every < 2 or args.steps < 2 * args.every or args.steps % args.every or args.gib <= 0 or args.rounds < 1:
        p.error("--every >= 2, --steps a multiple of --every and >= 2 x --every, --gib > 0, --rounds >= 1")
    root = Path(__file__).resolve().parent / "results"
    root.mkdir(exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(dir=args.dir or root) as d:
        for r in range(args.rounds):
            for v in VARIANTS:
                cmd = [sys.executable, __file__, "--variant", v, "--dir", d]
                cmd += ["--gib", str(args.gib), "--steps", str(args.steps), "--every", str(args.every)]
                cmd += ["--batch", str(args.batch)]
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PREEMPT_LOG_LEVEL": "WARNING"}
                if args.reuse_memory:
                    env["GLIBC_TUNABLES"] = REUSE_MEMORY
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
                if out.returncode != 0:
                    sys.exit(f"bench_lazy: variant {v} failed:\n{out.stderr}")
                results[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {r} {v:<6} loop {results[v][-1]['loop_s']:.2f} s", file=sys.stderr, flush=True)
    med = {v: statistics.median(x["loop_s"] for x in results[v]) for v in VARIANTS}
    floor = statistics.median(x["floor_s"] for v in VARIANTS for x in results[v])
    base = (med["none"] + med["none2"]) / 2
    nbytes = results["lazy"][0]["bytes"]
    n = args.steps // args.every
    print(f"\n{nbytes / GIB:.2f} GiB state (params + 2 AdamW moments), {args.steps + 1} steps, a checkpoint every")
    print(f"{args.every} steps ({n} wanted per run), medians of {args.rounds} round(s);", end=" ")
    malloc = "GLIBC_TUNABLES=" + REUSE_MEMORY if args.reuse_memory else "glibc's default malloc"
    print(f"copy floor {floor * 1e3:.0f} ms; {malloc}")
    print("\n| variant | loop | loop in the kernel | page faults | checkpoints | per checkpoint | / copy floor |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for v in VARIANTS:
        taken = statistics.median(x["checkpoints"] for x in results[v])
        cost = (med[v] - base) / taken if taken else None
        cells = ("", "") if cost is None else (f"{cost * 1e3:.0f} ms", f"{cost / floor:.2f}x")
        ks = statistics.median(x["kernel_s"] for x in results[v])
        faults = statistics.median(x["faults"] for x in results[v])
        print(f"| {v} | {med[v]:.2f} s | {ks:.2f} s | {faults:,.0f} | {taken:g} | {cells[0]} | {cells[1]} |")
    for v in VARIANTS:
        print(f"{v}: loops of the rounds " + " / ".join(f"{x['loop_s']:.2f}" for x in results[v]) + " s")
    print(f"\nnoise floor (none vs none2): {abs(med['none'] - med['none2']) / n * 1e3:.0f} ms per checkpoint's worth")


if __name__ == "__main__":
    main()
