"""The grace: the seconds from a stop's signal to the kill, where they come from, and whether a stop fits in them.

A stop is worth something only if its checkpoint is durable before the kill. Where the run can learn the grace
(:func:`choose`, first that applies):

1. ``grace=SECONDS`` (the option), else ``PREEMPT_GRACE_S``: what the user knows (a Kubernetes pod's
   ``terminationGracePeriodSeconds``, which the pod cannot read);
2. what the run can read, the shorter when both apply: under torchrun its shutdown timeout (``--shutdown-timeout``
   read from the agent's command line, else ``PET_SHUTDOWN_TIMEOUT``, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else
   torchrun's default of 30 s: the agent forwards the signal and kills its workers that much later); under SLURM
   the cluster's ``KillWait`` (``scontrol show config``), the time from SIGTERM to SIGKILL of a ``scancel``, a
   time limit's end and a preemption (a partition's ``GraceTime`` only delays that SIGTERM).

A notice (:mod:`preempt.cluster.notices`) brings its own deadline, which is that stop's grace.

:class:`StopCost` is what a stop costs now, from the run's own saves; :func:`advice` is the warning when it does not
fit. Pure; no torch. :func:`parent_argv` is the one read of the system (with psutil), for torchrun's agent.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from .. import _log

TORCHRUN_DEFAULT_S = 30.0  # torch.distributed.launcher.api.LaunchConfig: TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30


@dataclasses.dataclass(frozen=True)
class Grace:
    """The grace of a stop: ``seconds``, where they come from (``source``, in words) and how to raise them."""

    seconds: float
    source: str
    raise_it: str


def torchrun_timeout(argv: Sequence[str]) -> float | None:
    """``--shutdown-timeout N`` (or ``--shutdown_timeout``, ``=N``) of torchrun's command line (``torchrun ...`` or
    ``python -m torch.distributed.run ...``); None if not there, or not torchrun's."""
    names = ("--shutdown-timeout", "--shutdown_timeout")
    launcher = [i for i, a in enumerate(argv) if a in ("torch.distributed.run", "torch.distributed.launch")]
    launcher += [
        i for i, a in enumerate(argv) if a.endswith(("/torchrun", "torch/distributed/run.py")) or a == "torchrun"
    ]
    if not launcher:
        return None
    for i in range(min(launcher) + 1, len(argv)):
        arg, before = argv[i], argv[i - 1]
        value = None
        if arg in names and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(tuple(f"{n}=" for n in names)):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                seconds = float(value)
            except ValueError:
                return None
            return seconds if 0 <= seconds < 1e9 else None
        if arg.endswith(".py") or (not arg.startswith("-") and (not before.startswith("-") or "=" in before)):
            return None  # the training script and its own arguments: torchrun's options are over
    return None


def parent_argv(pid: int | None = None) -> list[str] | None:
    """The command line of this process's parent (torchrun's agent, for a worker), or of ``pid``, its empty
    arguments left out; None where it cannot be read (gone, not ours to read, no such facts on this system)."""
    import psutil  # here, not at the top: only a run under torchrun asks

    try:
        argv = psutil.Process(os.getppid() if pid is None else pid).cmdline()
    except (psutil.Error, OSError, ValueError):
        return None
    return [a for a in argv if a]


def from_torchrun(argv: Sequence[str] | None, variable: tuple[float, str] | None) -> Grace:
    """torchrun's shutdown timeout as a worker can learn it: the agent's ``--shutdown-timeout``, the variables
    (``variable``: seconds and name, :class:`~preempt.cluster.environment.Environment`), else the default."""
    how = "torchrun --shutdown-timeout N (or TORCH_ELASTIC_SHUTDOWN_TIMEOUT=N)"
    given = None if argv is None else torchrun_timeout(argv)
    if given is not None:
        return Grace(given, f"torchrun's --shutdown-timeout {given:g}", how)
    if variable is not None:
        return Grace(variable[0], f"torchrun's shutdown timeout ({variable[1]}={variable[0]:g})", how)
    return Grace(TORCHRUN_DEFAULT_S, f"torchrun's shutdown timeout (its default, {TORCHRUN_DEFAULT_S:g} s)", how)


def choose(
    *,
    option: float | None,
    variable: float | None,
    torchrun: Grace | None = None,
    kill_wait: float | None = None,
    grace_time: float | None = None,
) -> Grace | None:
    """The grace of a stop (see the module docstring for the order); None: nothing says. ``grace_time``: SLURM's
    GraceTime of the job's partition, said beside KillWait (a preemption there is signalled that much earlier)."""
    if option is not None:
        return Grace(option, f"grace={option:g}", "the platform's own, e.g. terminationGracePeriodSeconds, then grace=")
    if variable is not None:
        return Grace(
            variable,
            f"PREEMPT_GRACE_S={variable:g}",
            "the platform's own, e.g. terminationGracePeriodSeconds, then PREEMPT_GRACE_S",
        )
    read = []
    if torchrun is not None:
        read.append(torchrun)
    if kill_wait is not None:
        read.append(
            Grace(
                kill_wait,
                f"SLURM kills {_log.duration(kill_wait)} after SIGTERM (KillWait)"
                + (f"; a preemption gets GraceTime {_log.duration(grace_time)} more" if grace_time else ""),
                "KillWait in slurm.conf, GraceTime of the partition for preemptions (or an earlier --signal=TERM@N"
                " for the time limit)",
            )
        )
    return min(read, key=lambda g: g.seconds) if read else None


@dataclasses.dataclass(frozen=True)
class StopCost:
    """What a stop costs now, from the run's latest save: from the signal to its checkpoint durable.

    Attributes:
        save_s: The latest checkpoint's time from the start of its save to durable.
        nbytes: Its bytes.
        step_s: A step: the signal may come at its start, and the stop waits for its end.
        upload_s: The mirror's upload of a checkpoint (None: no mirror, or none timed yet).
    """

    save_s: float
    nbytes: int
    step_s: float = 0.0
    upload_s: float | None = None

    @property
    def seconds(self) -> float:
        return self.step_s + self.save_s + (self.upload_s or 0.0)

    def fits(self, grace_s: float) -> bool:
        return self.seconds <= grace_s

    def parts(self) -> str:
        """``"a step of 0.10 s, a checkpoint of 1.2 GiB in 8.0 s (150 MiB/s), its upload 20 s"``."""
        rate = f" ({_log.size(int(self.nbytes / self.save_s))}/s)" if self.save_s > 0 and self.nbytes else ""
        out = f"a step of {_log.duration(self.step_s)}, a checkpoint of {_log.size(self.nbytes)} in"
        out += f" {_log.duration(self.save_s)}{rate}"
        if self.upload_s is not None:
            out += f", its upload to the mirror {_log.duration(self.upload_s)}"
        return out


def advice(cost: StopCost, grace: Grace) -> str:
    """The warning of a stop that does not fit its grace: both figures, and what to do."""
    return (
        f"a stop now takes {_log.duration(cost.seconds)} to a durable checkpoint ({cost.parts()}), but the kill"
        f" comes {_log.duration(grace.seconds)} after the stop's signal ({grace.source}): a stop would lose the steps"
        " since the last durable checkpoint. Raise the grace (" + grace.raise_it + "), have the signal sent earlier"
        " (SLURM: --signal=TERM@N with N past the stop's time), make the checkpoint smaller (carry_unchanged=True"
        " writes only what changed), or save to a faster disk"
    )
