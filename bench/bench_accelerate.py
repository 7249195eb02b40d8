"""Accelerate's loop alone against the same loop inside PreemptibleRun, side by side in one run.

    python bench/bench_accelerate.py                       # 8 rounds of 60 optimizer steps per variant
    python bench/bench_accelerate.py --rounds 12 --steps 100 --variants alone,preempt

The loop of README_PREEMPTION.md, section 13: everything through ``accelerator.prepare`` (an MLP of three layers,
width 448 by default, whose optimizer step, two micro-batches of 64 samples under ``accelerator.accumulate``, took
~45 ms on one core of a loaded 2-core machine; AdamW; a LinearLR scheduler; a map-style dataset with ``shuffle=True``
that draws nothing; bf16 autocast). Variants:

* ``alone``: Accelerate's loop as its examples write it (``for batch in train_loader``);
* ``preempt``: the same with the ``with``, ``run.epochs``, ``run.batches(train_loader)`` and ``run.step()`` lines, no
  checkpoint due (``checkpoint_interval=None``);
* ``preempt_no_streams``: the same, the DataLoader given ``sampler=ResumableSampler(dataset, per_sample_rng=False)``
  (no per-sample random streams: what they cost, apart);
* ``preempt_saves``: ``preempt`` with a checkpoint every 20 steps in the background.

``--empty``: the same loops with nothing in the body but the ``accelerator.accumulate`` block: the time per step of
the loop and its data alone, in which preempt's part (the prepared loader's iteration, the per-sample streams,
``run.step()``) is a larger share, and which a busy machine disturbs less than a training step.

One process measures every variant in each round (a fresh model, optimizer and prepared loader each time), the
variants taking turns to go first, so that a machine whose load drifts weighs on all of them alike; one thread, so
that other work on the machine takes whole cores rather than slicing every matmul. Each measure is the median step
time (from one synchronised step to the next) after the first 10 steps. Printed: each round's figures and ratios to
``alone``, then each variant's median over the rounds and the median of its paired ratios. Figures: bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("alone", "preempt", "preempt_no_streams", "preempt_saves")

CHILD = r"""
import json, statistics, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from preempt import PreemptibleRun
from preempt.data.sampler import ResumableSampler

variants, where = sys.argv[2].split(","), sys.argv[6]
rounds, steps, width = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
empty = sys.argv[7] == "1"  # the loop's body does no training: what the loop and its data cost, alone
torch.set_num_threads(1)
set_seed(0)
BATCH = 64

class Samples(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, width, generator=g), torch.randint(0, 10, (n,), generator=g)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        layers = [m for _ in range(3) for m in (torch.nn.Linear(width, width), torch.nn.GELU())]
        self.body = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(width, 10)
    def forward(self, x, labels):
        logits = self.head(self.body(x))
        return type("Out", (), {"loss": torch.nn.functional.cross_entropy(logits.float(), labels)})

accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="bf16", cpu=True)
data = Samples(BATCH * 2 * (steps + 12))

def measure(mode):
    set_seed(0)
    if mode == "preempt_no_streams":
        train_loader = DataLoader(data, batch_size=BATCH, sampler=ResumableSampler(data, per_sample_rng=False))
    else:
        train_loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=steps)
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    marks = []

    def body(batch):
        with accelerator.accumulate(model):
            if empty:
                pass
            else:
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step(); scheduler.step(); optimizer.zero_grad()
        if accelerator.sync_gradients:
            marks.append(time.perf_counter())

    if mode == "alone":
        for epoch in range(1):
            for batch in train_loader:
                body(batch)
    else:
        options = {"checkpoint_every_steps": 20} if mode == "preempt_saves" else {}
        with tempfile.TemporaryDirectory(dir=where) as d:
            with PreemptibleRun(d + "/run", model=model, optimizer=optimizer, scheduler=scheduler,
                                checkpoint_interval=None, log_file=False, **options) as run:
                for epoch in run.epochs(1):
                    for batch in run.batches(train_loader):
                        body(batch)
                        run.step()
    accelerator.free_memory()
    return 1000 * statistics.median([b - a for a, b in zip(marks, marks[1:])][10:])

for r in range(rounds):
    k = r % len(variants)
    row = {mode: measure(mode) for mode in variants[k:] + variants[:k]}
    print(json.dumps(row), flush=True)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per measure (two micro-batches each)")
    p.add_argument("--width", type=int, default=448, help="the MLP's width (a step's time grows with its square)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument(
        "--empty", action="store_true", help="no training in the body: the loop's and its data's own time per step"
    )
    args = p.parse_args()
    variants = args.variants.split(",")
    assert variants[0] == "alone", "the first variant is the yardstick: alone"
    rows = []
    with tempfile.TemporaryDirectory() as where:
        cmd = [sys.executable, "-c", CHILD, str(ROOT), args.variants, str(args.rounds), str(args.steps)]
        cmd += [str(args.width), where, str(int(args.empty))]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            row = json.loads(line)
            rows.append(row)
            pairs = "  ".join(f"{m} {row[m]:.2f} ms ({row[m] / row['alone']:.3f}x)" for m in variants)
            print(f"round {len(rows)}: {pairs}", flush=True)
        if proc.wait() != 0:
            raise SystemExit(f"the measuring process failed (exit {proc.returncode})")
    base = statistics.median(r["alone"] for r in rows)
    print(
        "\n| time per optimizer step (median over the rounds) | ms | against alone | paired ratio, median (min-max) |"
    )
    print("| --- | --- | --- | --- |")
    for mode in variants:
        m = statistics.median(r[mode] for r in rows)
        ratios = [r[mode] / r["alone"] for r in rows]
        spread = f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})"
        print(f"| {mode} | {m:.2f} | {m / base:.3f}x | {spread} |")


if __name__ == "__main__":
    main()
