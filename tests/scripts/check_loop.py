"""A hand-written loop for ``preempt check``'s tests: exact as written, or with one of the patterns that break a resume.

Seeds torch, Python's ``random`` and NumPy. A map-style set with random augmentation in ``__getitem__`` (2 DataLoader
workers by default), dropout, AdamW and a per-step scheduler; 96 samples in batches of 8: 12 steps per epoch, 3
epochs. ``--pattern`` puts in one pattern of a loop that does not resume exactly (README_PREEMPTION.md, "Check that
your loop resumes exactly"):

* ``prefetch``: nanoGPT's loop: the next batch is drawn (from torch's global generator) before ``run.step()``;
* ``private_random``: a ``random.Random`` of the script's own scales the inputs;
* ``numpy_generator``: a NumPy ``Generator`` of the script's own adds noise;
* ``private_random_tracked``: ``private_random`` fixed as the guide says, its state kept by ``run.track``;
* ``stale_state_dict``: the model's ``state_dict()`` hands out the first layer's weight as the previous call saw it
  (a state_dict post-hook keeping a copy): every checkpoint holds that tensor from an older step;
* ``epoch_reset``: a sampler of the script's own (its order a function of the epoch set by ``set_epoch``) inside a
  loader wrapper that calls ``set_epoch`` with its own count of iterations, as Lightning Fabric's does: after a
  resume the count starts again at 0, and the next epoch comes in the first epoch's order;
* ``epoch_reset_preempt``: the same wrapper around a DataLoader over ``run.sampler()`` (the wrapper shows the
  DataLoader's ``sampler``, as Fabric's does).

``--accumulate K``: gradient accumulation, one optimizer step and one ``run.step()`` every K batches.
``--mirror URL`` and ``--tensorboard`` pass ``mirror=`` and ``loggers=["tensorboard"]`` to the run.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

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


class OneBehind:
    """A state_dict post-hook that hands out ``key`` as the previous ``state_dict()`` call saw it (a cache)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.held: torch.Tensor | None = None

    def __call__(self, module: torch.nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
        fresh = state[prefix + self.key].detach().clone()
        if self.held is not None:
            state[prefix + self.key] = self.held
        self.held = fresh


class OwnSampler(Sampler[int]):
    """A shuffling sampler of the script's own: its order is a function of the epoch ``set_epoch`` gave it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(100 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


class CountingLoader:
    """A loader wrapper that sets its sampler's epoch to its own count of iterations (as Fabric's does)."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.count = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)  # sampler, batch_sampler, ... of the DataLoader

    def __iter__(self):
        self.loader.sampler.set_epoch(self.count)
        self.count += 1
        return iter(self.loader)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save_dir", required=True)
    p.add_argument(
        "--pattern",
        choices=(
            "none",
            "prefetch",
            "private_random",
            "numpy_generator",
            "private_random_tracked",
            "stale_state_dict",
            "epoch_reset",
            "epoch_reset_preempt",
        ),
        default="none",
    )
    p.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
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

    if args.pattern == "stale_state_dict":
        model.register_state_dict_post_hook(OneBehind("0.weight"))

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

    def accumulated_step(x: torch.Tensor, y: torch.Tensor, last: bool) -> float:
        loss = torch.nn.functional.cross_entropy(model(x), y) / args.accumulate
        loss.backward()
        if last:
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
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
        sampler = OwnSampler(len(data)) if args.pattern == "epoch_reset" else run.sampler(data, seed=0)
        loader = DataLoader(data, batch_size=8, sampler=sampler, num_workers=args.workers)
        if args.pattern in ("epoch_reset", "epoch_reset_preempt"):
            loader = CountingLoader(loader)
        for _ in run.epochs(args.epochs):
            for x, y in run.batches(loader):
                if args.accumulate > 1:
                    last = run.batch % args.accumulate == 0  # run.batch: this epoch's batches so far, this one too
                    loss = accumulated_step(x, y, last)
                    if last:
                        run.step({"loss": loss})
                    continue
                loss = train_step(x, y)
                if run.global_step + 1 == args.crash_at:
                    raise RuntimeError(f"crashed on purpose at step {args.crash_at}")
                run.step({"loss": loss})


if __name__ == "__main__":
    main()
