"""A small DDP training (gloo, CPU) in a Ray Train ``TorchTrainer``, for tests/process/test_ray.py.

``--ray``: the script starts a local Ray cluster of its own on 127.0.0.1 (``ray.cluster_utils.Cluster``: a head without
CPUs, where the driver and Ray Train's controller run, and two nodes of 2 CPUs), runs ``loop`` on 2 workers (both on one
node: Ray packs them; ``--spread``: one on each), writes what Ray says at the end (``--result``, JSON) and stops the
cluster. Without ``--ray`` the same ``loop`` runs under torchrun: the uninterrupted reference.

What the first attempt does to itself (a file in ``--events``' directory marks it done, so a restart does not again):
``--hold_at STEP``: rank 0 holds before that step's ``run.step()`` (event ``holding``) until its run is asked to stop
(the test's SIGTERM to the job: to this worker, or the driver's word); ``--drain_at STEP:SECONDS``: before that step's
``run.step()``, rank 0 drains its own node for preemption (``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds SECONDS``) and holds until the run has heard it (its stop flag raised), so the stop lands
at that step; ``--die_at RANK:STEP[:SIGNAL]``: that rank sends its worker process SIGKILL (or SIGNAL, and holds until
its run has heard it) before that step's forward. Each rank appends its events to ``--events`` (JSON lines): ``driver``
(its pid), ``entered``, ``step``, ``durable`` (rank 0: its newest durable checkpoint, when it changed), ``drained``,
``holding`` and ``stopped`` with wall-clock times. At the end each rank writes ``--final_out`` with ``.rank<R>``
inserted (the model, the optimizer, the RNG, the samples rank 0 saw), as tests/scripts/train_ddp.py does. The driver
runs the trainer through ``preempt.ray.fit``; a cluster that cannot start is said in ``--result``
(``ray_did_not_start``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
from train import Synthetic, flatten, wait_for_stop  # noqa: E402

from preempt import PreemptibleRun  # noqa: E402
from preempt.errors import Preempted  # noqa: E402


class Indexed(Synthetic):
    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        return x, y, i


def tell(events: str | None, event: str, **fields) -> None:
    if events:
        line = json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields}) + "\n"
        with open(events, "a") as f:  # one write per line: the ranks append to one file
            f.write(line)


def first_time(events: str | None, what: str) -> bool:
    """True once per cluster run: the file beside the events marks ``what`` done."""
    if not events:
        return False
    try:
        Path(f"{events}.{what}").touch(exist_ok=False)
        return True
    except FileExistsError:
        return False


def _node() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


def drain_own_node(seconds: int) -> None:
    import ray

    node = ray.get_runtime_context().get_node_id()
    address = ray.get_runtime_context().gcs_address
    cmd = ["ray", "drain-node", "--address", address, "--node-id", node, "--reason", "DRAIN_NODE_REASON_PREEMPTION"]
    cmd += ["--reason-message", "test: spot reclaim", "--deadline-remaining-seconds", str(seconds)]
    subprocess.run(cmd, check=True, capture_output=True)


def loop(config: dict) -> None:
    """The training loop of every rank (under Ray Train or torchrun)."""
    import preempt.ray

    under_ray = config.get("ray", False)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    events = config.get("events")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = Indexed(config["samples"], 16, augment=False)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 2))
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    drain_step, drain_s = map(int, config["drain_at"].split(":")) if config.get("drain_at") else (-1, 0)
    die_rank, die_step, die_sig = (
        (*map(int, config["die_at"].split(":")), 9)[:3] if config.get("die_at") else (-1, -1, 9)
    )
    hold_step = config.get("hold_at") or -1
    save_dir = preempt.ray.save_dir() if under_ray else config["save_dir"]
    run = PreemptibleRun(
        save_dir, model=ddp, optimizer=opt, checkpoint_interval=None, checkpoint_every_steps=config.get("every")
    )
    seen: list[int] = []
    durable = None  # rank 0: the newest durable checkpoint it has told of
    node = _node() if under_ray else "-"
    with preempt.ray.reporting(run) if under_ray else run:
        tell(events, "entered", rank=rank, step=run.global_step, resumed_from=str(run.resumed_from), node=node)
        seen = run.user_state.setdefault(f"seen_rank{rank}", [])
        loader = DataLoader(data, batch_size=8, sampler=run.sampler(data, shuffle=True, seed=5))
        try:
            for _ in run.epochs(config["epochs"]):
                for x, y, idx in run.batches(loader):
                    step = run.global_step + 1
                    if rank == die_rank and step == die_step and first_time(events, "died"):
                        tell(events, "dying", rank=rank, step=step, signal=die_sig)
                        os.kill(os.getpid(), die_sig)
                        if die_sig != 9:
                            wait_for_stop(run)  # heard by preempt's handler (unless Ray's ends the worker first)
                    loss = torch.nn.functional.cross_entropy(ddp(x), y) + torch.randn(()) * 1e-3
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    seen.extend(idx.tolist())
                    if rank == 0 and step == hold_step and first_time(events, "held"):
                        tell(events, "holding", rank=rank, step=step)
                        wait_for_stop(run)  # the test's SIGTERM to the job (to this process, or the driver's word)
                        tell(events, "heard", rank=rank, step=step)
                    if rank == 0 and step == drain_step and first_time(events, "drained"):
                        t = time.time()
                        drain_own_node(drain_s)
                        tell(events, "drained", rank=rank, step=step, t_drain=t, deadline=t + drain_s, node=node)
                        wait_for_stop(run)
                        tell(events, "heard", rank=rank, step=step)
                    run.step()
                    tell(events, "step", rank=rank, step=run.global_step)
                    if rank == 0 and run.last_checkpoint is not None and run.last_checkpoint != durable:
                        durable = run.last_checkpoint
                        tell(events, "durable", rank=rank, step=run.global_step, checkpoint=str(durable))
        except Preempted as e:
            tell(events, "stopped", rank=rank, step=run.global_step, checkpoint=str(e.checkpoint), cause=e.cause)
            raise
    if config.get("final_out"):
        out: dict[str, torch.Tensor] = {}
        flatten("model", model.state_dict(), out)
        flatten("optimizer", opt.state_dict(), out)
        out["rng.torch"] = torch.get_rng_state()
        if rank == 0:
            out["seen"] = torch.tensor(seen, dtype=torch.int64)
        final = Path(config["final_out"])
        save_file(out, str(final.with_suffix(f".rank{rank}{final.suffix}")))
    tell(events, "done", rank=rank, step=run.global_step)
    if not under_ray:
        dist.barrier()
        dist.destroy_process_group()


def on_ray(args: argparse.Namespace, config: dict) -> None:
    import ray
    from ray.cluster_utils import Cluster
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import preempt.ray

    t0 = time.monotonic()
    cluster = Cluster()
    try:
        try:  # every port Ray's choice (the head's agent too: other tests may run a cluster beside this one)
            cluster.add_node(num_cpus=0, include_dashboard=False, dashboard_agent_listen_port=None)
            for _ in range(2):
                cluster.add_node(num_cpus=2)
            # RAY_ADDRESS in the job's processes: Ray Train's helpers that look for "the" cluster (its placement group
            # cleaner) must not find another test's
            ray.init(address=cluster.address, runtime_env={"env_vars": {"RAY_ADDRESS": cluster.address}})
            cluster.wait_for_nodes()
        except Exception as e:  # the test skips, saying why
            Path(args.result).write_text(json.dumps({"ray_did_not_start": f"{type(e).__name__}: {e}"}))
            return
        up_s = time.monotonic() - t0
        tell(args.events, "driver", pid=os.getpid())
        trainer = TorchTrainer(
            loop,
            train_loop_config={**config, "ray": True},
            scaling_config=ScalingConfig(num_workers=2, placement_strategy="SPREAD" if args.spread else "PACK"),
            run_config=RunConfig(
                storage_path=args.storage,
                name="job",
                failure_config=FailureConfig(max_failures=args.max_failures),
            ),
        )
        t1 = time.monotonic()
        result = preempt.ray.fit(trainer)  # a SIGTERM to the driver: the workers stop and save, then it exits 75
        ckpt = result.checkpoint
        Path(args.result).write_text(
            json.dumps(
                {
                    "checkpoint": None if ckpt is None else ckpt.path,
                    "metrics": result.metrics,
                    "error": None if result.error is None else repr(result.error),
                    "cluster_up_s": up_s,
                    "fit_s": time.monotonic() - t1,
                }
            )
        )
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ray", action="store_true")
    p.add_argument("--storage", help="--ray: RunConfig(storage_path=...)")
    p.add_argument("--result", help="--ray: what Ray said at the end (JSON)")
    p.add_argument("--max_failures", type=int, default=2)
    p.add_argument("--spread", action="store_true", help="--ray: one worker on each node (Ray packs them by default)")
    p.add_argument("--save_dir", help="under torchrun")
    p.add_argument("--final_out")
    p.add_argument("--events")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--every", type=int, default=None, help="checkpoint_every_steps")
    p.add_argument("--drain_at", default=None, help="STEP:SECONDS")
    p.add_argument("--die_at", default=None, help="RANK:STEP[:SIGNAL], SIGKILL by default")
    p.add_argument("--hold_at", type=int, default=None, help="rank 0 holds before this step until asked to stop")
    args = p.parse_args()
    config = {k: getattr(args, k) for k in ("save_dir", "final_out", "events", "epochs", "samples", "every")}
    config |= {"drain_at": args.drain_at, "die_at": args.die_at, "hold_at": args.hold_at}
    if args.ray:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every node on 127.0.0.1 (read when ray is imported)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")])  # the workers'
        on_ray(args, config)
    else:
        loop(config)


if __name__ == "__main__":
    main()
