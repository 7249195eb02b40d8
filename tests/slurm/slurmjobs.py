"""A live SLURM cluster of two nodes on this machine (slurm/cluster.sh) and helpers to submit the templates in
slurm/ to it.

The cluster is the one ``.ci/run`` started; when none answers, a session starts it, and the last session to use it
stops it (:func:`slurm_cluster`). Where it cannot be started (no root, no apt-get, no packages) every test here is
skipped with the reason.

(Not a conftest.py: a second conftest.py beside the root one would take over its hooks for these tests.)
"""

from __future__ import annotations

import fcntl
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, TRAIN, History
from helpers.processes import _event_of

from preempt import _testing

SLURM = ROOT / "slurm"
STATE_DIR = Path(os.environ.get("PREEMPT_SLURM_DIR", "/tmp/preempt-slurm"))
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "DEADLINE"}


class Cluster:
    """Client commands against the cluster whose slurm.conf is ``conf``."""

    def __init__(self, conf: Path) -> None:
        # Jobs inherit this environment (sbatch --export=ALL): PYTHONPATH makes them import this checkout of
        # preempt whatever an editable install points at; PREEMPT_TEST_EVENTS makes their processes write the events
        # of their runs into the job's output, where the tests read them (Job.history, Job.wait_event).
        self.env = {**os.environ, "SLURM_CONF": str(conf), "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
        self.env[_testing.EVENTS_ENV] = "1"

    def run(self, *cmd: str, timeout: float = 30.0, check: bool = True) -> str:
        r = subprocess.run(list(cmd), capture_output=True, text=True, env=self.env, timeout=timeout, check=False)
        if check and r.returncode != 0:
            raise AssertionError(f"{shlex.join(cmd)}: exit code {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def answers(self) -> bool:
        try:
            return (
                subprocess.run(
                    ["scontrol", "ping"], capture_output=True, env=self.env, timeout=10, check=False
                ).returncode
                == 0
            )
        except (OSError, subprocess.TimeoutExpired):
            return False

    def submit(self, template: str, command: Sequence[str], out: Path, options: Sequence[str] = ()) -> Job:
        """``sbatch [options] slurm/<template> <command>``, one CPU, output appended to ``out``."""
        job_id = (
            self.run(
                "sbatch",
                "--parsable",
                f"--chdir={ROOT}",
                f"--output={out}",
                "--cpus-per-task=1",
                "--job-name=preempt-test",
                *options,
                str(SLURM / template),
                *command,
            )
            .strip()
            .split(";")[0]
        )
        return Job(self, job_id, out, time.monotonic())


@dataclass
class Job:
    cluster: Cluster
    id: str
    out: Path
    submitted: float

    def info(self) -> dict[str, str]:
        """The job's fields (``JobState``, ``Restarts``, ...), from ``scontrol show job -o``: ``Key=Value`` words."""
        words = self.cluster.run("scontrol", "show", "job", "-o", self.id).split()
        return dict(w.split("=", 1) for w in words if "=" in w and w[0].isalpha())

    @property
    def log(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def history(self) -> History:
        """The events every process of the job told in its output (its runs one after another, the lines of the
        ranks of a run interleaved), as one History: ``job.history().events_of("stop", requeued=True)``."""
        events = [e for e in map(_event_of, self.log.splitlines()) if e is not None]
        return History(events=[events])

    def wait(self, what: str, predicate: Callable[[], object], timeout: float, poll: float = 0.1) -> object:
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"job {self.id}: no {what} within {timeout:.0f} s\n{self.describe()}")
            time.sleep(poll)

    def wait_event(self, kind: str, timeout: float, count: int = 1, **fields: Any) -> dict[str, Any]:
        """Waits until the job's processes have told ``count`` events ``kind`` with ``fields`` as given (see
        :meth:`history`); returns the last of them.

        Raises:
            AssertionError: The job ended first, or not within ``timeout`` seconds.
        """

        def seen() -> dict[str, Any] | None:
            found = self.history().events_of(kind, **fields)
            if len(found) >= count:
                return found[count - 1]
            if self.info().get("JobState") in TERMINAL:
                raise AssertionError(f"job {self.id} ended before event {kind} {fields} (x{count})\n{self.describe()}")
            return None

        return self.wait(f"event {kind} {fields} (x{count})", seen, timeout)  # type: ignore[return-value]

    def wait_running(self, timeout: float = 60.0, restarts: int | None = None) -> float:
        """Waits until the job runs (its ``restarts``-th run, if given); returns the monotonic time."""

        def running() -> bool:
            i = self.info()
            return i.get("JobState") == "RUNNING" and (restarts is None or i.get("Restarts") == str(restarts))

        self.wait("RUNNING state", running, timeout, poll=0.05)
        return time.monotonic()

    def wait_done(self, timeout: float) -> dict[str, str]:
        """Waits for a final state; returns the job's fields."""

        def done() -> dict[str, str] | None:
            i = self.info()
            return i if i.get("JobState") in TERMINAL else None

        return self.wait("final state", done, timeout, poll=0.5)  # type: ignore[return-value]

    def requeue(self) -> float:
        self.cluster.run("scontrol", "requeue", self.id)
        return time.monotonic()

    def cancel(self) -> None:
        self.cluster.run("scancel", self.id, check=False)

    def describe(self) -> str:
        try:
            fields = self.info()
            state = " ".join(f"{k}={fields.get(k)}" for k in ("JobState", "Reason", "Restarts", "EndTime"))
        except AssertionError as e:
            state = str(e)
        # a step whose processes outlived SIGKILL (the node drained "Kill task failed"): what they were doing
        evidence = sorted((STATE_DIR / "log").glob(f"unkillable.{self.id}.*.txt"))
        unkillable = "".join(f"\n--- {e} (a step's processes outlived SIGKILL):\n{e.read_text()}" for e in evidence)
        return f"{state}\n--- {self.out}:\n{self.log}{unkillable}"


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    """The cluster, started by the first session that finds none answering, stopped by the last session to leave
    it (several sessions at once: pytest-xdist's workers, or two runs of the suite). One session starts it while the
    others wait at a lock; each holds a shared lock on a file of users while it runs; the one that can then take
    that lock alone, at its end, is the last, and stops the cluster if a session started it (never one that
    ``.ci/run`` started). Two sessions starting it at once wrote its configuration twice ("Duplicated NodeName"),
    and the first to end stopped it under the other's jobs."""
    cluster = Cluster(STATE_DIR / "slurm.conf")
    users = open(f"{STATE_DIR}.users", "a+")  # noqa: SIM115 (held for the session)
    fcntl.flock(users, fcntl.LOCK_SH)
    try:
        with open(f"{STATE_DIR}.start", "a+") as gate:
            fcntl.flock(gate, fcntl.LOCK_EX)
            if not cluster.answers():
                _start(cluster)
                STARTED_BY_TESTS.touch()
        yield cluster
    finally:
        try:
            fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the last session using it
        except BlockingIOError:
            pass
        else:
            if STARTED_BY_TESTS.exists():
                subprocess.run([str(SLURM / "cluster.sh"), "stop"], capture_output=True, timeout=120, check=False)
                STARTED_BY_TESTS.unlink(missing_ok=True)
        users.close()


STARTED_BY_TESTS = Path(f"{STATE_DIR}.started-by-tests")  # a session started the cluster: the last one stops it


def _start(cluster: Cluster) -> None:
    """slurm/cluster.sh start; the test is skipped with the reason when it cannot be started."""
    try:
        start = [str(SLURM / "cluster.sh"), "start"]
        r = subprocess.run(start, capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"the local SLURM cluster could not be started (slurm/cluster.sh start: {e})")
    if r.returncode != 0 or not cluster.answers():
        said = (r.stderr or r.stdout).strip().splitlines()[-3:]
        pytest.skip(
            f"the local SLURM cluster could not be started (slurm/cluster.sh start: exit {r.returncode}:"
            f" {' / '.join(said)})"
        )


def train_command(save_dir: Path, final_out: Path, args: Sequence[str]) -> list[str]:
    return [sys.executable, str(TRAIN), "--save_dir", str(save_dir), "--final_out", str(final_out), *args]


def without_sleep(args: Sequence[str]) -> list[str]:
    """The same training without --step_sleep (the sleep changes the timing, not the state)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == "--step_sleep":
            skip = True
        elif not a.startswith("--step_sleep="):
            out.append(a)
    return out
