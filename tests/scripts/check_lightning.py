"""``preempt check``'s Lightning script: ``train_lightning.Net`` under a PreemptCallback, and with ``--counter`` a
LightningModule whose count of training steps, kept outside any ``state_dict``, scales the loss (a pattern that does
not resume exactly: the count starts again at 0 in the resumed process)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning.pytorch as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_lightning import Net  # noqa: E402

from preempt.lightning import PreemptCallback  # noqa: E402


class Counting(Net):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls = 0  # not in state_dict, not tracked

    def training_step(self, batch, batch_idx):
        self.calls += 1
        return super().training_step(batch, batch_idx) * (1.0 + 0.01 * self.calls)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save_dir", required=True)
    p.add_argument("--counter", action="store_true")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, workers=True, verbose=False)
    model = (Counting if args.counter else Net)(workers=args.workers)
    trainer = L.Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[PreemptCallback(args.save_dir)],
    )
    trainer.fit(model)


if __name__ == "__main__":
    main()
