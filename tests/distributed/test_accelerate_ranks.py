"""Accelerate's checkpointing loop on two processes (gloo on the CPU), everything through ``accelerator.prepare``:
a SIGTERM to one process stops both at one step with one checkpoint, and the rerun is bit-exact on each process
(``torch.equal`` on every tensor of the unwrapped model, the optimizer, the scheduler and its RNG).

The processes are started by torchrun, which Accelerate takes as its own launch (``accelerate launch --multi_gpu``
runs torchrun's agent too: the last test, under ``-m slow``). Accelerate's loader shards the batches (whole batches
per process, split batches, uneven last batches) or dispatches them from process 0: each configuration resumes in
preempt's order, sharded as Accelerate shards.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install -e '.[hf]')")

import torch  # noqa: E402
from helpers import PREEMPTED, TRAIN_ACCELERATE, Spawned, assert_equal_finals, ddp_finals, free_port, torchrun  # noqa: E402
from helpers.reference import References  # noqa: E402

from preempt.checkpoint.manager import CheckpointManager  # noqa: E402

pytestmark = pytest.mark.distributed

# 70 samples in batches of 4: 18 batches, 9 for each process (Accelerate evens them), a step every 2 micro-batches
ARGS = ["--accumulate", "2", "--precision", "bf16"]
CONFIGS = {
    "whole-batches": [],
    "split-batches": ["--split_batches"],
    "uneven-batches": ["--uneven"],
    "dispatched": ["--dispatch_batches", "--drop_last"],
}


def uninterrupted(reference: References, config: str) -> list[dict[str, torch.Tensor]]:
    """Each process's final state of the uninterrupted run of ``config``."""
    return ddp_finals(reference.torchrun([*ARGS, *CONFIGS[config]], script=TRAIN_ACCELERATE))


def stop_one_process_and_rerun(save_dir: Path, final: Path, args: list[str], launch) -> int:
    """Process 1 holds in its 5th batch (the first micro-batch of step 3) until the test's SIGTERM to it alone; both
    processes stop at one step with one checkpoint; the rerun completes. Returns the step of the stop."""
    p = launch(save_dir, final, [*args, "--hold_at", "step:5", "--hold_rank", "1"])
    held = p.wait_event("holding", point="step", n=5, timeout=300)
    assert held is not None, p.output
    os.kill(held["pid"], signal.SIGTERM)
    assert p.finish(timeout=300) != 0, p.output
    stops = [(e["rank"], e["step"]) for e in p.events_of("stopped", code=PREEMPTED)]  # each process's
    assert sorted(r for r, _ in stops) == [0, 1] and stops[0][1] == stops[1][1], f"both at one step\n{p.events}"
    step = stops[0][1]
    infos = CheckpointManager(save_dir, owner=False).list()
    assert [i.step for i in infos] == [step] and step >= 3, p.output
    assert {"rank_00001.json", "model.safetensors"} <= set(infos[0].manifest.files)
    again = launch(save_dir, final, args)
    assert again.finish(timeout=300) == 0, again.output
    assert again.events_of("resume", step=step), again.events
    return step


def by_torchrun(save_dir: Path, final: Path, args: list[str]) -> Spawned:
    return torchrun(save_dir, final, args, script=TRAIN_ACCELERATE)


@pytest.mark.parametrize(
    "config", ["whole-batches", *(pytest.param(c, marks=pytest.mark.slow) for c in list(CONFIGS)[1:])]
)
def test_sigterm_to_one_process_stops_both_and_resumes_bit_exact(tmp_path, reference, config):
    want = uninterrupted(reference, config)
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    stop_one_process_and_rerun(save_dir, final, [*ARGS, *CONFIGS[config]], by_torchrun)
    assert_equal_finals(want, ddp_finals(final))


@pytest.mark.slow
def test_accelerate_launch_two_processes_resumes_bit_exact(tmp_path, reference):
    """``accelerate launch --multi_gpu --num_processes 2`` (torchrun's agent under Accelerate's launcher; on a machine
    without GPUs the script's Accelerator runs on the CPU with gloo)."""
    want = uninterrupted(reference, "whole-batches")

    def by_accelerate(save_dir: Path, final: Path, args: list[str]) -> Spawned:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
        cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        cmd += ["--main_process_port", str(free_port()), str(TRAIN_ACCELERATE)]
        cmd += ["--save_dir", str(save_dir), "--final_out", str(final), *args]
        return Spawned(cmd, {"OMP_NUM_THREADS": "1", "PREEMPT_LOG_ALL_RANKS": "1"})

    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    stop_one_process_and_rerun(save_dir, final, list(ARGS), by_accelerate)
    assert_equal_finals(want, ddp_finals(final))
