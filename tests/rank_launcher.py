"""What the tests' torchrun agents start for each rank: ``python -u rank_launcher.py SCRIPT ARGS...``.

The rank's ``python SCRIPT ARGS...`` then runs as a child of one of the pytest worker's fork servers
(:mod:`forkserver`), which have imported torch and torch._dynamo once, instead of importing them afresh: a rank of
the suite's small trainings spent 6 to 7 s of CPU on those imports and under a second on its training. The agent, its
rendezvous, its store and its signals are torchrun's own; this process stands where the agent expects its rank:

- the rank leads a session of its own, as torchrun starts its ranks, and writes to this process's stdout and stderr;
- the signals the agent sends this process (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) are sent on to the
  rank, and this process ends as the rank ended: with its exit code, or killed by the same signal;
- if this process is killed, the rank is killed (the server's monitor sees the connection close).

``tests/conftest.py``'s ``torchrun`` names the servers in ``PREEMPT_TEST_RANK_SERVERS`` (:func:`servers_named`:
their sockets, and the variables python and torch read at their start as the servers have them). Without it, or
where this environment sets those variables otherwise (besides the ones torchrun adds for its ranks), the rank
starts as a fresh ``python -u``, as torchrun would start it. Rank ``LOCAL_RANK`` takes the servers in turn, so
that the ranks of one run have different hash seeds.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import forkserver

RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# What torchrun adds to the ranks' environment that starts with one of forkserver.STARTUP_PREFIXES; none of them is
# read when python or torch start (the agent's store, its error file, NCCL's error handling at a group's creation).
ADDED_BY_TORCHRUN = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
SERVERS_VAR = "PREEMPT_TEST_RANK_SERVERS"


def servers_named() -> dict[str, str]:
    """For the environment of a torchrun whose ranks this launcher starts: the test process's servers (started)."""
    return {SERVERS_VAR: json.dumps({"sockets": forkserver.rank_servers(), "startup": forkserver.startup_vars()})}


def server_for(env: dict[str, str]) -> str | None:
    """The socket of the server this rank is forked from, or None when it must start fresh."""
    named = env.get(SERVERS_VAR)
    if not named:
        return None
    servers = json.loads(named)
    startup = {k: v for k, v in forkserver.startup_vars(env).items() if not k.startswith(ADDED_BY_TORCHRUN)}
    if startup != servers["startup"]:
        return None
    sockets = servers["sockets"]
    return sockets[int(env.get("LOCAL_RANK", "0")) % len(sockets)]


def main() -> None:
    script, *args = sys.argv[1:]
    env = dict(os.environ)
    path = server_for(env)
    if path is None:
        os.execv(sys.executable, [sys.executable, "-u", script, *args])
    # Handlers before the rank starts: a signal that comes while it starts is kept and sent on once it has started.
    # (The rank still starts with these signals at their defaults, as exec would leave it.)
    rank: forkserver.Forked | None = None
    pending: list[int] = []

    def relay(sig: int, _frame: object) -> None:
        if rank is None:
            pending.append(sig)
        else:
            rank.send_signal(sig)

    for sig in RELAYED:
        signal.signal(sig, relay)
    rank = forkserver.start_from(path, [sys.executable, script, *args], env, os.getcwd())
    for sig in pending:
        rank.send_signal(sig)
    code = rank.wait()
    if code < 0:  # killed by signal -code: so is this process
        try:
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL, which no process handles
        os.kill(os.getpid(), -code)
    sys.exit(code if code >= 0 else 128 - code)  # (a signal whose default is not to end a process: as a shell says it)


if __name__ == "__main__":
    main()
