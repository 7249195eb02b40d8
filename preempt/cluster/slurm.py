"""SLURM: when the job ends, whether a stop is its time limit, and requeueing it.

Knows nothing of torch. The decision (:func:`decide_requeue`) is a pure
function of facts; the few calls to ``scontrol`` are separate and take their
``run`` function as a seam for tests.

**Which stops requeue the job.** SLURM does not requeue a job that reaches its
time limit, so the job must requeue itself; but the same SIGTERM also comes
from ``scancel`` (the job must not come back), from ``scontrol requeue`` and
from preemption (SLURM requeues it already). What tells them apart, measured
on Slurm 22.05:

* the time-limit warning (``--signal=[B:]SIG@N``) arrives while the job is
  still ``RUNNING``, between N and N + 30 s before its end time (the limits
  are checked every 30 s);
* ``scancel``, ``scontrol requeue`` and preemption first move the job to
  ``COMPLETING`` and then signal it; ``scancel`` also sets its EndTime to the
  moment of the cancel. A ``scontrol requeue`` issued by a cancelled job
  *succeeds* and brings it back, so the state must be read before requeueing;
* at the time limit itself SLURM sends SIGTERM with the job ``COMPLETING``
  and ``Reason=TimeLimit``; a requeue within KillWait still works.

So, at a stop, the run reads the job once (``scontrol show job``) and
requeues it when

1. its own walltime keeper stopped it (it knows that is the time limit), or
2. a signal came while the job was ``RUNNING`` and at most
   :data:`WARNING_WINDOW_S` before its end time, or
3. a signal came with the job ending for ``Reason=TimeLimit``,

and never when the restart count has reached ``max_restarts`` or the run made
no step since it (re)started (a requeue would only loop).

Limits: a signal sent by hand while the job runs (``kill``, ``scancel
--signal=TERM`` without cancelling) in the last :data:`WARNING_WINDOW_S`
looks exactly like the warning and requeues. Without ``scontrol`` (some
containers) the state cannot be read: a stop that the end time (from
``SLURM_JOB_END_TIME``) places in the window is taken for the time limit, and
since the job cannot be requeued the run exits with
:data:`~preempt.errors.REQUEUE_FAILED_EXIT_CODE` for a wrapper to act on; a
``scancel`` in the window then reads the same. The end time is read when the
run starts; a time limit changed later (``scontrol update``) is seen only at a
stop.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

from ..errors import SlurmError

WARNING_WINDOW_S = 900.0
"""A signal this close to the end time, with the job still running, is the time-limit warning.

Covers ``--signal`` lead times up to about 14 minutes (the warning can come up to 30 s before its lead
time); the common ones are 90 to 300 s.
"""

SCONTROL_TIMEOUT_S = 10.0

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def run_shielded(cmd: Sequence[str], **kwargs) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` of a command that ignores SIGTERM and SIGINT (the dispositions survive ``exec``).

    A ``scontrol requeue`` issued from inside the job makes SLURM end the job's processes at once, scontrol among
    them: measured under load, scontrol was killed (exit code -15) before it could report the requeue that had
    taken effect, and the run said it could not requeue. Shielded, scontrol gets its answer; its timeout and
    SIGKILL (after KillWait) still end it.

    The two signals are also blocked in the calling thread for the call, and the child inherits that mask: exec
    resets a handled signal to its default action, so a SIGTERM that came after sh's exec and before its ``trap``
    would end sh (exit code -15). That happened once, when SLURM's time-limit warning came as a requeued run was
    reading its job with ``scontrol show job`` at its start. Meanwhile the process's other threads take the signal,
    or it waits for the call's end (its timeout at most).
    """
    exe = shutil.which(cmd[0])
    if exe is None:
        raise FileNotFoundError(errno.ENOENT, "not found on PATH", cmd[0])
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        return subprocess.run(["sh", "-c", 'trap "" TERM INT; exec "$0" "$@"', exe, *cmd[1:]], **kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobInfo:
    """What ``scontrol show job`` says about one job (None: the field was missing or unknown)."""

    state: str | None = None
    reason: str | None = None
    end_time: float | None = None  # unix seconds
    time_limit_s: float | None = None
    requeue: bool | None = None  # Requeue=1: the job may be requeued
    restarts: int | None = None
    batch: bool | None = None  # BatchFlag=1: a batch job (interactive ones cannot be requeued)


def parse_duration(text: str) -> float | None:
    """SLURM's ``[D-]HH:MM:SS``, ``MM:SS``, ``MM`` or ``D-HH[:MM]`` in seconds; None for UNLIMITED or junk."""
    text = text.strip()
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not m:
        return None
    days, a, b, c = m.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:
        h, mi, s = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        h, mi, s = parts
    elif len(parts) == 2:
        h, (mi, s) = 0, parts
    else:
        h, mi, s = 0, parts[0], 0
    return float(((int(days or 0) * 24 + h) * 60 + mi) * 60 + s)


def _timestamp(text: str) -> float | None:
    """``2026-11-22T14:24:32`` (scontrol prints local time) as unix seconds; None for Unknown/None."""
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def parse_job(text: str) -> JobInfo:
    """Parses ``scontrol show job [-o]`` output (fields we do not read may hold spaces; ours do not)."""
    fields: dict[str, str] = {}
    for key, value in re.findall(r"(?:^|\s)([A-Za-z][\w/:]*)=(\S*)", text):
        fields.setdefault(key, value)

    def flag(key: str) -> bool | None:
        v = fields.get(key)
        return None if v is None or not v.isdigit() else v != "0"

    restarts = fields.get("Restarts", "")
    return JobInfo(
        state=fields.get("JobState") or None,
        reason=fields.get("Reason") or None,
        end_time=_timestamp(fields.get("EndTime", "")),
        time_limit_s=parse_duration(fields.get("TimeLimit", "")),
        requeue=flag("Requeue"),
        restarts=int(restarts) if restarts.isdigit() else None,
        batch=flag("BatchFlag"),
    )


def _scontrol(args: Sequence[str], timeout: float, run: Runner) -> str:
    cmd = ["scontrol", *args]
    try:
        r = run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise SlurmError(f"{' '.join(cmd)}: scontrol not found on PATH", missing=True) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(cmd)}: no answer within {timeout:.0f} s") from None
    except OSError as e:
        raise SlurmError(f"{' '.join(cmd)}: {e}") from None
    if r.returncode != 0:
        said = (r.stderr or r.stdout or "").strip().replace("\n", "; ")
        raise SlurmError(f"{' '.join(cmd)}: exit code {r.returncode}: {said or 'no message'}")
    return r.stdout


def show_job(job_id: str, *, timeout: float = SCONTROL_TIMEOUT_S, run: Runner = run_shielded) -> JobInfo:
    """The job's state, end time and flags.

    Raises:
        SlurmError: scontrol is missing (``missing`` set), timed out or failed.
    """
    return parse_job(_scontrol(["show", "job", "-o", job_id], timeout, run))


def kill_wait(*, timeout: float = SCONTROL_TIMEOUT_S, run: Runner = run_shielded) -> float | None:
    """KillWait (seconds between SIGTERM and SIGKILL) from ``scontrol show config``; None if unreadable."""
    try:
        out = _scontrol(["show", "config"], timeout, run)
    except SlurmError:
        return None
    m = re.search(r"^KillWait\s*=\s*(\d+)", out, flags=re.M)
    return float(m.group(1)) if m else None


def grace_time(partition: str, *, timeout: float = SCONTROL_TIMEOUT_S, run: Runner = run_shielded) -> float | None:
    """The partition's GraceTime (``scontrol show partition``): a job preempted there gets SIGTERM, then this many
    seconds, then the KillWait sequence; None if unreadable."""
    try:
        out = _scontrol(["show", "partition", "-o", partition], timeout, run)
    except SlurmError:
        return None
    m = re.search(r"(?:^|\s)GraceTime=(\d+)(?:\s|$)", out)
    return float(m.group(1)) if m else None


def requeue(target: str, *, timeout: float = SCONTROL_TIMEOUT_S, run: Runner = run_shielded) -> None:
    """``scontrol requeue TARGET``. SLURM then ends this job's processes (SIGTERM) and starts it again.

    Raises:
        SlurmError: scontrol is missing, or refused (e.g. ``--no-requeue``, an interactive job).
    """
    _scontrol(["requeue", target], timeout, run)


class Action(str, enum.Enum):
    NONE = "none"  # not the time limit (or cannot tell): save and exit, nothing else
    REQUEUE = "requeue"  # the time limit: requeue the job after the checkpoint is durable
    REFUSE = "refuse"  # the time limit, but a requeue would loop (max_restarts, no progress)


class Cause(str, enum.Enum):
    WALLTIME = "walltime"  # the run's walltime keeper
    SIGNAL = "signal"  # a stop signal
    REQUEST = "request"  # run.request_stop()


@dataclasses.dataclass(frozen=True)
class RequeueDecision:
    action: Action
    why: str


def decide_requeue(
    *,
    cause: Cause,
    signal_time: float | None,
    end_time: float | None,
    job: JobInfo | None,
    restart_count: int,
    max_restarts: int | None,
    progressed: bool,
) -> RequeueDecision:
    """Whether a stop under SLURM should requeue the job (see the module docstring for the rule).

    Args:
        cause: What stopped the run.
        signal_time: Unix time the signal arrived.
        end_time: The job's end time (unix seconds) known when the run started, if any.
        job: The job as read at the stop, or None when scontrol could not be asked.
        restart_count: ``SLURM_RESTART_COUNT`` (0 on the first run).
        max_restarts: The limit, or None.
        progressed: The run made at least one step since it (re)started.
    """
    if cause is Cause.WALLTIME:
        why = "the walltime keeper stopped the run before the job's time limit"
    elif cause is Cause.REQUEST or signal_time is None:
        return RequeueDecision(Action.NONE, "a stop asked for by the program, not the time limit")
    elif job is not None and job.state is not None:
        if job.state != "RUNNING":
            if job.reason == "TimeLimit" or job.state == "TIMEOUT":
                why = "the job reached its time limit"
            else:
                return RequeueDecision(
                    Action.NONE,
                    f"the job is ending (JobState={job.state}, Reason={job.reason}): cancelled, or requeued or"
                    " preempted by the scheduler, which requeues it itself when it should",
                )
        else:
            end = job.end_time if job.end_time is not None else end_time
            if end is None:
                return RequeueDecision(Action.NONE, "the job's end time is unknown: cannot tell a time-limit warning")
            left = end - signal_time
            if left > WARNING_WINDOW_S:
                return RequeueDecision(
                    Action.NONE,
                    f"the signal came {left:.0f} s before the job's end time, more than {WARNING_WINDOW_S:.0f} s:"
                    " not the time-limit warning",
                )
            why = f"the time-limit warning ({left:.0f} s before the job's end time)"
    else:
        if end_time is None:
            return RequeueDecision(
                Action.NONE, "neither scontrol nor SLURM_JOB_END_TIME tells whether this is the time limit"
            )
        left = end_time - signal_time
        if left > WARNING_WINDOW_S:
            return RequeueDecision(Action.NONE, f"the signal came {left:.0f} s before the job's end time")
        why = f"a signal {left:.0f} s before the job's end time (taken for the time-limit warning; scontrol cannot say)"
    if max_restarts is not None and restart_count >= max_restarts:
        return RequeueDecision(
            Action.REFUSE, f"{why}; but this is restart {restart_count} and max_restarts={max_restarts}"
        )
    if not progressed:
        return RequeueDecision(
            Action.REFUSE, f"{why}; but the run made no step since it started: requeueing again would loop"
        )
    return RequeueDecision(Action.REQUEUE, why)


def early_warning(
    *, signal_time: float | None, end_time: float | None, now: float, progressed: bool, margin: float | None
) -> bool:
    """Whether a stop signal is taken for SLURM's time-limit warning come before the run's first step, with time
    left to make one: the run then goes on to that step and stops there.

    SLURM checks its limits every 30 s, so a ``--signal`` warning may come up to 60 s before the time asked for,
    while a requeued job is still starting. Stopped there, the run would have made no step, and a job that requeues
    itself without progress could loop, so it would exit with code 77 instead, although most of its last minute was
    left. Nothing is lost by going on: the run has nothing new to save before its first step, and the walltime
    keeper (``margin``: its margin in seconds, None when it is not armed) still stops it before the end time.

    Args:
        signal_time: Unix time the signal arrived (None: no signal).
        end_time: The job's end time, unix seconds (None: unknown).
        now: Unix time now.
        progressed: The run made a step since it (re)started.
        margin: The walltime keeper's margin, or None.
    """
    if progressed or signal_time is None or end_time is None or margin is None:
        return False
    return 0.0 < end_time - signal_time <= WARNING_WINDOW_S and end_time - now > margin


def requeue_target(job_id: str, array_job_id: str | None, array_task_id: str | None) -> str:
    """``A_T`` for an array task, else the job id."""
    if array_job_id and array_task_id:
        return f"{array_job_id}_{array_task_id}"
    return job_id
