"""torchrun and its ranks for the distributed tests: ports, the launch, the ranks' final states."""

from __future__ import annotations

import itertools
import os
import random
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import forkserver
import rank_launcher
import torch
from safetensors.torch import load_file

from .processes import RANK_LAUNCHER, TRAIN_DDP, Spawned


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (where bind(0) and every outgoing connection draw theirs)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def port_slice(worker: str | None, workers: int, ephemeral_low: int, lowest: int = 20000) -> range:
    """The ports below the ephemeral range that one xdist worker (``gw<N>``; None when not under xdist) hands out:
    the range [lowest, ephemeral_low) cut into ``workers`` equal slices, so two workers never pick the same port.
    Empty where the ephemeral range starts too low to leave room."""
    index = int(worker[2:]) if worker and worker[2:].isdigit() else 0
    workers = max(workers, index + 1)
    size = max(ephemeral_low - lowest, 0) // workers
    return range(lowest + index * size, lowest + (index + 1) * size)


_ports = port_slice(
    os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), _ephemeral_low()
)


_turns = itertools.count(random.randrange(len(_ports)) if len(_ports) else 0)  # a random start, then in turn


def free_port() -> int:
    """A TCP port for a rendezvous or a MASTER_PORT that nothing else takes before the job binds it (the default
    29500 would collide between the jobs and processes of the suite).

    Not one the kernel hands out (bind to 0): that comes from the ephemeral range, where every outgoing connection
    draws its local port too (gloo's, a TCPStore client's, the other xdist worker's processes), and between the pick
    and torchrun's bind, seconds later in a SLURM job, one of them took it once in CI: torchrun's agent found the port
    busy, turned client of a stranger's socket and hung. So the port comes from below that range, from this worker's
    own slice (a random start, then in turn), and is checked to be bindable now."""
    for _ in range(len(_ports)):
        port = _ports[next(_turns) % len(_ports)]
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:  # in use, or in TIME_WAIT
                continue
            return port
    with socket.socket() as s:  # no room below the ephemeral range on this machine: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks_by_hand(save_dir: Path, final: Path | None, args: Sequence[str], nproc: int = 2) -> list[Spawned]:
    """train_ddp.py as ``nproc`` processes started without torchrun (MASTER_ADDR/PORT, RANK, WORLD_SIZE set
    here): no agent that kills the other ranks when one dies, as across the nodes of a job."""
    cmd = [sys.executable, str(TRAIN_DDP), "--save_dir", str(save_dir), *args]
    if final is not None:
        cmd += ["--final_out", str(final)]
    env = {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}  # ranks other than 0 log only errors
    env |= {"MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
    return [Spawned(cmd, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(nproc)]


def torchrun(
    save_dir: Path,
    final: Path | None,
    args: Sequence[str],
    nproc: int = 2,
    script: Path = TRAIN_DDP,
    env: dict[str, str] | None = None,
) -> Spawned:
    """``torchrun --standalone --nproc_per_node=N script --save_dir ... [--final_out ...]``.

    The agent starts each rank through ``tests/rank_launcher.py``, which forks ``python script ...`` from a fork server
    (see there) where the agent itself is forked from one."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {"OMP_NUM_THREADS": "1", "PREEMPT_LOG_ALL_RANKS": "1", **(env or {})}  # each rank says where it stopped
    if forkserver.forkable(cmd, {**os.environ, **env}):
        env |= rank_launcher.servers_named()
        cmd.append(str(RANK_LAUNCHER))
    cmd += [str(script), "--save_dir", str(save_dir), *args]
    if final is not None:
        cmd += ["--final_out", str(final)]
    return Spawned(cmd, env)


def torchrun_nodes(
    save_dirs: Sequence[Path],
    final: Path | None,
    args: Sequence[str],
    env: dict[str, str] | None = None,
    script: Path = TRAIN_DDP,
) -> list[Spawned]:
    """One ``torchrun --nnodes=N --node_rank=i --nproc_per_node=1`` per save_dir, meeting on the loopback address:
    the ranks of several nodes, each with a save_dir of its own (as nodes without a shared filesystem)."""
    port = free_port()
    env = {"OMP_NUM_THREADS": "1", "PREEMPT_LOG_ALL_RANKS": "1", **(env or {})}
    spawned = []
    for node, save_dir in enumerate(save_dirs):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(save_dirs)}", f"--node_rank={node}"]
        cmd += ["--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}"]
        cmd += [str(script), "--save_dir", str(save_dir), *args]
        if final is not None:
            cmd += ["--final_out", str(final)]
        spawned.append(Spawned(cmd, env))
    return spawned


def ddp_finals(final: Path, nproc: int = 2) -> list[dict[str, torch.Tensor]]:
    """What each rank of train_ddp.py wrote at the end (``final.rank<R>.safetensors``)."""
    return [load_file(str(final.with_suffix(f".rank{r}{final.suffix}"))) for r in range(nproc)]


def assert_equal_finals(want: list[dict[str, torch.Tensor]], got: list[dict[str, torch.Tensor]]) -> None:
    for rank, (a, b) in enumerate(zip(want, got, strict=True)):
        assert a.keys() == b.keys(), (rank, sorted(a.keys() ^ b.keys()))
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        assert not differ, f"rank {rank}: {differ}"


def two_gloo_ranks(script: Path, source: str, store: Path, timeout: float = 120) -> list[str]:
    """``source`` written to ``script`` and run as ranks 0 and 1 of a gloo group (``argv``: the file store, the rank);
    each rank's standard output, once both exited 0."""
    script.write_text(source)
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(store), str(r)], stdout=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    out = [p.communicate(timeout=timeout)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], out
    return out

