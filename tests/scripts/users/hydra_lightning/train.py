"""The template's ``train.py``: Hydra composes the config, everything is built by ``hydra.utils.instantiate``, the
callbacks come from the YAML. ``FINAL_OUT`` (the test's): the final state written there."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as L
import torch
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    from safetensors.torch import save_file
    from train import flatten  # tests/scripts/train.py

    torch.set_num_threads(1)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model)
    callbacks = [hydra.utils.instantiate(c) for c in cfg.callbacks.values()]
    trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=False)
    trainer.fit(model=model, datamodule=datamodule)
    final = os.environ.get("FINAL_OUT")
    if final:
        out: dict[str, Any] = {}
        flatten("model", model.state_dict(), out)
        flatten("optimizer", trainer.optimizers[0].state_dict(), out)
        out["val_losses"] = torch.tensor(model.val_losses, dtype=torch.float64)
        for cb in trainer.callbacks:
            if isinstance(cb, L.callbacks.ModelCheckpoint) and cb.best_model_score is not None:
                out["best_model_score"] = cb.best_model_score.detach().clone().reshape(())
            if isinstance(cb, L.callbacks.EarlyStopping):
                out["early_stopping.wait_count"] = torch.tensor(cb.wait_count)
        save_file(out, final)


if __name__ == "__main__":
    main()
