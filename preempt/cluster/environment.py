"""Facts about the process's surroundings, read in one place.

Environment variables are read only here (:meth:`Environment.from_env`), and
never written. Provenance (versions, the code's git commit) is gathered once
per run, because ``git status`` can take a while in a large repository.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _int(environ: Mapping[str, str], key: str) -> int | None:
    value = environ.get(key, "").strip()
    try:
        return int(value)
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Environment:
    """What the process learns from its environment variables.

    Attributes:
        slurm_job_id: ``SLURM_JOB_ID``.
        slurm_array_job_id: ``SLURM_ARRAY_JOB_ID``.
        slurm_array_task_id: ``SLURM_ARRAY_TASK_ID``.
        slurm_restart_count: ``SLURM_RESTART_COUNT`` (unset on a job's first run).
        slurm_job_end_time: ``SLURM_JOB_END_TIME`` (unix seconds), set by some clusters.
        rank: This process's global rank: ``RANK`` (torchrun), else ``SLURM_PROCID``
            (srun), else None. Only rank 0 (or None) requeues a SLURM job.
        log_level: ``PREEMPT_LOG_LEVEL``, e.g. ``DEBUG``.
    """

    slurm_job_id: str | None = None
    slurm_array_job_id: str | None = None
    slurm_array_task_id: str | None = None
    slurm_restart_count: int | None = None
    slurm_job_end_time: int | None = None
    rank: int | None = None
    log_level: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Environment:
        env = os.environ if environ is None else environ
        rank = _int(env, "RANK")
        return cls(
            slurm_job_id=env.get("SLURM_JOB_ID") or None,
            slurm_array_job_id=env.get("SLURM_ARRAY_JOB_ID") or None,
            slurm_array_task_id=env.get("SLURM_ARRAY_TASK_ID") or None,
            slurm_restart_count=_int(env, "SLURM_RESTART_COUNT"),
            slurm_job_end_time=_int(env, "SLURM_JOB_END_TIME"),
            rank=rank if rank is not None else _int(env, "SLURM_PROCID"),
            log_level=env.get("PREEMPT_LOG_LEVEL") or None,
        )

    def slurm(self) -> dict[str, Any] | None:
        """The SLURM facts for a manifest, or None outside SLURM.

        ``end_time`` is the job's end time in unix seconds when the environment
        says it; the run fills it in from ``scontrol show job`` otherwise.
        """
        if self.slurm_job_id is None:
            return None
        return {
            "job_id": self.slurm_job_id,
            "array_job_id": self.slurm_array_job_id,
            "array_task_id": self.slurm_array_task_id,
            "restart_count": self.slurm_restart_count or 0,
            "end_time": self.slurm_job_end_time,
        }


def git_state(directory: Path) -> dict[str, Any] | None:
    """Commit and dirtiness of the git work tree holding ``directory``, or None."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if commit.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "-C", str(directory), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {
        "commit": commit.stdout.strip(),
        "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None,
    }


def code_directory() -> Path:
    """The directory of the script being run (``sys.argv[0]``), else the working directory."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if script is not None and script.exists():
        return script.resolve().parent
    return Path.cwd()


def provenance(env: Environment) -> dict[str, Any]:
    """Versions, host, command line, code commit and SLURM job: what a manifest records."""
    import numpy
    import safetensors
    import torch

    from .._version import __version__

    return {
        "preempt": __version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "argv": list(sys.argv),
        "git": git_state(code_directory()),
        "slurm": env.slurm(),
    }
