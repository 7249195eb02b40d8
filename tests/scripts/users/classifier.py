"""An image classifier in the style of torchvision's reference ``train.py`` (written here, not copied; no torchvision:
its transforms are spelled out with torch ops, as the PyPI build of torchvision does not import beside the CPU
torch wheel of these machines).

Random 3x12x12 "images" of 4 classes; each sample padded and randomly cropped back to 12x12 and randomly flipped in
``__getitem__``, in 2 DataLoader workers (the loader is the user's own: ``shuffle=True``, no preempt sampler);
a small CNN with batch norm and dropout; label smoothing; SGD with momentum and Nesterov, weight decay; a
``MultiStepLR`` stepped at each epoch's end; an exponential moving average of the weights
(``torch.optim.swa_utils.AveragedModel``) tracked by the run; 112 samples in batches of 8: 14 steps per epoch, 3
epochs. ``--hold_at_step N``: the step N waits before ``run.step()`` until the run was asked to stop.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train import flatten, wait_for_stop  # noqa: E402

from preempt import PreemptibleRun, _testing  # noqa: E402


class Images(Dataset):
    def __init__(self, n: int = 112) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 3, 12, 12, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        img = torch.nn.functional.pad(self.x[i], (2, 2, 2, 2), mode="reflect")  # RandomCrop(12, padding=2)
        top, left = torch.randint(0, 5, (2,)).tolist()
        img = img[:, top : top + 12, left : left + 12]
        if torch.rand(()) < 0.5:  # RandomHorizontalFlip
            img = img.flip(-1)
        return img, self.y[i]


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(32, 4),
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save_dir", required=True)
    p.add_argument("--final_out", default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--hold_at_step", type=int, default=None)
    p.add_argument("--every_steps", type=int, default=None, help="periodic checkpoints, written synchronously")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train_set = Images()
    model = make_model()
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[1, 2], gamma=0.1)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    loader = DataLoader(train_set, batch_size=8, shuffle=True, num_workers=2, drop_last=True)
    with PreemptibleRun(
        args.save_dir,
        model=model,
        optimizer=opt,
        scheduler=sched,
        track={"ema": ema},
        checkpoint_interval=None,
        checkpoint_every_steps=args.every_steps,
        async_save=args.every_steps is None,
    ) as run:
        for _ in run.epochs(args.epochs):
            model.train()
            for img, target in run.batches(loader):
                loss = criterion(model(img), target)
                opt.zero_grad()
                loss.backward()
                opt.step()
                ema.update_parameters(model)
                if run.global_step + 1 == args.hold_at_step:
                    _testing.emit("holding", point="step", n=args.hold_at_step, pid=os.getpid())
                    wait_for_stop(run)
                run.step()
            sched.step()  # per epoch, after the epoch's steps (torchvision's lr_scheduler.step())
    if args.final_out:
        out: dict[str, torch.Tensor] = {}
        flatten("model", model.state_dict(), out)
        flatten("ema", ema.state_dict(), out)
        flatten("optimizer", opt.state_dict(), out)
        out["rng"] = torch.get_rng_state()
        save_file(out, args.final_out)


if __name__ == "__main__":
    main()
