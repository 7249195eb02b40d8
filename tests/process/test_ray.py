"""Ray Train: a PreemptibleRun in a TorchTrainer's workers on a real local Ray cluster, warned by a drain or killed.

``tests/scripts/train_ray.py --ray`` starts its own cluster on 127.0.0.1 (a head without CPUs for the driver and Ray
Train's controller, two nodes of 2 CPUs, the dashboard off, every port Ray's choice), runs 2 workers (packed on one
node, or one on each) through ``preempt.ray.fit`` and stops the cluster when the fit ends. The states are reached by
events: rank 0 drains its own node at a step, or holds at a step, until its run has heard the drain or the test's
signal; a rank SIGKILLs (or SIGTERMs) itself before a step's forward. Each final state is compared bit for bit with
the same loop run uninterrupted under torchrun.

Each test starts a Ray cluster (about 7 s) and two worker groups (about 8 s each): 30 to 60 s a test on a quiet 2-core
machine. The default tier runs the drain of both workers' node (about 45 s; with the guide's snippet in
tests/process/test_docs_run.py, about 20 s, the Ray tests of the default tier stay near a minute); the drain with the
workers spread, the SIGKILLed worker, the SIGTERMed worker and the SIGTERM to the whole job (two clusters, one after the
other, about 60 s each) are ``slow``. Without ray (``pip install 'preempt-torch[ray]'``) the file is skipped; where a
Ray cluster cannot start, each test is skipped with Ray's error.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from helpers import Spawned
from helpers.distributed import assert_equal_finals, ddp_finals
from helpers.processes import PREEMPTED, TESTS

from preempt.checkpoint.names import parse_checkpoint_name

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install 'preempt-torch[ray]')"
    ),
]

TRAIN_RAY = TESTS / "scripts" / "train_ray.py"
ARGS = ["--epochs", "2", "--samples", "128"]  # 8 steps an epoch on 2 ranks; what the reference trains too
LAST_STEP = 16
DRAIN_S = 10  # the drain's deadline: the ranks stop within it, then stay until Ray ends the group there
TIMEOUT_S = 300.0


def _start(tmp_path: Path, *args: str) -> Spawned:
    """The driver of a job on a cluster of its own, started (its events in ``events.jsonl``, what Ray said at the end
    in ``result.json``)."""
    (tmp_path / "result.json").unlink(missing_ok=True)
    cmd = [sys.executable, str(TRAIN_RAY), "--ray", "--storage", str(tmp_path / "store")]
    cmd += ["--result", str(tmp_path / "result.json"), "--events", str(tmp_path / "events.jsonl")]
    cmd += ["--final_out", str(tmp_path / "final.safetensors"), *ARGS, *args]
    return Spawned(cmd, {"OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0"})


def _events(tmp_path: Path) -> list[dict]:
    path = tmp_path / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _skip_where_ray_did_not_start(tmp_path: Path) -> None:
    result = tmp_path / "result.json"
    said = json.loads(result.read_text()) if result.exists() else {}
    if "ray_did_not_start" in said:
        pytest.skip(f"a local Ray cluster cannot start here: {said['ray_did_not_start']}")


def _ray_job(tmp_path: Path, *args: str) -> tuple[dict, list[dict], Path]:
    """The job run to its end: what Ray said (``result``), the ranks' events in order, the final state's path."""
    p = _start(tmp_path, *args)
    rc = p.finish(TIMEOUT_S)
    _skip_where_ray_did_not_start(tmp_path)
    assert rc == 0, f"exit {rc}:\n{p.output[-6000:]}"
    return json.loads((tmp_path / "result.json").read_text()), _events(tmp_path), tmp_path / "final.safetensors"


def _wait_for_event(p: Spawned, tmp_path: Path, name: str, timeout: float = TIMEOUT_S) -> dict:
    """The first event ``name`` in the events file, once a rank has written it (polled: the workers are Ray's
    processes, not the test's children); fails if the driver ends first or nothing comes within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _of(_events(tmp_path), name)
        if found:
            return found[0]
        if p.proc.poll() is not None:
            _skip_where_ray_did_not_start(tmp_path)
            raise AssertionError(f"the driver exited {p.proc.poll()} before {name}:\n{p.output[-6000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no {name} within {timeout} s:\n{p.output[-6000:]}")


def _of(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e["event"] == name]


def _ray_saw_the_last_checkpoint(result: dict, tmp_path: Path) -> None:
    """Ray's view (``result.checkpoint``) names preempt's final checkpoint, in place in the save_dir."""
    assert result["error"] is None, result
    assert result["metrics"]["step"] == LAST_STEP, result
    assert Path(result["checkpoint"]) == tmp_path / "store" / "job" / "preempt" / f"step_{LAST_STEP:09d}", result


@pytest.mark.parametrize("placed", ["packed", pytest.param("spread", marks=pytest.mark.slow)])
def test_a_drain_stops_the_group_at_its_step_and_ray_restarts_it_exactly(tmp_path, reference, placed):
    """Packed, both ranks on the drained node; spread, rank 1's node is not drained and stops by the ranks'
    agreement. Either way the ranks stay until Ray Train ends the group at the drain's deadline, so Ray counts a
    preemption, not a failure (``max_failures=0``: a failure would end the fit), and the restarted group runs on the
    node that is left."""
    want = reference.torchrun(ARGS, script=TRAIN_RAY)
    spread = ["--spread"] if placed == "spread" else []
    result, events, final = _ray_job(tmp_path, "--drain_at", f"5:{DRAIN_S}", "--max_failures", "0", *spread)

    (drained,) = _of(events, "drained")
    stopped = _of(events, "stopped")
    assert sorted(e["rank"] for e in stopped) == [0, 1] and {e["step"] for e in stopped} == {5}, stopped
    assert {e["checkpoint"] for e in stopped} == {str(tmp_path / "store" / "job" / "preempt" / "step_000000005")}
    by_rank = {e["rank"]: e for e in stopped}
    assert by_rank[0]["cause"].startswith("ray notice: node "), by_rank[0]  # the drain, heard by rank 0's node
    durable_s = max(e["t"] for e in stopped) - drained["t_drain"]
    assert durable_s < drained["deadline"] - drained["t_drain"], (durable_s, drained)
    print(f"drain -> both ranks stopped with a durable checkpoint: {durable_s:.2f} s (deadline {DRAIN_S} s)")

    entered = _of(events, "entered")
    assert [e["step"] for e in entered] == [0, 0, 5, 5], entered  # the restarted group resumed at the stop's step
    first = {e["rank"]: e["node"] for e in entered[:2]}
    assert first[0] == drained["node"] and (first[1] == drained["node"]) == (placed == "packed"), (first, drained)
    assert all(e["node"] != drained["node"] for e in entered[2:]), (entered, drained)
    assert {e["resumed_from"] for e in entered[2:]} == {str(tmp_path / "store/job/preempt/step_000000005")}
    restarted = min(e["t"] for e in entered[2:])
    assert restarted >= drained["deadline"], (restarted, drained)  # Ray ended the group at the deadline, not before
    print(f"stop -> restarted group entered: {restarted - max(e['t'] for e in stopped):.1f} s")
    _ray_saw_the_last_checkpoint(result, tmp_path)
    assert_equal_finals(ddp_finals(want), ddp_finals(final))


@pytest.mark.slow
def test_a_sigkilled_worker_s_group_resumes_from_the_newest_durable_checkpoint(tmp_path, reference):
    want = reference.torchrun(ARGS, script=TRAIN_RAY)
    result, events, final = _ray_job(tmp_path, "--die_at", f"1:6:{int(signal.SIGKILL)}", "--every", "2")

    assert [(e["rank"], e["step"]) for e in _of(events, "dying")] == [(1, 6)]
    assert not _of(events, "stopped")  # no warning: nothing saved at the kill
    entered = _of(events, "entered")
    assert len(entered) == 4 and [e["step"] for e in entered[:2]] == [0, 0], entered
    restart = events.index(entered[2])
    before = events[:restart]
    reached = max(e["step"] for e in _of(before, "step") if e["rank"] == 0)
    # (a durable event's step is the step at which rank 0 noticed it; its checkpoint's own step is in the name)
    known = max((parse_checkpoint_name(Path(e["checkpoint"]).name) or 0 for e in _of(before, "durable")), default=0)
    resumed = {e["step"] for e in entered[2:]}
    # The newest durable checkpoint: at least the newest rank 0 had seen durable at its last step, at most the step it
    # reached (a write in flight may have become durable as rank 0 left)
    assert len(resumed) == 1 and known <= min(resumed) <= reached and min(resumed) > 0, (known, resumed, reached)
    assert reached == 5, reached  # rank 1 died before step 6's all-reduce
    print(f"steps recomputed after the SIGKILL: {reached - min(resumed)}")
    _ray_saw_the_last_checkpoint(result, tmp_path)
    assert_equal_finals(ddp_finals(want), ddp_finals(final))


def _stopped_at(events: list[dict], step: int, tmp_path: Path) -> list[dict]:
    """Both ranks stopped at ``step`` with the checkpoint of that step (the events ``stopped``)."""
    stopped = _of(events, "stopped")
    assert sorted(e["rank"] for e in stopped) == [0, 1] and {e["step"] for e in stopped} == {step}, stopped
    assert {e["checkpoint"] for e in stopped} == {str(tmp_path / "store" / "job" / "preempt" / f"step_{step:09d}")}
    return stopped


@pytest.mark.slow
def test_a_sigterm_to_one_worker_stops_the_group_at_its_step_and_ray_restarts_it_exactly(tmp_path, reference):
    """preempt's handler is on the worker actor's main thread (Ray's own would end the actor at once): rank 1's
    SIGTERM before step 6 stops both ranks at step 6 with its checkpoint; Ray restarts the group, resumed there."""
    want = reference.torchrun(ARGS, script=TRAIN_RAY)
    result, events, final = _ray_job(tmp_path, "--die_at", f"1:6:{int(signal.SIGTERM)}", "--every", "4")

    assert [(e["rank"], e["step"]) for e in _of(events, "dying")] == [(1, 6)]
    stopped = _stopped_at(events, 6, tmp_path)
    assert {e["rank"]: e["cause"] for e in stopped}[1] == "SIGTERM", stopped
    entered = _of(events, "entered")
    assert [e["step"] for e in entered] == [0, 0, 6, 6], entered
    _ray_saw_the_last_checkpoint(result, tmp_path)
    assert_equal_finals(ddp_finals(want), ddp_finals(final))


@pytest.mark.slow
@pytest.mark.parametrize("to", ["job", "driver"])
def test_a_sigterm_to_the_whole_job_stops_the_workers_at_a_step_and_the_driver_s_rerun_resumes_exactly(
    tmp_path, reference, to
):
    """As a cluster manager stops a job: SIGTERM to the driver and to each worker at once (``job``), or to the driver
    alone (``driver``: a container's first process), while rank 0 holds before step 5. The workers stop at step 5 with
    its checkpoint (their own signal, or the driver's word); the driver waits for rank 0's word and exits 75 (the job's
    actors die with it, before Ray could restart them); the driver run again resumes at step 5, bit-exact."""
    want = reference.torchrun(ARGS, script=TRAIN_RAY)
    p = _start(tmp_path, "--hold_at", "5", "--every", "3")
    _wait_for_event(p, tmp_path, "holding")
    events = _events(tmp_path)
    (driver,) = _of(events, "driver")
    workers = [e["pid"] for e in _of(events, "entered")]
    assert len(workers) == 2, events
    t_kill = time.time()
    for pid in [driver["pid"], *(workers if to == "job" else [])]:
        os.kill(pid, signal.SIGTERM)
    rc = p.finish(TIMEOUT_S)
    assert rc == PREEMPTED, f"exit {rc}:\n{p.output[-6000:]}"

    events = _events(tmp_path)
    stopped = _stopped_at(events, 5, tmp_path)
    if to == "driver":  # rank 0's node watcher read the driver's word
        assert {e["rank"]: e["cause"] for e in stopped}[0] == "ray notice: the driver was stopped (SIGTERM)", stopped
    durable_s = max(e["t"] for e in stopped) - t_kill
    print(f"SIGTERM to the {to} -> both ranks stopped with a durable checkpoint: {durable_s:.2f} s")
    assert len(_of(events, "entered")) == 2, events  # no restart within the job: the driver left first

    result, events, final = _ray_job(tmp_path)  # the driver run again
    entered = _of(events, "entered")
    assert [e["step"] for e in entered] == [0, 0, 5, 5], entered
    assert {e["resumed_from"] for e in entered[2:]} == {str(tmp_path / "store/job/preempt/step_000000005")}
    _ray_saw_the_last_checkpoint(result, tmp_path)
    assert_equal_finals(ddp_finals(want), ddp_finals(final))
