"""The Python side of a Hydra + Lightning project in the layout of the most used public template (written here, not
copied): a LightningModule that takes its network and its optimizer and scheduler *factories* (``functools.partial``
objects made by Hydra's ``_partial_: true``) and calls ``self.save_hyperparameters()`` on all of them, and a
LightningDataModule with ``setup()`` splitting a data set. Nothing here knows of preempt: only the YAML lists its
callback."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset, random_split


class SimpleDenseNet(torch.nn.Module):
    def __init__(self, input_size: int = 16, lin1_size: int = 32, output_size: int = 2, dropout: float = 0.2):
        super().__init__()
        self.model = torch.nn.Sequential(
            torch.nn.Linear(input_size, lin1_size),
            torch.nn.BatchNorm1d(lin1_size),
            torch.nn.ReLU(),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(lin1_size, output_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class LitModule(L.LightningModule):
    def __init__(self, net: torch.nn.Module, optimizer: Any, scheduler: Any, compile: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)  # net, and the two partials: objects JSON cannot hold
        self.net = net
        self.criterion = torch.nn.CrossEntropyLoss()
        self.val_losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.criterion(self.net(x), y)
        self.log("train/loss", loss, on_step=True, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = self.criterion(self.net(x), y)
        self.log("val/loss", loss, on_epoch=True)
        self.val_losses.append(loss.item())

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.hparams.optimizer(params=self.trainer.model.parameters())
        scheduler = self.hparams.scheduler(optimizer=optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["val_losses"] = list(self.val_losses)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.val_losses = list(checkpoint.get("val_losses", []))


class Noisy(Dataset):
    """Features with a class signal and noise drawn anew at each access (an augmentation)."""

    def __init__(self, n: int, dim: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.y = torch.randint(0, 2, (n,), generator=g)
        self.x = torch.randn(n, dim, generator=g) + self.y[:, None]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(self.x.shape[1]), self.y[i]


class DataModule(L.LightningDataModule):
    def __init__(self, samples: int = 120, dim: int = 16, batch_size: int = 8, num_workers: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.data_train: Dataset | None = None
        self.data_val: Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.data_train is None:
            full = Noisy(self.hparams.samples, self.hparams.dim)
            self.data_train, self.data_val = random_split(full, [96, 24], generator=torch.Generator().manual_seed(42))

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        return DataLoader(self.data_train, batch_size=h.batch_size, num_workers=h.num_workers, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data_val, batch_size=self.hparams.batch_size, num_workers=0, shuffle=False)


class Steps(L.Callback):
    """The test's hook: prints each optimizer step; at ``hold_at`` waits until the run was asked to stop."""

    def __init__(self, hold_at: int | None = None) -> None:
        self.hold_at = hold_at

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        import os

        from train import wait_for_stop  # tests/scripts/train.py (on the path: train.py of this project puts it)

        from preempt import _testing
        from preempt.lightning import PreemptCallback

        print(f"step {trainer.global_step}", flush=True)
        if trainer.global_step == self.hold_at:
            run = next(cb for cb in trainer.callbacks if isinstance(cb, PreemptCallback)).run
            _testing.emit("holding", point="step", n=trainer.global_step, pid=os.getpid())
            wait_for_stop(run)  # released by the test's signal, which the run records
