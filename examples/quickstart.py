"""A small real training that survives SIGTERM and resumes exactly where it stopped.

    python examples/quickstart.py --save_dir runs/quickstart
    timeout --signal=TERM 10 python examples/quickstart.py --save_dir runs/quickstart   # stopped: saves, exits
    python examples/quickstart.py --save_dir runs/quickstart                            # resumes mid-epoch

A multilayer perceptron learns to classify points drawn from a mixture of
Gaussians (generated deterministically, no download). Dropout, a cosine LR
schedule and two DataLoader workers make it a fair test of exact resume.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from preempt import PreemptibleRun


def make_data(n: int, dim: int, classes: int) -> TensorDataset:
    g = torch.Generator().manual_seed(2024)
    centers = torch.randn(classes, dim, generator=g) * 2.0
    labels = torch.randint(0, classes, (n,), generator=g)
    points = centers[labels] + torch.randn(n, dim, generator=g) * 6.0
    return TensorDataset(points, labels)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save_dir", default="runs/quickstart", help="where checkpoints go")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--samples", type=int, default=24000)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--num_workers", type=int, default=2)
    p.add_argument("--checkpoint_interval", type=float, default=3.0, help="seconds between periodic checkpoints")
    args = p.parse_args()

    torch.manual_seed(0)
    data = make_data(args.samples, dim=64, classes=10)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(512, 10),
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    steps = args.epochs * (len(data) // args.batch_size + (len(data) % args.batch_size > 0))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)

    with PreemptibleRun(
        args.save_dir, model=model, optimizer=opt, scheduler=sched, checkpoint_interval=args.checkpoint_interval
    ) as run:
        sampler = run.sampler(data, shuffle=True, seed=0)
        loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers)
        t0, s0 = time.monotonic(), run.global_step
        for epoch in run.epochs(args.epochs):
            correct = seen = 0
            for x, y in run.batches(loader):
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                correct += (logits.argmax(1) == y).sum().item()
                seen += len(y)
                if run.global_step % 100 == 0:
                    rate = (run.global_step - s0) / max(time.monotonic() - t0, 1e-9)
                    eta = f"{(steps - run.global_step) / rate:.0f} s" if rate > 0 else "-"
                    print(
                        f"step {run.global_step:5d}/{steps}  epoch {epoch}  loss {loss.item():.4f}"
                        f"  lr {sched.get_last_lr()[0]:.2e}  {rate:.0f} steps/s  eta {eta}",
                        flush=True,
                    )
                run.step()  # the safe point: last statement of the iteration
            if seen:
                print(f"epoch {epoch} done: train accuracy {correct / seen:.3f} (over {seen} samples)", flush=True)
    print(f"finished at step {run.global_step}; weights in {run.last_checkpoint}/model.safetensors")


if __name__ == "__main__":
    main()
