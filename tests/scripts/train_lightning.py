"""A small Lightning training for the Lightning tests: real Lightning, real workers, real signals.

A map-style set with random augmentation in ``__getitem__`` (in 2 DataLoader workers by default), dropout and a
draw from the global RNG in each training step, AdamW with a per-step scheduler, ``seed_everything(0,
workers=True)``; 96 samples in batches of 8, so 12 batches per epoch. Every optimizer step prints ``step N epoch E
batch B``. At the end ``--final_out`` gets the model's and the optimizer's tensors, and the losses.

The training data reaches Lightning as users give it (``--data``): the module's own ``train_dataloader`` hook
(``module``, the default), a ``LightningDataModule`` given as ``datamodule=`` (``datamodule``; ``datamodule_state``
adds ``state_dict``/``load_state_dict`` and Lightning 1.x's ``on_save_checkpoint`` hooks), a datamodule given
positionally (``positional``), or the loaders given to ``fit(train_dataloaders=..., val_dataloaders=...)``
(``loaders``).

Run alone or as a LightningCLI (``--cli``, the rest of the command line goes to LightningCLI: ``fit --config
x.yaml``). ``--hold_at_step N`` makes the N-th optimizer step of this process wait, before the run's safe point,
until the run has been asked to stop: the test signals the process then, whatever the machine's speed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.plugins import MixedPrecision
from safetensors.torch import save_file
from torch.utils.data import DataLoader, RandomSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import Synthetic, flatten, wait_for_stop  # noqa: E402

from preempt import _testing  # noqa: E402
from preempt.lightning import PreemptCallback  # noqa: E402


class Shuffled(RandomSampler):
    """A sampler of the user's own (preempt does not replace it)."""


class Net(L.LightningModule):
    def __init__(
        self,
        dim: int = 16,
        lr: float = 1e-2,
        workers: int = 2,
        samples: int = 96,
        batch_size: int = 8,
        custom_sampler: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(dim, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 2)
        )
        self.losses: list[float] = []
        self.val_losses: list[float] = []  # what the validations logged, carried across processes as the losses
        self.validations = 0
        self.hold_in_validation: int | None = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y) + torch.randn(()) * 1e-3
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        val_loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("val_loss", val_loss)
        self.val_losses.append(val_loss.item())
        if batch_idx == 0:
            self.validations += 1
            if self.validations == self.hold_in_validation:  # --hold_in_validation: the signal comes during it
                print(f"holding in validation {self.validations} after step {self.trainer.global_step}", flush=True)
                _testing.emit("holding", point="validation", n=self.validations, step=self.trainer.global_step)
                wait_for_stop(held_run(self.trainer))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        h = self.hparams
        return train_loader(h.samples, h.dim, h.batch_size, h.workers, h.custom_sampler)

    def val_dataloader(self):
        return val_loader(self.hparams.dim)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["losses"] = list(self.losses)
        checkpoint["val_losses"] = list(self.val_losses)

    def on_load_checkpoint(self, checkpoint):
        if "losses" in checkpoint:  # a preempt checkpoint (or Lightning's) carries the losses so far
            self.losses = list(checkpoint["losses"])
            self.val_losses = list(checkpoint.get("val_losses", []))


def train_loader(samples: int, dim: int, batch_size: int, workers: int, custom_sampler: bool = False) -> DataLoader:
    data = Synthetic(samples, dim, augment=True)
    if custom_sampler:  # a sampler of the user's own: a resumed epoch replays its batches
        sampler = Shuffled(data)  # its order drawn from torch's global generator when the epoch's iterator is made
        return DataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=workers)
    return DataLoader(data, batch_size=batch_size, shuffle=True, num_workers=workers)


def val_loader(dim: int) -> DataLoader:
    return DataLoader(Synthetic(32, dim, augment=True, seed=99), batch_size=8, num_workers=0)


class Data(L.LightningDataModule):
    """A plain datamodule, as Lightning 2.x's documentation writes one: no state of its own."""

    def __init__(self, dim: int = 16, workers: int = 2, samples: int = 96, batch_size: int = 8) -> None:
        super().__init__()
        self.dim, self.workers, self.samples, self.batch_size = dim, workers, samples, batch_size

    def train_dataloader(self):
        return train_loader(self.samples, self.dim, self.batch_size, self.workers)

    def val_dataloader(self):
        return val_loader(self.dim)


class CountingData(Data):
    """A datamodule with state: its ``state_dict`` counts the training loaders made, and Lightning 1.x's hooks carry
    a note (both must come back on resume)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loaders_made = 0
        self.note = "fresh"

    def train_dataloader(self):
        self.loaders_made += 1
        return super().train_dataloader()

    def state_dict(self):
        return {"loaders_made": self.loaders_made}

    def load_state_dict(self, state):
        self.loaders_made = int(state["loaders_made"])

    def on_save_checkpoint(self, checkpoint):
        checkpoint["note"] = f"saved after {self.loaders_made} loader(s)"

    def on_load_checkpoint(self, checkpoint):
        self.note = checkpoint["note"]


class Steps(L.Callback):
    """Prints each optimizer step; holds at one until the run is asked to stop (--hold_at_step; under DDP on the
    rank --hold_rank only: the others wait for it in the run's agreement at that step)."""

    def __init__(self, hold_at: int | None, step_sleep: float, hold_rank: int = 0) -> None:
        self.hold_at = hold_at
        self.hold_rank = hold_rank
        self.step_sleep = step_sleep
        self.steps = 0  # optimizer steps of this process
        self.seen = -1

    def on_train_start(self, trainer, pl_module):
        self.seen = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.seen:
            return  # an accumulated micro-batch
        self.seen = trainer.global_step
        self.steps += 1
        if self.step_sleep:
            time.sleep(self.step_sleep)
        rank = f"rank {trainer.global_rank} " if trainer.world_size > 1 else ""
        print(f"{rank}step {trainer.global_step} epoch {trainer.current_epoch} batch {batch_idx + 1}", flush=True)
        _testing.emit(
            "step", step=trainer.global_step, epoch=trainer.current_epoch, batch=batch_idx + 1, rank=trainer.global_rank
        )
        if self.steps == self.hold_at and trainer.global_rank == self.hold_rank:
            print(f"{rank}holding at step {trainer.global_step} pid {os.getpid()}", flush=True)
            _testing.emit("holding", point="step", n=trainer.global_step, rank=trainer.global_rank, pid=os.getpid())
            wait_for_stop(held_run(trainer))
            print(f"{rank}released at step {trainer.global_step}", flush=True)


def held_run(trainer: L.Trainer):
    """The PreemptibleRun of the trainer's PreemptCallback."""
    return next(cb for cb in trainer.callbacks if isinstance(cb, PreemptCallback)).run


def write_final(path: str, module: Net, trainer: L.Trainer) -> None:
    out: dict[str, torch.Tensor] = {}
    flatten("model", module.state_dict(), out)
    flatten("optimizer", trainer.optimizers[0].state_dict(), out)
    out["losses"] = torch.tensor(module.losses, dtype=torch.float64)
    out["val_losses"] = torch.tensor(module.val_losses, dtype=torch.float64)
    # Lightning's own counters (the loops' progress): a resumed fit ends with the uninterrupted one's
    for name, value in _counters("fit_loop", trainer.fit_loop.state_dict()):
        out[name] = torch.tensor(value)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:
        flatten("scaler", scaler.state_dict(), out)
    for cb in trainer.callbacks:  # the user's own callbacks' state at the end (--user_callbacks)
        if isinstance(cb, L.callbacks.ModelCheckpoint) and cb.best_model_score is not None:
            out["model_checkpoint.best_model_score"] = cb.best_model_score.detach().clone().reshape(())
            out["model_checkpoint.kept"] = torch.tensor(len(cb.best_k_models))
        if isinstance(cb, L.callbacks.EarlyStopping):
            out["early_stopping.wait_count"] = torch.tensor(cb.wait_count)
            out["early_stopping.best_score"] = cb.best_score.detach().clone().reshape(())
    save_file(out, path)


def _counters(prefix: str, tree: Any):
    """The integers of a loop's state_dict, by dotted name (the progress counters)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _counters(f"{prefix}.{k}", v)
    elif isinstance(tree, int) and not isinstance(tree, bool):
        yield prefix, tree


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save_dir", default=None, help="PreemptCallback's save_dir (none: Lightning alone)")
    p.add_argument("--final_out", default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--every_steps", type=int, default=None)
    p.add_argument("--validate", action="store_true", help="a validation every 5 batches")
    p.add_argument("--hold_at_step", type=int, default=None)
    p.add_argument("--step_sleep", type=float, default=0.0)
    p.add_argument("--sync_save", action="store_true")
    p.add_argument("--ddp", type=int, default=None, help="strategy='ddp' with this many CPU processes (gloo)")
    p.add_argument("--hold_rank", type=int, default=0)
    p.add_argument("--custom_sampler", action="store_true", help="a RandomSampler subclass of the user's own")
    p.add_argument("--hold_in_validation", type=int, default=None, help="N: the N-th validation holds until a stop")
    p.add_argument("--scaler", action="store_true", help="float16 autocast with a GradScaler (on the CPU)")
    p.add_argument(
        "--data",
        choices=("module", "datamodule", "datamodule_state", "positional", "loaders"),
        default="module",
        help="how the training data reaches Lightning",
    )
    p.add_argument(
        "--user_callbacks",
        default=None,
        help="DIR: ModelCheckpoint (top 2 by val_loss), EarlyStopping, LearningRateMonitor and a CSVLogger, under DIR",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, workers=True, verbose=False)
    model = Net(workers=args.workers, custom_sampler=args.custom_sampler)
    model.hold_in_validation = args.hold_in_validation
    callbacks: list[L.Callback] = [Steps(args.hold_at_step, args.step_sleep, args.hold_rank)]
    if args.save_dir:
        callbacks.append(
            PreemptCallback(
                args.save_dir,
                checkpoint_interval=None,
                checkpoint_every_steps=args.every_steps,
                async_save=not args.sync_save,
            )
        )
    logger: Any = False
    if args.user_callbacks:
        where = Path(args.user_callbacks)
        callbacks += [
            L.callbacks.ModelCheckpoint(dirpath=where / "ckpt", monitor="val_loss", save_top_k=2),
            L.callbacks.EarlyStopping(monitor="val_loss", patience=1000),
            L.callbacks.LearningRateMonitor(logging_interval="step"),
        ]
        logger = L.loggers.CSVLogger(where / "logs", name="csv")
    plugins = []
    if args.scaler:  # Lightning picks bf16 without a scaler on the CPU; a GradScaler whose state matters, given here
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8)))
    trainer = L.Trainer(
        max_epochs=args.epochs,
        plugins=plugins,
        accelerator="cpu",
        devices=args.ddp or 1,
        strategy="ddp" if args.ddp else "auto",
        logger=logger,
        enable_checkpointing=bool(args.user_callbacks),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=args.accumulate,
        limit_val_batches=1.0 if args.validate else 0,
        val_check_interval=5 if args.validate else None,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    if args.data == "module":
        trainer.fit(model)
    elif args.data in ("datamodule", "datamodule_state"):
        dm = (CountingData if args.data == "datamodule_state" else Data)(workers=args.workers)
        trainer.fit(model, datamodule=dm)
        if isinstance(dm, CountingData):
            print(f"datamodule loaders_made {dm.loaders_made} note {dm.note!r}", flush=True)
            _testing.emit("datamodule", loaders_made=dm.loaders_made, note=dm.note)
    elif args.data == "positional":
        trainer.fit(model, Data(workers=args.workers))
    else:
        trainer.fit(model, train_dataloaders=train_loader(96, 16, 8, args.workers), val_dataloaders=val_loader(16))
    if args.final_out:  # under DDP each rank its own file, .rank<R> before the suffix (the losses are the rank's)
        final = Path(args.final_out)
        if trainer.world_size > 1:
            final = final.with_suffix(f".rank{trainer.global_rank}{final.suffix}")
        write_final(str(final), model, trainer)
    print(f"done at step {trainer.global_step} pid {os.getpid()} rank {trainer.global_rank}", flush=True)


if __name__ == "__main__":
    main()
