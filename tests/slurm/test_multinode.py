"""slurm/job_torchrun.sbatch across two nodes of the local cluster: one torchrun per node under srun, one gloo
rank on each, the rendezvous across the nodes.

The nodes n1 and n2 are slurmds of their own on this machine (slurm/cluster.sh): SLURM allocates them to the job as
two nodes, srun starts a task on each through that node's daemon, and a requeue tears down and restarts the job on
both. The job is requeued with ``scontrol requeue`` (once; twice under -m slow), the last time held and given a
one-minute limit before it is released (the runs before have ten minutes, however slowly the machine starts them),
and then meets that limit once, with no warning signal: only rank 0's walltime keeper sees it coming; the ranks agree
on that stop at one step, and rank 0 requeues the job. The final state of each rank must equal, tensor for tensor,
that of an uninterrupted torchrun of the same training.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import s3server
from helpers import TRAIN_DDP, assert_equal_finals, ddp_finals, free_port, torchrun
from slurmjobs import Cluster, Job, slurm_cluster  # noqa: F401

from preempt.mirror.store import MirrorStore
from preempt.mirror.survey import Surveyor

pytestmark = [pytest.mark.slurm, pytest.mark.distributed]

# 1600 samples, 8 per rank per step on 2 ranks: 100 steps per epoch, 200 in all; at --step_sleep 0.3 that is
# more than a minute of training, more than the run after the requeue can do within the one-minute job (195 steps or
# more are left, 58.5 s of sleep alone): that run's walltime keeper stops it and requeues the job.
ARGS = ["--epochs", "2", "--samples", "1600", "--every_steps", "10"]


def requeue_after_steps(job: Job, restarts: int, steps: int, *, limit: str | None = None) -> None:
    """Waits until run ``restarts`` has both ranks in the run and ``steps`` more steps done; requeues it (held,
    given the time ``limit``, then released, when a limit is given)."""
    job.wait_event("entered", timeout=120, count=2 * (restarts + 1))
    before = len(job.history().events_of("step", rank=0))
    job.wait_event("step", rank=0, timeout=90, count=before + steps)
    if limit is None:
        job.requeue()
    else:
        job.cluster.run("scontrol", "requeuehold", job.id)
        job.wait("held", lambda: job.info().get("Restarts") == str(restarts + 1), timeout=120)
        job.cluster.run("scontrol", "update", f"JobId={job.id}", f"TimeLimit={limit}")
        job.cluster.run("scontrol", "release", job.id)
    job.wait_running(timeout=60, restarts=restarts + 1)


@pytest.mark.parametrize("requeues", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_two_nodes_requeued_then_stopped_by_the_walltime_keeper(
    slurm_cluster: Cluster,  # noqa: F811
    tmp_path: Path,
    requeues: int,
) -> None:
    nodes = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N").split()
    if len(set(nodes)) < 2:
        pytest.skip(f"the local cluster has {len(set(nodes))} node(s) ({nodes}); this test needs 2 (slurm/cluster.sh)")
    ref = torchrun(tmp_path / "ref", tmp_path / "ref.safetensors", ARGS)
    assert ref.finish(timeout=240) == 0, ref.output

    final, raised = tmp_path / "final.safetensors", tmp_path / "limit_raised"
    args = [*ARGS, "--step_sleep", "0.3", "--save_dir", str(tmp_path / "run"), "--final_out", str(final)]
    args += ["--wait_file_in_restart", f"{requeues}:{raised}"]
    # Ten minutes for the runs before the last requeue, whatever the machine's speed; the last requeue holds the job
    # and gives it one minute, which the run after it reads when it starts.
    options = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--gres=none", "--time=10", "--signal=TERM@0"]
    options.append(f"--export=ALL,GPUS_PER_NODE=1,RDZV_PORT={free_port()},PREEMPT_LOG_ALL_RANKS=1")
    job = slurm_cluster.submit("job_torchrun.sbatch", [str(TRAIN_DDP), *args], tmp_path / "job.out", options)
    for restarts in range(requeues):
        requeue_after_steps(job, restarts=restarts, steps=4, limit="1" if restarts == requeues - 1 else None)
    # The run after the last requeue has read its end time when its walltime keeper says when the job ends; its
    # ranks then wait before their first step, so no stop can come, until the test has raised the job's limit to 10
    # minutes. That keeper still stops the run at the old end and requeues the job, and the next run finishes well
    # within its limit. With the one-minute limit kept, how close the finishing run comes to the limit would depend
    # on the machine's speed: one that finished 4 s before it ended TIMEOUT while torchrun and srun exited (CI, on
    # 9e625d0), and on a busy machine the keeper stopped two runs instead of one.
    job.wait_event("waiting", rank=0, point="restart", n=requeues, timeout=180)
    slurm_cluster.run("scontrol", "update", f"JobId={job.id}", "TimeLimit=10")
    assert job.info()["Restarts"] == str(requeues), f"the limit went up after that run ended\n{job.describe()}"
    raised.touch()
    info = job.wait_done(timeout=300)
    runs = requeues + 2  # each requeue's run, the one the walltime keeper stops, and the one that finishes
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == str(runs - 1), job.describe()
    assert info["NumNodes"] == "2" and info["NodeList"] == "n[1-2]", info
    assert "DUE TO TIME LIMIT" not in job.log, job.describe()
    history = job.history()

    # Each run had rank 0 and rank 1 on different nodes, at one step.
    starts = by_run(history.events_of("entered"), runs, job)
    for run, (r0, r1) in enumerate(starts):
        assert r0["step"] == r1["step"] and r0["node"] != r1["node"], (run, r0, r1)

    # A stop before each restart, at one step on both ranks; each restart resumed from the stop's step on both.
    stops = by_run(history.events_of("stopped"), runs - 1, job)
    for restart, (s0, s1) in enumerate(stops, start=1):
        assert s0["step"] == s1["step"], (s0, s1)
        assert all(r["step"] == s0["step"] and r["resumed_from"] is not None for r in starts[restart]), starts
    # The first ones by the scheduler's SIGTERM (each rank's, or the other's agreed), the last one by rank 0's
    # walltime keeper (both ranks), and rank 0 requeued the job then, and only then.
    kinds = [s["cause"] == "walltime" for pair in stops for s in pair]
    assert kinds == [False] * (2 * requeues) + [True] * 2, stops
    assert [(s["rank"], s["cause"]) for pair in stops for s in pair if s["requeued"]] == [(0, "walltime")], stops

    assert_equal_finals(ddp_finals(tmp_path / "ref.safetensors"), ddp_finals(final))


def by_run(events: list[dict[str, Any]], runs: int, job: Job) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The events of the two ranks (``rank``), one pair per run in order, rank 0's first."""
    assert len(events) == 2 * runs, f"{len(events)} events for {runs} runs of 2 ranks\n{job.describe()}"
    pairs = [tuple(sorted(events[i : i + 2], key=lambda e: e["rank"])) for i in range(0, len(events), 2)]
    assert all((a["rank"], b["rank"]) == (0, 1) for a, b in pairs), pairs
    return pairs  # type: ignore[return-value]


# 320 samples, 8 per rank per step on 2 ranks: 20 steps per epoch, 40 in all; a checkpoint every 10 steps.
APART_ARGS = ["--epochs", "2", "--samples", "320", "--every_steps", "10"]


def test_two_nodes_with_save_dirs_of_their_own_resume_from_the_mirror_after_both_are_wiped(
    slurm_cluster: Cluster,  # noqa: F811
    tmp_path: Path,
    mirror_url: str,
    s3_endpoint: str,
) -> None:
    """Nodes that share only the mirror (the S3-compatible server of .ci/run): each node's rank writes to a save_dir
    of its own (``{node}`` in the path), the job is requeued and held, both save_dirs are wiped (new machines), and
    the released job resumes from the mirror on both nodes and ends bit-exact."""
    nodes = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N").split()
    if len(set(nodes)) < 2:
        pytest.skip(f"the local cluster has {len(set(nodes))} node(s) ({nodes}); this test needs 2 (slurm/cluster.sh)")
    ref = torchrun(tmp_path / "ref", tmp_path / "ref.safetensors", APART_ARGS)
    assert ref.finish(timeout=240) == 0, ref.output

    final = tmp_path / "final.safetensors"
    args = [
        *APART_ARGS,
        "--step_sleep",
        "0.3",
        "--save_dir",
        str(tmp_path / "{node}" / "run"),
        "--final_out",
        str(final),
    ]
    args += ["--mirror", mirror_url, "--hold_until_stop", "13"]
    options = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--gres=none", "--time=10"]
    aws = ",".join(f"{k}={v}" for k, v in s3server.env(s3_endpoint).items())  # the job's environment is sbatch's
    options.append(f"--export=ALL,GPUS_PER_NODE=1,RDZV_PORT={free_port()},PREEMPT_LOG_ALL_RANKS=1,{aws}")
    job = slurm_cluster.submit("job_torchrun.sbatch", [str(TRAIN_DDP), *args], tmp_path / "job.out", options)
    job.wait_event("holding", point="step", n=13, timeout=240, count=2)  # after the checkpoint of step 10
    slurm_cluster.run("scontrol", "requeuehold", job.id)  # SIGTERM to both ranks; the job waits, held
    job.wait("held", lambda: job.info().get("JobState") == "PENDING" and job.info().get("Restarts") == "1", timeout=120)
    step = 13
    stops = job.history().events_of("stopped")
    assert sorted(s["rank"] for s in stops) == [0, 1] and {s["step"] for s in stops} == {step}, job.describe()
    # each rank's stop waited for its node's part in the mirror: the whole checkpoint is there, every node's files
    whole = Surveyor(MirrorStore(mirror_url)).survey().manifests[step]
    assert whole.part is None and {"model.safetensors", "rank_00001.json"} <= set(whole.files), whole.files
    held = sorted(p.parent.parent.name for p in tmp_path.glob("n*/run/step_*"))
    assert set(held) == {"n1", "n2"}, held  # each node wrote into its own save_dir
    for d in tmp_path.glob("n*"):  # new machines: nothing on either disk
        shutil.rmtree(d)

    slurm_cluster.run("scontrol", "release", job.id)
    info = job.wait_done(timeout=300)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.describe()
    history = job.history()
    assert history.events_of("mirror_pull", step=step), job.describe()  # rank 0's node pulled it
    # each rank resumed from the step pulled into its own node's save_dir (their paths differ, as they may on a
    # cluster); both were wiped, so each node pulled its copy
    resumed = [e for e in history.events_of("entered", step=step) if e["resumed_from"] is not None]
    assert sorted(e["rank"] for e in resumed) == [0, 1], job.describe()
    assert all(Path(e["resumed_from"]).parent.parent.name == e["node"] for e in resumed), resumed
    assert_equal_finals(ddp_finals(tmp_path / "ref.safetensors"), ddp_finals(final))
