"""train_lightning.py's model as a LightningCLI project: ``python train_lightning_cli.py fit --config x.yaml``.

The user's code is a plain LightningCLI; PreemptCallback comes from the YAML config alone (``trainer.callbacks``).
``FINAL_OUT`` in the environment: where the final model and optimizer tensors are written after ``fit``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_lightning import Net, write_final  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    cli = LightningCLI(Net, save_config_kwargs={"overwrite": True})
    final = os.environ.get("FINAL_OUT")
    if final:
        write_final(final, cli.model, cli.trainer)
    print(f"done at step {cli.trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
