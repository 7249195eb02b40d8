"""The job templates of slurm/ on a live SLURM cluster, running tests/scripts/train.py, compared bit for bit.

The time-limit jobs need SLURM's minute granularity (``--time=1``), so they are submitted together when the
module starts (the ``time_limit_jobs`` fixture) and run side by side while the interactive tests (requeue,
scancel) run; each time-limit test then waits for its own job. The cluster's node takes up to 4 jobs per CPU
(their steps mostly sleep).

Why ``--signal=...@20`` and not ``@30`` in one-minute jobs: SLURM checks the limits every 30 s and sends the
warning up to 30 s before its lead time, so in a 60 s job ``@30`` can arrive at second 0, before python has
imported torch and entered the run (the default action of SIGTERM then kills it). ``@20`` arrives between
second 10 and 40, and second 10 came before the run was entered in a stress run (the srun template's step died
with 143 on a loaded machine). So the script also blocks the stop signals from its first statement
(``--block_signals``): a warning during its imports stays pending until the run installs its handlers, which
unblock it (:mod:`preempt.cluster.signals`); how long the imports take no longer matters.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import (
    DDP_ARGS,
    PREEMPTED,
    TRAIN_DDP,
    History,
    assert_equal_finals,
    assert_same_final,
    ddp_finals,
    free_port,
    torchrun,
)
from slurmjobs import Cluster, Job, slurm_cluster, train_command, without_sleep  # noqa: F401

from preempt.checkpoint.manager import CheckpointManager

pytestmark = pytest.mark.slurm

# 128 steps; their time is --step_sleep. --block_signals: SLURM may send a --signal warning up to 60 s early, so with
# --time=1 it can come while python still imports torch (seen under load: the srun template's step died with 143);
# blocked from the script's first statement, it waits for the run's handlers instead of killing the process.
BASE = ("--samples", "1024", "--epochs", "2", "--interval", "10", "--block_signals")


@dataclass(frozen=True)
class Spec:
    template: str
    options: tuple[str, ...]
    args: tuple[str, ...]
    timeout: float
    # Once the first run's walltime keeper has read the job's end time, the limit goes up to this many minutes: that
    # keeper still stops the run at the old end and requeues the job, and the next run completes far from its limit.
    # A run that completed a few seconds before a one-minute limit left the job TIMEOUT under load (7 s before it,
    # in a stress run), and how close it came depended on the machine's speed.
    then_minutes: int | None = None


# One --time=1 allocation trains at most ~37 s before an @20 warning, ~55 s before the walltime keeper.
SPECS = {
    # ~45 s of work: at least one self-requeue
    "test_time_limit_warning_requeues_the_job": Spec(
        "job.sbatch", ("--time=1", "--signal=B:TERM@20"), (*BASE, "--step_sleep", "0.35"), 300
    ),
    # ~80 s of work: at least two self-requeues
    "test_time_limit_warning_requeues_again_and_again": Spec(
        "job.sbatch", ("--time=1", "--signal=B:TERM@20"), (*BASE, "--step_sleep", "0.62"), 420
    ),
    "test_srun_template_time_limit_warning": Spec(
        "job_srun.sbatch", ("--time=1", "--signal=TERM@20"), (*BASE, "--step_sleep", "0.35"), 300
    ),
    # ~70 s of work and no warning at all (a lead time of 0 sends none): only the walltime keeper saves it, once
    "test_walltime_keeper_without_any_signal": Spec(
        "job.sbatch", ("--time=1", "--signal=B:TERM@0"), (*BASE, "--step_sleep", "0.55"), 300, then_minutes=10
    ),
}


@pytest.fixture(scope="module")
def time_limit_jobs(
    slurm_cluster: Cluster,  # noqa: F811
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, tuple[Job, Path]]]:
    """Submits the time-limit jobs of the selected tests at once; cancels what is left at the end."""
    selected = {item.name for item in request.session.items}
    jobs = {}
    for name, spec in SPECS.items():
        if name in selected:
            d = tmp_path_factory.mktemp(name.removeprefix("test_")[:40])
            # the first run waits at its first step, where no stop can come, until the limit has gone up
            hold = () if spec.then_minutes is None else ("--wait_file_at", f"step:1:{d / 'limit_raised'}")
            cmd = train_command(d / "run", d / "final.safetensors", (*spec.args, *hold))
            jobs[name] = (slurm_cluster.submit(spec.template, cmd, d / "job.out", spec.options), d)
    # The first run's keeper reads the job's end time when the run is entered; the run then waits at its first step
    # until the limit has gone up. That run cannot finish within its minute (~70 s of work), so its keeper stops it at
    # the old end; the requeued run passes the wait (the file is there).
    for name, (job, d) in jobs.items():
        if (minutes := SPECS[name].then_minutes) is not None:
            job.wait_event("waiting", point="step", n=1, timeout=60)
            slurm_cluster.run("scontrol", "update", f"JobId={job.id}", f"TimeLimit={minutes}")
            assert job.info()["Restarts"] == "0", f"the limit went up after the first run ended\n{job.describe()}"
            (d / "limit_raised").touch()
    # Let them import torch before the other tests start theirs: a start-up slower than 10 s would meet the
    # earliest @20 warning outside the run.
    for job, _ in jobs.values():
        job.wait_event("entered", timeout=60)
    yield jobs
    # squeue lists only the jobs still pending, running or completing, and never fails for one whose record is gone
    active = slurm_cluster.run("squeue", "-h", "-o", "%i").split()
    for job, _ in jobs.values():
        if job.id in active:
            job.cancel()


def finish_time_limit_job(
    request: pytest.FixtureRequest, jobs: dict[str, tuple[Job, Path]], reference: Callable[[Sequence[str]], Path]
) -> tuple[Job, dict[str, str], History]:
    """Waits for the test's time-limit job: completed, never at its limit, bit-exact; its restarts and events."""
    name = request.node.name
    job, d = jobs[name]
    spec = SPECS[name]
    info = job.wait_done(timeout=spec.timeout)
    assert info["JobState"] == "COMPLETED", job.describe()
    assert "DUE TO TIME LIMIT" not in job.log, f"the job reached its time limit\n{job.describe()}"
    assert_same_final(reference(without_sleep(spec.args)), d / "final.safetensors")
    history = job.history()
    assert_each_stop_resumed(history, job)
    return job, info, history


def assert_each_stop_resumed(history: History, job: Job) -> None:
    """The job's runs, in order: each run after a stop resumed at the stop's step (a stop before any checkpoint, at
    step 0, leaves nothing to resume: the next run starts afresh), and the last run completed."""
    runs = [e for events in history.events for e in events if e["event"] in ("start", "resume", "stop", "complete")]
    for stop, after in zip(runs, runs[1:], strict=False):
        if stop["event"] == "stop":
            resumed = after["event"] == "resume" or (after["event"] == "start" and stop["checkpoint"] is None)
            assert resumed and after["step"] == stop["step"], f"{stop} then {after}\n{job.describe()}"
    assert runs and runs[-1]["event"] == "complete", job.describe()


@pytest.mark.parametrize("requeues", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_scontrol_requeue_at_random_moments(
    slurm_cluster: Cluster,  # noqa: F811
    time_limit_jobs: dict,
    tmp_path: Path,
    reference: Callable[[Sequence[str]], Path],
    requeues: int,
) -> None:
    """Scheduler requeues (one by default, two under -m slow): saved and exited each time, never requeued by the
    run itself; bit-exact."""
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    args = (*BASE, "--step_sleep", "0.15")  # ~20 s of work
    cmd = train_command(tmp_path / "run", tmp_path / "final.safetensors", args)
    # --time=5: the end is within preempt's 15-minute warning window, so only the job state (COMPLETING, not
    # RUNNING) tells these SIGTERMs from the time-limit warning.
    job = slurm_cluster.submit("job.sbatch", cmd, tmp_path / "job.out", ["--time=5"])
    job.wait_event("entered", timeout=90)
    time.sleep(rng.uniform(0.5, 5.0))  # somewhere in the training
    for restart in range(1, requeues + 1):
        if restart > 1:
            time.sleep(rng.uniform(0.0, 8.0))  # anywhere: start-up, resume, training
        requeued = job.requeue()
        back = job.wait_running(timeout=60, restarts=restart)
        print(f"requeue -> running: {back - requeued:.1f} s (seed {seed})")
    info = job.wait_done(timeout=120)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == str(requeues), f"seed {seed}\n{job.describe()}"
    # each requeue that found the run entered stopped it (SIGTERM, saved), and the run never requeued the job that
    # SLURM was requeueing; each stop was resumed
    history = job.history()
    stops = history.events_of("stop")
    assert 1 <= len(stops) <= requeues, f"seed {seed}\n{job.describe()}"
    assert all(s["cause"] == "SIGTERM" and s["code"] == PREEMPTED and not s["requeued"] for s in stops), stops
    assert_each_stop_resumed(history, job)
    # what the resumed run tells its user under SLURM: the restart, the job, where it resumed from
    resumed = rf"^\[preempt\] restart {requeues} of job {job.id}: resumed from \S+step_\d+: step \d+"
    assert re.search(resumed, job.log, re.M), job.log
    assert_same_final(reference(without_sleep(args)), tmp_path / "final.safetensors")


def test_scancel_saves_and_does_not_requeue(
    slurm_cluster: Cluster,  # noqa: F811
    time_limit_jobs: dict,
    tmp_path: Path,
    reference: Callable[[Sequence[str]], Path],
) -> None:
    """scancel: the checkpoint is written, the job stays cancelled; a new job continues it bit-exactly."""
    args = (*BASE, "--step_sleep", "0.12")  # ~16 s of work
    cmd = train_command(tmp_path / "run", tmp_path / "final.safetensors", args)
    job = slurm_cluster.submit("job.sbatch", cmd, tmp_path / "job.out", ["--time=5"])
    job.wait_event("step", step=20, timeout=90)
    job.cancel()
    info = job.wait_done(timeout=60)
    time.sleep(2.0)  # a requeue would show as PENDING/RUNNING and a Restarts count by now
    info = job.info()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", job.describe()
    (stop,) = job.history().events_of("stop")
    assert stop["cause"] == "SIGTERM" and stop["code"] == PREEMPTED and not stop["requeued"], job.describe()
    saved = [c for c in CheckpointManager(tmp_path / "run", owner=False).list() if c.status == "valid"]
    assert saved and saved[0].step == stop["step"] and str(saved[0].path) == stop["checkpoint"], (saved, stop)

    again = slurm_cluster.submit("job.sbatch", cmd, tmp_path / "job.out", ["--time=5"])
    info = again.wait_done(timeout=120)
    assert info["JobState"] == "COMPLETED", again.describe()
    assert again.history().events_of("resume", step=stop["step"], **{"from": stop["checkpoint"]}), again.describe()
    assert_same_final(reference(without_sleep(args)), tmp_path / "final.safetensors")


def test_time_limit_warning_requeues_the_job(
    request: pytest.FixtureRequest, time_limit_jobs: dict, reference: Callable[[Sequence[str]], Path]
) -> None:
    """--time=1 --signal=B:TERM@20, exec template: save at the warning, requeue itself, complete."""
    job, info, history = finish_time_limit_job(request, time_limit_jobs, reference)
    restarts = int(info["Restarts"])
    assert restarts >= 1, job.describe()
    assert_requeued_at_each_warning(history, restarts, job)


def assert_requeued_at_each_warning(history: History, restarts: int, job: Job) -> None:
    """One stop per restart, each on the warning's signal, each requeueing the job itself."""
    stops = history.events_of("stop")
    assert len(stops) == restarts, job.describe()
    assert all(s["cause"] == "SIGTERM" and s["requeued"] and s["code"] == PREEMPTED for s in stops), stops


@pytest.mark.slow
def test_time_limit_warning_requeues_again_and_again(
    request: pytest.FixtureRequest, time_limit_jobs: dict, reference: Callable[[Sequence[str]], Path]
) -> None:
    """The same with more than a minute of work: the job requeues itself at least twice."""
    job, info, history = finish_time_limit_job(request, time_limit_jobs, reference)
    restarts = int(info["Restarts"])
    assert restarts >= 2, job.describe()
    assert_requeued_at_each_warning(history, restarts, job)


def test_srun_template_time_limit_warning(
    request: pytest.FixtureRequest, time_limit_jobs: dict, reference: Callable[[Sequence[str]], Path]
) -> None:
    """The srun template with --signal=TERM@20 (no B:): the step's python gets the warning."""
    job, info, history = finish_time_limit_job(request, time_limit_jobs, reference)
    restarts = int(info["Restarts"])
    assert restarts >= 1 and ": srun " in job.log, job.describe()
    assert_requeued_at_each_warning(history, restarts, job)


def test_walltime_keeper_without_any_signal(
    request: pytest.FixtureRequest, time_limit_jobs: dict, reference: Callable[[Sequence[str]], Path]
) -> None:
    """No warning at all: the walltime keeper stops and saves before the end, requeues, completes (the job's limit
    raised after its first run's keeper read it: one stop)."""
    job, info, history = finish_time_limit_job(request, time_limit_jobs, reference)
    restarts = int(info["Restarts"])
    assert restarts == 1, job.describe()
    (stop,) = history.events_of("stop")  # by the keeper, before its deadline, requeueing the job
    assert stop["cause"] == "walltime" and stop["margin_s"] > 0 and stop["requeued"], (stop, job.describe())


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What each rank of an uninterrupted 2-rank train_ddp.py run (DDP_ARGS) ends with."""
    d = tmp_path_factory.mktemp("ddp_ref")
    ref = torchrun(d / "ref", d / "ref.safetensors", DDP_ARGS)
    assert ref.finish(timeout=180) == 0, ref.output
    return ddp_finals(d / "ref.safetensors")


def submit_torchrun(cluster: Cluster, d: Path, out: str = "job.out", step_sleep: str = "0.3") -> Job:
    """slurm/job_torchrun.sbatch on one node: srun -> torchrun -> 2 gloo ranks of train_ddp.py, each logging."""
    args = [*DDP_ARGS, "--step_sleep", step_sleep, "--save_dir", str(d / "run")]
    args += ["--final_out", str(d / "final.safetensors")]
    options = ["--nodes=1", "--cpus-per-task=2", "--gres=none", "--time=5"]
    options.append(f"--export=ALL,GPUS_PER_NODE=2,RDZV_PORT={free_port()},PREEMPT_LOG_ALL_RANKS=1")
    return cluster.submit("job_torchrun.sbatch", [str(TRAIN_DDP), *args], d / out, options)


def test_torchrun_template_two_ranks_requeued_by_the_scheduler(
    slurm_cluster: Cluster,  # noqa: F811
    time_limit_jobs: dict,
    tmp_path: Path,
    ddp_reference: list[dict],
) -> None:
    """slurm/job_torchrun.sbatch on one node of the cluster (srun -> torchrun -> 2 gloo ranks), requeued mid-run:
    both ranks stop at one step, the job comes back, resumes, and each rank ends bit-exact."""
    final = tmp_path / "final.safetensors"
    job = submit_torchrun(slurm_cluster, tmp_path)
    job.wait_event("step", rank=0, step=6, timeout=120)
    job.requeue()
    job.wait_running(timeout=60, restarts=1)
    info = job.wait_done(timeout=180)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.describe()
    history = job.history()
    stops = history.events_of("stopped")  # each rank's (on the scheduler's SIGTERM, or agreed on the other's)
    assert sorted(s["rank"] for s in stops) == [0, 1] and stops[0]["step"] == stops[1]["step"], job.describe()
    assert not any(s["requeued"] for s in stops), stops  # SLURM requeues this job, not the run
    resumed = [e for e in history.events_of("entered") if e["resumed_from"] is not None]
    assert sorted(e["rank"] for e in resumed) == [0, 1], job.describe()
    assert all(e["step"] == stops[0]["step"] for e in resumed), (stops, resumed)
    assert_equal_finals(ddp_reference, ddp_finals(final))


def _rank_pid(save_dir: Path, rank: int) -> int | None:
    """The pid of the train_ddp.py worker of ``rank`` that writes to ``save_dir`` (torchrun sets RANK)."""
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            if str(TRAIN_DDP).encode() in cmd and str(save_dir).encode() in cmd:
                if f"RANK={rank}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                    return int(proc.name)
        except (OSError, ValueError):
            continue
    return None


def test_torchrun_template_a_rank_killed_fails_the_job_and_a_resubmission_resumes(
    slurm_cluster: Cluster,  # noqa: F811
    time_limit_jobs: dict,
    tmp_path: Path,
    ddp_reference: list[dict],
) -> None:
    """A rank dies (SIGKILL, as the OOM killer does) after a checkpoint: nothing hangs, the job ends FAILED (torchrun
    turns its workers' end into exit 1; SLURM requeues by itself only for a node failure), the last checkpoint
    stands, and submitting the same job again resumes from it and ends bit-exact on every rank."""
    job = submit_torchrun(slurm_cluster, tmp_path)
    job.wait_event("step", rank=1, step=6, timeout=120)
    manager = CheckpointManager(tmp_path / "run", owner=False)
    job.wait("a durable checkpoint", lambda: manager.list(), timeout=30)
    saved = max(c.step for c in manager.list())
    pid = _rank_pid(tmp_path / "run", 1)
    assert pid is not None, job.describe()
    os.kill(pid, signal.SIGKILL)
    info = job.wait_done(timeout=120)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", job.describe()
    assert not job.history().events_of("complete"), job.describe()
    newest = max(c.step for c in manager.list())
    assert newest >= saved, job.describe()

    again = submit_torchrun(slurm_cluster, tmp_path, out="again.out", step_sleep="0")
    info = again.wait_done(timeout=180)
    assert info["JobState"] == "COMPLETED", again.describe()
    resumed = [e for e in again.history().events_of("entered", step=newest) if e["resumed_from"] is not None]
    assert sorted(e["rank"] for e in resumed) == [0, 1], again.describe()
    assert_equal_finals(ddp_reference, ddp_finals(tmp_path / "final.safetensors"))
