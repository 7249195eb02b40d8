"""Accelerate's ``examples/by_feature/checkpointing.py`` loop, its shape kept, with preempt's lines added (marked).

Everything goes through ``accelerator.prepare`` (model, optimizer, the training loader, scheduler); the loop is the
example's: ``accelerator.accumulate``, ``accelerator.backward``, ``optimizer.step()``, ``lr_scheduler.step()``,
``optimizer.zero_grad()``, and the example's own milestone ``accelerator.save_state`` at each epoch's end
(``--save_state``). Run it alone, or with torchrun / ``accelerate launch --num_processes 2`` (gloo on the CPU).

A tiny model takes the batch as keywords and returns an object with ``.loss`` (as a transformers model does), the
dataset draws random augmentation in ``__getitem__``, the model has dropout and the loop adds a draw per step: every
random stream matters. At the end each process writes ``--final_out`` with ``.rank<R>`` inserted before the suffix:
the unwrapped model, the optimizer, the scheduler, the scaler (fp16) and the process's RNG.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train as harness  # noqa: E402  (the suite's hold and signal points: --hold_at, --signal_at)
from train_ddp import stop_told  # noqa: E402  (each process's stop as an event)

from preempt import PreemptibleRun, _testing  # noqa: E402


class Pairs(Dataset):
    """Features and labels, each sample augmented with draws from the global generators of whoever loads it."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x[:, 0] + 0.5 * self.x[:, 1] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i] + 0.01 * torch.randn(16), "labels": self.y[i]}


class Tiny(torch.nn.Module):
    """``model(**batch).loss``, as a transformers model is called."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 2))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> types.SimpleNamespace:
        logits = self.net(x)
        return types.SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.float(), labels), logits=logits)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save_dir", required=True)
    p.add_argument("--final_out", default=None)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=70)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--accumulate", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--precision", default="no", help="mixed_precision: no, bf16, fp16")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--split_batches", action="store_true")
    p.add_argument("--dispatch_batches", action="store_true")
    p.add_argument("--uneven", action="store_true", help="even_batches=False")
    p.add_argument("--drop_last", action="store_true")
    p.add_argument("--every_steps", type=int, default=None, help="checkpoint_every_steps")
    p.add_argument("--save_state", action="store_true", help="accelerator.save_state at each epoch's end")
    p.add_argument(
        "--settle_saves", action="store_true", help="after a step that took a checkpoint, wait for its write"
    )
    p.add_argument("--hold_at", default=None)
    p.add_argument("--signal_at", default=None)
    p.add_argument("--hold_rank", type=int, default=None, help="apply --hold_at/--signal_at on this process only")
    args = p.parse_args()

    config = DataLoaderConfiguration(
        split_batches=args.split_batches, dispatch_batches=args.dispatch_batches or None, even_batches=not args.uneven
    )
    accelerator = Accelerator(
        gradient_accumulation_steps=args.accumulate,
        mixed_precision=args.precision,
        cpu=not torch.cuda.is_available(),
        dataloader_config=config,
    )
    rank = accelerator.process_index
    if args.hold_rank is None or args.hold_rank == rank:
        if args.hold_at:
            harness.hold_at(args.hold_at)
        if args.signal_at:
            harness.signal_at(args.signal_at)
    torch.set_num_threads(1)
    set_seed(42)
    train_dataloader = DataLoader(
        Pairs(args.samples),
        shuffle=True,
        batch_size=args.batch_size,
        num_workers=args.workers,
        drop_last=args.drop_last,
    )
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=40)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )

    with (
        PreemptibleRun(  # preempt
            args.save_dir,
            model=model,
            optimizer=optimizer,
            scheduler=lr_scheduler,
            checkpoint_interval=None,
            checkpoint_every_steps=args.every_steps,
        ) as run,
        stop_told(run),  # (the suite's: this process's stop as an event)
    ):
        harness._runs.append(run)  # (the suite's hold points wait for its stop flag)
        for epoch in run.epochs(args.epochs):  # preempt: was range(starting_epoch, num_epochs)
            model.train()
            for batch in run.batches(train_dataloader):  # preempt: was the loader, or skip_first_batches(...)
                with accelerator.accumulate(model):
                    outputs = model(**batch)
                    loss = outputs.loss + torch.randn((), device=accelerator.device) * 1e-3
                    accelerator.backward(loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
                harness.reached("step")
                _testing.emit("step", rank=rank, step=run.global_step, batch=run.batch)
                run.step()  # preempt
                if args.settle_saves and run.last_save is not None and run.last_save.step == run.global_step:
                    run.wait_for_checkpoint(harness.HOLD_LIMIT_S)  # (every save durable when due, however slow)
            if args.save_state:  # the example's own milestone save, beside preempt's checkpoints
                accelerator.save_state(os.path.join(args.save_dir, "..", "accelerate_state", f"epoch_{epoch}"))

    if args.final_out:
        out: dict[str, torch.Tensor] = {}
        harness.flatten("model", accelerator.unwrap_model(model).state_dict(), out)
        harness.flatten("optimizer", optimizer.optimizer.state_dict(), out)
        harness.flatten("scheduler", lr_scheduler.scheduler.state_dict(), out)
        if accelerator.scaler is not None:
            harness.flatten("scaler", accelerator.scaler.state_dict(), out)
        out["rng.torch"] = torch.get_rng_state()
        final = Path(args.final_out)
        save_file(out, str(final.with_suffix(f".rank{rank}{final.suffix}")))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
