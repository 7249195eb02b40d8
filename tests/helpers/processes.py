"""Training processes a test starts, signals and reruns: the child and its output, the interrupted run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import forkserver

from preempt import _testing

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
TRAIN = TESTS / "scripts" / "train.py"
TRAIN_DDP = TESTS / "scripts" / "train_ddp.py"
TRAIN_ACCELERATE = TESTS / "scripts" / "train_accelerate.py"
RANK_LAUNCHER = TESTS / "rank_launcher.py"
DDP_ARGS = ["--epochs", "2", "--samples", "192", "--every_steps", "4"]  # 12 steps per epoch on 2 ranks, 24 in all
PREEMPTED = 75


def _event_of(line: str) -> dict[str, Any] | None:
    """The event a line carries (``preempt._testing.emit``), wherever the line's prefix puts it; None for others."""
    at = line.find(_testing.EVENT_PREFIX)
    if at < 0:
        return None
    try:
        event = json.loads(line[at + len(_testing.EVENT_PREFIX) :])
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def _matches(event: dict[str, Any], kind: str, fields: dict[str, Any]) -> bool:
    """The event is ``kind`` and has each field as given (a callable given: the field's value satisfies it)."""
    if event.get("event") != kind:
        return False
    return all(v(event.get(k)) if callable(v) else event.get(k) == v for k, v in fields.items())


def select(events: Sequence[dict[str, Any]], kind: str, **fields: Any) -> list[dict[str, Any]]:
    """The events ``kind`` with ``fields`` as given (a callable given: the field's value satisfies it), in order."""
    return [e for e in events if _matches(e, kind, fields)]


def history_events(save_dir: Path, kind: str, **fields: Any) -> list[dict[str, Any]]:
    """The markers ``kind`` with ``fields`` as given in ``save_dir/history.jsonl`` (every process of the run, in
    order): what a process started without the test's event stream (``subprocess.run``, a CLI) recorded."""
    path = save_dir / "history.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return select([d for d in lines if isinstance(d, dict)], kind, **fields)


@dataclass(frozen=True)
class On:
    """An event a test waits for: its kind, and the fields it must have (``on("holding", point="step", n=3)``)."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)


def on(kind: str, **fields: Any) -> On:
    return On(kind, fields)


class Spawned:
    """A child process whose merged stdout/stderr is collected line by line by a thread.

    The child runs with ``PREEMPT_TEST_EVENTS=1``: the events of its run (``preempt._testing.emit``: the history's
    markers, the training scripts' hold points) arrive as structured records in :attr:`events`, apart from its
    other lines (:attr:`output`). Tests wait and assert on events (:meth:`wait_event`, :meth:`events_of`), never on
    the wording of a log line.
    """

    def __init__(self, cmd: Sequence[str], env: dict[str, str] | None = None, *, session: bool = False) -> None:
        """``session``: the child leads a session and process group of its own, which a test may signal whole
        (``os.killpg(p.proc.pid, sig)``, as ``timeout`` and SLURM do) without signalling pytest."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", _testing.EVENTS_ENV: "1", **(env or {})}
        self.proc: subprocess.Popen | forkserver.Forked
        if forkserver.forkable(cmd, full_env):  # python script.py / python -m module: forked from a server with torch
            self.proc = forkserver.start(cmd, full_env, ROOT, session=session)
        else:
            self.proc = subprocess.Popen(
                list(cmd),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=full_env,
                cwd=ROOT,
                start_new_session=session,
            )
        self.lines: list[str] = []
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            event = _event_of(line)
            with self._cond:
                if event is None:
                    self.lines.append(line.rstrip("\n"))
                else:
                    self.events.append(event)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = 60.0, count: int = 1) -> bool:
        """Blocks until ``count`` lines matching ``pattern`` (regex) appeared; False if the process ended first."""
        rx = re.compile(pattern)
        seen = found = 0
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    found += bool(rx.search(line))
                    if found >= count:
                        return True
                seen = len(self.lines)
                if self.proc.poll() is not None and not self._reader.is_alive():
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no line matching {pattern!r} within {timeout} s:\n{self.output}")
                self._cond.wait(min(left, 0.05))

    def wait_event(self, kind: str, timeout: float = 60.0, count: int = 1, **fields: Any) -> dict[str, Any] | None:
        """Blocks until the ``count``-th event ``kind`` whose ``fields`` are as given has come, and returns it; None
        if the process ended first.

        Raises:
            TimeoutError: Not within ``timeout`` seconds (the process still runs), with its output and events.
        """
        seen = found = 0
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for event in self.events[seen:]:
                    if _matches(event, kind, fields):
                        found += 1
                        if found >= count:
                            return event
                seen = len(self.events)
                if self.proc.poll() is not None and not self._reader.is_alive():
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"no event {kind} {fields} within {timeout} s:\n{self.output}\nevents: {self.events}"
                    )
                self._cond.wait(min(left, 0.05))

    def events_of(self, kind: str, **fields: Any) -> list[dict[str, Any]]:
        """The events ``kind`` with ``fields`` as given, so far, in order."""
        with self._cond:
            return [e for e in self.events if _matches(e, kind, fields)]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def finish(self, timeout: float = 120.0) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"process did not finish within {timeout} s:\n{self.output}") from None
        self._reader.join(10)
        return rc

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)


def run_python(
    cmd: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout: float | None = None,
    errors: str = "strict",
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, ...)``; forked from a server that has torch when ``cmd``
    is ``python script.py ...``, ``python -m module ...`` or ``python -c code ...`` (tests/forkserver.py)."""
    env = dict(os.environ if env is None else env)
    cwd = os.getcwd() if cwd is None else cwd
    if forkserver.forkable(cmd, env):
        return forkserver.run(cmd, env, cwd, timeout=timeout, errors=errors)
    return subprocess.run(list(cmd), capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, errors=errors)


def train_cmd(save_dir: Path, final_out: Path | None, args: Sequence[str], script: Path = TRAIN) -> list[str]:
    cmd = [sys.executable, str(script), "--save_dir", str(save_dir), *args]
    if final_out is not None:
        cmd += ["--final_out", str(final_out)]
    return cmd


@dataclass(frozen=True)
class Script:
    """A training script of tests/scripts run as a user runs it: ``python SCRIPT --save_dir DIR [ARGS]
    [--final_out FILE]``, held inside its N-th optimizer step until its run has been asked to stop with
    ``--hold_at_step N`` (the event ``holding``, point "step", n N)."""

    path: Path
    timeout: float = 120.0

    def command(self, save_dir: Path, final: Path | None, args: Sequence[str] = ()) -> list[str]:
        return train_cmd(save_dir, final, args, self.path)

    def stop_at(self, save_dir: Path, args: Sequence[str], step: int, sig: int, *, group: bool = False) -> Spawned:
        """Runs until its optimizer step ``step``, and signals it there (the whole process group: ``group``, as
        ``timeout`` and SLURM signal a job, DataLoader workers included)."""
        p = Spawned(self.command(save_dir, None, [*args, "--hold_at_step", str(step)]), session=group)
        assert p.wait_event("holding", point="step", n=step, timeout=self.timeout), p.output
        if group:
            os.killpg(p.proc.pid, sig)
        else:
            p.signal(sig)
        return p

    def resume(self, save_dir: Path, final: Path | None, args: Sequence[str] = ()) -> Spawned:
        """Runs it (again) to the end, which must be exit 0."""
        p = Spawned(self.command(save_dir, final, args))
        rc = p.finish(self.timeout * 2)
        assert rc == 0, f"exit {rc}:\n{p.output}"
        return p


@dataclass(frozen=True)
class StoppedRun:
    """A run stopped once, made by a module fixture and shared by its tests: each copies ``save_dir`` before it
    resumes (``copy_to``), and reads what the stopped processes printed from ``output``."""

    save_dir: Path
    output: str

    def copy_to(self, save_dir: Path) -> Path:
        shutil.copytree(self.save_dir, save_dir, symlinks=True)
        return save_dir


@dataclass
class Interrupt:
    """Start the training (with ``args`` added for this process only), wait for the event ``after``, wait ``delay``
    s more (the trials at random moments), send ``sig``. A test that needs the signal to land at a given point holds
    the process there (``args=("--hold_at", "POINT:N")``, ``after=on("holding", point=POINT, n=N)``) instead of
    counting on a delay."""

    after: On = field(default_factory=lambda: on("entered"))
    delay: float = 0.0
    sig: int = signal.SIGTERM
    args: Sequence[str] = ()


def in_step(k: int, sig: int = signal.SIGTERM) -> Interrupt:
    """``sig`` while the process holds inside the work of its own k-th step (before that step's ``run.step()``):
    a SIGTERM stops it at that step's safe point, however fast or slow the machine."""
    return Interrupt(after=on("holding", point="step", n=k), sig=sig, args=("--hold_at", f"step:{k}"))


@dataclass
class History:
    """Return codes, outputs and events of every process of one interrupted run."""

    codes: list[int] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    events: list[list[dict[str, Any]]] = field(default_factory=list)

    def events_of(self, kind: str, **fields: Any) -> list[dict[str, Any]]:
        """The events ``kind`` with ``fields`` as given that the processes emitted, in order."""
        return [e for events in self.events for e in events if _matches(e, kind, fields)]

    def count_events(self, kind: str, **fields: Any) -> int:
        """How many events ``kind`` with ``fields`` as given the processes emitted, in all."""
        return len(self.events_of(kind, **fields))

    @property
    def text(self) -> str:
        return "\n----\n".join(self.outputs)


def run_interrupted(
    save_dir: Path,
    final_out: Path,
    args: Sequence[str],
    interrupts: Sequence[Interrupt],
    env: dict[str, str] | None = None,
    between: Callable[[int], None] | None = None,
    max_reruns: int = 4,
    script: Path = TRAIN,
) -> History:
    """Runs the training (``script``: another of tests/scripts/), interrupting it as listed, then reruns it until it
    completes (exit 0)."""
    history = History()
    for i, it in enumerate(interrupts):
        p = Spawned(train_cmd(save_dir, final_out, [*args, *it.args], script), env)
        if p.wait_event(it.after.kind, **it.after.fields):
            if it.delay:
                time.sleep(it.delay)
            p.signal(it.sig)
        rc = p.finish()
        history.codes.append(rc)
        history.outputs.append(p.output)
        history.events.append(list(p.events))
        if rc == 0:
            break
        if between is not None:
            between(i)
    for _ in range(max_reruns):
        if history.codes and history.codes[-1] == 0:
            break
        p = Spawned(train_cmd(save_dir, final_out, args, script), env)
        history.codes.append(p.finish())
        history.outputs.append(p.output)
        history.events.append(list(p.events))
    assert history.codes[-1] == 0, f"the training never completed: codes {history.codes}\n{history.text}"
    return history
