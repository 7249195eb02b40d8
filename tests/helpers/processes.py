"""Training processes a test starts, signals and reruns: the child and its output, the interrupted run."""

from __future__ import annotations

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

import forkserver

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
TRAIN = TESTS / "scripts" / "train.py"
TRAIN_DDP = TESTS / "scripts" / "train_ddp.py"
RANK_LAUNCHER = TESTS / "rank_launcher.py"
DDP_ARGS = ["--epochs", "2", "--samples", "192", "--every_steps", "4"]  # 12 steps per epoch on 2 ranks, 24 in all
PREEMPTED = 75


class Spawned:
    """A child process whose merged stdout/stderr is collected line by line by a thread."""

    def __init__(self, cmd: Sequence[str], env: dict[str, str] | None = None, *, session: bool = False) -> None:
        """``session``: the child leads a session and process group of its own, which a test may signal whole
        (``os.killpg(p.proc.pid, sig)``, as ``timeout`` and SLURM do) without signalling pytest."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
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
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
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


def train_cmd(save_dir: Path, final_out: Path | None, args: Sequence[str]) -> list[str]:
    cmd = [sys.executable, str(TRAIN), "--save_dir", str(save_dir), *args]
    if final_out is not None:
        cmd += ["--final_out", str(final_out)]
    return cmd


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
    """Start the training (with ``args`` added for this process only), wait for ``after`` (a regex), wait ``delay``
    s more, send ``sig``. A test that needs the signal to land at a given point holds the process there
    (``args=("--hold_at", POINT)``, ``after=r"^holding at POINT"``) instead of counting on a delay."""

    after: str = r"^start "
    delay: float = 0.0
    sig: int = signal.SIGTERM
    args: Sequence[str] = ()


def in_step(k: int, sig: int = signal.SIGTERM) -> Interrupt:
    """``sig`` while the process holds inside the work of its own k-th step (before that step's ``run.step()``):
    a SIGTERM stops it at that step's safe point, however fast or slow the machine."""
    return Interrupt(after=rf"^holding at step {k}$", sig=sig, args=("--hold_at", f"step:{k}"))


@dataclass
class History:
    """Return codes and outputs of every process of one interrupted run."""

    codes: list[int] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n----\n".join(self.outputs)

    def count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.text, flags=re.M))


def run_interrupted(
    save_dir: Path,
    final_out: Path,
    args: Sequence[str],
    interrupts: Sequence[Interrupt],
    env: dict[str, str] | None = None,
    between: Callable[[int], None] | None = None,
    max_reruns: int = 4,
) -> History:
    """Runs the training, interrupting it as listed, then reruns it until it completes (exit 0)."""
    history = History()
    for i, it in enumerate(interrupts):
        p = Spawned(train_cmd(save_dir, final_out, [*args, *it.args]), env)
        if p.wait_for(it.after):
            if it.delay:
                time.sleep(it.delay)
            p.signal(it.sig)
        rc = p.finish()
        history.codes.append(rc)
        history.outputs.append(p.output)
        if rc == 0:
            break
        if between is not None:
            between(i)
    for _ in range(max_reruns):
        if history.codes and history.codes[-1] == 0:
            break
        p = Spawned(train_cmd(save_dir, final_out, args), env)
        history.codes.append(p.finish())
        history.outputs.append(p.output)
    assert history.codes[-1] == 0, f"the training never completed: codes {history.codes}\n{history.text}"
    return history
