"""PreemptibleRun under a faked SLURM (environment and scontrol replaced) and with time_limit: walltime
stops, self-requeue decisions, exit codes, restart guard, log lines and manifest facts."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import FakeClock
from torch.utils.data import DataLoader, TensorDataset

from preempt import (
    PREEMPTED_EXIT_CODE,
    REQUEUE_FAILED_EXIT_CODE,
    RESTART_LIMIT_EXIT_CODE,
    Preempted,
    PreemptibleRun,
    RestartLimitReached,
)
from preempt.cluster import slurm
from preempt.cluster.slurm import JobInfo
from preempt.errors import SlurmError


class FakeScontrol:
    """Replaces preempt.cluster.slurm's scontrol calls; records requeues."""

    def __init__(
        self,
        monkeypatch,
        job: JobInfo | None = None,
        missing: bool = False,
        kill_wait: float = 30.0,
        at_start: JobInfo | None = None,
    ):
        self.job = job
        self.at_start = at_start  # what the run reads when it starts, if not ``job``
        self.missing = missing
        self.requeued: list[str] = []
        self.refuse: str | None = None
        monkeypatch.setattr(slurm, "show_job", self.show_job)
        monkeypatch.setattr(slurm, "requeue", self.requeue)
        monkeypatch.setattr(slurm, "kill_wait", lambda **kw: kill_wait)

    def show_job(self, job_id, **kw):
        if self.missing:
            raise SlurmError("scontrol show job -o 1234: scontrol not found on PATH", missing=True)
        if self.at_start is not None:
            job, self.at_start = self.at_start, None
            return job
        return self.job

    def requeue(self, target, **kw):
        if self.missing:
            raise SlurmError(f"scontrol requeue {target}: scontrol not found on PATH", missing=True)
        if self.refuse:
            raise SlurmError(self.refuse)
        self.requeued.append(target)
        os.kill(os.getpid(), signal.SIGTERM)  # as SLURM ends the job it requeues; the run must absorb it


def slurm_env(monkeypatch, restart: int | None = None, end_time: float | None = None, **extra: str) -> None:
    for key in (
        "SLURM_JOB_ID",
        "SLURM_ARRAY_JOB_ID",
        "SLURM_ARRAY_TASK_ID",
        "SLURM_RESTART_COUNT",
        "SLURM_JOB_END_TIME",
        "SLURM_PROCID",
        "RANK",
    ):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    if restart is not None:
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
    if end_time is not None:
        monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(end_time)))
    for k, v in extra.items():
        monkeypatch.setenv(k, v)


def train(save_dir: Path, clock=time.monotonic, step_s: float = 0.0, signal_at: int | None = None, **kwargs):
    """A tiny loop: 3 epochs of 5 steps; each step advances ``clock`` by ``step_s``; returns the steps done."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 4, generator=g), torch.randint(0, 2, (40,), generator=g))
    kwargs.setdefault("checkpoint_interval", None)
    with PreemptibleRun(save_dir, model=model, optimizer=opt, clock=clock, **kwargs) as run:
        loader = DataLoader(data, batch_size=8, sampler=run.sampler(data, seed=3))
        for _ in run.epochs(3):
            for x, y in run.batches(loader):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if isinstance(clock, FakeClock):
                    clock.t += step_s
                if run.global_step + 1 == signal_at:
                    signal.raise_signal(signal.SIGTERM)  # a real signal, caught by the run's handler
                run.step()
    return run.global_step


def manifest(path: str | Path) -> dict:
    return json.loads((Path(path) / "manifest.json").read_text())


# ------------------------------------------------------------------ walltime outside SLURM


def test_time_limit_stops_and_saves_before_the_deadline(tmp_path, caplog):
    clock = FakeClock()
    caplog.set_level(logging.INFO, logger="preempt")
    with pytest.raises(Preempted) as e:
        train(tmp_path / "run", clock=clock, step_s=1.0, time_limit=9.0)
    assert e.value.code == PREEMPTED_EXIT_CODE and e.value.signum is None and not e.value.requeued
    m = manifest(e.value.checkpoint)
    assert m["reason"] == "walltime"
    # margin: 1.5 * (1 s step + 0.5 s prior save) + 2 s = 4.25 s, so it stops at the first step past 4.75 s
    assert m["step"] == 5 and clock.t - 1000.0 == 5.0, m
    assert "stopping on walltime (4.00 s before the deadline; margin 4.25 s" in caplog.text
    assert "walltime: time_limit=9 s ends in 9.00 s" in caplog.text
    # the rerun continues and completes (its own time_limit counts from its start)
    assert train(tmp_path / "run", clock=clock, step_s=0.1, time_limit=9.0) == 15


def test_time_limit_accepts_slurm_durations_and_rejects_nonsense(tmp_path):
    assert PreemptibleRun(tmp_path, time_limit="1-00:00:00").config.time_limit == 86400.0
    assert PreemptibleRun(tmp_path, time_limit=90).config.time_limit == 90.0
    for bad in (0, -1, float("inf"), "soon", True):
        with pytest.raises(ValueError, match="time_limit: expected a positive number of seconds"):
            PreemptibleRun(tmp_path, time_limit=bad)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_restarts: expected an integer >= 0 or None"):
            PreemptibleRun(tmp_path, max_restarts=bad)


def test_no_deadline_no_walltime_keeper(tmp_path):
    assert train(tmp_path / "run", clock=FakeClock(), step_s=1000.0) == 15


# ------------------------------------------------------------------------------ SLURM


def test_time_limit_warning_saves_then_requeues_the_job(tmp_path, monkeypatch, caplog):
    slurm_env(monkeypatch, restart=1)
    end_time = time.time() + 100
    fake = FakeScontrol(monkeypatch, JobInfo(state="RUNNING", reason="None", end_time=end_time))
    caplog.set_level(logging.INFO, logger="preempt")
    with pytest.raises(Preempted) as e:
        train(tmp_path / "run", signal_at=4)
    assert e.value.code == PREEMPTED_EXIT_CODE and e.value.requeued
    assert fake.requeued == ["1234"]
    m = manifest(e.value.checkpoint)
    assert (m["reason"], m["step"]) == ("preempt", 4)
    job = m["provenance"]["slurm"]
    assert job["job_id"] == "1234" and job["restart_count"] == 1 and job["end_time"] == pytest.approx(end_time)
    # the seconds left when the warning came: 100 less however long the loop took to get there on this machine
    warned = re.search(
        r"SLURM job 1234: the time-limit warning \((\d+) s before the job's end time\); requeued it", caplog.text
    )
    assert warned and 0 < int(warned.group(1)) <= 100, caplog.text
    assert "restart 2 continues from step 4" in caplog.text
    # the requeued job (restart 2) says so when it resumes
    slurm_env(monkeypatch, restart=2)
    caplog.clear()
    assert train(tmp_path / "run") == 15
    assert "restart 2 of job 1234: resumed from " in caplog.text and ": step 4, epoch 0" in caplog.text


def test_array_task_requeues_by_array_id(tmp_path, monkeypatch):
    slurm_env(monkeypatch, SLURM_ARRAY_JOB_ID="1230", SLURM_ARRAY_TASK_ID="4")
    fake = FakeScontrol(monkeypatch, JobInfo(state="RUNNING", end_time=time.time() + 60))
    with pytest.raises(Preempted):
        train(tmp_path / "run", signal_at=2)
    assert fake.requeued == ["1230_4"]


@pytest.mark.parametrize(
    "job, why",
    [
        (JobInfo(state="COMPLETING", reason="None", end_time=time.time()), "the job is ending"),  # scancel
        (JobInfo(state="RUNNING", end_time=time.time() + 7200), "not the time-limit warning"),
    ],
)
def test_scancel_requeue_or_an_early_signal_only_save(tmp_path, monkeypatch, caplog, job, why):
    slurm_env(monkeypatch)
    fake = FakeScontrol(monkeypatch, job, at_start=JobInfo(state="RUNNING", end_time=time.time() + 7200))
    caplog.set_level(logging.INFO, logger="preempt")
    with pytest.raises(Preempted) as e:
        train(tmp_path / "run", signal_at=3)
    assert e.value.code == PREEMPTED_EXIT_CODE and not e.value.requeued and fake.requeued == []
    assert manifest(e.value.checkpoint)["step"] == 3
    assert "SLURM job 1234: not requeued: " in caplog.text and why in caplog.text


def test_walltime_keeper_under_slurm_requeues(tmp_path, monkeypatch, caplog):
    clock = FakeClock()
    slurm_env(monkeypatch)
    fake = FakeScontrol(monkeypatch, JobInfo(state="RUNNING", end_time=time.time() + 10))
    caplog.set_level(logging.INFO, logger="preempt")
    with pytest.raises(Preempted) as e:
        train(tmp_path / "run", clock=clock, step_s=1.0)
    assert e.value.code == PREEMPTED_EXIT_CODE and e.value.requeued and fake.requeued == ["1234"]
    assert manifest(e.value.checkpoint)["reason"] == "walltime"
    assert "walltime: SLURM job 1234 ends in" in caplog.text
    assert "the walltime keeper stopped the run before the job's time limit; requeued it" in caplog.text


def test_scontrol_missing_warns_at_start_and_exits_76_at_the_time_limit(tmp_path, monkeypatch, caplog):
    slurm_env(monkeypatch, end_time=time.time() + 100)
    FakeScontrol(monkeypatch, missing=True)
    caplog.set_level(logging.INFO, logger="preempt")
    with pytest.raises(Preempted) as e:
        train(tmp_path / "run", signal_at=3)
    assert e.value.code == REQUEUE_FAILED_EXIT_CODE == 76 and not e.value.requeued
    assert manifest(e.value.checkpoint)["step"] == 3  # saved all the same
    assert "scontrol not found on PATH. This job cannot requeue itself" in caplog.text
    assert "could not requeue it" in caplog.text and "requeue or resubmit the job (exit code 76)" in caplog.text


def test_scontrol_missing_and_no_end_time_cannot_tell(tmp_path, monkeypatch, caplog):
    slurm_env(monkeypatch)
    FakeScontrol(monkeypatch, missing=True)
    caplog.set_level(logging.INFO, logger="preempt")
    with pytest.raises(Preempted) as e:
        train(tmp_path / "run", signal_at=3)
    assert e.value.code == PREEMPTED_EXIT_CODE
    assert "walltime keeping needs time_limit=" in caplog.text
    assert "neither scontrol nor SLURM_JOB_END_TIME tells" in caplog.text


def test_slurm_refusing_the_requeue_exits_76(tmp_path, monkeypatch, caplog):
    slurm_env(monkeypatch)
    fake = FakeScontrol(monkeypatch, JobInfo(state="RUNNING", end_time=time.time() + 60, requeue=False))
    fake.refuse = "scontrol requeue 1234: exit code 1: Requeue of JobId=1234 not allowed"
    caplog.set_level(logging.INFO, logger="preempt")
    with pytest.raises(Preempted) as e:
        train(tmp_path / "run", signal_at=3)
    assert e.value.code == REQUEUE_FAILED_EXIT_CODE
    assert "has Requeue=0 (--no-requeue)" in caplog.text and "not allowed" in caplog.text


def test_max_restarts_refuses_to_start_and_refuses_to_requeue(tmp_path, monkeypatch, caplog):
    slurm_env(monkeypatch, restart=3)
    fake = FakeScontrol(monkeypatch, JobInfo(state="RUNNING", end_time=time.time() + 60))
    with pytest.raises(RestartLimitReached) as e:
        train(tmp_path / "run", max_restarts=2)
    assert e.value.code == RESTART_LIMIT_EXIT_CODE == 77 and not list((tmp_path / "run").glob("step_*"))
    assert "is at restart 3 but max_restarts=2: not training" in caplog.text
    # at the limit it trains, saves at the warning, and does not requeue
    with pytest.raises(Preempted) as e:
        train(tmp_path / "run", max_restarts=3, signal_at=2)
    assert e.value.code == RESTART_LIMIT_EXIT_CODE and fake.requeued == []
    assert manifest(e.value.checkpoint)["step"] == 2
    # unlimited below it
    slurm_env(monkeypatch, restart=2)
    with pytest.raises(Preempted) as e:
        train(tmp_path / "run", max_restarts=3, signal_at=4)
    assert e.value.code == PREEMPTED_EXIT_CODE and fake.requeued == ["1234"]


def test_no_progress_since_the_restart_is_not_requeued(tmp_path, monkeypatch, caplog):
    """A restart whose deadline is already inside the margin stops before any step: no requeue loop."""
    clock = FakeClock()
    slurm_env(monkeypatch)
    fake = FakeScontrol(monkeypatch, JobInfo(state="RUNNING", end_time=time.time() + 1.0))
    with pytest.raises(Preempted) as e:
        train(tmp_path / "run", clock=clock, step_s=1.0)
    assert e.value.code == RESTART_LIMIT_EXIT_CODE and fake.requeued == []
    assert "the run made no step since it started: requeueing again would loop" in caplog.text


def test_only_rank_0_requeues_and_requeue_false_never(tmp_path, monkeypatch):
    slurm_env(monkeypatch, SLURM_PROCID="1")
    fake = FakeScontrol(monkeypatch, JobInfo(state="RUNNING", end_time=time.time() + 60))
    with pytest.raises(Preempted) as e:
        train(tmp_path / "a", signal_at=2)
    assert e.value.code == PREEMPTED_EXIT_CODE and fake.requeued == []
    slurm_env(monkeypatch)
    with pytest.raises(Preempted):
        train(tmp_path / "b", signal_at=2, requeue=False)
    assert fake.requeued == []


def test_save_longer_than_kill_wait_is_warned_once(tmp_path, monkeypatch, caplog):
    slurm_env(monkeypatch)
    FakeScontrol(monkeypatch, JobInfo(state="RUNNING", end_time=time.time() + 3600), kill_wait=0.0)
    train(tmp_path / "run", checkpoint_every_steps=2)
    assert caplog.text.count("SLURM kills 0.00 s after SIGTERM (KillWait)") == 1


def test_a_time_limit_warning_before_the_first_step_is_taken_at_that_step(tmp_path, monkeypatch, caplog):
    """SLURM may send its --signal warning up to 60 s early, while a (requeued) job is still starting: stopped
    before its first step, the run could not requeue itself (no progress: exit 77) although most of a minute was
    left. It makes that step, stops there and requeues; both at a fresh start and on a resume inside an epoch."""
    caplog.set_level(logging.INFO, logger="preempt")

    def started_then_warned(save_dir: Path) -> Preempted:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
        with pytest.raises(Preempted) as e:
            with PreemptibleRun(save_dir, model=model, optimizer=opt, checkpoint_interval=None) as run:
                signal.raise_signal(signal.SIGTERM)  # the warning, before any step of this process
                loader = DataLoader(data, batch_size=8, sampler=run.sampler(data, seed=3))
                for _ in run.epochs(3):
                    for x, y in run.batches(loader):
                        opt.zero_grad()
                        torch.nn.functional.cross_entropy(model(x), y).backward()
                        opt.step()
                        run.step()
        return e.value

    slurm_env(monkeypatch, restart=0)
    fake = FakeScontrol(monkeypatch, JobInfo(state="RUNNING", reason="None", end_time=time.time() + 50))
    first = started_then_warned(tmp_path / "run")
    assert first.code == PREEMPTED_EXIT_CODE and first.requeued and fake.requeued == ["1234"], caplog.text
    assert manifest(first.checkpoint)["step"] == 1
    assert "before this process's first step" in caplog.text and "made no step" not in caplog.text
    # the requeued job, resumed inside epoch 0 at step 1, warned again before its first step: stops at step 2
    slurm_env(monkeypatch, restart=1)
    caplog.clear()
    again = started_then_warned(tmp_path / "run")
    assert again.requeued and manifest(again.checkpoint)["step"] == 2, caplog.text
    assert "before this process's first step" in caplog.text
    assert "resumed from" in caplog.text and "epoch 0, batch 1/" in caplog.text
