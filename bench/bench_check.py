"""``preempt check``'s wall time against one plain run to step N of a quick-start loop, measured in the same run.

    python bench/bench_check.py                       # N = 200, stops chosen by the check
    python bench/bench_check.py --steps 600 --stop-at 100

The loop is ``examples/quickstart.py``'s (an MLP 64-512-512-10 with dropout, AdamW, a cosine schedule, two
DataLoader workers, 375 steps per epoch), in this file (``--train``). First one plain run to step N (the loop
leaves at N and the run completes: its final checkpoint included), then ``preempt check --steps N`` of the same
command: prints both wall times, their ratio, the CPU seconds of each (every process they started, DataLoader
workers too: on a shared machine the wall time follows the load, the CPU time much less), and the check's seconds
per run (reference, trial, and the second reference when the trial differed from the first at N). Each round runs
the two in turn; ``--rounds`` > 1 prints medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(save_dir: str, steps: int) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from preempt import PreemptibleRun

    g = torch.Generator().manual_seed(2024)
    centers = torch.randn(10, 64, generator=g) * 2.0
    labels = torch.randint(0, 10, (24000,), generator=g)
    data = TensorDataset(centers[labels] + torch.randn(24000, 64, generator=g) * 6.0, labels)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(512, 10),
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8 * 375)
    with PreemptibleRun(save_dir, model=model, optimizer=opt, scheduler=sched, checkpoint_interval=3.0) as run:
        loader = DataLoader(data, batch_size=64, sampler=run.sampler(data, seed=0), num_workers=2)
        for _ in run.epochs(8):
            for x, y in run.batches(loader):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                run.step()
                if run.global_step >= steps:
                    break
            if run.global_step >= steps:
                break


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--stop-at", type=int, action="append", default=None)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--train", default=None, metavar="SAVE_DIR", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.train is not None:
        train(args.train, args.steps)
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    plain_s, check_s, plain_cpu, check_cpu, runs = [], [], [], [], []

    def cpu() -> float:
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        return used.ru_utime + used.ru_stime

    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as d:
            t0, c0 = time.monotonic(), cpu()
            cmd = [sys.executable, __file__, "--train", f"{d}/plain", "--steps", str(args.steps)]
            subprocess.run(cmd, env=env, check=True, capture_output=True)
            plain_s.append(time.monotonic() - t0)
            plain_cpu.append(cpu() - c0)
            stops = [f"--stop-at={s}" for s in args.stop_at or ()]
            cmd = [sys.executable, "-m", "preempt", "check", "--json", "--steps", str(args.steps), *stops, "--"]
            cmd += [sys.executable, __file__, "--train", f"{d}/user", "--steps", str(10 * args.steps)]
            t0, c0 = time.monotonic(), cpu()
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            check_s.append(time.monotonic() - t0)
            check_cpu.append(cpu() - c0)
            doc = json.loads(out.stdout)
            if out.returncode != 0:
                sys.exit(f"preempt check exited {out.returncode}: {doc}")
            runs.append(doc)
            print(
                f"round {len(runs)}: plain {plain_s[-1]:.1f} s wall, {plain_cpu[-1]:.1f} s CPU; check"
                f" {check_s[-1]:.1f} s wall, {check_cpu[-1]:.1f} s CPU",
                flush=True,
            )
    plain, checked = statistics.median(plain_s), statistics.median(check_s)
    last = runs[-1]
    compared = len(last["compared_steps"])
    print(f"steps {args.steps}, stops {last['stops']} ({compared} compared steps), {args.rounds} round(s)")
    pc, cc = statistics.median(plain_cpu), statistics.median(check_cpu)
    print(f"one plain run to step {args.steps}: {plain:.1f} s wall, {pc:.1f} s CPU")
    wall, used = f"{checked:.1f} s wall ({checked / plain:.2f}x)", f"{cc:.1f} s CPU ({cc / pc:.2f}x)"
    print(f"preempt check:               {wall}, {used}")
    print(f"verdict {last['verdict']}")
    print("check's runs (s):", ", ".join(f"{k} {v:.1f}" for k, v in last["seconds"].items()))


if __name__ == "__main__":
    main()
