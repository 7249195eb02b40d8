"""preempt: PyTorch training loops that survive preemption and resume bit for bit.

``CheckpointManager``, ``PreemptibleRun`` and ``ResumableSampler`` import torch,
so they are loaded on first use (PEP 562 ``__getattr__``): the parts that need
no torch (``preempt supervise``, ``preempt --help``, :mod:`preempt.errors`,
:mod:`preempt.cluster.signals`) start without importing torch (``bench/README.md``, "Command-line start-up").
``from preempt import PreemptibleRun`` works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__
from .errors import (
    NONFINITE_EXIT_CODE,
    OOM_EXIT_CODE,
    PEER_LOST_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    REQUEUE_FAILED_EXIT_CODE,
    RESTART_LIMIT_EXIT_CODE,
    SAVE_FAILED_EXIT_CODE,
    CheckpointUnreadableError,
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompatibleStateError,
    LockedError,
    LockLostError,
    MirrorError,
    NoCheckpointError,
    PeerLost,
    Preempted,
    PreemptError,
    RestartLimitReached,
    RunComplete,
    SaveFailed,
    SlurmError,
    UnsupportedStateError,
)

if TYPE_CHECKING:
    from .checkpoint.manager import CheckpointManager
    from .data.sampler import ResumableSampler
    from .run.preemptible import PreemptibleRun

__all__ = [
    "NONFINITE_EXIT_CODE",
    "OOM_EXIT_CODE",
    "PEER_LOST_EXIT_CODE",
    "PREEMPTED_EXIT_CODE",
    "REQUEUE_FAILED_EXIT_CODE",
    "RESTART_LIMIT_EXIT_CODE",
    "SAVE_FAILED_EXIT_CODE",
    "CheckpointManager",
    "CheckpointUnreadableError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "IncompatibleStateError",
    "LockLostError",
    "LockedError",
    "MirrorError",
    "NoCheckpointError",
    "PeerLost",
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

_LAZY = {
    "CheckpointManager": "checkpoint.manager",
    "PreemptibleRun": "run.preemptible",
    "ResumableSampler": "data.sampler",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
