"""A writer that fails at each named stage of the commit, in one process, and what the run does about it.

The kill tests (test_kill.py) show what the next start makes of a process that
died at each stage; these show what the writing process itself does when a
stage raises (an I/O error, a full disk): the partial write is removed at
once, the previous checkpoint stays the one chosen, and the run either goes on
(a periodic checkpoint) or leaves with a clear error (a stop's or the final one).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from preempt import SAVE_FAILED_EXIT_CODE, CheckpointManager, CheckpointWriteError, PreemptibleRun, SaveFailed, _testing
from preempt.checkpoint import commit


def objects():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture
def fail_at() -> Iterator:
    """``fail_at(stage, nth, err)``: the nth time the commit reaches ``stage``, raise OSError(err)."""

    def install(stage: str, nth: int = 1, err: int = errno.EIO) -> None:
        seen = {"n": 0}

        def hook(name: str, cancel: object = None) -> None:
            if name == stage:
                seen["n"] += 1
                if seen["n"] == nth:
                    raise OSError(err, os.strerror(err))

        _testing.install("commit", hook)

    yield install
    _testing.install("commit", None)


def entries(d: Path) -> list[str]:
    return sorted(os.listdir(d))


@pytest.mark.parametrize("stage", [s for s in commit.STAGES if s != "after_replace"])
def test_failure_at_each_stage_keeps_the_previous_checkpoint(tmp_path, fail_at, stage):
    model, opt = objects()
    m = CheckpointManager(tmp_path, keep_last=5)
    m.prepare()
    m.save_state(step=1, model=model, optimizer=opt)
    fail_at(stage)
    with pytest.raises(OSError, match="Input/output error"):
        m.save_state(step=2, model=model, optimizer=opt)
    committed = stage in ("before_dir_fsync", "committed")
    chosen = m.candidates("latest")[0]
    # Up to the rename the new checkpoint does not exist; after it, every file of it was already durable.
    assert chosen.step == (2 if committed else 1)
    assert not m.verify(chosen)
    # The partial directory is gone at once, not at the next start: on a full disk its space is needed.
    assert [e for e in entries(tmp_path) if e.startswith(".tmp-")] == []
    _testing.install("commit", None)
    info, _ = CheckpointManager(tmp_path).load("latest")
    assert info.step == chosen.step


def test_failure_while_replacing_a_checkpoint_of_the_same_step_puts_the_old_one_back(tmp_path, fail_at):
    model, opt = objects()
    m = CheckpointManager(tmp_path)
    m.prepare()
    m.save_state(step=3, model=model, optimizer=opt, user_state={"v": "old"})
    fail_at("after_replace")
    with pytest.raises(OSError):
        m.save_state(step=3, model=model, optimizer=opt, user_state={"v": "new"})
    assert entries(tmp_path) == ["step_000000003"]
    _, loaded = m.load(3)
    assert loaded.tree["user"] == {"v": "old"}


# ------------------------------------------------------------------ the run's reaction


def loop(
    save_dir: Path,
    *,
    steps_per_epoch: int = 6,
    epochs: int = 2,
    stop_at: int | None = None,
    tick: list[float] | None = None,
    **kw,
):
    model, opt = objects()
    data = TensorDataset(torch.randn(steps_per_epoch * 2, 8), torch.randn(steps_per_epoch * 2, 4))
    kw.setdefault("checkpoint_interval", None)
    # Synchronous: these tests count the saves that reach a stage; tests/unit/test_async_save.py has the
    # failures of the background writer.
    kw.setdefault("async_save", False)
    with PreemptibleRun(save_dir, model=model, optimizer=opt, **kw) as run:
        loader = DataLoader(data, batch_size=2, sampler=run.sampler(data, seed=1))
        for _ in run.epochs(epochs):
            for x, y in run.batches(loader):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                if run.global_step + 1 == stop_at:
                    run.request_stop()
                if tick is not None:
                    tick[0] += 1.0  # the clock of a run whose steps take 1 s
                run.step()
    return run


def test_failed_periodic_save_is_logged_and_training_goes_on(tmp_path, fail_at, caplog):
    fail_at("before_manifest", nth=2, err=errno.ENOSPC)  # the save of step 4 fails
    with caplog.at_level(logging.INFO, logger="preempt"):
        run = loop(tmp_path, checkpoint_every_steps=2, keep_last=10)
    assert run.failed_saves == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert re.search(
        r"could not write checkpoint step_000000004 \(steps\) in .*: No space left on device \(ENOSPC\);"
        r" the last good checkpoint is .*step_000000002 \(step 2, saved .* ago\); training goes on",
        errors[0],
    ), errors[0]
    steps = [c.step for c in CheckpointManager(tmp_path, owner=False).list()]
    assert steps == [12, 10, 8, 6, 2], "only the failed save is missing; the run went on and saved again"
    assert [e for e in entries(tmp_path) if e.startswith(".tmp-")] == []


def test_failed_interval_save_retries_at_the_next_interval_not_every_step(tmp_path, fail_at, monkeypatch):  # noqa: ARG001
    """Every write fails; with a 3 s interval and a clock that moves 1 s per step, the run tries at steps 3,
    6 and 9, not at every step after the first failure."""
    now = [0.0]
    seen = {"n": 0}

    def always(name: str, cancel: object = None) -> None:
        if name == "before_manifest":
            seen["n"] += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    _testing.install("commit", always)
    events: list[tuple[str, dict]] = []  # the run's events, taken in this process
    monkeypatch.setattr(_testing, "emit", lambda kind, /, **fields: events.append((kind, fields)))
    with pytest.raises(CheckpointWriteError):  # the final save cannot be written either
        loop(tmp_path, checkpoint_interval=3.0, clock=lambda: now[0], tick=now)
    failed = [e["step"] for kind, e in events if kind == "checkpoint_failed" and e["reason"] == "interval"]
    assert failed == [3, 6, 9, 12], events
    assert seen["n"] == len(failed) + 1  # + the final save


def test_failed_save_at_a_stop_exits_74_naming_the_last_good_checkpoint(tmp_path, fail_at, caplog):
    loop(tmp_path, stop_at=None, epochs=1, checkpoint_every_steps=3)  # a complete first epoch: step 3 and 6 saved
    fail_at("before_manifest", err=errno.ENOSPC)
    with caplog.at_level(logging.ERROR, logger="preempt"), pytest.raises(SaveFailed) as e:
        loop(tmp_path, stop_at=8, epochs=2, exit_if_complete=False)
    assert e.value.code == SAVE_FAILED_EXIT_CODE == 74
    assert e.value.last_good is not None and e.value.last_good.endswith("step_000000006")
    assert isinstance(e.value.error, OSError) and e.value.error.errno == errno.ENOSPC
    assert re.search(
        r"could not write checkpoint step_000000008 \(preempt\).*ENOSPC.*the last good checkpoint is"
        r" .*step_000000006 \(step 6, .*\); the 2 step\(s\) since are lost; exiting with code 74",
        caplog.text,
    ), caplog.text
    _testing.install("commit", None)
    run = loop(tmp_path, epochs=2, exit_if_complete=False)  # the rerun continues from step 6
    assert run.resumed_from is not None and run.resumed_from.name == "step_000000006"
    assert run.global_step == 12


def test_failed_final_save_raises_and_leaves_the_run_incomplete(tmp_path, fail_at):
    fail_at("before_rename", err=errno.EIO)
    with pytest.raises(CheckpointWriteError, match=r"step_000000012 \(final\).*there is no earlier checkpoint"):
        loop(tmp_path)
    assert not (tmp_path / "complete.json").exists()
    assert not (tmp_path / "lock").read_bytes(), "the lock is released even when leaving with an error"
    # the history ends the process with the error, not "complete" (chaos seed 70, fault #65: preempt report and the
    # campaign took a run whose final checkpoint had failed for a completed one)
    events = [json.loads(line).get("event") for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    ended = [e for e in events if e in ("complete", "error", "stop")]
    assert ended == ["error"], events
