"""preempt.hf.install in this process: what it refuses, at once and by name, and what it changes on the Trainer.
(Stops and resumes: tests/process/test_hf.py.)"""

from __future__ import annotations

import logging
import re

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

import torch  # noqa: E402
from helpers import history_events, wait_for_stop  # noqa: E402
from helpers.metadata import MetadataService  # noqa: E402

import preempt.hf  # noqa: E402
from preempt.errors import PREEMPTED_EXIT_CODE, Preempted, PreemptError  # noqa: E402


class Pairs(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((4,), float(i)), "labels": torch.tensor(i % 2)}


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x, labels=None):
        logits = self.layer(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def trainer(tmp_path, **args) -> transformers.Trainer:
    options = dict(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, disable_tqdm=True, **args)
    return transformers.Trainer(
        model=Tiny(), args=transformers.TrainingArguments(**options), train_dataset=Pairs(), eval_dataset=Pairs()
    )


def test_what_is_not_a_trainer_an_unknown_option_and_a_second_install_are_refused(tmp_path):
    with pytest.raises(TypeError, match="expected a transformers.Trainer"):
        preempt.hf.install(object(), tmp_path / "run")
    t = trainer(tmp_path)
    with pytest.raises(TypeError, match=r"unknown option\(s\) keep_lst"):
        preempt.hf.install(t, tmp_path / "run", keep_lst=2)
    with pytest.raises(TypeError, match="optimizer: set from the framework's objects"):
        preempt.hf.install(t, tmp_path / "run", optimizer=None)
    preempt.hf.install(t, tmp_path / "run")
    with pytest.raises(PreemptError, match="installed on this Trainer already"):
        preempt.hf.install(t, tmp_path / "run")


def test_resume_from_checkpoint_is_refused_since_preempt_resumes_by_itself(tmp_path):
    t = trainer(tmp_path)
    preempt.hf.install(t, tmp_path / "run")
    with pytest.raises(PreemptError, match="preempt resumes from .* by itself; call trainer.train"):
        t.train(resume_from_checkpoint=True)


def test_the_trainers_saving_arguments_become_preempts_options(tmp_path):
    t = trainer(
        tmp_path,
        eval_strategy="steps",
        save_strategy="steps",
        save_steps=4,
        eval_steps=4,
        save_total_limit=3,
        load_best_model_at_end=True,
        metric_for_best_model="accuracy",
        greater_is_better=True,
    )
    driver = preempt.hf.install(t, tmp_path / "run")
    assert driver.options == {
        "checkpoint_every_steps": 4,
        "checkpoint_interval": None,
        "keep_last": 3,
        "best_metric": "eval_accuracy",
        "best_mode": "max",
        "keep_best": 1,
    }
    given = preempt.hf.install(trainer(tmp_path, save_total_limit=3), tmp_path / "other", keep_last=5)
    assert given.options["keep_last"] == 5  # what install is given wins


def test_save_steps_set_preempts_cadence_and_the_trainers_own_saving_is_off(tmp_path):
    t = trainer(tmp_path, save_strategy="steps", save_steps=3, num_train_epochs=1, per_device_train_batch_size=2)
    driver = preempt.hf.install(t, tmp_path / "run", log_file=False)
    assert driver.options["checkpoint_every_steps"] == 3 and driver.options["checkpoint_interval"] is None
    assert t.args.save_strategy == transformers.trainer_utils.SaveStrategy.NO
    t.train()
    steps = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "run").glob("step_*"))
    assert steps == [3, 4] and not list((tmp_path / "out").glob("checkpoint-*")), steps
    assert (tmp_path / "run" / "complete.json").is_file()


def test_a_trainer_without_the_methods_install_takes_over_is_refused_with_the_version(tmp_path):
    t = trainer(tmp_path)
    t._run_epoch = None  # as on a transformers 4 Trainer, which has no _run_epoch
    with pytest.raises(PreemptError, match=r"has no _run_epoch; preempt.hf needs transformers 5"):
        preempt.hf.install(t, tmp_path / "run")


class StopAt(transformers.TrainerCallback):
    """Asks the run to stop at one optimizer step, as a signal would (the stop lands at that step's safe point)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.driver = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.driver.run.request_stop()


def counted(
    tmp_path, save_dir: str, stop_at: int | None = None, every: str = "steps"
) -> tuple[transformers.Trainer, object]:
    """A Trainer that logs every 3 steps and evaluates every 2 (``every="epoch"``: at each epoch's end; 4 steps an
    epoch, 2 epochs), early stopping by eval_loss; trained to its end, or stopped at ``stop_at`` (SystemExit 75)."""
    torch.manual_seed(0)
    options = dict(
        output_dir=str(tmp_path / "out"),
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        per_device_train_batch_size=2,
        num_train_epochs=2,
        logging_steps=3,
        eval_strategy=every,
        eval_steps=2,
        save_strategy=every,
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        learning_rate=0.5,
        seed=0,
    )
    stop = StopAt(stop_at or -1)
    t = transformers.Trainer(
        model=Tiny(),
        args=transformers.TrainingArguments(**options),
        train_dataset=Pairs(),
        eval_dataset=Pairs(),
        callbacks=[stop, transformers.EarlyStoppingCallback(early_stopping_patience=5, early_stopping_threshold=5.0)],
    )
    stop.driver = preempt.hf.install(t, tmp_path / save_dir, log_file=False)
    if stop_at is not None:
        with pytest.raises(SystemExit) as stopped:
            t.train()
        assert stopped.value.code == 75
        return t, None
    return t, t.train()


def _read(t: transformers.Trainer, out) -> dict:
    timing = ("_runtime", "_per_second")
    early = next(cb for cb in t.callback_handler.callbacks if isinstance(cb, transformers.EarlyStoppingCallback))
    return {
        "training_loss": out.training_loss,
        "metrics": {k: v for k, v in out.metrics.items() if not k.endswith(timing) and "_per_second" not in k},
        "log": [
            {k: v for k, v in e.items() if not k.endswith(timing) and "_per_second" not in k}
            for e in t.state.log_history
        ],
        "best": (t.state.best_metric, t.state.best_global_step),
        "flos": t.state.total_flos,
        "patience": early.early_stopping_patience_counter,
    }


def test_a_stop_at_an_epochs_last_step_evaluates_first_and_the_counters_continue(tmp_path):
    """Stopped at step 4 (epoch 0's last, an evaluation due, the loss of step 4 not logged yet): the evaluation is in
    the stopped process's log; the resumed one logs, counts and ends as the uninterrupted run does (the loss summed
    since the log at step 3, the train loss over all 8 steps, the flos, best_metric and its step, the early-stopping
    counter)."""
    whole, out = counted(tmp_path, "whole")
    want = _read(whole, out)
    assert want["patience"] > 0 and any("eval_loss" in e and e["step"] == 4 for e in want["log"]), want
    stopped, _ = counted(tmp_path, "run", stop_at=4)
    assert [e["step"] for e in stopped.state.log_history if "eval_loss" in e] == [2, 4]
    resumed, out = counted(tmp_path, "run")
    assert _read(resumed, out) == want
    assert out.metrics["train_runtime"] >= 0


def test_an_evaluation_at_the_epochs_end_after_a_stop_at_its_last_step_runs_on_the_rerun(tmp_path):
    """eval_strategy="epoch": the stop at step 4 comes before epoch 0's end, where its evaluation is; the rerun
    evaluates epoch 0 before its first step, and ends as the uninterrupted run does."""
    whole, out = counted(tmp_path, "whole", every="epoch")
    want = _read(whole, out)
    assert [e["step"] for e in want["log"] if "eval_loss" in e] == [4, 8], want
    stopped, _ = counted(tmp_path, "run", stop_at=4, every="epoch")
    assert not [e for e in stopped.state.log_history if "eval_loss" in e], stopped.state.log_history
    resumed, out = counted(tmp_path, "run", every="epoch")
    assert _read(resumed, out) == want


def test_the_progress_line_counts_to_max_steps(tmp_path, caplog):
    """max_steps=5 over epochs of 4 steps: the Trainer plans 2 epochs, the progress line's total is 5."""
    t = trainer(tmp_path, per_device_train_batch_size=2, num_train_epochs=3, max_steps=5)
    preempt.hf.install(t, tmp_path / "run", log_file=False, progress_every_s=1e-6)
    caplog.set_level(logging.INFO, logger="preempt")
    t.train()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines and all(re.match(r"step \d/5 \|", line) for line in lines), lines


def test_install_takes_notices_and_grace(tmp_path, monkeypatch):
    """As the Lightning callback: a notice from the emulated AWS service stops the Trainer at its next step."""
    t = trainer(tmp_path, per_device_train_batch_size=4)
    with pytest.raises(ValueError, match="notices: expected one of aws, gce, azure"):
        preempt.hf.install(t, tmp_path / "run", notices="ec2")
    driver = preempt.hf.install(t, tmp_path / "run", notices="aws", grace=45.0)

    class Hold(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                wait_for_stop(driver.run)

    t.add_callback(Hold())
    with MetadataService("aws") as service:
        monkeypatch.setenv(*next(iter(service.env().items())))
        monkeypatch.delenv("PREEMPT_NOTICES", raising=False)
        service.give_notice()
        with pytest.raises(Preempted) as e:
            t.train()
    assert e.value.code == PREEMPTED_EXIT_CODE and e.value.cause.startswith("aws notice: "), e.value.cause
    assert service.requests[0].path == "/latest/api/token"
    (stop,) = history_events(tmp_path / "run", "stop")
    assert stop["step"] == 1 and stop["cause"] == e.value.cause, stop
