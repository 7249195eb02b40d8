"""Ray Train: a PreemptibleRun in a TorchTrainer's workers on a real local Ray cluster, warned by a drain or killed.

``tests/scripts/train_ray.py --ray`` starts its own cluster on 127.0.0.1 (a head without CPUs for the driver and Ray
Train's controller, two nodes of 2 CPUs, the dashboard off), runs 2 workers (packed on one node, or one on each) and
stops the cluster when ``fit()`` returns. The states are reached by events: rank 0 drains its own node at a step and
holds there until its run has heard the drain; a rank SIGKILLs (or SIGTERMs) itself before a step's forward. Each final
state is compared bit for bit with the same loop run uninterrupted under torchrun.

The whole file is slow (``-m slow``): each test starts a Ray cluster (about 7 s) and two worker groups (about 8 s each),
35 to 60 s a test on a 2-core machine, about 3 minutes for the file. Without ray (``pip install 'preempt-torch[ray]'``)
it is skipped.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
from pathlib import Path

import pytest
from helpers import Spawned
from helpers.distributed import assert_equal_finals, ddp_finals
from helpers.processes import TESTS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install 'preempt-torch[ray]')"
    ),
]

TRAIN_RAY = TESTS / "scripts" / "train_ray.py"
ARGS = ["--epochs", "2", "--samples", "128"]  # 8 steps an epoch on 2 ranks; what the reference trains too
LAST_STEP = 16
TIMEOUT_S = 300.0


def _ray_job(tmp_path: Path, *args: str) -> tuple[dict, list[dict], Path]:
    """The job run to its end: what Ray said (``result``), the ranks' events in order, the final state's path."""
    final = tmp_path / "final.safetensors"
    cmd = [sys.executable, str(TRAIN_RAY), "--ray", "--storage", str(tmp_path / "store")]
    cmd += ["--result", str(tmp_path / "result.json"), "--events", str(tmp_path / "events.jsonl")]
    cmd += ["--final_out", str(final), *ARGS, *args]
    p = Spawned(cmd, {"OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0"})
    rc = p.finish(TIMEOUT_S)
    assert rc == 0, f"exit {rc}:\n{p.output[-6000:]}"
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    return json.loads((tmp_path / "result.json").read_text()), events, final


def _of(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e["event"] == name]


def _ray_saw_the_last_checkpoint(result: dict, tmp_path: Path) -> None:
    """Ray's view (``result.checkpoint``) names preempt's final checkpoint, in place in the save_dir."""
    assert result["error"] is None, result
    assert result["metrics"]["step"] == LAST_STEP, result
    assert Path(result["checkpoint"]) == tmp_path / "store" / "job" / "preempt" / f"step_{LAST_STEP:09d}", result


@pytest.mark.parametrize("placed", ["packed", "spread"])
def test_a_drain_stops_the_group_at_its_step_and_ray_restarts_it_exactly(tmp_path, reference, placed):
    """Packed, both ranks on the drained node; spread, rank 1's node is not drained and stops by the ranks'
    agreement. Either way the restarted group runs on the node that is left."""
    want = reference.torchrun(ARGS, script=TRAIN_RAY)
    result, events, final = _ray_job(tmp_path, "--drain_at", "5:30", *(["--spread"] if placed == "spread" else []))

    (drained,) = _of(events, "drained")
    stopped = _of(events, "stopped")
    assert sorted(e["rank"] for e in stopped) == [0, 1] and {e["step"] for e in stopped} == {5}, stopped
    assert {e["checkpoint"] for e in stopped} == {str(tmp_path / "store" / "job" / "preempt" / "step_000000005")}
    by_rank = {e["rank"]: e for e in stopped}
    assert by_rank[0]["cause"].startswith("ray notice: node "), by_rank[0]  # the drain, heard by rank 0's node
    durable_s = max(e["t"] for e in stopped) - drained["t_drain"]
    assert durable_s < drained["deadline"] - drained["t_drain"], (durable_s, drained)
    print(f"drain -> both ranks stopped with a durable checkpoint: {durable_s:.2f} s (deadline 30 s)")

    entered = _of(events, "entered")
    assert [e["step"] for e in entered] == [0, 0, 5, 5], entered  # the restarted group resumed at the stop's step
    first = {e["rank"]: e["node"] for e in entered[:2]}
    assert first[0] == drained["node"] and (first[1] == drained["node"]) == (placed == "packed"), (first, drained)
    assert all(e["node"] != drained["node"] for e in entered[2:]), (entered, drained)
    assert {e["resumed_from"] for e in entered[2:]} == {str(tmp_path / "store/job/preempt/step_000000005")}
    print(f"stop -> restarted group entered: {min(e['t'] for e in entered[2:]) - max(e['t'] for e in stopped):.1f} s")
    _ray_saw_the_last_checkpoint(result, tmp_path)
    assert_equal_finals(ddp_finals(want), ddp_finals(final))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_worker_s_group_resumes_from_the_newest_durable_checkpoint(tmp_path, reference, sig):
    """SIGTERM too: Ray's own handler in the worker's main thread ends the actor (preempt catches no signal in a Ray
    worker), a failed worker to Ray Train as after SIGKILL."""
    want = reference.torchrun(ARGS, script=TRAIN_RAY)
    result, events, final = _ray_job(tmp_path, "--die_at", f"1:6:{int(sig)}", "--every", "2")

    assert [(e["rank"], e["step"]) for e in _of(events, "dying")] == [(1, 6)]
    assert not _of(events, "stopped")  # no warning: nothing saved at the kill
    entered = _of(events, "entered")
    assert len(entered) == 4 and [e["step"] for e in entered[:2]] == [0, 0], entered
    restart = events.index(entered[2])
    before = events[:restart]
    reached = max(e["step"] for e in _of(before, "step") if e["rank"] == 0)
    known = max((e["step"] for e in _of(before, "durable")), default=0)
    resumed = {e["step"] for e in entered[2:]}
    # The newest durable checkpoint: at least the newest rank 0 had seen durable at its last step, at most the step it
    # reached (a write in flight may have become durable as rank 0 left; under SIGTERM rank 1's training thread goes
    # on for a few steps while Ray's handler ends the process, and the group with it)
    assert len(resumed) == 1 and known <= min(resumed) <= reached and min(resumed) > 0, (known, resumed, reached)
    if sig == signal.SIGKILL:
        assert reached == 5, reached  # rank 1 died before step 6's all-reduce
    _ray_saw_the_last_checkpoint(result, tmp_path)
    assert_equal_finals(ddp_finals(want), ddp_finals(final))
