"""The frameworks' integrations take ``notices=`` and ``grace=`` as PreemptibleRun does: a Lightning fit and a Hugging
Face Trainer, in this process, watch the emulated AWS service on 127.0.0.1 and stop with exit code 75 on its notice.
Each loop waits inside its first step until its run has been asked to stop (bounded), so the notice lands there
however fast or slow the machine."""

from __future__ import annotations

import json
import time

import pytest
import torch
from helpers.metadata import MetadataService
from torch.utils.data import DataLoader, Dataset, TensorDataset

from preempt.errors import PREEMPTED_EXIT_CODE, Preempted

HOLD_S = 60.0


def wait_for_stop(run) -> None:
    end = time.monotonic() + HOLD_S
    while not run.stop_requested and time.monotonic() < end:
        time.sleep(0.005)


def stop_marker(save_dir) -> dict:
    lines = [json.loads(x) for x in (save_dir / "history.jsonl").read_text().splitlines()]
    (stop,) = [d for d in lines if d.get("event") == "stop"]
    return stop


def test_lightning_callback_takes_notices_and_grace(tmp_path, monkeypatch):
    L = pytest.importorskip("lightning.pytorch", reason="Lightning is not installed (pip install -e '.[lightning]')")
    from preempt.lightning import PreemptCallback

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            return DataLoader(
                TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)), 4
            )

    preempt_cb = PreemptCallback(tmp_path / "run", notices="aws", grace=90, checkpoint_interval=None)
    assert preempt_cb.config.notices == "aws" and preempt_cb.config.grace == 90

    class Hold(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 0:
                wait_for_stop(preempt_cb.run)

    with MetadataService("aws") as service:
        monkeypatch.setenv(*next(iter(service.env().items())))
        monkeypatch.delenv("PREEMPT_NOTICES", raising=False)
        service.give_notice()
        trainer = L.Trainer(
            max_epochs=1,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
            callbacks=[Hold(), preempt_cb],
        )
        with pytest.raises(Preempted) as e:
            trainer.fit(Tiny())
    assert e.value.code == PREEMPTED_EXIT_CODE and e.value.cause.startswith("aws notice: "), e.value.cause
    assert service.requests[0].path == "/latest/api/token"
    stop = stop_marker(tmp_path / "run")
    assert stop["step"] == 1 and stop["cause"] == e.value.cause and stop["margin_s"] > 0, stop


class Pairs(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x, labels=None):
        logits = self.layer(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_hf_install_takes_notices_and_grace(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    import preempt.hf

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, disable_tqdm=True, per_device_train_batch_size=4
    )
    trainer = transformers.Trainer(model=TinyModel(), args=args, train_dataset=Pairs())
    with pytest.raises(ValueError, match="notices: expected one of aws, gce, azure"):
        preempt.hf.install(trainer, tmp_path / "run", notices="ec2")
    driver = preempt.hf.install(trainer, tmp_path / "run", notices="aws", grace=45.0)

    class Hold(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                wait_for_stop(driver.run)

    trainer.add_callback(Hold())
    with MetadataService("aws") as service:
        monkeypatch.setenv(*next(iter(service.env().items())))
        monkeypatch.delenv("PREEMPT_NOTICES", raising=False)
        service.give_notice()
        with pytest.raises(Preempted) as e:
            trainer.train()
    assert e.value.code == PREEMPTED_EXIT_CODE and e.value.cause.startswith("aws notice: "), e.value.cause
    assert service.requests[0].path == "/latest/api/token"
    assert stop_marker(tmp_path / "run")["step"] == 1
