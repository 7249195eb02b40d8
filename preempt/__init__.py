"""preempt: PyTorch training loops that survive preemption and resume bit for bit."""

__version__ = "0.1.0"

from .checkpoint import CheckpointManager
from .errors import (
    PREEMPTED_EXIT_CODE,
    REQUEUE_FAILED_EXIT_CODE,
    RESTART_LIMIT_EXIT_CODE,
    SAVE_FAILED_EXIT_CODE,
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompatibleStateError,
    NoCheckpointError,
    Preempted,
    PreemptError,
    RestartLimitReached,
    RunComplete,
    SaveFailed,
    SlurmError,
    UnsupportedStateError,
)
from .run import PreemptibleRun
from .sampler import ResumableSampler

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "REQUEUE_FAILED_EXIT_CODE",
    "RESTART_LIMIT_EXIT_CODE",
    "SAVE_FAILED_EXIT_CODE",
    "CheckpointManager",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "IncompatibleStateError",
    "NoCheckpointError",
    "PreemptError",
    "Preempted",
    "PreemptibleRun",
    "ResumableSampler",
    "RestartLimitReached",
    "RunComplete",
    "SaveFailed",
    "SlurmError",
    "UnsupportedStateError",
]
