"""preempt.cluster.slurm without a cluster: parsing scontrol, the requeue rule, scontrol failures."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from preempt.cluster.slurm import (
    WARNING_WINDOW_S,
    Action,
    Cause,
    JobInfo,
    decide_requeue,
    kill_wait,
    parse_duration,
    parse_job,
    requeue,
    requeue_target,
    run_shielded,
    show_job,
)
from preempt.errors import SlurmError

# `scontrol show job 7` on Slurm 22.05 while the job handled its time-limit warning
SHOW_JOB = """JobId=7 JobName=sigtest2.sh
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   Priority=4294901753 Nice=0 Account=(null) QOS=(null)
   JobState=RUNNING Reason=None Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0
   RunTime=00:00:14 TimeLimit=00:01:00 TimeMin=N/A
   SubmitTime=2026-11-22T14:23:32 EligibleTime=2026-11-22T14:23:32
   StartTime=2026-11-22T14:23:32 EndTime=2026-11-22T14:24:32 Deadline=N/A
   Command=/tmp/a dir/sigtest2.sh
   WorkDir=/tmp
"""


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("00:01:00", 60),
        ("1-02:03:04", 93784),
        ("2-00", 172800),
        ("1-01:30", 91800),
        ("30:15", 1815),
        ("45", 2700),
        ("365-00:00:00", 365 * 86400),
        ("UNLIMITED", None),
        ("", None),
        ("1:2:3:4", None),
    ],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


def test_parse_job_reads_the_fields_the_rule_needs():
    info = parse_job(SHOW_JOB)
    assert info == JobInfo(
        state="RUNNING",
        reason="None",
        end_time=time.mktime(time.strptime("2026-11-22T14:24:32", "%Y-%m-%dT%H:%M:%S")),
        time_limit_s=60.0,
        requeue=True,
        restarts=0,
        batch=True,
    )
    one_line = parse_job(" ".join(SHOW_JOB.split()))  # scontrol show job -o
    assert one_line == info


def test_parse_job_unknown_fields():
    info = parse_job("JobId=3 JobState=PENDING Reason=Priority EndTime=Unknown TimeLimit=UNLIMITED Requeue=0")
    assert (info.state, info.end_time, info.time_limit_s, info.requeue, info.restarts) == (
        "PENDING",
        None,
        None,
        False,
        None,
    )


def facts(**kw):
    now = 1_000_000.0
    base = dict(
        cause=Cause.SIGNAL,
        signal_time=now,
        end_time=now + 40,
        job=JobInfo(state="RUNNING", reason="None", end_time=now + 40),
        restart_count=0,
        max_restarts=None,
        progressed=True,
    )
    base.update(kw)
    return base


NOW = 1_000_000.0


@pytest.mark.parametrize(
    "kw, action, why",
    [
        ({}, Action.REQUEUE, "time-limit warning (40 s before"),
        ({"cause": Cause.WALLTIME, "job": None}, Action.REQUEUE, "walltime keeper"),
        ({"cause": Cause.REQUEST}, Action.NONE, "asked for by the program"),
        # a signal long before the end: kill, or scancel --signal without cancelling
        ({"job": JobInfo(state="RUNNING", end_time=NOW + 3600)}, Action.NONE, "more than 900 s"),
        ({"job": JobInfo(state="RUNNING", end_time=NOW + WARNING_WINDOW_S)}, Action.REQUEUE, "warning"),
        # scancel: COMPLETING, and SLURM moves EndTime to the moment of the cancel (here: now)
        ({"job": JobInfo(state="COMPLETING", reason="None", end_time=NOW)}, Action.NONE, "the job is ending"),
        # scontrol requeue / preemption: COMPLETING too
        ({"job": JobInfo(state="COMPLETING", reason="None", end_time=NOW + 300)}, Action.NONE, "cancelled, or"),
        ({"job": JobInfo(state="CANCELLED")}, Action.NONE, "JobState=CANCELLED"),
        # the time limit itself (no warning, or it was lost): SIGTERM with Reason=TimeLimit; a requeue still works
        ({"job": JobInfo(state="COMPLETING", reason="TimeLimit")}, Action.REQUEUE, "reached its time limit"),
        ({"job": JobInfo(state="TIMEOUT")}, Action.REQUEUE, "reached its time limit"),
        # the run's own end time when scontrol prints none
        ({"job": JobInfo(state="RUNNING", end_time=None)}, Action.REQUEUE, "warning"),
        ({"job": JobInfo(state="RUNNING"), "end_time": None}, Action.NONE, "end time is unknown"),
        # scontrol unavailable: the end time alone decides (and the requeue itself will fail: exit 76)
        ({"job": None}, Action.REQUEUE, "scontrol cannot say"),
        ({"job": None, "end_time": NOW + 3600}, Action.NONE, "3600 s before"),
        ({"job": None, "end_time": None}, Action.NONE, "neither scontrol nor SLURM_JOB_END_TIME"),
        # guards
        ({"restart_count": 3, "max_restarts": 3}, Action.REFUSE, "restart 3 and max_restarts=3"),
        ({"restart_count": 2, "max_restarts": 3}, Action.REQUEUE, "warning"),
        ({"progressed": False}, Action.REFUSE, "no step since it started"),
        ({"cause": Cause.WALLTIME, "progressed": False}, Action.REFUSE, "would loop"),
        ({"job": JobInfo(state="COMPLETING"), "progressed": False}, Action.NONE, "ending"),
    ],
)
def test_decide_requeue(kw, action, why):
    d = decide_requeue(**facts(**kw))
    assert d.action is action, d
    assert why in d.why, d.why


class FakeRun:
    """Stands in for subprocess.run."""

    def __init__(self, returncode=0, stdout="", stderr="", raises=None):
        self.calls = []
        self.result = subprocess.CompletedProcess([], returncode, stdout, stderr)
        self.raises = raises

    def __call__(self, cmd, **kw):
        self.calls.append(cmd)
        if self.raises is not None:
            raise self.raises
        return self.result


def test_show_job_and_requeue_call_scontrol():
    run = FakeRun(stdout=SHOW_JOB)
    assert show_job("7", run=run).state == "RUNNING"
    requeue("5_3", run=FakeRun())
    assert run.calls == [["scontrol", "show", "job", "-o", "7"]]


def test_scontrol_missing_is_said_and_flagged():
    with pytest.raises(SlurmError, match="scontrol not found on PATH") as e:
        requeue("7", run=FakeRun(raises=FileNotFoundError(2, "No such file")))
    assert e.value.missing


def test_scontrol_refusal_and_timeout_are_errors_with_the_message():
    with pytest.raises(SlurmError, match="exit code 1: Requeue of JobId=7 not allowed") as e:
        requeue("7", run=FakeRun(returncode=1, stderr="Requeue of JobId=7 not allowed\n"))
    assert not e.value.missing
    with pytest.raises(SlurmError, match="no answer within 5 s"):
        show_job("7", timeout=5, run=FakeRun(raises=subprocess.TimeoutExpired("scontrol", 5)))


def test_kill_wait_from_show_config():
    assert kill_wait(run=FakeRun(stdout="JobRequeue              = 1\nKillWait                = 5 sec\n")) == 5.0
    assert kill_wait(run=FakeRun(returncode=1)) is None
    assert kill_wait(run=FakeRun(raises=FileNotFoundError())) is None


def test_requeue_target_names_the_array_task():
    assert requeue_target("1240", "1234", "6") == "1234_6"
    assert requeue_target("1240", None, None) == "1240"


SIGTERMED_ANSWER = (
    "import os, signal, time\n"
    "os.kill(os.getpid(), signal.SIGTERM)  # what SLURM does to the job's processes after a requeue\n"
    "time.sleep(0.2)\n"
    "print('requeued')\n"
)


def test_scontrol_survives_the_sigterm_of_its_own_requeue():
    """The shield is what keeps the answer: the same child unshielded dies of the SIGTERM (exit code -15)."""
    cmd = [sys.executable, "-c", SIGTERMED_ANSWER]
    bare = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    assert bare.returncode == -signal.SIGTERM, bare
    shielded = run_shielded(cmd, capture_output=True, text=True, timeout=30, check=False)
    assert (shielded.returncode, shielded.stdout) == (0, "requeued\n"), shielded


def test_a_shielded_command_starts_with_sigterm_and_sigint_blocked_and_ends_with_them_ignored():
    """The mask is inherited through fork and exec, so no SIGTERM between sh's exec and its ``trap`` can end sh; the
    caller's own mask is as it was."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    r = run_shielded(["grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status"], capture_output=True, text=True, check=True)
    masks = {name: int(bits, 16) for name, bits in (line.split(":\t") for line in r.stdout.splitlines())}
    for name in ("SigBlk", "SigIgn"):
        for sig in (signal.SIGTERM, signal.SIGINT):
            assert masks[name] >> (sig - 1) & 1, f"{name} lacks {sig.name}: {r.stdout}"
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before


def test_shielded_run_of_a_missing_command_is_file_not_found(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(FileNotFoundError):
        run_shielded(["scontrol", "show", "config"], capture_output=True, text=True, timeout=5, check=False)
    assert kill_wait() is None
    with pytest.raises(SlurmError, match="scontrol requeue 7: scontrol not found on PATH") as e:
        requeue("7")
    assert e.value.missing


@pytest.mark.parametrize(
    "kw, held",
    [
        ({}, True),  # the warning 40 s before the end, no step yet, a margin of 5 s: held
        ({"progressed": True}, False),  # after a step: taken at once (and requeued)
        ({"margin": None}, False),  # no walltime keeper to stop in time: taken at once
        ({"margin": 45.0}, False),  # not even one step fits before the keeper's stop: taken at once (exit 77)
        ({"end_time": None}, False),  # no end time: cannot tell a warning
        ({"signal_time": None}, False),  # no signal (a request)
        ({"signal_time": 0.0}, False),  # 1000 s before the end: not the time-limit warning
    ],
)
def test_early_warning(kw, held):
    from preempt.cluster.slurm import early_warning

    facts = {"signal_time": 960.0, "end_time": 1000.0, "now": 961.0, "progressed": False, "margin": 5.0} | kw
    assert early_warning(**facts) is held
