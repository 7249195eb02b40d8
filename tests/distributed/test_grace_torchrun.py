"""Under torchrun the grace is its shutdown timeout: read from the agent's ``--shutdown-timeout``, as a worker sees it.

torchrun is started as users start it (its console script, not from the suite's fork server), so that each rank is a
child of the agent whose command line it reads.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import DDP_ARGS, PREEMPTED, TRAIN_DDP, Spawned, free_port

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
