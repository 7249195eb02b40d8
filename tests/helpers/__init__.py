"""What the tests share as code, in one place: processes, tensors, the distributed launch, the CLI, the clock and
the events a training process emits. ``conftest.py`` keeps only the suite's hooks and fixtures.

``from helpers import Spawned, assert_same_final`` (``tests/`` is on ``sys.path`` through the root ``conftest.py``).
"""

from .cli import cli, cli_json, small_run
from .clock import FakeClock
from .distributed import (
    assert_equal_finals,
    ddp_finals,
    free_port,
    port_slice,
    ranks_by_hand,
    torchrun,
    torchrun_nodes,
)
from .hold import stop_marker, wait_for_stop
from .processes import (
    DDP_ARGS,
    PREEMPTED,
    RANK_LAUNCHER,
    ROOT,
    TRAIN,
    TRAIN_ACCELERATE,
    TRAIN_DDP,
    History,
    Interrupt,
    On,
    Spawned,
    StoppedRun,
    in_step,
    on,
    run_interrupted,
    run_python,
    train_cmd,
)
from .tensors import (
    MiB,
    assert_same_final,
    assert_writes_what_changed,
    changed_bytes,
    checkpoint_tensors,
    direct_io_supported,
    flip_bit,
    model_and_optimizer_tensors,
    read_into,
)

__all__ = [
    "DDP_ARGS",
    "PREEMPTED",
    "RANK_LAUNCHER",
    "ROOT",
    "TRAIN",
    "TRAIN_ACCELERATE",
    "TRAIN_DDP",
    "FakeClock",
    "History",
    "Interrupt",
    "On",
    "MiB",
    "Spawned",
    "StoppedRun",
    "assert_equal_finals",
    "assert_same_final",
    "assert_writes_what_changed",
    "changed_bytes",
    "checkpoint_tensors",
    "cli",
    "cli_json",
    "ddp_finals",
    "direct_io_supported",
    "flip_bit",
    "free_port",
    "in_step",
    "on",
    "model_and_optimizer_tensors",
    "port_slice",
    "ranks_by_hand",
    "read_into",
    "run_interrupted",
    "run_python",
    "small_run",
    "stop_marker",
    "torchrun",
    "torchrun_nodes",
    "train_cmd",
    "wait_for_stop",
]
