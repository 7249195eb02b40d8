"""Several ranks: a cloud's notice seen by one node's first rank stops every rank at one step, and under torchrun the
grace is its shutdown timeout, read from the agent's ``--shutdown-timeout`` as a rank sees it.

For the grace, torchrun is started as users start it (its console script, not from the suite's fork server), so that
each rank is a child of the agent whose command line it reads.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import DDP_ARGS, PREEMPTED, TRAIN_DDP, Spawned, assert_equal_finals, ddp_finals, free_port, torchrun
from helpers.metadata import MetadataService

pytestmark = pytest.mark.distributed


def test_the_grace_is_torchruns_shutdown_timeout(tmp_path):
    """Rank 1 sends itself SIGTERM before step 4: both ranks stop at step 4; rank 0's stop says a grace of 7 s, the
    ``--shutdown-timeout 7`` the agent was started with, and a margin within it."""
    launcher = Path(sys.executable).with_name("torchrun")
    if not launcher.is_file():
        pytest.skip(f"no torchrun console script beside {sys.executable}")
    cmd = [
        str(launcher),
        "--nnodes=1",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-backend=c10d",
        "--nproc-per-node=2",
        "--shutdown-timeout",
        "7",
        str(TRAIN_DDP),
        "--save_dir",
        str(tmp_path / "run"),
        *DDP_ARGS,
        "--self_signal",
        "1:4",
        "--sync_save",
    ]
    p = Spawned(cmd, {"OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "99"})
    rc = p.finish(timeout=300)
    assert rc != 0, p.output  # the agent reports its ranks' exit code 75 as a failure
    (stop,) = p.events_of("stop")  # rank 0's history
    assert stop["step"] == 4 and stop["code"] == PREEMPTED, stop
    assert stop["grace_s"] == 7.0 and stop["margin_s"] == pytest.approx(7.0 - stop["durable_s"], abs=0.01), stop


def test_a_notice_on_rank_0s_node_stops_both_ranks_at_one_step_and_they_resume_bit_exact(tmp_path):
    """The AWS notice is posted before the ranks start: only the node's first rank polls (LOCAL_RANK 0), and the
    ranks' agreement stops both at the same step, exit 75; a rerun of both (no notice: a new machine) ends equal to
    an uninterrupted run, tensor for tensor."""
    ref = tmp_path / "ref"
    p = torchrun(ref / "run", ref / "final.safetensors", DDP_ARGS)
    assert p.finish() == 0, p.output
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    with MetadataService("aws") as service:
        service.give_notice()
        p = torchrun(save_dir, None, [*DDP_ARGS, "--sync_save"], env={**service.env(), "PREEMPT_NOTICES": "aws"})
        p.finish(timeout=300)
    (stop,) = p.events_of("stop")  # rank 0's history
    assert stop["cause"].startswith("aws notice: spot instance-action") and stop["code"] == PREEMPTED, stop
    stops = p.events_of("stopped", step=stop["step"], code=PREEMPTED)  # each rank's
    assert sorted(s["rank"] for s in stops) == [0, 1], (p.output, p.events)
    tokens = [r for r in service.requests if r.path == "/latest/api/token"]
    assert len(tokens) == 1, service.requests  # one watcher on the node: rank 0's
    again = torchrun(save_dir, final, DDP_ARGS)
    assert again.finish() == 0, again.output
    assert again.events_of("resume", step=stop["step"]), again.events
    assert_equal_finals(ddp_finals(ref / "final.safetensors"), ddp_finals(final))
