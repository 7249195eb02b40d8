"""The process side of ``preempt supervise``: one attempt of CMD in its own process group, its output streamed
and scanned live, stop signals forwarded with a grace period, leftovers of the group killed, and the attempts
run one after another as :mod:`preempt.supervise.policy` decides.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import math
import os
import selectors
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from .._log import duration
from ..cluster.signals import DEFAULT_SIGNALS, signal_name
from ..errors import NONFINITE_EXIT_CODE, OOM_EXIT_CODE, PREEMPTED_EXIT_CODE
from .policy import (
    FAILED,
    NONFINITE,
    OOM,
    Cause,
    Match,
    Scanner,
    SuperviseConfig,
    child_env,
    classify,
    fmt,
    plan_next,
    substitute,
)

EXIT_CANNOT_EXECUTE, EXIT_NOT_FOUND = 126, 127
_LEFTOVER_GRACE = 5.0  # s between SIGTERM and SIGKILL for what is left in the group after the child exited
_DRAIN = 0.5  # s to read the pipes after the group is empty; longer only if a process outside it holds them
_TICK = 1.0  # s; the loop wakes on output, signals and SIGCHLD; this only bounds a missed wakeup
_READ = 1 << 16


# --------------------------------------------------------------- the process


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One run of CMD, as the summary shows it."""

    number: int
    argv: tuple[str, ...]
    lr: float | None
    batch_size: int | None
    code: int  # shell style: 128 + N for death by signal N
    cause: Cause
    seconds: float
    pattern: Match | None  # the last pattern seen in its output
    signalled: tuple[int, ...] = ()  # the stop signals forwarded to it


@dataclasses.dataclass(frozen=True)
class Result:
    code: int
    reason: str
    attempts: tuple[Attempt, ...]


def exit_code(returncode: int) -> int:
    """Popen's returncode (``-N`` for death by signal N) as a shell reports it (``128 + N``)."""
    return 128 - returncode if returncode < 0 else returncode


def _killpg(pgid: int, sig: int) -> bool:
    """Sends ``sig`` to the group; False when the group is gone (or not ours)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _same_file(a: int, b: int) -> bool:
    try:
        return os.path.samestat(os.fstat(a), os.fstat(b))
    except OSError:
        return a == b


def _reap(pgid: int) -> None:
    """Reaps the exited members of the group that are our children (orphans, thanks to the subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-pgid, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36


def become_subreaper() -> bool:
    """Makes orphaned descendants this process's children (Linux ``PR_SET_CHILD_SUBREAPER``); False elsewhere.

    Process-wide, so only the ``preempt supervise`` command calls it, not :class:`Supervisor`.
    """
    libc = _libc()
    return libc is not None and libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


class Supervisor:
    """Runs the attempts of one ``preempt supervise``.

    Installs its signal handlers (main thread only) for the duration of :meth:`run` and restores them.

    Args:
        config: What to run and the limits.
        log: A text file the events are appended to (one line each), or None.
        environ: The environment the attempts' environments derive from (default ``os.environ``).
        stdout_fd: Where the child's stdout goes.
        stderr_fd: Where the child's stderr goes.
        err: Where the supervisor's own messages go (default ``sys.stderr``).
        clock: Monotonic clock.
        save_dir: The run's save_dir: as each attempt starts, its newest valid checkpoint is read into the page
            cache beside it (:mod:`preempt.checkpoint.readahead`), while the child imports torch.
    """

    def __init__(
        self,
        config: SuperviseConfig,
        *,
        log: IO[str] | None = None,
        environ: Mapping[str, str] | None = None,
        stdout_fd: int = 1,
        stderr_fd: int = 2,
        err: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        save_dir: Path | None = None,
    ) -> None:
        self.config = config
        self._save_dir = save_dir
        self._log = log
        self._environ = dict(os.environ if environ is None else environ)
        self._out = {"stdout": stdout_fd, "stderr": stderr_fd}
        self._err = err
        # The child's streams that end up where our messages go (its stderr; its stdout too on a terminal), and
        # whether the child's last write there left a line unfinished (a progress bar): a message then starts on a
        # new line.
        self._shares_err = {name for name, fd in self._out.items() if _same_file(fd, stderr_fd)}
        self._open_line = False
        self._clock = clock
        self._pending: list[int] = []  # stop signals not yet forwarded (appended by the handler)
        self.stop_signal: int | None = None  # the first stop signal received
        self._wake_r = self._wake_w = -1
        self._libc = _libc()
        self._parent = os.getpid()

    # ------------------------------------------------------------ messages

    def event(self, message: str) -> None:
        """One event: a line on stderr and a line in the log."""
        message = message.replace("\n", "\\n")
        err = self._err or sys.stderr
        newline = "\n" if self._open_line else ""
        self._open_line = False
        try:
            err.write(f"{newline}[preempt supervise] {message}\n")
            err.flush()
        except (BrokenPipeError, ValueError):
            pass  # nobody reads our stderr any more; the log still gets it
        if self._log is not None:
            now = datetime.datetime.now().astimezone().isoformat(timespec="milliseconds")
            self._log.write(f"{now} [{self._parent}] {message}\n")
            self._log.flush()

    def _values(self, lr: float | None, batch_size: int | None) -> str:
        parts = ([f"lr {fmt(lr)}"] if lr is not None else []) + (
            [f"batch_size {batch_size}"] if batch_size is not None else []
        )
        return f" ({', '.join(parts)})" if parts else ""

    # ------------------------------------------------------------- signals

    def _on_stop(self, signum: int, frame: object) -> None:
        # Only records (preempt.cluster.signals' rule); the loop forwards at once, woken by the wakeup fd.
        self._pending.append(signum)
        if self.stop_signal is None:
            self.stop_signal = signum

    def _install(self) -> dict[int, Any]:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        previous: dict[int, Any] = {}
        for sig in DEFAULT_SIGNALS:
            handler = signal.getsignal(sig)
            if sig == signal.SIGINT and handler == signal.SIG_IGN:
                continue
            previous[sig] = handler
            signal.signal(sig, self._on_stop)
        # A Python-level SIGCHLD handler, so that the C handler writes to the wakeup fd when the child exits.
        previous[signal.SIGCHLD] = signal.getsignal(signal.SIGCHLD)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        previous[-1] = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        return previous

    def _restore(self, previous: dict[int, Any]) -> None:
        signal.set_wakeup_fd(previous.pop(-1))
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _preexec(self) -> None:
        # In the child between fork and exec: die with the supervisor (a SIGKILLed supervisor cannot clean up).
        # SIGTERM, not SIGKILL: a preempt run saves. Races with the supervisor's death, hence the getppid check.
        if self._libc is not None:
            self._libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            if os.getppid() != self._parent:
                os.kill(os.getpid(), signal.SIGTERM)

    # ------------------------------------------------------------ the loop

    def run(self) -> Result:
        """Runs attempts until one completes or the plan says stop; returns the exit code and the history."""
        cfg = self.config
        previous = self._install()
        attempts: list[Attempt] = []
        try:
            self.event(
                f"supervising {shlex.join(cfg.cmd)}: --max-retries {cfg.max_retries}, --max-preemptions"
                f" {cfg.max_preemptions}, --factor {fmt(cfg.factor)}, --grace {fmt(cfg.grace)} s"
                + (f", --lr {fmt(cfg.lr)}, --min-lr {fmt(cfg.min_lr)}" if cfg.lr is not None else "")
                + (
                    f", --batch-size {cfg.batch_size}, --min-batch-size {cfg.min_batch_size}"
                    if cfg.batch_size is not None
                    else ""
                )
            )
            lr, bs = cfg.lr, cfg.batch_size
            retries = preemptions = 0
            cause: Cause | None = None
            while True:
                if self.stop_signal is not None:
                    code = PREEMPTED_EXIT_CODE
                    reason = (
                        f"{signal_name(self.stop_signal)} before attempt {len(attempts) + 1} started; not starting it"
                    )
                    break
                attempt = self._attempt(len(attempts) + 1, lr, bs, cause)
                attempts.append(attempt)
                plan = plan_next(cfg, attempt.cause, lr=lr, batch_size=bs, retries=retries, preemptions=preemptions)
                code = attempt.code
                if plan.action == "stop" and not (self.stop_signal is not None and attempt.signalled):
                    reason = plan.reason
                    break
                if self.stop_signal is not None:
                    how = "forwarded to it" if attempt.signalled else "after it ended"
                    if not attempt.signalled:
                        code = PREEMPTED_EXIT_CODE
                    reason = f"{signal_name(self.stop_signal)} {how}; not starting another attempt"
                    break
                self.event(plan.reason)
                if plan.action == "retry":
                    retries += 1
                else:
                    preemptions += 1
                lr, bs, cause = plan.lr, plan.batch_size, attempt.cause
            self._summary(attempts, code, reason)
            return Result(code, reason, tuple(attempts))
        finally:
            self._restore(previous)

    def _summary(self, attempts: list[Attempt], code: int, reason: str) -> None:
        self.event(f"stop: {reason}; exit {code}")
        self.event(f"summary: {len(attempts)} attempt(s)")
        for a in attempts:
            extra = ""
            if a.signalled:
                extra += f", after {'+'.join(signal_name(s) for s in a.signalled)}"
            if (
                a.pattern is not None
                and a.cause in (NONFINITE, OOM)
                and a.code not in (NONFINITE_EXIT_CODE, OOM_EXIT_CODE)
            ):
                extra += f", {a.pattern.stream} said {a.pattern.text!r}"
            self.event(
                f"  attempt {a.number}: exit {a.code}, {a.cause}{extra}, {duration(a.seconds)}"
                f"{self._values(a.lr, a.batch_size)}: {shlex.join(a.argv)}"
            )

    def _attempt(self, number: int, lr: float | None, batch_size: int | None, cause: Cause | None) -> Attempt:
        cfg = self.config
        argv = substitute(cfg.cmd, lr, batch_size)
        scale = None if lr is None or cfg.lr is None else lr / cfg.lr
        env = child_env(self._environ, attempt=number, cause=cause, lr=lr, lr_scale=scale, batch_size=batch_size)
        start = self._clock()
        self._read_ahead(number)
        try:
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
                preexec_fn=self._preexec if self._libc is not None else None,
            )
        except OSError as e:
            code = EXIT_NOT_FOUND if isinstance(e, (FileNotFoundError, NotADirectoryError)) else EXIT_CANNOT_EXECUTE
            self.event(f"attempt {number}: cannot run {argv[0]!r}: {e.strerror or e}")
            return Attempt(number, tuple(argv), lr, batch_size, code, FAILED, self._clock() - start, None)
        self.event(f"attempt {number}: pid {proc.pid}{self._values(lr, batch_size)}: {shlex.join(argv)}")
        last, signalled = self._pump(number, proc)
        seconds = self._clock() - start
        assert proc.returncode is not None
        code = exit_code(proc.returncode)
        result = classify(code, last.cause if last is not None else None)
        died = f" (killed by {signal_name(-proc.returncode)})" if proc.returncode < 0 else ""
        self.event(f"attempt {number}: exit {code}{died} after {duration(seconds)}: {result}")
        return Attempt(number, tuple(argv), lr, batch_size, code, result, seconds, last, tuple(signalled))

    def _read_ahead(self, number: int) -> None:
        """The newest valid checkpoint of the save_dir read into memory in a thread, beside the child's start."""
        if self._save_dir is None:
            return
        from ..checkpoint import readahead
        from ..checkpoint.manager import newest_files

        found = newest_files(self._save_dir)
        if found is None:
            return
        path, files = found
        threading.Thread(target=readahead.warm, args=(files,), kwargs={"read": True}, daemon=True).start()
        self.event(f"attempt {number}: reading {path} ahead of its restore")

    def _pump(self, number: int, proc: subprocess.Popen[bytes]) -> tuple[Match | None, list[int]]:
        """Copies the child's output, forwards signals and cleans its group up, until all of it is gone.

        Returns:
            The last pattern seen, and the stop signals forwarded.
        """
        assert proc.stdout is not None and proc.stderr is not None
        pgid = proc.pid  # start_new_session: the child leads its own group
        pipes = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
        scanners = {fd: Scanner(name) for fd, name in pipes.items()}
        sel = selectors.DefaultSelector()
        for fd in pipes:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        last: Match | None = None
        seen: set[Cause] = set()
        signalled: list[int] = []
        kill_at: float | None = None  # the end of --grace after the first forwarded signal
        exited = gave_up = False
        leftover_kill_at: float | None = None
        give_up_at: float | None = None
        close_at: float | None = None

        def scanned(matches: list[Match]) -> None:
            nonlocal last
            for m in matches:
                if m.cause not in seen:
                    seen.add(m.cause)
                    self.event(f"attempt {number}: {m.cause} pattern on {m.stream}: {m.text!r}")
            if matches:
                last = matches[-1]

        try:
            while True:
                now = self._clock()
                while self._pending:
                    sig = self._pending.pop(0)
                    if exited:
                        continue  # what is left of the group is being cleaned up anyway
                    _killpg(pgid, sig)
                    signalled.append(sig)
                    if kill_at is None:
                        kill_at = now + self.config.grace
                        self.event(
                            f"attempt {number}: {signal_name(sig)} received; forwarded to process group {pgid};"
                            f" waiting up to {fmt(self.config.grace)} s for it to exit"
                        )
                    else:
                        self.event(f"attempt {number}: {signal_name(sig)} received; forwarded to process group {pgid}")
                if not exited and proc.poll() is not None:
                    exited = True
                if not exited and kill_at is not None and now >= kill_at:
                    self.event(f"attempt {number}: still running {fmt(self.config.grace)} s after the signal; SIGKILL")
                    _killpg(pgid, signal.SIGKILL)
                    kill_at = math.inf
                deadlines = [kill_at] if kill_at is not None and not exited else []
                if exited:
                    _reap(pgid)
                    alive = not gave_up and _killpg(pgid, 0)
                    if alive and leftover_kill_at is None:
                        wait = min(self.config.grace, _LEFTOVER_GRACE)
                        self.event(
                            f"attempt {number}: processes left in group {pgid} after the command exited;"
                            f" SIGTERM, SIGKILL after {fmt(wait)} s"
                        )
                        _killpg(pgid, signal.SIGTERM)
                        leftover_kill_at = now + wait
                    elif alive and give_up_at is None and now >= (leftover_kill_at or 0.0):
                        self.event(f"attempt {number}: processes still in group {pgid}; SIGKILL")
                        _killpg(pgid, signal.SIGKILL)
                        give_up_at = now + 2.0
                    elif alive and give_up_at is not None and now >= give_up_at:
                        self.event(
                            f"attempt {number}: group {pgid} still not empty 2 s after SIGKILL (zombies that"
                            " nobody reaps?); going on"
                        )
                        gave_up, alive = True, False
                    if alive:
                        # Members that are not our children exit without a SIGCHLD to wake us: poll.
                        deadlines.append(now + 0.05)
                    elif not pipes:
                        break
                    elif close_at is None:
                        close_at = now + _DRAIN
                        deadlines.append(close_at)
                    elif now >= close_at:
                        self.event(
                            f"attempt {number}: its output is still open, held by a process outside group"
                            f" {pgid}; no longer reading it"
                        )
                        break
                    else:
                        deadlines.append(close_at)
                timeout = min([_TICK, *(max(0.0, d - now) for d in deadlines)])
                for key, _ in sel.select(timeout):
                    fd = key.fd
                    if fd == self._wake_r:
                        try:
                            while os.read(fd, 512):
                                pass
                        except BlockingIOError:
                            pass
                        continue
                    try:
                        data = os.read(fd, _READ)
                    except BlockingIOError:
                        continue
                    if not data:
                        sel.unregister(fd)
                        scanned(scanners[fd].close())
                        del pipes[fd]
                        continue
                    self._copy(pipes[fd], data)
                    scanned(scanners[fd].feed(data))
        finally:
            for fd in pipes:
                scanned(scanners[fd].close())
            sel.close()
            proc.stdout.close()
            proc.stderr.close()
            if proc.returncode is None:  # only after an exception in the loop: leave nothing behind
                _killpg(pgid, signal.SIGKILL)
                proc.wait()
        return last, signalled

    def _copy(self, stream: str, data: bytes) -> None:
        fd = self._out[stream]
        if fd < 0:
            return
        if stream in self._shares_err:
            self._open_line = not data.endswith(b"\n")
        view = memoryview(data)
        try:
            while view:
                try:
                    n = os.write(fd, view)
                except BlockingIOError:  # an O_NONBLOCK stdout that is full
                    time.sleep(0.001)
                    continue
                view = view[n:]
        except (BrokenPipeError, OSError):
            # The reader of our stdout/stderr left: keep reading (and scanning) the child's, so it never blocks.
            self._out[stream] = -1
