"""A small FSDP2 training (``fully_shard`` on the CPU, gloo) for the sharded-state tests; run it with torchrun.

With one process (``--nproc_per_node=1``) the same model is left unsharded: a checkpoint written by 2 ranks
then loads into it through DCP's resharding. ``--dump_start`` / ``--final_out`` write, from rank 0, the full
(unsharded) model and optimizer state right after entering the run / at the end. ``--lora``: a fine-tuning, a frozen
base of ~4 MiB with low-rank adapters beside it (only the adapters and the head train).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import HOLD_LIMIT_S, Synthetic  # noqa: E402
from train_ddp import entered, leave, say, stop_told  # noqa: E402

from preempt import PreemptibleRun, _testing  # noqa: E402


def full_state(model, opt) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer, unsharded, keyed by name (a collective under FSDP)."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {f"model.{k}": v.clone() for k, v in msd.items()}
    for fqn, s in osd.get("state", {}).items():  # empty on ranks other than 0 (cpu_offload)
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{fqn}.{k}"] = v.clone().reshape(v.shape)
    return out


class Progress:
    """The loop's last step done, for the writer's hold: set by the loop, waited on by the fault point's hook."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.step = 0
        self.done = False

    def stepped(self, step: int) -> None:
        with self.cond:
            self.step = step
            self.cond.notify_all()

    def end(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify_all()


PROGRESS = Progress()


def hold_writes() -> None:
    """Each background write of a checkpoint's files waits until the loop has done the step after the checkpoint's
    (the fault point "write" of preempt._testing), so the loop has gone on during the write by construction; prints
    the checkpoint's step."""

    def hold(directory: Path) -> None:
        if threading.current_thread().name != "preempt-writer":
            return
        step = int(directory.name.split("step_")[1].split("-")[0])
        say(f"rank {dist.get_rank()} slow_write {step}")
        _testing.emit("slow_write", rank=dist.get_rank(), step=step)
        with PROGRESS.cond:
            PROGRESS.cond.wait_for(lambda: PROGRESS.step > step or PROGRESS.done, timeout=HOLD_LIMIT_S)

    _testing.install("write", hold)


class Adapted(torch.nn.Module):
    """A frozen linear layer and a trained low-rank update beside it (LoRA)."""

    def __init__(self, n_in: int, n_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = torch.nn.Linear(n_in, n_out)
        self.base.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(rank, n_in) / n_in**0.5)
        self.b = torch.nn.Parameter(torch.zeros(n_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def build(lora: bool) -> torch.nn.Module:
    if lora:
        return torch.nn.Sequential(
            Adapted(16, 1024), torch.nn.ReLU(), Adapted(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 2)
        )
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Linear(48, 2))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save_dir", required=True)
    p.add_argument("--final_out", default=None)
    p.add_argument("--dump_start", default=None)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--every_steps", type=int, default=4)
    p.add_argument("--self_signal", default=None, help="RANK:STEP: that rank sends itself SIGTERM before that step")
    p.add_argument("--resume", default="latest")
    p.add_argument("--slow_write", action="store_true", help="background writes wait for the loop's next step")
    p.add_argument("--lora", action="store_true", help="a frozen base of ~4 MiB with trained adapters")
    p.add_argument("--keep_last", type=int, default=2)
    p.add_argument("--kill_at", default=None, help="RANK:STEP: that rank SIGKILLs itself before that step")
    p.add_argument("--sync_save", action="store_true", help="async_save=False")
    p.add_argument("--mirror", default=None, help="mirror= (the AWS variables of the environment)")
    p.add_argument("--poke_base", default=None, help="RANK:STEP: that rank adds 1 to a frozen value through .data")
    args = p.parse_args()
    if args.slow_write:
        hold_writes()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = Synthetic(128, 16, augment=False)
    model = build(args.lora)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    signal_rank, signal_step = map(int, args.self_signal.split(":")) if args.self_signal else (-1, -1)
    kill_rank, kill_step = map(int, args.kill_at.split(":")) if args.kill_at else (-1, -1)
    poke_rank, poke_step = map(int, args.poke_base.split(":")) if args.poke_base else (-1, -1)

    kw = dict(
        checkpoint_interval=None,
        checkpoint_every_steps=args.every_steps,
        resume=args.resume,
        keep_last=args.keep_last,
        async_save=not args.sync_save,
        mirror=args.mirror,
    )
    with PreemptibleRun(args.save_dir, model=model, optimizer=opt, **kw) as run, stop_told(run):
        if args.dump_start:
            start = full_state(model, opt)
            if rank == 0:
                save_file(start, args.dump_start)
        say(f"rank {rank} start step {run.global_step} world {world}")
        entered(run, world=world)
        loader = DataLoader(data, batch_size=8, sampler=run.sampler(data, shuffle=True, seed=1))
        for _epoch in run.epochs(args.epochs):
            for x, y in run.batches(loader):
                if rank == signal_rank and run.global_step + 1 == signal_step:
                    os.kill(os.getpid(), 15)
                if rank == poke_rank and run.global_step + 1 == poke_step:  # behind autograd: no version bump
                    weight = model[0].base.weight
                    local = weight.to_local() if hasattr(weight, "to_local") else weight
                    local.data[0, 0] += 1.0
                if rank == kill_rank and run.global_step + 1 == kill_step:
                    os.kill(os.getpid(), 9)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                say(f"rank {rank} step {run.global_step + 1}")
                _testing.emit("step", rank=rank, step=run.global_step + 1, epoch=run.epoch, batch=run.batch)
                PROGRESS.stepped(run.global_step + 1)
                run.step()
    PROGRESS.end()
    final = full_state(model, opt)
    if args.final_out and rank == 0:
        save_file(final, args.final_out)
    leave(rank)


if __name__ == "__main__":
    main()
