"""tests/forkserver.py: a child forked from a server stands for ``python script.py`` started fresh.

The same probe script runs both ways, and what it sees of its start must match: argv, sys.path[0], the working
directory, the environment, its session, the dispositions and mask of the signals it inherits (as ``exec`` keeps
them), the exit status of ``sys.exit`` and of a death by signal, and stdout and stderr apart or merged.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
import rank_launcher
from helpers import RANK_LAUNCHER, ROOT, Spawned, run_python

pytestmark = pytest.mark.skipif(not forkserver.ENABLED, reason="PREEMPT_TEST_FORKSERVER=0: every process is fresh")
HANG_S = 120  # a bound on waiting for a process's end, for a process that hangs

PROBE = r"""
import json, os, signal, sys
import numpy
if sys.argv[1] == "term":  # a SIGTERM ends it with exit code 75, as a preempt run's stop does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
sigs = {s.name: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP,
                                               signal.SIGPIPE, signal.SIGCHLD)}
print(json.dumps({
    "argv": sys.argv,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "env": os.environ.get("PROBE_VALUE"),
    "leader": os.getsid(0) == os.getpid(),
    "signals": {k: v if isinstance(v, int) else getattr(v, "__name__", repr(v)) for k, v in sigs.items()},
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "main": __name__,
    "file": globals().get("__file__"),
    "random": float(numpy.random.rand()),
    "threads": __import__("torch").get_num_threads(),
    "hash": hash("preempt"),
    "pid": os.getpid(),
}), flush=True)
print("on stderr", file=sys.stderr, flush=True)
if sys.argv[1] in ("wait", "term"):
    signal.pause()
if sys.argv[1] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(sys.argv[1]))
"""


def probe(tmp_path: Path) -> Path:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return script


def fresh_and_forked(cmd: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    env = {**os.environ, "PROBE_VALUE": "x=1 y", "OMP_NUM_THREADS": "1"}
    fresh = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=120)
    assert forkserver.forkable(cmd, env)
    forked = run_python(cmd, env=env, cwd=cwd, timeout=120)
    return fresh, forked


@pytest.mark.parametrize("how", ["script", "-c"])
def test_a_forked_child_sees_what_a_fresh_interpreter_sees(tmp_path: Path, how: str) -> None:
    cmd = [sys.executable, *([str(probe(tmp_path))] if how == "script" else ["-c", PROBE]), "3", "--flag"]
    for _ in range(2):  # both servers up before the signals change here, so that they cannot have inherited it
        assert run_python(cmd, timeout=120).returncode == 3
    blocked = {signal.SIGUSR2}
    previous_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # ignored here: exec keeps it ignored
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)  # blocked here: exec keeps the mask
    try:
        fresh, forked = fresh_and_forked(cmd, ROOT)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        signal.signal(signal.SIGHUP, previous_hup)
    assert fresh.returncode == forked.returncode == 3, (fresh, forked)
    assert fresh.stderr == forked.stderr == "on stderr\n", (fresh.stderr, forked.stderr)
    a, b = json.loads(fresh.stdout), json.loads(forked.stdout)
    assert a.pop("random") != b.pop("random")  # each seeded from the OS
    a.pop("hash"), b.pop("hash"), a.pop("pid"), b.pop("pid")
    assert a == b, (a, b)
    assert b["signals"]["SIGHUP"] == int(signal.SIG_IGN) and int(signal.SIGUSR2) in b["blocked"], b
    assert b["threads"] == 1, b


def test_an_environment_that_changes_what_python_or_torch_read_at_start_gets_a_fresh_process(tmp_path: Path) -> None:
    cmd = [sys.executable, str(probe(tmp_path)), "0"]
    assert forkserver.forkable(cmd, {**os.environ, "OMP_NUM_THREADS": "1", "PREEMPT_LOG_LEVEL": "DEBUG"})
    for name, value in (("PYTHONHASHSEED", "7"), ("PYTHONPATH", str(tmp_path)), ("TORCH_LOGS", "dynamo")):
        assert not forkserver.forkable(cmd, {**os.environ, name: value}), name


def test_a_death_by_signal_reads_as_popen_says_it_and_a_session_is_its_own(tmp_path: Path) -> None:
    cmd = [sys.executable, str(probe(tmp_path)), "wait"]
    p = Spawned(cmd, session=True)
    assert isinstance(p.proc, forkserver.Forked)
    assert p.wait_for(r"^on stderr$")  # stderr merged into the one pipe, after the line on stdout
    seen = json.loads(p.lines[0])
    assert seen["leader"] and seen["main"] == "__main__", seen
    os.killpg(p.proc.pid, signal.SIGTERM)  # its group, as timeout and SLURM signal
    assert p.finish(timeout=60) == -signal.SIGTERM


def test_consecutive_children_alternate_hash_seeds_and_each_seeds_random_afresh(tmp_path: Path) -> None:
    """The servers take turns: a run that resumes never has the hash seed of the process that saved it. Children of
    one server do not share its numpy global generator's state."""
    cmd = [sys.executable, str(probe(tmp_path)), "0"]
    seen = [json.loads(run_python(cmd, timeout=120).stdout) for _ in range(4)]
    hashes = [s["hash"] for s in seen]
    assert hashes[0] != hashes[1] and hashes[0] == hashes[2] and hashes[1] == hashes[3], hashes
    assert len({s["random"] for s in seen}) == 4, seen


def test_a_timeout_kills_the_child(tmp_path: Path) -> None:
    cmd = [sys.executable, str(probe(tmp_path)), "wait"]
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(cmd, timeout=1.0)


# ------------------------------------------------------------------ tests/rank_launcher.py: a torchrun agent's ranks


def launched(script: Path, arg: str, **env: str) -> subprocess.Popen:
    """``python -u rank_launcher.py probe.py ARG`` started as torchrun's agent starts a rank (a session of its own, the
    environment it gives its ranks), naming the servers as helpers' ``torchrun`` does."""
    ranks_env = {"LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "probe", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    env = {**os.environ, "OMP_NUM_THREADS": "1", **rank_launcher.servers_named(), **ranks_env, **env}
    cmd = [sys.executable, "-u", str(RANK_LAUNCHER), str(script), arg]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


def test_a_rank_is_forked_leads_its_session_and_its_exit_code_is_the_launchers(tmp_path: Path) -> None:
    with launched(probe(tmp_path), "3") as launcher:
        out, err = launcher.communicate(timeout=HANG_S)
    assert launcher.returncode == 3 and err == "on stderr\n", (launcher.returncode, out, err)
    seen = json.loads(out)
    assert seen["pid"] != launcher.pid, "forked by a server, not exec'd by the launcher"
    assert seen["leader"] and seen["argv"] == [str(probe(tmp_path)), "3"] and seen["threads"] == 1, seen
    assert all(seen["signals"][name] == int(signal.SIG_DFL) for name in ("SIGTERM", "SIGHUP", "SIGUSR1")), seen


def test_where_the_environment_differs_at_start_the_rank_is_the_launcher_exec_d(tmp_path: Path) -> None:
    with launched(probe(tmp_path), "0", TORCH_LOGS="dynamo") as launcher:
        out, _ = launcher.communicate(timeout=HANG_S)
    assert launcher.returncode == 0 and json.loads(out)["pid"] == launcher.pid


def rank_started(launcher: subprocess.Popen) -> int:
    """The rank's pid, once its probe has printed it (the launcher's handlers are in place before the rank starts)."""
    assert launcher.stdout is not None
    return json.loads(launcher.stdout.readline())["pid"]


def test_a_signal_to_the_launcher_reaches_the_rank(tmp_path: Path) -> None:
    with launched(probe(tmp_path), "term") as launcher:
        rank_started(launcher)
        launcher.send_signal(signal.SIGTERM)  # as torchrun's agent stops its ranks (os.killpg: the launcher's group)
        assert launcher.wait(timeout=HANG_S) == 75, "the rank's handler ran and its exit code came back"


def test_a_rank_killed_by_a_signal_is_a_launcher_killed_by_it(tmp_path: Path) -> None:
    with launched(probe(tmp_path), "killed") as launcher:
        assert launcher.wait(timeout=HANG_S) == -signal.SIGKILL  # what torchrun's agent reports of a rank


def test_a_killed_launcher_takes_its_rank_with_it(tmp_path: Path) -> None:
    with launched(probe(tmp_path), "wait") as launcher:
        pidfd = os.pidfd_open(rank_started(launcher))
        try:
            launcher.kill()
            launcher.wait(timeout=HANG_S)
            readable, _, _ = select.select([pidfd], [], [], HANG_S)  # a pidfd reads ready once its process has ended
            assert readable, f"the rank outlived its launcher by {HANG_S} s"
        finally:
            os.close(pidfd)
