"""Lightning Fabric's image-classifier loop (tests/scripts/train_fabric.py: ``fabric.setup(model, optimizer)``,
``fabric.setup_dataloaders``, ``fabric.backward``) as real processes stopped by real signals: SIGTERM to the process,
SIGTERM to its whole group while DataLoader workers run, SIGKILL after a durable checkpoint, and, on two CPU processes
that ``fabric.launch()`` starts (``strategy="ddp"``), SIGTERM to one of them. Each rerun ends bit-exact with the
uninterrupted run: ``torch.equal`` on every tensor of the plain model, the optimizer, the scheduler and the process's
RNG.

Fabric's loader wrapper calls ``set_epoch`` with its own count of iterations in the process, which a resumed process
begins at 0: without the run's hold on the epoch, a process resumed in epoch 1 ran it in epoch 0's order, with epoch
0's per-sample draws, and ended with 25 of its 57 tensors different. Both of the script's loaders are tried:
``run.sampler()`` inside a DataLoader (the guide's recipe) and the example's plain ``shuffle=True`` DataLoader, which
Fabric gives a ``DistributedSampler`` under DDP.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("lightning.fabric", reason="Lightning Fabric is not installed (pip install -e '.[lightning]')")

from helpers import (  # noqa: E402
    PREEMPTED,
    ROOT,
    Interrupt,
    Spawned,
    assert_equal_finals,
    assert_same_final,
    ddp_finals,
    free_port,
    in_step,
    on,
    run_interrupted,
    train_cmd,
)
from helpers.reference import References, run_to_end  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from preempt.checkpoint.manager import CheckpointManager  # noqa: E402

TRAIN_FABRIC = ROOT / "tests" / "scripts" / "train_fabric.py"
ARGS = ["--epochs", "3"]  # 128 samples in batches of 8: 16 steps an epoch, 48 in all (24 on each of two processes)
LOADERS = {"run.sampler": ["--loader", "sampler"], "shuffle=True": ["--loader", "shuffle"]}


def final(d: Path) -> Path:
    return d / "final.rank0.safetensors"


def uninterrupted(reference: References, loader: str, extra: tuple[str, ...] = ()) -> Path:
    return final(reference([*ARGS, *LOADERS[loader], *extra], TRAIN_FABRIC).parent)


@pytest.mark.parametrize("loader", list(LOADERS))
def test_sigterm_mid_epoch_resumes_bit_exact(tmp_path, reference, loader):
    """The signal in step 22 (epoch 1, batch 6): exit 75 with one checkpoint there; the rerun resumes at it, in
    epoch 1's order (Fabric's loader counts this process's first iteration as its epoch 0) and ends bit-exact."""
    args = [*ARGS, *LOADERS[loader]]
    history = run_interrupted(
        tmp_path / "run", tmp_path / "final.safetensors", args, [in_step(22)], script=TRAIN_FABRIC
    )
    assert history.codes == [PREEMPTED, 0], history.text
    assert [(e["step"], e["reason"]) for e in history.events_of("saving")][:1] == [(22, "preempt")]
    assert [e["step"] for e in history.events_of("resume")] == [22], history.events_of("resume")
    steps = [(e["epoch"], e["batch"]) for e in history.events[1] if e["event"] == "step"]
    assert steps[0] == (1, 7) and len(steps) == 48 - 22, steps
    assert_same_final(uninterrupted(reference, loader), final(tmp_path))


def test_sigkill_after_a_durable_checkpoint_resumes_bit_exact(tmp_path, reference):
    """Checkpoints every 4 steps, each waited for; SIGKILL in step 22: the rerun goes on from step 20."""
    args = [*ARGS, *LOADERS["run.sampler"], "--every_steps", "4", "--settle_saves"]
    kill = Interrupt(after=on("entered"), sig=signal.SIGKILL, args=("--signal_at", "step:22:KILL"))
    history = run_interrupted(tmp_path / "run", tmp_path / "final.safetensors", args, [kill], script=TRAIN_FABRIC)
    assert history.codes == [-signal.SIGKILL, 0], history.text
    assert [e["step"] for e in history.events_of("resume")] == [20], history.events_of("resume")
    assert_same_final(uninterrupted(reference, "run.sampler"), final(tmp_path))
    # the checkpoint holds the plain model, as fabric.setup() had it before wrapping: no _forward_module. prefix
    for ckpt in (tmp_path / "run").glob("step_*"):
        plain = {k.removeprefix("model.") for k in load_file(str(final(tmp_path))) if k.startswith("model.")}
        assert set(load_file(str(ckpt / "model.safetensors"))) == plain, ckpt


def test_sigterm_to_the_group_with_workers_resumes_bit_exact(tmp_path, reference):
    """Two DataLoader workers inside Fabric's loader, SIGTERM to the whole process group (as ``timeout`` and SLURM
    send it): the workers are shielded, the process stops at the step (exit 75); the rerun, with workers again, ends
    equal to the run without any (each sample's draws are seeded by the run, whoever loads it)."""
    args = [*ARGS, *LOADERS["run.sampler"], "--workers", "2"]
    cmd = train_cmd(tmp_path / "run", tmp_path / "final.safetensors", [*args, "--hold_at", "step:27"], TRAIN_FABRIC)
    p = Spawned(cmd, session=True)
    assert p.wait_event("holding", point="step", n=27) is not None, p.output
    os.killpg(p.proc.pid, signal.SIGTERM)
    assert p.finish() == PREEMPTED, p.output
    assert "exited unexpectedly" not in p.output
    assert [e["step"] for e in p.events_of("saving")] == [27]
    again = Spawned(train_cmd(tmp_path / "run", tmp_path / "final.safetensors", args, TRAIN_FABRIC))
    assert again.finish() == 0, again.output
    assert_same_final(uninterrupted(reference, "run.sampler"), final(tmp_path))


# ------------------------------------------------------------------ two processes: fabric.launch(), strategy="ddp"


def launched(save_dir: Path, final_out: Path | None, args: list[str]) -> Spawned:
    """``python train_fabric.py --devices 2``: Fabric's launcher starts process 1 itself, as a child of process 0
    (both print into one stream); the rendezvous on a port of this worker's."""
    cmd = train_cmd(save_dir, final_out, [*args, "--devices", "2"], TRAIN_FABRIC)
    return Spawned(cmd, {"MASTER_PORT": str(free_port())})


def ddp_uninterrupted(reference: References, args: list[str]) -> list:
    def make(d: Path) -> None:
        run_to_end(launched(d / "run", d / "final.safetensors", args))

    return ddp_finals(reference.made(("fabric.launch", "2", str(TRAIN_FABRIC), *args), make) / "final.safetensors")


@pytest.mark.distributed
@pytest.mark.parametrize("loader", ["run.sampler", pytest.param("shuffle=True", marks=pytest.mark.slow)])
def test_sigterm_to_one_of_two_processes_stops_both_at_one_step_and_resumes_bit_exact(tmp_path, reference, loader):
    """Process 1 holds in its step 13 (epoch 1 of 8-step epochs) until the test's SIGTERM to it alone: both stop
    at one step with one checkpoint, exit 75, and the rerun ends bit-exact on each process. With ``shuffle=True``
    Fabric's own DistributedSampler takes the run's epoch (Fabric's count is set to it)."""
    args = [*ARGS, *LOADERS[loader]]
    want = ddp_uninterrupted(reference, args)
    save_dir, final_out = tmp_path / "run", tmp_path / "final.safetensors"
    p = launched(save_dir, final_out, [*args, "--hold_at", "step:13", "--hold_rank", "1"])
    held = p.wait_event("holding", point="step", n=13, timeout=300)
    assert held is not None, p.output
    os.kill(held["pid"], signal.SIGTERM)
    assert p.finish(timeout=300) == PREEMPTED, p.output
    stops = [(e["rank"], e["step"]) for e in p.events_of("stopped", code=PREEMPTED)]
    assert sorted(r for r, _ in stops) == [0, 1] and stops[0][1] == stops[1][1], f"both at one step\n{p.events}"
    step = stops[0][1]
    assert [i.step for i in CheckpointManager(save_dir, owner=False).list()] == [step] and step >= 13, p.output
    again = launched(save_dir, final_out, args)
    assert again.finish(timeout=300) == 0, again.output
    assert again.events_of("resume", step=step), again.events
    assert_equal_finals(want, ddp_finals(final_out))


# ------------------------------------------------------------------ what cannot hold is refused


def test_fabric_s_distributed_sampler_around_run_sampler_is_refused(tmp_path):
    """Under DDP ``fabric.setup_dataloaders(loader)`` wraps a sampler of the user's in its DistributedSamplerWrapper,
    which shards ``run.sampler()``'s shard again: the first epoch refuses it and says to pass
    ``use_distributed_sampler=False``. The wrapper made here is the one Fabric makes (its own static method)."""
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.utilities.data import _update_dataloader
    from torch.utils.data import DataLoader

    from preempt import PreemptError, PreemptibleRun

    fabric = Fabric(accelerator="cpu", devices=1)
    with PreemptibleRun(tmp_path / "run", model=torch.nn.Linear(2, 2)) as run:
        loader = DataLoader(range(8), batch_size=2, sampler=run.sampler(range(8)))
        loader = _update_dataloader(loader, Fabric._get_distributed_sampler(loader, num_replicas=2, rank=0))
        wrapped = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
        for _ in run.epochs(1):
            with pytest.raises(PreemptError, match="use_distributed_sampler=False"):
                next(iter(run.batches(wrapped)))
