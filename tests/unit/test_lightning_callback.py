"""PreemptCallback in this process: its options checked at once, the signals and the data source left as they were,
Lightning's state refused where it cannot be stored without pickle. (Stops and resumes: tests/process.)"""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys

import pytest

L = pytest.importorskip("lightning.pytorch", reason="Lightning is not installed (pip install -e '.[lightning]')")

import torch  # noqa: E402
from helpers import history_events, wait_for_stop  # noqa: E402
from helpers.metadata import MetadataService  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from preempt.errors import PREEMPTED_EXIT_CODE, Preempted, PreemptError  # noqa: E402
from preempt.lightning import PreemptCallback  # noqa: E402


def test_import_preempt_never_imports_a_framework():
    code = (
        "import sys, preempt, preempt.run.preemptible, preempt.cli.main\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in"
        " ('lightning', 'pytorch_lightning', 'transformers', 'accelerate')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_an_unknown_option_is_named():
    with pytest.raises(TypeError, match=r"unknown option\(s\) checkpoint_evry_steps; PreemptibleRun's options are"):
        PreemptCallback("runs/x", checkpoint_evry_steps=5)


def test_the_parts_the_callback_sets_are_not_options():
    with pytest.raises(TypeError, match="model, optimizer: set from the framework's objects, not an option"):
        PreemptCallback("runs/x", model=torch.nn.Linear(1, 1), optimizer=None)


def test_a_bad_value_is_refused_when_the_callback_is_made():
    with pytest.raises(ValueError, match="keep_last"):
        PreemptCallback("runs/x", keep_last=-1)
    with pytest.raises(ValueError, match="save_dir: expected a directory path"):
        PreemptCallback("")


class Tiny(L.LightningModule):
    def __init__(self, note: object = "plain", factory: object = None, steps: object = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)), 4)


def quiet_trainer(tmp_path, callbacks: list) -> L.Trainer:
    """One epoch on the CPU, nothing logged, saved or drawn but by ``callbacks``."""
    return L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
    )


def fit(tmp_path, module: L.LightningModule) -> L.Trainer:
    trainer = quiet_trainer(tmp_path, [PreemptCallback(tmp_path / "run", checkpoint_interval=None, log_file=False)])
    trainer.fit(module)
    return trainer


def test_after_fit_the_signals_and_the_data_source_are_as_before(tmp_path):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)}
    module = Tiny()
    trainer = fit(tmp_path, module)
    assert trainer.global_step == 4
    after = {sig: signal.getsignal(sig) for sig in before}
    assert after == before
    assert "train_dataloader" not in module.__dict__  # the hook swapped for the fit is the class's again
    assert (tmp_path / "run" / "complete.json").is_file()


def test_a_hyper_parameter_that_json_cannot_hold_is_recorded_by_type_with_one_warning(tmp_path, caplog):
    net = torch.nn.Linear(2, 2)
    trainer = fit(tmp_path, Tiny(note=net, factory=functools.partial(torch.optim.AdamW, lr=1e-3), steps=[1, 2]))
    assert trainer.global_step == 4
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    told = [r.getMessage() for r in caplog.records if "hyper-parameters" in r.getMessage()]
    assert len(told) == 1 and "note, factory" in told[0], told  # once, naming the keys, not once per checkpoint
    newest = max((tmp_path / "run").glob("step_*"))
    hp = _find(json.loads((newest / "state.json").read_text()), "hyper_parameters")
    assert hp["note"] == "<torch.nn.modules.linear.Linear>"
    assert hp["factory"] == "<functools.partial of torch.optim.adamw.AdamW>"
    assert hp["steps"] == [1, 2]


def _find(tree, key):
    """The value under ``key`` anywhere in a JSON tree."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    for v in tree if isinstance(tree, list) else ():
        found = _find(v, key)
        if found is not None:
            return found
    return None


def test_lightning_older_than_supported_is_refused_and_newer_is_said(caplog):
    from preempt.lightning.callback import _check_version

    with pytest.raises(PreemptError, match=r"Lightning 2\.4\.0 is older than 2\.5, the oldest supported"):
        _check_version("2.4.0")
    _check_version("2.5.0.post0")
    _check_version("2.6.6")
    assert "newer than the versions tested" not in caplog.text
    _check_version("2.7.0")
    assert "Lightning 2.7.0 is newer than the versions tested (up to 2.6.x)" in caplog.text


class _Made:
    """What resumable() asked for: a stand-in sampler that records its arguments."""

    def __init__(self, dataset, **options) -> None:
        self.dataset, self.options = dataset, options

    def __iter__(self):
        return iter(range(len(self.dataset)))

    def __len__(self) -> int:
        return len(self.dataset)


def test_a_loader_with_torchs_samplers_is_remade_with_the_runs_and_any_other_kept():
    from torch.utils.data import DistributedSampler, IterableDataset, RandomSampler

    from preempt.lightning.batches import resumable

    data = TensorDataset(torch.arange(12.0))
    shuffled = resumable(DataLoader(data, batch_size=4, shuffle=True, drop_last=True), _Made, 7)
    assert isinstance(shuffled.sampler, _Made) and shuffled.sampler.options == {
        "shuffle": True,
        "seed": 7,
        "drop_last": False,
    }
    assert shuffled.batch_size == 4 and shuffled.drop_last  # the rest of the loader as it was
    ordered = resumable(DataLoader(data, batch_size=4), _Made, 7)
    assert ordered.sampler.options["shuffle"] is False
    ddp = DistributedSampler(data, num_replicas=2, rank=1, shuffle=False, seed=5, drop_last=True)
    sharded = resumable(DataLoader(data, batch_size=2, sampler=ddp), _Made, 7)
    assert sharded.sampler.options == {"shuffle": False, "seed": 5, "drop_last": True}

    class Own(RandomSampler):
        pass

    for kept in (
        DataLoader(data, sampler=Own(data)),  # a sampler of the user's own
        DataLoader(data, sampler=RandomSampler(data, replacement=True)),  # draws with replacement
        DataLoader(data, batch_sampler=[[0, 1], [2, 3]]),  # batches of the user's own
    ):
        assert resumable(kept, _Made, 7) is kept

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    stream = DataLoader(Stream(), batch_size=2)
    assert resumable(stream, _Made, 7) is stream
    assert resumable([1, 2, 3], _Made, 7) == [1, 2, 3]  # not a DataLoader


def test_the_callback_takes_notices_and_grace(tmp_path, monkeypatch):
    """A notice from the emulated AWS service stops the fit at its next step, exit code 75; the loop holds in its first
    step until the run has been asked to stop, so the notice lands there however fast or slow the machine."""
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
        with pytest.raises(Preempted) as e:
            quiet_trainer(tmp_path, [Hold(), preempt_cb]).fit(Tiny())
    assert e.value.code == PREEMPTED_EXIT_CODE and e.value.cause.startswith("aws notice: "), e.value.cause
    assert service.requests[0].path == "/latest/api/token"
    (stop,) = history_events(tmp_path / "run", "stop")
    assert stop["step"] == 1 and stop["cause"] == e.value.cause and stop["margin_s"] > 0, stop
