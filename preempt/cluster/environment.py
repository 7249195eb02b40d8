"""Facts about the process's surroundings, read in one place.

Environment variables are read only here (:meth:`Environment.from_env`), each
checked, and never written. ``PREEMPT_CHECK`` (:class:`CheckSpec`) is how ``preempt check`` drives a run.
Provenance (versions, the code's git commit) is gathered once
per run, because ``git status`` can take a while in a large repository.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import _log
from .._secrets import scrub_argv

END_TIMES = (1_000_000_000, 7_258_118_400)  # unix seconds, 2001-09-09 to 2200-01-01: a SLURM job's end lies between
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
_MOST = 2**63 - 1
NOTICE_PLATFORMS = ("aws", "gce", "azure", "ray")  # whose advance notices preempt reads (ray: cluster.ray_notice)


class _Reader:
    """Reads and checks variables; a value it cannot use is one line in ``problems`` and reads as unset."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ
        self.problems: list[str] = []

    def _bad(self, name: str, expected: str, then: str) -> None:
        self.problems.append(f"{name}={self.environ[name]!r}: expected {expected}; {then}")

    def text(self, name: str) -> str | None:
        return self.environ.get(name, "").strip() or None

    def integer(self, name: str, then: str = "ignored") -> int | None:
        """A whole number >= 0 (a rank, a restart count)."""
        text = self.text(name)
        if text is None:
            return None
        if text.isdecimal() and text.isascii() and int(text) <= _MOST:
            return int(text)
        self._bad(name, "a whole number >= 0", then)
        return None

    def job_id(self, name: str) -> str | None:
        """A SLURM job or array task number: digits, as SLURM writes it (it goes on scontrol's command line)."""
        text = self.text(name)
        if text is None or (text.isdecimal() and text.isascii() and len(text) <= 20):
            return text
        self._bad(name, "a SLURM job number (digits)", "ignored")
        return None

    def _number(self, name: str, lo: float, hi: float) -> tuple[bool, float | None]:
        """Whether the variable is set, and its value when it is a number in ``[lo, hi]`` (else None)."""
        text = self.text(name)
        if text is None:
            return False, None
        try:
            value = float(text)
        except ValueError:
            return True, None
        return True, (value if lo <= value <= hi else None)  # (NaN and inf are in no range)

    def end_time(self, name: str) -> int | None:
        """Unix seconds in :data:`END_TIMES`: a negative, past-2200 or non-finite value is no deadline."""
        lo, hi = END_TIMES
        given, value = self._number(name, lo, hi)
        if value is not None:
            return int(value)
        if given:
            self._bad(
                name, f"the job's end in unix seconds, between {lo} (2001) and {hi} (2200)", "no deadline from it"
            )
        return None

    def level(self, name: str) -> str | None:
        text = self.text(name)
        if text is None or text.upper() in _log.LEVELS:
            return None if text is None else text.upper()
        self._bad(name, f"one of {', '.join(_log.LEVELS)}", "ignored (the level stays as configured)")
        return None

    def seconds(self, name: str) -> float | None:
        """A number of seconds >= 0 (a grace, a timeout)."""
        given, value = self._number(name, 0.0, 1e9)
        if given and value is None:
            self._bad(name, "a number of seconds >= 0", "ignored")
        return value

    def choice(self, name: str, allowed: tuple[str, ...]) -> str | None:
        text = self.text(name)
        if text is None or text.lower() in allowed:
            return None if text is None else text.lower()
        self._bad(name, f"one of {', '.join(allowed)}", "ignored")
        return None

    def url(self, name: str) -> str | None:
        """An http:// URL (a metadata service's endpoint)."""
        text = self.text(name)
        if text is None or (text.startswith("http://") and len(text) > 7 and text.isascii() and " " not in text):
            return text
        self._bad(name, "an http:// URL", "the platform's own address is used")
        return None

    def host(self, name: str) -> str | None:
        """A host[:port], no scheme (``GCE_METADATA_HOST``, as google-auth reads it)."""
        text = self.text(name)
        if text is None or (text.isascii() and not any(c in text for c in "/ @?#")):
            return text
        self._bad(name, "a host or host:port, no scheme or path", "the platform's own address is used")
        return None

    def flag(self, name: str) -> bool:
        text = (self.text(name) or "").lower()
        if text in _ON or text in _OFF:
            return text in _ON
        self._bad(name, "1 or 0 (true/false, yes/no, on/off)", "taken as 0")
        return False


CHECK_VARIABLE = "PREEMPT_CHECK"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckSpec:
    """What ``preempt check`` (:mod:`preempt.cli.check`) asks of a run, through ``PREEMPT_CHECK`` (JSON).

    Inside a check the run writes its checkpoints to ``save_dir`` whatever path the script names, keeps them all,
    writes them synchronously, and mirrors, logs to W&B/TensorBoard and requeues nothing
    (:func:`preempt.run.config.checked_config`).

    Attributes:
        save_dir: The check's scratch directory, in place of the script's own save_dir.
        saves: The steps at which the run writes a checkpoint (in ``run.step()``), for the comparison.
        stops: The steps at which the run stops (each reached once: a rerun resumes past it).
        kill: How it stops there: False, the run's normal stop (as ``request_stop()``, exit code 75); True, the
            process kills itself with SIGKILL once that step's checkpoint is durable.
        last: The step at which the run stops for good: it writes a checkpoint and leaves as on a stop, with
            exit code :data:`preempt.errors.CHECK_ENDED_EXIT_CODE`, the run not marked complete.
    """

    save_dir: str
    saves: frozenset[int]
    stops: frozenset[int]
    kill: bool
    last: int

    @property
    def live_dir(self) -> str:
        """Beside ``save_dir``: where the run records its live state at each checkpoint step, for the check to hold
        each checkpoint to (:mod:`preempt.checkpoint.live_record`)."""
        return f"{self.save_dir}.live"

    def to_env(self) -> str:
        """The value of ``PREEMPT_CHECK`` that :meth:`parse` reads back."""
        return json.dumps(
            {
                "save_dir": self.save_dir,
                "saves": sorted(self.saves),
                "stops": sorted(self.stops),
                "kill": self.kill,
                "last": self.last,
            }
        )

    @classmethod
    def parse(cls, text: str) -> CheckSpec:
        """Raises ValueError naming what is wrong (the spec is written by ``preempt check``, never by hand)."""
        try:
            tree = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{CHECK_VARIABLE}: not JSON ({e})") from None
        if not isinstance(tree, dict) or set(tree) != {"save_dir", "saves", "stops", "kill", "last"}:
            raise ValueError(f"{CHECK_VARIABLE}: expected save_dir, saves, stops, kill and last, found {text!r}")

        def steps(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 1

        save_dir, saves, stops, kill, last = (tree[k] for k in ("save_dir", "saves", "stops", "kill", "last"))
        if not isinstance(save_dir, str) or not save_dir:
            raise ValueError(f"{CHECK_VARIABLE}: save_dir: expected a directory path, found {save_dir!r}")
        for name, value in (("saves", saves), ("stops", stops)):
            if not isinstance(value, list) or not all(steps(v) for v in value):
                raise ValueError(f"{CHECK_VARIABLE}: {name}: expected a list of steps >= 1, found {value!r}")
        if not isinstance(kill, bool) or not steps(last) or any(s >= last for s in stops):
            raise ValueError(f"{CHECK_VARIABLE}: expected kill true/false and stops before last, found {text!r}")
        return cls(save_dir=save_dir, saves=frozenset(saves), stops=frozenset(stops), kill=kill, last=last)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Environment:
    """What the process learns from its environment variables.

    Every variable the library reads is read here, in :meth:`from_env`, and
    checked: a value it cannot use reads as unset (the default holds) and is
    one line in ``problems``, which the run logs as warnings.

    Attributes:
        slurm_job_id: ``SLURM_JOB_ID`` (digits).
        slurm_array_job_id: ``SLURM_ARRAY_JOB_ID`` (digits).
        slurm_array_task_id: ``SLURM_ARRAY_TASK_ID`` (digits).
        slurm_restart_count: ``SLURM_RESTART_COUNT`` (unset on a job's first run).
        slurm_job_end_time: ``SLURM_JOB_END_TIME`` (unix seconds), set by some clusters; a value outside
            :data:`END_TIMES` (negative, past 2200, not a number) is no deadline.
        rank: This process's global rank: ``RANK`` (torchrun), else ``SLURM_PROCID``
            (srun), else None. Only rank 0 (or None) requeues a SLURM job.
        log_level: ``PREEMPT_LOG_LEVEL``, e.g. ``DEBUG``; upper case.
        log_all_ranks: ``PREEMPT_LOG_ALL_RANKS`` (1/0): ranks other than 0 log too.
        check: ``PREEMPT_CHECK``: what ``preempt check`` asks of this run (:class:`CheckSpec`), None outside one.
        local_rank: ``LOCAL_RANK`` (torchrun), else ``SLURM_LOCALID`` (srun), else None: the rank on its node.
        notices: ``PREEMPT_NOTICES``: ``aws``, ``gce``, ``azure`` (:mod:`preempt.cluster.notices`) or ``ray``
            (:mod:`preempt.cluster.ray_notice`).
        grace_s: ``PREEMPT_GRACE_S``: seconds from a stop's signal to the kill (:mod:`preempt.cluster.grace`).
        aws_metadata_endpoint: ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` (as botocore reads it): the instance metadata
            service's URL.
        gce_metadata_host: ``GCE_METADATA_HOST`` (as google-auth reads it): the metadata server's host[:port].
        azure_metadata_endpoint: ``PREEMPT_AZURE_METADATA_ENDPOINT``: Azure's instance metadata service's URL.
        torchelastic: ``TORCHELASTIC_RUN_ID`` is set: a worker of torchrun.
        torchrun_shutdown_timeout: ``PET_SHUTDOWN_TIMEOUT`` (torchrun's ``--shutdown-timeout`` given as a
            variable), else ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``; seconds, and the variable's name.
        slurm_partition: ``SLURM_JOB_PARTITION``: where SLURM's GraceTime of a preemption is read.
        problems: One line per variable whose value was not used, naming it, its value and what was expected.
    """

    slurm_job_id: str | None = None
    slurm_array_job_id: str | None = None
    slurm_array_task_id: str | None = None
    slurm_restart_count: int | None = None
    slurm_job_end_time: int | None = None
    rank: int | None = None
    log_level: str | None = None
    log_all_ranks: bool = False
    check: CheckSpec | None = None
    local_rank: int | None = None
    notices: str | None = None
    grace_s: float | None = None
    aws_metadata_endpoint: str | None = None
    gce_metadata_host: str | None = None
    azure_metadata_endpoint: str | None = None
    torchelastic: bool = False
    torchrun_shutdown_timeout: tuple[float, str] | None = None
    slurm_partition: str | None = None
    problems: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Environment:
        """Reads and checks the variables of ``environ`` (default ``os.environ``); pure: it logs nothing.

        Raises:
            ValueError: ``PREEMPT_CHECK`` is set but malformed: unlike the others it is not ignored, since without
                it the run would write to the script's own save_dir.
        """
        read = _Reader(os.environ if environ is None else environ)
        check = read.text(CHECK_VARIABLE)
        rank = read.integer("RANK")
        procid = read.integer("SLURM_PROCID")
        local_rank = read.integer("LOCAL_RANK")
        localid = read.integer("SLURM_LOCALID")
        shutdown = None
        for name in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):  # torchrun's own precedence
            seconds = read.seconds(name)
            if seconds is not None and shutdown is None:
                shutdown = (seconds, name)
        partition = read.text("SLURM_JOB_PARTITION")
        return cls(
            slurm_job_id=read.job_id("SLURM_JOB_ID"),
            slurm_array_job_id=read.job_id("SLURM_ARRAY_JOB_ID"),
            slurm_array_task_id=read.job_id("SLURM_ARRAY_TASK_ID"),
            slurm_restart_count=read.integer("SLURM_RESTART_COUNT", then="taken as 0"),
            slurm_job_end_time=read.end_time("SLURM_JOB_END_TIME"),
            rank=rank if rank is not None else procid,
            log_level=read.level("PREEMPT_LOG_LEVEL"),
            log_all_ranks=read.flag("PREEMPT_LOG_ALL_RANKS"),
            check=None if check is None else CheckSpec.parse(check),
            local_rank=local_rank if local_rank is not None else localid,
            notices=read.choice("PREEMPT_NOTICES", NOTICE_PLATFORMS),
            grace_s=read.seconds("PREEMPT_GRACE_S"),
            aws_metadata_endpoint=read.url("AWS_EC2_METADATA_SERVICE_ENDPOINT"),
            gce_metadata_host=read.host("GCE_METADATA_HOST"),
            azure_metadata_endpoint=read.url("PREEMPT_AZURE_METADATA_ENDPOINT"),
            torchelastic=read.text("TORCHELASTIC_RUN_ID") is not None,
            torchrun_shutdown_timeout=shutdown,
            slurm_partition=partition if partition is not None and partition.replace("-", "_").isidentifier() else None,
            problems=tuple(read.problems),
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
        "argv": scrub_argv(sys.argv),  # secrets never recorded (preempt._secrets says the rule)
        "git": git_state(code_directory()),
        "slurm": env.slurm(),
    }
