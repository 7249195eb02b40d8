"""The loggers' decisions without TensorBoard or W&B: which loggers, which first step, which W&B id, and that a
failing logger never stops a run. Fake loggers record their calls; no thread, no sleep."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from preempt import PreemptibleRun
from preempt.health.loggers import WANDB_ID_FILE, Loggers, TensorBoard, WandB, checked, new_run_id, wandb_run_id


class Fake:
    name = "fake"

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def open(self, save_dir, first_step, resumed):
        self.calls.append(("open", first_step, resumed))
        if self.fail == "open":
            raise RuntimeError("no server")

    def log(self, step, metrics):
        self.calls.append(("log", step, dict(metrics)))
        if self.fail == "log":
            raise OSError(28, "No space left on device")

    def close(self, exit_code, preempted):
        self.calls.append(("close", exit_code, preempted))


def test_names_become_loggers_and_objects_are_kept():
    fake = Fake()
    got = checked(["tensorboard", fake])
    assert isinstance(got[0], TensorBoard) and got[1] is fake
    assert checked(None) == () and checked([]) == ()
    assert isinstance(checked("tensorboard")[0], TensorBoard)  # one name alone


@pytest.mark.parametrize(
    ("loggers", "error"),
    [
        (["mlflow"], r"loggers: expected 'tensorboard', 'wandb' or a logger object, got 'mlflow'"),
        ([object()], r"has no open\(\), log\(\), close\(\): expected a logger object"),
        (["tensorboard", TensorBoard()], "loggers: tensorboard listed twice"),
    ],
)
def test_bad_loggers_are_refused_naming_what_was_expected(loggers, error):
    with pytest.raises(ValueError, match=error):
        checked(loggers)


def test_a_missing_package_is_refused_with_the_extra_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ImportError, match=r"wandb needs the wandb package, which is not installed: pip install "):
        checked(["wandb"])


def test_the_run_checks_its_loggers_when_it_is_made(tmp_path):
    with pytest.raises(ValueError, match="loggers: expected 'tensorboard', 'wandb'"):
        PreemptibleRun(tmp_path, model=torch.nn.Linear(2, 2), loggers=["tensorbored"])


def test_wandb_id_and_resume_are_the_runs_own():
    with pytest.raises(ValueError, match=r"WandB: id, resume are set by the run"):
        WandB(id="x", resume="never")


def test_the_first_step_a_process_logs_is_after_its_checkpoint_or_zero(tmp_path):
    resumed, fresh = Fake(), Fake()
    Loggers([resumed]).open(tmp_path, 40, resumed=True)
    Loggers([fresh]).open(tmp_path, 0, resumed=False)
    assert resumed.calls == [("open", 41, True)] and fresh.calls == [("open", 0, False)]


def test_a_failing_logger_is_said_once_and_left_out_the_others_go_on(tmp_path, caplog):
    bad, good = Fake(fail="log"), Fake()
    loggers = Loggers([bad, good])
    loggers.open(tmp_path, 0, resumed=False)
    with caplog.at_level(logging.WARNING, logger="preempt"):
        loggers.log(1, {"loss": 1.0})
        loggers.log(2, {"loss": 0.5})
        loggers.log(3, {})  # nothing to log: no call
    said = [r.getMessage() for r in caplog.records]
    assert said == ["logger fake: log failed (OSError: [Errno 28] No space left on device); left out from now on"]
    assert [c for c in bad.calls if c[0] == "log"] == [("log", 1, {"loss": 1.0})]
    assert [c for c in good.calls if c[0] == "log"] == [("log", 1, {"loss": 1.0}), ("log", 2, {"loss": 0.5})]
    loggers.close(75, preempted=True)
    assert good.calls[-1] == ("close", 75, True) and ("close", 75, True) not in bad.calls


def test_a_logger_that_cannot_open_is_left_out(tmp_path, caplog):
    bad = Fake(fail="open")
    loggers = Loggers([bad])
    with caplog.at_level(logging.WARNING, logger="preempt"):
        loggers.open(tmp_path, 0, resumed=False)
        loggers.log(1, {"loss": 1.0})
    assert "logger fake: open failed (RuntimeError: no server)" in caplog.text
    assert bad.calls == [("open", 0, False)]


def test_a_fresh_start_makes_a_wandb_id_and_a_resume_reuses_it(tmp_path):
    ids = iter(["first123", "second45"])
    assert wandb_run_id(tmp_path, False, lambda: next(ids)) == "first123"
    assert json.loads((tmp_path / WANDB_ID_FILE).read_text()) == {"id": "first123"}
    assert wandb_run_id(tmp_path, True, lambda: next(ids)) == "first123"  # a requeue: the same W&B run
    assert wandb_run_id(tmp_path, False, lambda: next(ids)) == "second45"  # started over: a new one
    (tmp_path / "other").mkdir()
    assert wandb_run_id(tmp_path / "other", True, new_run_id) != "second45"  # resumed from elsewhere: none here


def test_a_resume_with_a_bad_wandb_id_file_is_refused_naming_it(tmp_path):
    (tmp_path / WANDB_ID_FILE).write_text('{"id": "../../etc"}')
    with pytest.raises(ValueError) as e:
        wandb_run_id(tmp_path, True, new_run_id)
    assert str(e.value) == (
        f'{tmp_path / WANDB_ID_FILE}: expected {{"id": "<1-64 letters, digits, - or _>"}}, found id'
        " '../../etc'; delete the file to start a new W&B run"
    )


def test_new_ids_look_like_wandbs():
    assert all(len(i) == 8 and i.isalnum() and i.lower() == i for i in (new_run_id() for _ in range(20)))


def test_a_symlink_planted_as_the_tensorboard_directory_is_refused_and_the_run_goes_on(tmp_path, caplog):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    save_dir = tmp_path / "run"
    save_dir.mkdir()
    (save_dir / "tensorboard").symlink_to(elsewhere)
    loggers = Loggers([TensorBoard()])
    with caplog.at_level(logging.WARNING, logger="preempt"):
        loggers.open(save_dir, 0, resumed=False)
        loggers.log(1, {"loss": 1.0})
    said = f"logger tensorboard: open failed (ValueError: {save_dir / 'tensorboard'}: expected a directory, found a"
    assert f"{said} symbolic link); left out from now on" in caplog.text and not list(elsewhere.iterdir())
