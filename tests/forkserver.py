"""Python processes for the tests, forked from a server that imported torch once instead of each paying for it.

Most of the suite's CPU time went to starting processes: ``import torch`` costs 2 to 4 s of CPU on these machines,
a training's first optimizer step 2 to 2.5 s more (it imports ``torch._dynamo``), and the tests start a few hundred
Python processes, each of which then trains for a fraction of that. :func:`start` runs ``python script.py args``,
``python -m module args`` or ``python -c code args`` instead as a child forked from a server process that has
imported torch, torch._dynamo, numpy and safetensors (never preempt: each child imports this checkout's preempt
itself). Everything else is a real process, started for the test: its own pid, session when asked, environment,
working directory, stdout and stderr on a pipe to the test, signals sent to it by pid, and an exit status that says
``-N`` for a death by signal N, as :class:`subprocess.Popen` does.

What a fresh interpreter would have and the fork gives it too, set in the child before the script runs:
``sys.argv`` and ``sys.path[0]`` as ``python`` sets them; the environment; the test's blocked signals and the
signals it ignores (``exec`` keeps both), every other signal at its default and SIGINT at Python's handler; the
global generators of ``random`` and numpy seeded afresh from the OS. What it cannot have: its own hash seed for
``str`` (fixed at the server's start). Two servers, started with different seeds, take turns, so that the process
which resumes a run never has the hash seed of the one that saved it.

A child whose environment sets what python, torch or the OpenMP runtime read when they start otherwise than the
servers' (``PYTHONPATH``, ``PYTHONHASHSEED``, ``TORCH_LOGS``, ...: :data:`STARTUP_PREFIXES`) is not forked: the
callers start it fresh (:func:`forkable`); ``OMP_NUM_THREADS`` the child applies itself. Where the fork cannot stand
for a fresh interpreter for another reason (a test of what happens while python imports), start the process with
:class:`subprocess.Popen`. ``PREEMPT_TEST_FORKSERVER=0`` turns the
server off for a whole run (every process then starts fresh, as before), to compare or to rule it out.

Each server lives as long as the pytest process that started it (it exits when its parent does); each child has a
small monitor process between it and the server, which waits for it and sends its exit status to the test.

torchrun's ranks come from these servers too: the agent starts ``tests/rank_launcher.py`` for each rank, which asks a
server for the rank (:func:`start_from`) and stands for it towards the agent. Such a child is bound to the process
that asked for it: its monitor kills it if that process ends first.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

# torch._dynamo: a training's first optimizer step imports it, 2 to 2.5 s of CPU more on these machines.
PRELOAD = ("torch", "torch._dynamo", "numpy", "safetensors.torch", "xxhash")
ENABLED = os.environ.get("PREEMPT_TEST_FORKSERVER", "1") != "0"
# Signals that Python itself sets to SIG_IGN at start whatever it inherits; every other one the child takes from the
# test: ignored if ignored there, at its default otherwise.
PYTHON_IGNORES = {signal.SIGPIPE, signal.SIGXFSZ}
START_TIMEOUT_S = 120.0  # a server's imports, on a loaded machine
# Variables that python, torch or the OpenMP/MKL runtimes read when they start, before a child could set them: a child
# whose environment sets them otherwise than the servers' starts fresh. OMP_NUM_THREADS the child applies itself
# (torch.set_num_threads), and the servers run unbuffered whatever PYTHONUNBUFFERED says.
STARTUP_PREFIXES = ("PYTHON", "TORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_")
APPLIED_IN_CHILD = {"OMP_NUM_THREADS", "PYTHONUNBUFFERED"}


# ------------------------------------------------------------------------------------------------ the test's side


def forkable(cmd: Sequence[str], env: Mapping[str, str]) -> bool:
    """``[sys.executable, script.py, ...]``, ``[sys.executable, "-m", module, ...]`` or
    ``[sys.executable, "-c", code, ...]``, in an environment that sets what python and torch read at their start as the
    servers' does: what a server can run."""
    if not ENABLED or len(cmd) < 2 or cmd[0] != sys.executable:
        return False
    if startup_vars(env) != startup_vars(_servers_env()):
        return False
    if cmd[1] in ("-m", "-c"):
        return len(cmd) > 2
    return not cmd[1].startswith("-") and cmd[1].endswith(".py") and Path(cmd[1]).is_file()


def startup_vars(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What of ``env`` (default: the servers' environment) python, torch or the OpenMP runtime read at their start."""
    if env is None:
        env = _servers_env()
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) and k not in APPLIED_IN_CHILD}


class Forked:
    """A child of a fork server, with the part of :class:`subprocess.Popen`'s interface the tests use.

    A thread waits for the exit status that the child's monitor sends when the child ends."""

    def __init__(
        self, args: Sequence[str], conn: socket.socket, stdout: IO[str] | None, stderr: IO[str] | None
    ) -> None:
        self.args = list(args)
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._conn = conn
        self._buffer = b""
        conn.settimeout(START_TIMEOUT_S)
        try:
            message, fds = self._receive()
        except TimeoutError:
            raise TimeoutError(f"fork server: no pid for {self.args} within {START_TIMEOUT_S:.0f} s") from None
        if not message.startswith("pid ") or len(fds) != 1:
            raise RuntimeError(f"fork server: expected 'pid N' and a pidfd for {self.args}, got {message!r}")
        self.pid = int(message.split()[1])
        self._pidfd = fds[0]
        weakref.finalize(self, os.close, self._pidfd)
        self._ended = threading.Event()
        self._waiter = threading.Thread(target=self._wait_for_status, daemon=True)
        self._waiter.start()

    def _receive(self) -> tuple[str, list[int]]:
        """One line from the monitor, and the descriptors sent with it."""
        fds: list[int] = []
        while b"\n" not in self._buffer:
            data, got, _, _ = socket.recv_fds(self._conn, 4096, 1)
            fds += got
            if not data:
                raise RuntimeError(f"fork server: the monitor of {self.args} closed without an exit status")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode(), fds

    def _wait_for_status(self) -> None:
        try:
            self._conn.settimeout(None)
            message, _ = self._receive()
            if not message.startswith("exit "):
                raise RuntimeError(f"fork server: expected 'exit N' for {self.args}, got {message!r}")
            self.returncode = int(message.split()[1])
        finally:
            self._conn.close()
            self._ended.set()

    def poll(self) -> int | None:
        return self.returncode if self._ended.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        if self.returncode is None:
            raise RuntimeError(f"fork server: no exit status for {self.args} (see the error above)")
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Through the pidfd: never to another process that reused the pid after this one ended."""
        if not self._ended.is_set():
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass  # ended; its status is on its way

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Server:
    """One fork server process, started when first asked for a child."""

    def __init__(self, hash_seed: int) -> None:
        self.hash_seed = hash_seed
        self.proc: subprocess.Popen | None = None
        self.dir = Path(tempfile.mkdtemp(prefix="preempt-forkserver-"))
        self.path = self.dir / "socket"
        self.log = self.dir / "server.log"

    def _start(self) -> None:
        self.path.unlink(missing_ok=True)
        env = {**_servers_env(), "PYTHONHASHSEED": str(self.hash_seed), "PYTHONUNBUFFERED": "1"}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", __file__, str(self.path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,  # a Ctrl+C meant for pytest does not reach it
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the fork server did not start; its log ({self.log}):\n{self.log.read_text()}")
            time.sleep(0.05)

    def started(self) -> Server:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        return self

    def connect(self) -> socket.socket:
        return _connect(str(self.started().path))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_servers: list[Server] = []
_turn = 0
_servers_lock = threading.Lock()
_env: dict[str, str] = {}


def _servers_env() -> dict[str, str]:
    """The environment the servers start with: this process's when first asked (the suite's conftest has set
    PYTHONPATH by then), whatever a test changes in it later."""
    if not _env:
        _env.update(os.environ)
    return _env


def _next_server() -> Server:
    global _turn
    with _servers_lock:
        if not _servers:
            atexit.register(stop_servers)
            seeds = int.from_bytes(os.urandom(4), "little") % 4_000_000_000
            _servers.extend(Server(seeds + i) for i in range(2))
        server = _servers[_turn % len(_servers)]
        _turn += 1
        return server


def stop_servers() -> None:
    with _servers_lock:
        for server in _servers:
            server.stop()


def rank_servers() -> list[str]:
    """The sockets of both servers, started, the next one in turn first: for the ranks of a torchrun
    (``tests/rank_launcher.py``), so that rank 0 of one run and of the next get different hash seeds."""
    first = _next_server()
    return [str(server.started().path) for server in (first, *(s for s in _servers if s is not first))]


def _connect(path: str) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    return conn


def _send(
    conn: socket.socket, cmd: Sequence[str], env: Mapping[str, str], cwd: Path | str, fds: Sequence[int], **how: bool
) -> None:
    """The request for ``cmd``: its environment, directory, the signals this process ignores and blocks (which the
    child takes, as ``exec`` would give them), ``how`` (``session``, ``bound``), and ``fds``: its stdout and stderr."""
    ignored = [int(s) for s in signal.valid_signals() if s not in PYTHON_IGNORES and _ignored(s)]
    blocked = [int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])]
    request = {"argv": list(cmd[1:]), "env": dict(env), "cwd": str(cwd), **how}
    request |= {"ignored": ignored, "blocked": blocked}
    payload = json.dumps(request).encode()
    socket.send_fds(conn, [struct.pack("!I", len(payload)) + payload], list(fds))


def start_from(path: str, cmd: Sequence[str], env: Mapping[str, str], cwd: Path | str) -> Forked:
    """``cmd`` as a child of the server at ``path``, for a process that is not the test (a rank launcher): the child
    writes to this process's stdout and stderr, leads a session of its own (as torchrun's ranks do), and is killed if
    this process ends before it (the server's monitor sees the connection close)."""
    conn = _connect(path)
    _send(conn, cmd, env, cwd, [1, 2], session=True, bound=True)
    return Forked(cmd, conn, None, None)


def start(
    cmd: Sequence[str],
    env: Mapping[str, str],
    cwd: Path | str,
    *,
    session: bool = False,
    merge_stderr: bool = True,
    errors: str = "replace",
) -> Forked:
    """Runs ``cmd`` (see :func:`forkable`) as a child of a fork server. Its stdout is a text pipe at ``.stdout``; its
    stderr goes into the same pipe, or with ``merge_stderr=False`` into one of its own at ``.stderr``. Both are read as
    UTF-8, with ``errors`` for bytes that are not."""
    pipes = [os.pipe() for _ in range(1 if merge_stderr else 2)]
    readers = [open(r, encoding="utf-8", errors=errors) for r, _ in pipes]  # noqa: SIM115 (read to the end)
    try:
        conn = _next_server().connect()
        _send(conn, cmd, env, cwd, [w for _, w in pipes], session=session)
    except BaseException:
        for reader in readers:
            reader.close()
        raise
    finally:
        for _, w in pipes:
            os.close(w)
    return Forked(cmd, conn, readers[0], readers[1] if len(readers) > 1 else None)


def run(
    cmd: Sequence[str], env: Mapping[str, str], cwd: Path | str, timeout: float | None = None, errors: str = "strict"
) -> subprocess.CompletedProcess[str]:
    """:func:`subprocess.run` with ``capture_output=True, text=True``, through a fork server: a timeout kills the
    child and raises :class:`subprocess.TimeoutExpired`, bytes that are not UTF-8 meet ``errors`` here, and the
    newlines are translated as text mode does."""
    p = start(cmd, env, cwd, merge_stderr=False)
    assert p.stderr is not None
    raw: dict[str, bytes] = {}
    threads = [
        threading.Thread(target=lambda k=k, f=f: raw.__setitem__(k, f.buffer.read()), daemon=True)
        for k, f in (("stdout", p.stdout), ("stderr", p.stderr))
    ]
    for t in threads:
        t.start()
    try:
        rc = p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    finally:
        for t in threads:
            t.join()
        p.stdout.close()
        p.stderr.close()
    text = {k: v.decode("utf-8", errors).replace("\r\n", "\n").replace("\r", "\n") for k, v in raw.items()}
    return subprocess.CompletedProcess(list(cmd), rc, text["stdout"], text["stderr"])


def _ignored(sig: int) -> bool:
    try:
        return signal.getsignal(sig) == signal.SIG_IGN
    except ValueError:
        return False


# ------------------------------------------------------------------------------------------------ the server's side


def _serve(path: str) -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # The preloaded objects into the collector's permanent generation: a child's collections then never walk the
    # 288,069 objects the imports leave (counted with gc.get_objects()), nor write to their headers (which would copy
    # each page they lie on into the child). A forked training's CPU was halved by this (1.7 s to 0.8 s); what the
    # child itself creates is collected as usual.
    gc.collect()
    gc.freeze()
    parent = os.getppid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the monitors are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)  # before the rename: a client that finds the path must find it accepting
    os.rename(path + ".new", path)  # the path appears only once it accepts
    listener.settimeout(1.0)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the pytest process that started this server is gone
                return
            continue
        conn.settimeout(None)
        fds: list[int] = []
        try:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
            while len(data) >= 4 and len(data) < 4 + struct.unpack("!I", data[:4])[0]:
                more = conn.recv(1 << 16)
                if not more:
                    break
                data += more
            request = json.loads(data[4:])
        except (OSError, ValueError) as e:  # a client that went away, or sent something else: not this server's end
            print(f"fork server: a request that could not be read: {e!r}", file=sys.stderr)
            request = None
        if request is not None and os.fork() == 0:
            listener.close()
            _monitor(conn, request, fds)  # the child returns from here into the script
            return
        conn.close()
        for fd in fds:
            os.close(fd)


def _monitor(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """Forks the child, sends its pid (and a pidfd for it), waits for it and sends its exit status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _child(request, fds)
        return
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    try:
        socket.send_fds(conn, [f"pid {pid}\n".encode()], [pidfd])
    except OSError:
        pass
    if request.get("bound"):
        threading.Thread(target=_kill_when_closed, args=(conn, pidfd), daemon=True).start()
    _, status = os.waitpid(pid, 0)
    try:
        conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
    except OSError:
        pass
    os._exit(0)


def _kill_when_closed(conn: socket.socket, pidfd: int) -> None:
    """A bound child dies with its client: SIGKILL once the client's end of the connection closes before the child
    ended (through the pidfd: a no-op once the child is reaped)."""
    try:
        conn.recv(1)
    except OSError:
        pass
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass


def _child(request: dict, fds: list[int]) -> None:
    """Makes this fork what ``python <argv>`` started fresh would be, and returns to run the script at top level."""
    os.dup2(fds[0], 1)
    os.dup2(fds[-1], 2)  # the same pipe, or stderr's own
    for fd in set(fds):
        os.close(fd)
    if request["session"]:
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    ignored = set(request["ignored"])
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP) or sig in PYTHON_IGNORES:
            continue
        if sig in ignored:
            handler = signal.SIG_IGN
        elif sig == signal.SIGINT:
            handler = signal.default_int_handler
        else:
            handler = signal.SIG_DFL
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError):
            pass  # one the platform does not let Python set
    signal.pthread_sigmask(signal.SIG_SETMASK, request["blocked"])
    if "numpy" in sys.modules:  # (Python's random reseeds itself in a forked child; numpy's global generator does not)
        sys.modules["numpy"].random.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:  # OpenMP read the server's at its load
        sys.modules["torch"].set_num_threads(int(threads))
    global _child_argv
    _child_argv = request["argv"]


_child_argv: list[str] | None = None  # in a child: what to run, once the server's loop has returned to the top level


def _run_script(argv: list[str]) -> None:
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")  # a __main__ of its own, without __file__, as python -c has
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    _serve(sys.argv[1])
    if _child_argv is not None:  # a child: the server's loop returned here to run the script at the top level
        _run_script(_child_argv)
