"""A small DDP training (gloo, CPU) for the distributed tests; run it with torchrun.

Every rank prints ``rank R step N epoch E batch B`` per step. At the end each
rank writes ``--final_out`` with ``.rank<R>`` inserted before the suffix: the
model and optimizer (every rank holds the replicated copy), its RNG states,
its losses and the global sample indices it trained on.

Each rank tells the test its own events (``preempt._testing.emit``, with ``rank``): ``entered`` (the step, epoch and
batch it starts at, its SLURM node, the checkpoint it resumed from), ``step`` (with the sample indices it trained on),
``stopped`` (its stop: the step and what its ``Preempted`` says), ``holding``, ``waiting`` and ``fail_write``. The
run's own markers (``stop``, ``resume``, ``checkpoint``, ...) are rank 0's history alone. train_fsdp.py and
train_accelerate.py tell theirs with the same functions.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import HOLD_LIMIT_S, Synthetic, flatten, signal_at, wait_for_file, wait_for_stop  # noqa: E402

from preempt import PreemptibleRun, _testing  # noqa: E402
from preempt.errors import Preempted  # noqa: E402


class Indexed(Synthetic):
    """The Synthetic data, each item with its index (to check which samples every rank saw)."""

    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        return x, y, i


NODE = os.environ.get("SLURMD_NODENAME", "-")  # the SLURM node this rank runs on


def say(line: str) -> None:
    """One write per line: the ranks share the agent's stdout, and two writes could interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def entered(run: PreemptibleRun, **fields) -> None:
    """The event ``entered``: the rank's step, epoch and batch once in the run, its SLURM node (``-`` outside SLURM),
    the checkpoint it resumed from (None: a fresh start) and ``fields``."""
    where = {"step": run.global_step, "epoch": run.epoch, "batch": run.batch, "node": NODE}
    resumed = None if run.resumed_from is None else str(run.resumed_from)
    _testing.emit("entered", rank=run.rank, **where, resumed_from=resumed, **fields)


@contextlib.contextmanager
def stop_told(run: PreemptibleRun) -> Iterator[None]:
    """Around the loop, inside the run: the rank's stop as the event ``stopped``, its step and what its Preempted
    says (``cause``: a signal's name, ``"signal"`` for a stop another rank's signal asked for, ``"walltime"``)."""
    try:
        yield
    except Preempted as e:
        where = {"step": run.global_step, "epoch": run.epoch, "batch": run.batch}
        said = {"cause": e.cause, "code": e.code, "requeued": e.requeued, "checkpoint": e.checkpoint}
        _testing.emit("stopped", rank=run.rank, **where, **said)
        raise


_LAST_WORK: list[dist.Work] = []


def leave(rank: int) -> None:
    """Says ``rank R done`` and ends the process group at a last barrier. The barrier's work is kept until the
    process ends, so that the main thread destroys it (and the works it waited for) with the GIL:
    preempt/cluster/distributed.py, "Works destroyed in the main thread"."""
    say(f"rank {rank} done")
    _LAST_WORK.append(dist.barrier(async_op=True))
    _LAST_WORK[-1].wait()
    dist.destroy_process_group()


def fail_write(n: int) -> None:
    """Rank 0's n-th background write of its files fails as on a full disk; prints the checkpoint's step.

    The fault point ``write`` of ``preempt._testing``: reached by the background writer before it writes a
    checkpoint's files (``CheckpointManager.save_into``), not by the synchronous distributed commit.
    """
    calls = [0]

    def failing(directory):
        if threading.current_thread().name != "preempt-writer":
            return  # a synchronous save's (the stop's): not a background write
        calls[0] += 1
        if calls[0] == n:
            step = int(directory.name.split("step_")[1].split("-")[0])
            say(f"rank 0 fail_write step {step}")
            _testing.emit("fail_write", rank=0, step=step)
            raise OSError(errno.ENOSPC, "No space left on device (injected)", str(directory))

    _testing.install("write", failing)


def wait_file_in_restart(spec: str, rank: int) -> None:
    """``N:FILE``: in the run whose SLURM_RESTART_COUNT is N (0 for the first), the rank says ``rank R waiting`` and
    waits, after the run is entered (its walltime keeper armed) and before its first step, until FILE exists (made by
    the test once it has done what must happen meanwhile), at most HOLD_LIMIT_S. No stop can come before a step."""
    restart, _, path = spec.partition(":")
    if int(os.environ.get("SLURM_RESTART_COUNT", "0")) != int(restart):
        return
    say(f"rank {rank} waiting for {path}")
    _testing.emit("waiting", rank=rank, point="restart", n=int(restart), path=path)
    wait_for_file(path)
    say(f"rank {rank} went on")


def settle(run: PreemptibleRun, rank: int) -> None:
    """After a step that took a checkpoint, the loop waits until that write has ended, so that every save is taken
    when it is due, however slow the machine, instead of being postponed behind a write still in flight. Rank 0
    writes in the background; the other ranks meet it at the next step's all-reduce."""
    if run.last_save is not None and run.last_save.step == run.global_step:
        run.wait_for_checkpoint(HOLD_LIMIT_S)
        say(f"rank {rank} settled at step {run.global_step}")


def pause(seconds: float) -> None:
    """SIGSTOPs this process; a detached shell continues it ``seconds`` later (the fault's length, not a wait)."""
    _testing.emit("paused", rank=dist.get_rank(), seconds=seconds, pid=os.getpid())
    cont = f"sleep {seconds:g}; kill -CONT {os.getpid()}"
    subprocess.Popen(["/bin/sh", "-c", cont], start_new_session=True, stdout=subprocess.DEVNULL)
    os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save_dir", required=True, help="{node}: the SLURM node's name (a save_dir per node)")
    p.add_argument("--final_out", default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=192)
    p.add_argument("--batch_size", type=int, default=8, help="per rank")
    p.add_argument("--every_steps", type=int, default=None)
    p.add_argument("--step_sleep", type=float, default=0.0)
    p.add_argument("--self_signal", default=None, help="RANK:STEP: that rank sends itself SIGTERM before that step")
    p.add_argument("--die_at", default=None, help="RANK:STEP: that rank SIGKILLs itself before that step's forward")
    p.add_argument(
        "--pause_at",
        default=None,
        help="RANK:STEP:SECONDS: that rank SIGSTOPs itself before that step's forward, continued SECONDS later",
    )
    p.add_argument("--collective_timeout_s", type=float, default=None, help="init_process_group's timeout")
    p.add_argument("--signal_at", default=None, help="STAGE:N:SIG, as in train.py (on every rank)")
    p.add_argument("--signal_rank", type=int, default=None, help="apply --signal_at on this rank only")
    p.add_argument("--sync_save", action="store_true", help="async_save=False")
    p.add_argument("--resume", default="latest", help="latest, best, a step number or a path")
    p.add_argument("--weights_only", action="store_true")
    p.add_argument("--fail_write", type=int, default=None, help="rank 0's N-th background write fails (ENOSPC)")
    p.add_argument(
        "--settle_saves",
        action="store_true",
        help="after each step that took a checkpoint, wait until its background write has ended (durable or failed)",
    )
    p.add_argument("--frozen", action="store_true", help="a frozen part of ~4 MiB before the trained layers")
    p.add_argument("--keep_last", type=int, default=2)
    p.add_argument("--save_dir_per_rank", action="store_true", help="each rank its own SAVE_DIR/rank<R> (refused)")
    p.add_argument(
        "--hold_until_stop",
        type=int,
        default=None,
        help="in the first SLURM run, each rank holds before step N's run.step() until a stop was requested",
    )
    p.add_argument("--mirror", default=None, help="mirror= (the AWS variables of the environment)")
    p.add_argument(
        "--wait_file_in_restart", default=None, help="N:FILE: in SLURM restart N, wait for FILE before the first step"
    )
    args = p.parse_args()

    timeout = None if args.collective_timeout_s is None else datetime.timedelta(seconds=args.collective_timeout_s)
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    if args.signal_at and (args.signal_rank is None or args.signal_rank == rank):
        signal_at(args.signal_at)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    np.random.seed(0)
    data = Indexed(args.samples, 16, augment=False)
    if args.frozen:  # a fine-tuning under DDP: the frozen layers are in no optimizer, so in base.safetensors
        frozen = torch.nn.Sequential(torch.nn.Linear(16, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
        frozen.requires_grad_(False)
        model = torch.nn.Sequential(frozen, torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 2))
    else:
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 2))
    ddp = DDP(model)
    opt = torch.optim.AdamW([q for q in ddp.parameters() if q.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
    signal_rank, signal_step = map(int, args.self_signal.split(":")) if args.self_signal else (-1, -1)
    die_rank, die_step = map(int, args.die_at.split(":")) if args.die_at else (-1, -1)
    pause_rank, pause_step, pause_s = map(float, args.pause_at.split(":")) if args.pause_at else (-1, -1, 0.0)
    if args.fail_write is not None and rank == 0:
        fail_write(args.fail_write)

    save_dir = args.save_dir.replace("{node}", NODE)
    with (
        PreemptibleRun(
            f"{save_dir}/rank{rank}" if args.save_dir_per_rank else save_dir,
            model=ddp,
            optimizer=opt,
            scheduler=sched,
            checkpoint_interval=None,
            checkpoint_every_steps=args.every_steps,
            keep_last=args.keep_last,
            async_save=not args.sync_save,
            resume=int(args.resume) if args.resume.isdigit() else args.resume,
            weights_only=args.weights_only,
            mirror=args.mirror,
        ) as run,
        stop_told(run),
    ):
        run.user_state.setdefault("losses", [])
        seen = run.user_state.setdefault(f"seen_rank{rank}", [])  # rank 0's user_state is the one saved
        sampler = run.sampler(data, shuffle=True, seed=5)
        loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
        say(f"rank {rank} start step {run.global_step} epoch {run.epoch} batch {run.batch} node {NODE}")
        entered(run)
        if args.wait_file_in_restart:
            wait_file_in_restart(args.wait_file_in_restart, rank)
        for _epoch in run.epochs(args.epochs):
            for x, y, idx in run.batches(loader):
                if rank == signal_rank and run.global_step + 1 == signal_step:
                    os.kill(os.getpid(), 15)
                if rank == die_rank and run.global_step + 1 == die_step:
                    os.kill(os.getpid(), 9)  # the others' next collective is DDP's all-reduce in backward()
                if rank == pause_rank and run.global_step + 1 == pause_step:
                    pause(pause_s)  # a rank frozen (a swap storm, a stopped VM): the others' all-reduce times out
                loss = torch.nn.functional.cross_entropy(ddp(x), y) + torch.randn(()) * 1e-3
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                run.user_state["losses"].append(loss.item())
                seen.extend(idx.tolist())
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                ids = ",".join(map(str, idx.tolist()))
                say(f"rank {rank} step {run.global_step + 1} epoch {run.epoch} batch {run.batch} idx {ids}")
                where = {"step": run.global_step + 1, "epoch": run.epoch, "batch": run.batch}
                _testing.emit("step", rank=rank, **where, idx=idx.tolist())
                if args.hold_until_stop == run.global_step + 1 and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
                    say(f"rank {rank} holding at step {args.hold_until_stop}")
                    _testing.emit("holding", rank=rank, point="step", n=args.hold_until_stop, pid=os.getpid())
                    wait_for_stop(run)
                run.step()
                if args.settle_saves:
                    settle(run, rank)

    if args.final_out:
        out: dict[str, torch.Tensor] = {}
        flatten("model", model.state_dict(), out)
        flatten("optimizer", opt.state_dict(), out)
        out["rng.torch"] = torch.get_rng_state()
        if rank == 0:  # only rank 0's user_state is saved
            out["seen"] = torch.tensor(seen, dtype=torch.int64)
        final = Path(args.final_out)
        save_file(out, str(final.with_suffix(f".rank{rank}{final.suffix}")))
    leave(rank)


if __name__ == "__main__":
    main()
