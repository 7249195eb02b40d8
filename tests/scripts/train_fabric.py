"""Lightning Fabric's ``examples/fabric/image_classifier/train_fabric.py``, its shape kept, tiny, with preempt's lines
added (marked).

The example's loop: ``Fabric(accelerator=..., strategy=..., devices=...)``, ``fabric.launch()``,
``fabric.seed_everything``, a small conv net with dropout, ``fabric.setup(model, optimizer)``,
``fabric.setup_dataloaders(train_loader)``, ``fabric.backward(loss)``, a ``StepLR`` stepped at each epoch's end. The
images are synthetic tensors (no download) and each sample is augmented with a random flip and noise drawn from the
global generators of whoever loads it. The training loader is either ``run.sampler()`` inside a DataLoader
(``--loader sampler``, the guide's own-loop recipe) or the example's plain ``shuffle=True`` DataLoader
(``--loader shuffle``); Fabric's loader wrapper goes around either and calls ``set_epoch`` with its own count.

``--devices 2`` runs two CPU processes under ``strategy="ddp"``: ``fabric.launch()`` starts the second itself. At
the end each process writes ``--final_out`` with ``.rank<R>`` inserted before the suffix: the plain model's and the
optimizer's and the scheduler's state, and the process's RNG.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train as harness  # noqa: E402  (the suite's hold and signal points: --hold_at, --signal_at)
from train_ddp import stop_told  # noqa: E402  (each process's stop as an event)

from preempt import PreemptibleRun, _testing  # noqa: E402


class Images(Dataset):
    """1x8x8 images of 4 classes; each sample flipped at random and given noise by whoever loads it."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x = torch.randn(n, 1, 8, 8, generator=g) + self.y.view(n, 1, 1, 1).float()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x + 0.05 * torch.randn_like(x), self.y[i]


class Net(torch.nn.Module):
    """The example's Net, shrunk: conv, conv, max-pool, dropout, two linear layers, log-softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 4, 3, 1)
        self.conv2 = torch.nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = torch.nn.Dropout(0.25)
        self.fc1 = torch.nn.Linear(32, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(torch.flatten(x, 1))
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save_dir", required=True)
    p.add_argument("--final_out", default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--loader", choices=("sampler", "shuffle"), default="sampler")
    p.add_argument("--devices", type=int, default=1, help="2: strategy='ddp' on two CPU processes")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--every_steps", type=int, default=None, help="checkpoint_every_steps")
    p.add_argument("--settle_saves", action="store_true", help="after a step that took a checkpoint, wait for it")
    p.add_argument("--hold_at", default=None)
    p.add_argument("--signal_at", default=None)
    p.add_argument("--hold_rank", type=int, default=None, help="apply --hold_at/--signal_at on this process only")
    args = p.parse_args()

    strategy = "ddp" if args.devices > 1 else "auto"
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=args.devices)
    fabric.launch()
    rank = fabric.global_rank
    if args.hold_rank is None or args.hold_rank == rank:
        if args.hold_at:
            harness.hold_at(args.hold_at)
        if args.signal_at:
            harness.signal_at(args.signal_at)
    torch.set_num_threads(1)
    fabric.seed_everything(42)

    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)

    with (
        PreemptibleRun(  # preempt
            args.save_dir,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            checkpoint_interval=None,
            checkpoint_every_steps=args.every_steps,
        ) as run,
        stop_told(run),  # (the suite's: this process's stop as an event)
    ):
        harness._runs.append(run)  # (the suite's hold points wait for its stop flag)
        dataset = Images(args.samples)
        if args.loader == "sampler":  # preempt: the guide's own-loop recipe
            sampler = run.sampler(dataset, shuffle=True, seed=0)
            loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers)
            train_loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
        else:  # the example's own loader
            loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
            train_loader = fabric.setup_dataloaders(loader)

        for epoch in run.epochs(args.epochs):  # preempt: was range(1, hparams.epochs + 1)
            model.train()
            for data, target in run.batches(train_loader):  # preempt: was enumerate(train_loader)
                optimizer.zero_grad()
                output = model(data)
                loss = F.nll_loss(output, target)
                fabric.backward(loss)
                optimizer.step()
                harness.reached("step")
                _testing.emit("step", rank=rank, step=run.global_step, epoch=epoch, batch=run.batch)
                run.step()  # preempt
                if args.settle_saves and run.last_save is not None and run.last_save.step == run.global_step:
                    run.wait_for_checkpoint(harness.HOLD_LIMIT_S)  # (every save durable when due, however slow)
            scheduler.step()

    if args.final_out:
        out: dict[str, torch.Tensor] = {}
        harness.flatten("model", model.state_dict(), out)
        harness.flatten("optimizer", optimizer.state_dict(), out)
        harness.flatten("scheduler", scheduler.state_dict(), out)
        out["rng.torch"] = torch.get_rng_state()
        final = Path(args.final_out)
        save_file(out, str(final.with_suffix(f".rank{rank}{final.suffix}")))
    fabric.barrier()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
