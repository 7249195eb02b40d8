#!/usr/bin/env python
"""Sharded fine-tuning checkpoints: what a LoRA run under FSDP2 writes, stalls and costs at a stop.

Run from the repository root::

    python bench/bench_fsdp_finetune.py                 # 2 gloo ranks, a 1 GiB frozen fp32 base + LoRA r=16
    python bench/bench_fsdp_finetune.py --base_gib 0.06 # a smoke run (~1 min)
    python bench/bench_fsdp_finetune.py --nproc 2 --base_gib 2 --saves 4
    python bench/bench_fsdp_finetune.py --trials 5 --profile  # 5 stops per way; each rank's stop, phase by phase
    python bench/bench_fsdp_finetune.py --ways 2 --trials 9   # preempt carrying the base alone (and the raw write)

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
time runs until the last rank has its stop checkpoint durable (the run raises ``Preempted`` after it); with
``--trials N``, N stops (each after a fresh run's two checkpoints, beyond the first run's), their median and range.
``--profile``: each rank's stop, phase by phase (the agreement, each exchange, the snapshot, the files marked carried,
the staging copy, each file written and synced, the manifest, the renames), from the signal: :data:`PHASES`, timed by
wrapping those functions during the stops (medians over the trials). The reference figures: the bytes that
changed between checkpoints (adapters and their AdamW state) and a raw write of that many bytes (each rank its
share, written and fsynced at once; the slowest rank).
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


# What a stop does, in the order it does it: (module, function), each timed by --profile on every rank.
PHASES = [
    ("preempt.run.preemptible", "PreemptibleRun._safe_point"),
    ("preempt.cluster.distributed", "Coordinator.agree"),
    ("preempt.run.stopping", "Stopper.stopping"),
    ("preempt.run.save_scheduler", "SaveScheduler.save"),
    ("preempt.run.snapshot", "Snapshot.manifest"),
    ("preempt.run.snapshot", "Snapshot.split"),
    ("preempt.run.snapshot", "Snapshot.pieces"),
    ("preempt.run.snapshot", "Snapshot.capture"),
    ("preempt.run.snapshot", "Snapshot.run_state"),
    ("preempt.checkpoint.manager", "CheckpointManager.mark_carried"),
    ("preempt.run.background", "Background.staged_now"),
    ("preempt.cluster.distributed", "save_ranked"),
    ("preempt.checkpoint.manager", "CheckpointManager.new_tmp_dir"),
    ("preempt.cluster.distributed", "Coordinator.broadcast"),
    ("preempt.cluster.distributed", "Coordinator.gather"),
    ("preempt.cluster.distributed", "write_payload"),
    ("preempt.checkpoint.hashed_io", "link_file"),
    ("preempt.checkpoint.hashed_io", "write_file"),
    ("preempt.checkpoint.hashed_io", "sync_together"),
    ("preempt.checkpoint.hashed_io", "fsync_dir"),
    ("preempt.checkpoint.manager", "CheckpointManager.commit"),
    ("preempt.checkpoint.commit", "commit_dir"),
    ("preempt.checkpoint.manager", "CheckpointManager.prune"),
    ("preempt.cluster.distributed", "read_manifest"),
    ("preempt.checkpoint.manager", "CheckpointManager.committed"),
    ("preempt.run.outcomes", "Outcomes.durable"),
    ("preempt.run.stopping", "Stopper.stop"),
]


class Profile:
    """Times :data:`PHASES` while on (each call: its start and end, and how deep in the others it ran)."""

    def __init__(self) -> None:
        import importlib

        self.on = False
        self.calls: list[tuple[float, float, int, str]] = []
        self.missing: list[str] = []
        self._depth = 0
        for module, name in PHASES:
            owner: Any = importlib.import_module(module)
            *path, last = name.split(".")
            for part in path:
                owner = getattr(owner, part, None)
            if owner is None or not callable(getattr(owner, last, None)):
                self.missing.append(f"{module}.{name}")  # renamed or gone since: said, not timed
                continue
            setattr(owner, last, self._timed(getattr(owner, last), name))

    def _timed(self, function: Any, name: str) -> Any:
        import functools

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return function(*args, **kwargs)
            depth, self._depth, t0 = self._depth, self._depth + 1, time.time()
            try:
                return function(*args, **kwargs)
            finally:
                self._depth = depth
                self.calls.append((t0, time.time(), depth, name))

        return timed

    def trial(self, t0: float) -> list[tuple[str, float, float]]:
        """The calls of one stop as (phase, start from ``t0``, seconds), in order; each phase numbered by its calls."""
        seen: dict[str, int] = {}
        out = []
        for start, end, depth, name in sorted(self.calls):
            seen[name] = seen.get(name, 0) + 1
            label = "  " * depth + name + (f" #{seen[name]}" if seen[name] > 1 else "")
            out.append((label, start - t0, end - start))
        self.calls.clear()
        return out


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


def preempt_way(
    model: Any, opt: Any, root: str, saves: int, carry: bool, trials: int, profile: Profile | None
) -> dict[str, Any]:
    import torch.distributed as dist

    from preempt import PreemptibleRun
    from preempt.errors import Preempted

    kw = dict(checkpoint_interval=None, checkpoint_every_steps=1, keep_last=2, exit_if_complete=False)
    written, stalls, durable, stops, phases = [], [], [], [], []
    for trial in range(trials):
        previous = None
        with PreemptibleRun(shared_dir(root), model=model, optimizer=opt, carry_unchanged=carry, **kw) as run:
            for i in range(saves + 1 if trial == 0 else 2):  # later trials: the first and one carrying
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
                if i and trial == 0:
                    written.append(nbytes)
                    stalls.append(stall)
                    durable.append(done)
            pids = [None] * dist.get_world_size()
            dist.all_gather_object(pids, os.getpid())
            train_step(model, opt)
            dist.barrier()
            if profile is not None:
                profile.on = True
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
            if profile is not None:
                profile.on = False
                phases.append(profile.trial(t0))
        stops.append(slowest(ended - t0))
    return {"written": written, "stall": stalls, "durable": durable, "sigterm": stops, "phases": phases}


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
    return {"written": written, "stall": stalls, "durable": stalls, "sigterm": None, "phases": []}


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


def phase_table(name: str, per_rank: list[list[list[tuple[str, float, float]]]]) -> None:
    """Each rank's stop, phase by phase: the median start (from the signal) and time of each, over the trials."""
    print(f"\n{name}: each rank's stop, phase by phase (ms from the signal; medians of {len(per_rank[0])} stops)\n")
    print("| phase | " + " | ".join(f"rank {r} starts | rank {r} takes" for r in range(len(per_rank))) + " |")
    print("|---|" + "---:|---:|" * len(per_rank))
    starts: dict[str, list[float]] = {}
    for trials in per_rank:
        for trial in trials:
            for label, start, _ in trial:
                starts.setdefault(label, []).append(start)
    for label in sorted(starts, key=lambda lab: statistics.median(starts[lab])):
        name = label.lstrip(" ")
        cells = ["· " * ((len(label) - len(name)) // 2) + name]
        for trials in per_rank:
            got = [(start, took) for trial in trials for lab, start, took in trial if lab == label]
            if got:
                cells += [f"{statistics.median(s for s, _ in got) * 1e3:.1f}"]
                cells += [f"{statistics.median(t for _, t in got) * 1e3:.2f}"]
            else:
                cells += ["", ""]
        print("| " + " | ".join(cells) + " |")


def worker(base_gib: float, dim: int, saves: int, root: str, trials: int, profiled: bool, only: set[int]) -> None:
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
    profile = Profile() if profiled else None
    if profile is not None and profile.missing and rank == 0:
        print(f"--profile: not timed (not found): {', '.join(profile.missing)}")
    ways = {
        "1. preempt, carry_unchanged=False": lambda: preempt_way(model, opt, root, saves, False, trials, profile),
        "2. preempt, the base carried (default)": lambda: preempt_way(model, opt, root, saves, True, trials, profile),
        "3. DCP save, get_state_dict(model, opt)": lambda: dcp_way(model, opt, root, saves, frozen=True),
        "4. DCP save, ignore_frozen_params=True": lambda: dcp_way(model, opt, root, saves, frozen=False),
    }
    rows = {name: run() for name, run in ways.items() if int(name[0]) in only}
    raw = raw_write(changed, root)
    profiles: dict[str, list[Any]] = {}
    for name, r in rows.items():
        if r["phases"]:
            profiles[name] = [None] * world
            dist.all_gather_object(profiles[name], r["phases"])
    if rank == 0:
        head = f"FSDP2 on {world} gloo ranks, torch {torch.__version__}: a frozen base of {base / GIB:.2f} GiB"
        head += f", LoRA r={LORA_R} ({trained / MIB:.2f} MiB trained), AdamW; medians of {saves} checkpoints after"
        head += f" a first. Changed per checkpoint: {changed / MIB:.2f} MiB; a raw write of it: {raw * 1e3:.0f} ms"
        print(f"\n{head}\n")
        stops = f"SIGTERM -> durable (median of {trials})" if trials > 1 else "SIGTERM -> durable"
        print(f"| way | written per checkpoint | / changed | loop waits | durable after | {stops} |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, r in rows.items():
            w, stall, durable = (statistics.median(r[k]) for k in ("written", "stall", "durable"))
            stop = ""
            if r["sigterm"] is not None:
                t = statistics.median(r["sigterm"])
                stop = f"{t * 1e3:.0f} ms ({t / raw:.2f}x raw)"
                if len(r["sigterm"]) > 1:
                    stop += f", {min(r['sigterm']) * 1e3:.0f}-{max(r['sigterm']) * 1e3:.0f} ms"
            cells = [name, f"{w / MIB:.2f} MiB", f"{w / changed:.2f}x", f"{stall * 1e3:.0f} ms", f"{durable:.2f} s"]
            print("| " + " | ".join([*cells, stop]) + " |")
        for name, per_rank in profiles.items():
            phase_table(name, per_rank)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--base_gib", type=float, default=1.0)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--trials", type=int, default=1, help="stops per preempt way (SIGTERM -> durable: their median)")
    p.add_argument("--profile", action="store_true", help="each rank's stop, phase by phase")
    p.add_argument("--ways", default="1,2,3,4", help="the ways to run, by number (e.g. 2: preempt carrying alone)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory in bench/)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    only = {int(w) for w in args.ways.split(",") if w.strip().isdigit()}
    if args.nproc < 2 or args.base_gib <= 0 or args.dim < 16 or args.saves < 1 or args.trials < 1:
        p.error("--nproc >= 2, --base_gib > 0, --dim >= 16, --saves >= 1, --trials >= 1")
    if not only or not only <= {1, 2, 3, 4}:
        p.error(f"--ways {args.ways!r}: expected numbers among 1,2,3,4 separated by commas")
    if args.worker:
        worker(args.base_gib, args.dim, args.saves, args.dir, args.trials, args.profile, only)
        return
    with tempfile.TemporaryDirectory(dir=args.dir or os.path.dirname(os.path.abspath(__file__))) as root:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
        cmd += [__file__, "--worker", "--base_gib", str(args.base_gib), "--dim", str(args.dim)]
        cmd += ["--saves", str(args.saves), "--trials", str(args.trials), "--ways", args.ways, "--dir", root]
        cmd += ["--profile"] if args.profile else []
        # this tree's preempt, whatever is installed
        path = os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")])
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PREEMPT_LOG_LEVEL": "WARNING", "PYTHONPATH": path}
        sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
