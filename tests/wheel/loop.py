"""The quick start's loop (README.md), run from the installed wheel by tests/wheel/check.sh.

    python loop.py --save_dir DIR --out FINAL.pt [--stop_at STEP]

--stop_at sends the process SIGTERM after that optimizer step, as a scheduler would: the run saves at its next safe
point and exits 75; the same command again resumes there and finishes. FINAL.pt holds the model's and the
optimizer's tensors at the end, for check.sh to compare with an uninterrupted run's under torch.equal.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from torch.utils.data import DataLoader, TensorDataset

from preempt import PreemptibleRun


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save_dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stop_at", type=int, default=None, help="SIGTERM to itself after this step")
    args = p.parse_args()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    train_set = TensorDataset(torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)

    with PreemptibleRun(args.save_dir, model=model, optimizer=opt, scheduler=sched, keep_last=2) as run:
        sampler = run.sampler(train_set, shuffle=True, seed=0)
        loader = DataLoader(train_set, batch_size=16, sampler=sampler)
        for _epoch in run.epochs(3):
            for x, y in run.batches(loader):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                if run.global_step + 1 == args.stop_at:
                    os.kill(os.getpid(), signal.SIGTERM)  # recorded only: the save and exit 75 come at run.step()
                run.step()
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, state in opt.state_dict()["state"].items():
        tensors.update({f"opt.{i}.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
    torch.save(tensors, args.out)
    print(f"finished at step {run.global_step}")


if __name__ == "__main__":
    main()
