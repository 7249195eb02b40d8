"""The job templates of slurm/ run by hand, outside SLURM, as the guide suggests for trying a job locally.

``bash slurm/job.sbatch python train.py ...`` must run the command as the job would, so that ``kill -TERM`` of the
script's pid reaches python the way SLURM's ``B:`` warning does; before, ``set -eu`` stopped every template at its
first ``$SLURM_JOB_ID`` (``unbound variable``), and the srun and torchrun templates need a job's srun and scontrol.
No SLURM here: every ``SLURM_*`` variable is removed from the environment. tests/slurm/test_jobs.py runs the same
templates under a real cluster.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from helpers import PREEMPTED, ROOT, TRAIN, TRAIN_DDP, Spawned

SLURM = ROOT / "slurm"
SHORT = ["--epochs", "1", "--samples", "64"]


@pytest.fixture(autouse=True)
def _outside_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)


def by_hand(template: str, *command: str, env: dict[str, str] | None = None) -> Spawned:
    return Spawned(["bash", str(SLURM / template), *command], env)


def test_job_sbatch_by_hand_execs_python_so_a_sigterm_to_the_script_saves(tmp_path: Path):
    save_dir = tmp_path / "run"
    job = by_hand("job.sbatch", "python", str(TRAIN), "--save_dir", str(save_dir), *SHORT, "--hold_at", "step:2")
    assert job.wait_event("holding", point="step", n=2), job.output
    job.signal(signal.SIGTERM)  # the script's own pid: python, through the template's exec
    assert job.finish() == PREEMPTED, job.output
    assert "unbound variable" not in job.output
    assert f" job none restart 0 on {os.uname().nodename}: python " in job.output.splitlines()[0], job.output
    assert (save_dir / "step_000000002").is_dir(), "the stop's checkpoint"


def test_job_srun_sbatch_by_hand_runs_the_command_without_srun(tmp_path: Path):
    job = by_hand("job_srun.sbatch", "python", str(TRAIN), "--save_dir", str(tmp_path / "run"), *SHORT)
    assert job.finish() == 0, job.output
    assert " job none (not under SLURM) on " in job.output.splitlines()[0], job.output
    assert (tmp_path / "run" / "complete.json").exists()


def test_job_torchrun_sbatch_by_hand_runs_torchrun_standalone_on_this_machine(tmp_path: Path):
    cmd = [str(TRAIN_DDP), "--save_dir", str(tmp_path / "run"), "--epochs", "1", "--samples", "32"]
    job = by_hand("job_torchrun.sbatch", *cmd, env={"GPUS_PER_NODE": "2", "OMP_NUM_THREADS": "1"})
    assert job.finish(timeout=180) == 0, job.output
    assert " job none (not under SLURM) on " in job.output.splitlines()[0], job.output
    assert (tmp_path / "run" / "complete.json").exists(), job.output
    assert "rank_00001.json" in os.listdir(next((tmp_path / "run").glob("step_*"))), "two ranks wrote"
