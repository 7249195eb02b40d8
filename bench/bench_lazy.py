#!/usr/bin/env python
"""What a checkpoint costs a loop of real training steps: lazy snapshots against eager copies and DCP.

    python bench/bench_lazy.py [--gib 1.5] [--cycles 12] [--every 6] [--batch 16] [--reuse-memory] [--device cuda]

The state is an MLP of square ``Linear`` layers whose parameters and two AdamW moments come to ``--gib`` GiB;
each step is a real forward and backward on a batch of ``--batch`` rows and ``optimizer.step()``, with torch on
one thread (the other core is the writer's). Every variant runs in its own process (buffers and DCP's stager
sized before the timing) for ``--cycles`` cycles of 2 x ``--every`` steps, a checkpoint at the start of each:

- ``none``: ``PreemptibleRun(async_save=False)`` without checkpoints: what the estimate reads where nothing
  happens (its spread is the noise of the method);
- ``eager``: ``async_save=True, lazy_snapshot=False``: the state is copied at the step, then written;
- ``lazy``: ``async_save=True, lazy_snapshot=True``: the parameters and moments are copied by the writer
  while the next forward and backward run; the next ``optimizer.step()`` waits for what is not copied yet;
- ``dcp``: ``torch.distributed.checkpoint.async_save`` of the same tensors with a ``DefaultStager`` created once
  and reused (staging before it returns), the loop otherwise the same, no ``PreemptibleRun``.

Cost of one checkpoint, measured per cycle in the same process: the time of the checkpoint call and the
``--every`` steps after it (window A, where the copies and the write happen) minus the mean of the two quiet
windows of ``--every`` steps around it, the one before and the one after. The step time of this shared machine
drifts by 20% over tens of seconds; comparing adjacent windows cancels most of that drift (whole-run comparisons
between processes did not: their noise was 100 to 200 ms per checkpoint), and ``none`` shows what is left. A
cycle whose write still ran at the end of A would count part of its cost in the quiet window after it: such
cycles are counted and reported. The mean over cycles, with its standard error, is reported as a ratio to the
copy floor: the state copied into buffers allocated and touched before, measured in each process. "Loop waited"
is the part of the cost that the saver itself counts, without noise: ``run.last_save.stall_s`` (the copy at
the step, and for lazy snapshots the optimizer's wait for the copies), or the time in DCP's call.

``--device cuda``: the model, its state and the batch on the GPU (default batch 8192), each train step ending with a
synchronisation (as a loop that reads its loss), the copy floor measured into pinned buffers; lazy snapshots copy on
a side stream there, and DCP stages into pinned memory (falling back to its defaults where that fails).

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

VARIANTS = ("none", "eager", "lazy", "dcp")
REUSE_MEMORY = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
GIB = 1 << 30


def build(gib: float, batch: int, device: str = "cpu") -> tuple[Any, Any, Any]:
    """An MLP of ``width``-square layers sized for ``gib`` GiB of params + 2 moments, its AdamW, one batch."""
    import torch

    torch.manual_seed(0)
    width, layers = 4096, max(1, round(gib * GIB / 12 / (4096 * 4096)))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers))).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(batch, width, device=device)
    return model, opt, x


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    model, opt, x = build(args.gib, args.batch, args.device)

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()  # as a loop that reads its loss each step: the step's time is the GPU's

    train_step()  # step 1: the moments exist from here
    tensors = {f"p{i}": p for i, p in enumerate(model.parameters())}
    tensors.update({f"s{i}.{k}": v for i, s in enumerate(opt.state.values()) for k, v in s.items()})
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    # the copy floor: into buffers allocated and touched before (pinned, for a GPU's state: one synchronisation)
    bufs = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda and t.is_cuda).fill_(0) for k, t in tensors.items()}
    floors = []
    for _ in range(3):
        t0 = time.perf_counter()
        for k, t in tensors.items():
            bufs[k].copy_(t, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        floors.append(time.perf_counter() - t0)
    del bufs
    work = Path(args.dir) / args.variant
    tid = threading.get_native_id()
    period = 2 * args.every  # a checkpoint at every step that is a multiple of it, from step `period` on
    last = (args.cycles + 1) * period  # its train step closes the last quiet window; no checkpoint there
    trains: list[float] = []  # per loop iteration from step 2: the train step (forward, backward, optimizer)
    calls: list[float] = []  # and the call after it (run.step(), or DCP's save at a checkpoint)
    stalls: list[float] = []  # per checkpoint: what the loop waited for it, as the saver counts it (once known)
    overlapped = 0  # cycles whose write still ran at the end of window A
    dcp_tried: list[str] = []  # how DCP staged (the ways that failed first)

    def timed_loop(train: Any, save: Any, idle: Any) -> tuple[float, tuple[float, int], tuple[float, int]]:
        nonlocal overlapped
        k0, t0 = kernel(tid), time.perf_counter()
        for i in range(2, last + 1):
            a = time.perf_counter()
            train()
            b = time.perf_counter()
            trains.append(b - a)
            if i == last:
                break
            (save if i % period == 0 else idle)(i)
            calls.append(time.perf_counter() - b)
            if i % period == args.every and i > period:
                if not ready():
                    overlapped += 1
        return time.perf_counter() - t0, k0, kernel(tid)

    if args.variant == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        tensors = {k: t.detach() for k, t in tensors.items()}
        # A GPU's state: DCP's stager into pinned memory, created once; if it fails on this state (torch 2.11:
        # "KeyError: <class 'type'>"), with the optimizer's CPU step counts moved to the GPU; then DCP's defaults.
        tries = [("pinned stager", tensors), ("pinned stager, step counts on the GPU", on_gpu(tensors))] if cuda else []
        tries.append(("defaults" if cuda else "stager", tensors))
        for how, state in tries:
            stager = DefaultStager(StagingOptions(cuda, False, False, False)) if how != "defaults" else None
            try:  # twice: on the H200 (torch 2.11) the pinned stager failed only when reused
                for n in range(2):
                    where = str(work / f"warm{n}")
                    warm = dcp.async_save(state, checkpoint_id=where, async_stager=stager, no_dist=True)
                    (warm.upload_completion if hasattr(warm, "upload_completion") else warm).result()  # sized once
            except Exception as e:  # noqa: BLE001  (said in the table; the next way is tried)
                dcp_tried.append(f"{how}: {type(e).__name__}: {e}"[:160])
                for n in range(2):
                    shutil.rmtree(work / f"warm{n}", ignore_errors=True)
                continue
            tensors = state
            dcp_tried.append(how)
            break
        pending: list[Any] = []

        def save(i: int) -> None:
            if pending:
                pending.pop().result()  # one write in flight, as preempt
            resp = dcp.async_save(tensors, checkpoint_id=str(work / f"c{i}"), async_stager=stager, no_dist=True)
            if hasattr(resp, "staging_completion"):
                resp.staging_completion.result()
                resp = resp.upload_completion
            pending.append(resp)

        def ready() -> bool:  # DCP's stall is its call (the staging), known whether the write ended or not
            stalls.append(calls[-args.every - 1])
            return pending[0].done()

        loop_s, k0, k1 = timed_loop(train_step, save, lambda i: None)
        for p in pending:
            p.result()
    else:
        from preempt import PreemptibleRun

        saving = args.variant != "none"
        # New files for every checkpoint, as DCP writes (no pool written ahead, nothing recycled)
        kw: dict[str, Any] = dict(checkpoint_interval=None, keep_last=1, log_file=False, progress_every_s=None)
        kw.update(recycle_files=False, async_save=saving, lazy_snapshot=args.variant == "lazy")
        if saving:
            kw.update(checkpoint_every_steps=period)
        with PreemptibleRun(work, model=model, optimizer=opt, **kw) as run:
            while saving and run.staging_prepare_s is None:
                time.sleep(0.05)  # the buffers are sized at the start (the moments exist), outside the timing
                run.wait_for_checkpoint()
            run.step()  # step 1, trained above

            def ready() -> bool:  # preempt's stall is known once the write is collected
                try:
                    run.wait_for_checkpoint(timeout=0)
                except TimeoutError:
                    return False
                if saving:
                    stalls.append(run.last_save.stall_s)  # with lazy copies, the optimizer's wait too
                return True

            loop_s, k0, k1 = timed_loop(train_step, lambda i: run.step(), lambda i: run.step())
            run.wait_for_checkpoint()
    shutil.rmtree(work, ignore_errors=True)
    # Per cycle c: window A (the checkpoint's call and the `every` iterations after it) minus the mean of the
    # quiet windows around it (`every` train steps each, with the calls between them), which cancels a linear drift.
    e = args.every

    def quiet(j: int) -> float:  # the quiet window that ends with the train step of iteration j (a checkpoint's)
        return sum(trains[j - e + 1 : j + 1]) + sum(calls[j - e + 1 : j])

    costs = []
    for c in range(args.cycles):
        j = (c + 1) * period - 2  # the iteration of the checkpoint (the lists start at step 2)
        window_a = calls[j] + sum(trains[j + 1 : j + 1 + e]) + sum(calls[j + 1 : j + 1 + e])
        costs.append(window_a - (quiet(j) + quiet(j + period)) / 2)
    return {
        "variant": args.variant,
        "loop_s": loop_s,
        "costs": costs,
        "overlapped": overlapped,
        "stall_s": statistics.mean(stalls) if stalls else None,
        "floor_s": min(floors),
        "bytes": nbytes,
        "kernel_s": k1[0] - k0[0],
        "faults": k1[1] - k0[1],
        "trains": trains,
        "dcp": dcp_tried,
        "gpu": torch.cuda.get_device_name() if cuda else None,
    }


def on_gpu(tensors: dict[str, Any]) -> dict[str, Any]:
    """The tensors, those on the CPU (AdamW's step counts) copied to the GPU."""
    return {k: t if t.is_cuda else t.cuda() for k, t in tensors.items()}


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
    p.add_argument("--cycles", type=int, default=12)
    p.add_argument("--every", type=int, default=6)
    p.add_argument("--batch", type=int, default=None, help="rows per batch (default 16 on the CPU, 8192 on a GPU)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model and its state live")
    p.add_argument("--variants", default=",".join(VARIANTS), help="a comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--reuse-memory", action="store_true", help="children keep freed memory (GLIBC_TUNABLES)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one under bench/results)")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(child(args)))
        return
    if args.batch is None:
        args.batch = 8192 if args.device == "cuda" else 16
    variants = args.variants.split(",")
    if args.every < 2 or args.cycles < 2 or args.gib <= 0 or not set(variants) <= set(VARIANTS):
        p.error(f"--every >= 2, --cycles >= 2, --gib > 0, --variants among {','.join(VARIANTS)}")
    root = Path(__file__).resolve().parent / "results"
    root.mkdir(exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir or root) as d:
        for v in variants:
            cmd = [sys.executable, __file__, "--variant", v, "--dir", d, "--gib", str(args.gib)]
            cmd += ["--cycles", str(args.cycles), "--every", str(args.every), "--batch", str(args.batch)]
            cmd += ["--device", args.device]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PREEMPT_LOG_LEVEL": "WARNING"}
            if args.reuse_memory:
                env["GLIBC_TUNABLES"] = REUSE_MEMORY
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if out.returncode != 0:
                print(f"bench_lazy: variant {v} failed:\n{out.stderr}", file=sys.stderr)
                continue
            results[v] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{v:<6} loop {results[v]['loop_s']:.2f} s", file=sys.stderr, flush=True)
    if not results:
        sys.exit("bench_lazy: every variant failed (above)")
    floor = statistics.median(r["floor_s"] for r in results.values())
    nbytes = next(iter(results.values()))["bytes"]
    malloc = "GLIBC_TUNABLES=" + REUSE_MEMORY if args.reuse_memory else "glibc's default malloc"
    where = "on the CPU"
    if args.device == "cuda":
        where = f"on {next(iter(results.values()))['gpu']}, copy floor into pinned memory"
    step = statistics.median(statistics.median(r["trains"]) for r in results.values())
    print(
        f"\n{nbytes / GIB:.2f} GiB state (params + 2 AdamW moments) {where}, {args.cycles} cycles of {2 * args.every}"
        f" steps, a checkpoint at the start of each; batch {args.batch}, a train step {step * 1e3:.0f} ms;"
    )
    print(f"copy floor {floor * 1e3:.0f} ms; {malloc}")
    print("\n| variant | per checkpoint (mean +- s.e.) | / copy floor | median | loop waited | writes past window A |"
          " loop | loop in the kernel | page faults |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for v, r in results.items():
        costs = r["costs"]
        mean, se = statistics.mean(costs), statistics.stdev(costs) / len(costs) ** 0.5
        cells = [f"{mean * 1e3:.0f} +- {se * 1e3:.0f} ms", f"{mean / floor:.2f}x"]
        cells += [
            f"{statistics.median(costs) * 1e3:.0f} ms",
            "-" if r["stall_s"] is None else f"{r['stall_s'] * 1e3:.0f} ms",
        ]
        cells += [f"{r['overlapped']} of {len(costs)}", f"{r['loop_s']:.2f} s", f"{r['kernel_s']:.2f} s"]
        print(f"| {v} | " + " | ".join(cells) + f" | {r['faults']:,} |")
    for v, r in results.items():
        print(f"{v}: per cycle " + " ".join(f"{c * 1e3:.0f}" for c in r["costs"]) + " ms")
    if "dcp" in results:
        print("dcp staged with: " + "; then ".join(results["dcp"]["dcp"]))
    if len(results) < len(variants):
        sys.exit(f"bench_lazy: {', '.join(v for v in variants if v not in results)} failed (above)")


if __name__ == "__main__":
    main()
