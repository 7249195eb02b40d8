"""A hand-written loop for ``preempt check``'s tests: exact as written, or with one of the patterns that break a resume.

Seeds torch, Python's ``random`` and NumPy. A map-style set with random augmentation in ``__getitem__`` (2 DataLoader
workers by default), dropout, AdamW and a per-step scheduler; 96 samples in batches of 8: 12 steps per epoch, 3
epochs. ``--pattern`` puts in one pattern of a loop that does not resume exactly (README_PREEMPTION.md, "Check that
your loop resumes exactly"):

* ``prefetch``: nanoGPT's loop: the next batch is drawn (from torch's global generator) before ``run.step()``;
* ``private_random``: a ``random.Random`` of the script's own scales the inputs;
* ``numpy_generator``: a NumPy ``Generator`` of the script's own adds noise;
* ``private_random_tracked``: ``private_random`` fixed as the guide says, its state kept by ``run.track``.

``--mirror URL`` and ``--tensorboard`` pass ``mirror=`` and ``loggers=["tensorboard"]`` to the run.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import Synthetic  # noqa: E402

from preempt import PreemptibleRun  # noqa: E402


class Kept:
    """A ``random.Random`` kept in the checkpoint (README_PREEMPTION.md, "Check that your loop resumes exactly")."""

    def __init__(self, gen: random.Random) -> None:
        self.gen = gen

    def state_dict(self) -> dict:
        return {"state": self.gen.getstate()}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["state"]
        self.gen.setstate((version, tuple(internal), gauss))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save_dir", required=True)
    p.add_argument(
        "--pattern",
        choices=("none", "prefetch", "private_random", "numpy_generator", "private_random_tracked"),
        default="none",
    )
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mirror", default=None)
    p.add_argument("--tensorboard", action="store_true")
    p.add_argument("--crash_at", type=int, default=None, help="raise an error at this step")
    args = p.parse_args()

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    data = Synthetic(96, 8, augment=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    private = random.Random(7)
    gen = np.random.default_rng(7)
    options = {"mirror": args.mirror} if args.mirror else {}
    if args.tensorboard:
        options["loggers"] = ["tensorboard"]

    def train_step(x: torch.Tensor, y: torch.Tensor) -> float:
        if args.pattern in ("private_random", "private_random_tracked"):
            x = x * (1.0 + 0.1 * private.random())
        elif args.pattern == "numpy_generator":
            x = x + torch.from_numpy(gen.standard_normal(x.shape)).float() * 0.1
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        return loss.item()

    with PreemptibleRun(args.save_dir, model=model, optimizer=opt, scheduler=sched, **options) as run:
        if args.pattern == "private_random_tracked":
            run.track("augment", Kept(private))
        if args.pattern == "prefetch":

            def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
                ix = torch.randint(len(data), (8,))
                return data.x[ix], data.y[ix]

            x, y = get_batch()
            while run.global_step < args.epochs * 12:
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits, y)
                x, y = get_batch()  # the next batch, drawn before run.step(): not in the checkpoint
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                run.step({"loss": loss.item()})
            return
        loader = DataLoader(data, batch_size=8, sampler=run.sampler(data, seed=0), num_workers=args.workers)
        for _ in run.epochs(args.epochs):
            for x, y in run.batches(loader):
                loss = train_step(x, y)
                if run.global_step + 1 == args.crash_at:
                    raise RuntimeError(f"crashed on purpose at step {args.crash_at}")
                run.step({"loss": loss})


if __name__ == "__main__":
    main()
