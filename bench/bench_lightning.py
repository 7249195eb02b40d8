"""Lightning alone against Lightning with PreemptCallback, the same model and data, side by side in one run.

    python bench/bench_lightning.py                    # both measures, 3 rounds each
    python bench/bench_lightning.py --rounds 5 --steps 80

1. **Time per training step**: an MLP whose step takes ~50 ms on 2 cores, a shuffled map-style loader, AdamW. Each
   round runs Lightning alone, with the callback (no checkpoint due: what the callback adds to every step), and
   with a checkpoint every 20 steps in the background, each in a fresh process, each variant first in its turn so
   that load on a shared machine (and the disk flushing the stops' writes) falls on all alike. The median step
   time (steps 10 to the end) of each, and the ratios.
2. **A stop at ~1 GiB of state** (a 92M-parameter model with AdamW's two moments, after one step), in the same
   process at the same step: Lightning's ``trainer.save_checkpoint`` (``torch.save``; timed with and without an
   fsync of the file, which Lightning does not do) against the callback's stop: the time from ``os.kill(SIGTERM)``
   to ``trainer.fit`` raising the stop's SystemExit(75) after its checkpoint is durable (the commit's fsyncs and
   renames, and Lightning's teardown after it, included).

Figures: bench/README.md. Needs ``pip install -e '.[lightning]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, signal, statistics, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
import torch
import lightning.pytorch as L
from torch.utils.data import DataLoader, TensorDataset
from preempt.lightning import PreemptCallback

mode, steps = sys.argv[2], int(sys.argv[3])
torch.set_num_threads(2)
L.seed_everything(0, verbose=False)
big = mode.startswith("stop")
dims = (8192, 8192, 3000) if big else (1024, 2048, 10)  # ~1.1 GB with AdamW's moments, or a ~50 ms step
n = 256 if big else 128 * (steps + 2)

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        a, b, c = dims
        layers = [torch.nn.Linear(a, b), torch.nn.ReLU(), torch.nn.Linear(b, c)] if big else [
            torch.nn.Linear(a, b), torch.nn.ReLU(), torch.nn.Linear(b, b), torch.nn.ReLU(), torch.nn.Linear(b, c)]
        self.net = torch.nn.Sequential(*layers)
    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)
    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, dims[0], generator=g)
        y = torch.randint(0, dims[2], (n,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=2 if big else 128, shuffle=True)

class Clock(L.Callback):
    def __init__(self):
        self.times = []
        self.out = {}
    def on_train_batch_end(self, trainer, module, outputs, batch, i):
        self.times.append(time.perf_counter())
        if mode == "stop_lightning" and trainer.global_step == 1:
            path = os.path.join(d, "lightning.ckpt")
            t0 = time.perf_counter()
            trainer.save_checkpoint(path)
            t1 = time.perf_counter()
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            t2 = time.perf_counter()
            self.out = {"save_s": t1 - t0, "save_fsync_s": t2 - t0, "bytes": os.path.getsize(path)}
            trainer.should_stop = True
        if mode == "stop_preempt" and trainer.global_step == 1:
            self.out["t_signal"] = time.perf_counter()
            os.kill(os.getpid(), signal.SIGTERM)

with tempfile.TemporaryDirectory(dir=sys.argv[4]) as d:
    clock = Clock()
    callbacks = [clock]
    if mode in ("callback", "callback_saves", "stop_preempt"):
        every = 20 if mode == "callback_saves" else None
        callbacks.append(PreemptCallback(os.path.join(d, "run"), checkpoint_interval=None,
                                         checkpoint_every_steps=every, log_file=False, progress_every_s=None))
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=callbacks)
    try:
        trainer.fit(Net())
    except SystemExit as e:
        clock.out["t_durable"] = time.perf_counter()
        clock.out["code"] = e.code
        ckpt = max(name for name in os.listdir(os.path.join(d, "run")) if name.startswith("step_"))
        clock.out["bytes"] = sum(os.path.getsize(os.path.join(d, "run", ckpt, f))
                                 for f in os.listdir(os.path.join(d, "run", ckpt)))
    times = clock.times
    step_s = statistics.median(b - a for a, b in zip(times[10:], times[11:])) if len(times) > 12 else None
    print(json.dumps({"step_s": step_s, **clock.out}))
"""


def child(mode: str, steps: int, where: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT), mode, str(steps), where],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"{mode}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = p.parse_args()
    where = args.dir or tempfile.gettempdir()
    steps: dict[str, list[float]] = {"alone": [], "callback": [], "callback_saves": []}
    stops: dict[str, list[dict]] = {"stop_lightning": [], "stop_preempt": []}
    modes = list(steps)
    for r in range(args.rounds):
        for mode in modes[r % 3 :] + modes[: r % 3]:  # each variant first in its turn
            steps[mode].append(child(mode, args.steps, where)["step_s"])
        for mode in stops:
            stops[mode].append(child(mode, 4, where))
            os.sync()  # the 1 GiB written is on disk before anything else is timed
        print(f"round {r + 1}: " + ", ".join(f"{m} {v[-1] * 1e3:.1f} ms" for m, v in steps.items()), flush=True)
    med = {m: statistics.median(v) for m, v in steps.items()}
    print("\n1. time per training step (median of the rounds' medians)")
    for m, v in med.items():
        print(f"   {m:15s} {v * 1e3:7.2f} ms   {v / med['alone']:.3f}x Lightning alone")
    lightning = [s["save_s"] for s in stops["stop_lightning"]]
    lightning_fsync = [s["save_fsync_s"] for s in stops["stop_lightning"]]
    preempt = [s["t_durable"] - s["t_signal"] for s in stops["stop_preempt"]]
    assert all(s["code"] == 75 for s in stops["stop_preempt"]), stops["stop_preempt"]
    gib = stops["stop_lightning"][0]["bytes"] / (1 << 30)
    print(
        f"\n2. a stop at {gib:.2f} GiB (Lightning's file; preempt's checkpoint"
        f" {stops['stop_preempt'][0]['bytes'] / (1 << 30):.2f} GiB), median of {args.rounds}"
    )
    print(f"   Lightning trainer.save_checkpoint          {statistics.median(lightning):6.2f} s (not durable)")
    print(f"   Lightning trainer.save_checkpoint + fsync  {statistics.median(lightning_fsync):6.2f} s")
    print(
        f"   PreemptCallback SIGTERM -> durable, exit 75 {statistics.median(preempt):6.2f} s"
        f"   {statistics.median(preempt) / statistics.median(lightning_fsync):.2f}x Lightning's durable save"
    )


if __name__ == "__main__":
    main()
