"""Accelerate's checkpointing loop (tests/scripts/train_accelerate.py: everything through ``accelerator.prepare``,
``accelerator.accumulate`` with 2 micro-batches a step, bf16 autocast) as real processes stopped by real signals:
SIGTERM to the process, SIGTERM to its whole group while DataLoader workers run, SIGKILL. Each rerun ends bit-exact
with the uninterrupted run: ``torch.equal`` on every tensor of the unwrapped model, the optimizer, the scheduler and
the process's RNG. Two processes: tests/distributed/test_accelerate_ranks.py.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install -e '.[hf]')")

import torch  # noqa: E402
from helpers import (  # noqa: E402
    PREEMPTED,
    TRAIN_ACCELERATE,
    Interrupt,
    Spawned,
    assert_same_final,
    in_step,
    on,
    run_interrupted,
    train_cmd,
)
from safetensors.torch import load_file  # noqa: E402

ARGS = ["--accumulate", "2", "--precision", "bf16"]  # 70 samples in batches of 4: 18 batches, 9 steps an epoch


def final(d: Path) -> Path:
    return d / "final.rank0.safetensors"


@pytest.fixture(scope="module")
def uninterrupted(reference) -> Path:
    """The uninterrupted run, without DataLoader workers (the per-sample streams make the workers' number moot)."""
    return final(reference(ARGS, TRAIN_ACCELERATE).parent)


def test_sigterm_between_micro_batches_stops_at_the_next_optimizer_step(tmp_path, uninterrupted):
    """The signal comes in batch 7, the first micro-batch of step 4: the process goes on to batch 8, where the
    gradients are synchronised and the optimizer steps, and stops there with one checkpoint, at step 4."""
    history = run_interrupted(
        tmp_path / "run", tmp_path / "final.safetensors", ARGS, [in_step(7)], script=TRAIN_ACCELERATE
    )
    assert history.codes == [PREEMPTED, 0], history.text
    saves = [e for e in history.events[0] if e["event"] == "saving"]
    assert [(e["step"], e["reason"]) for e in saves] == [(4, "preempt")], saves
    manifest = json.loads(next((tmp_path / "run").glob("step_000000004*/manifest.json")).read_text())
    assert manifest["cursor"]["batch"] == 8, manifest["cursor"]
    assert_same_final(uninterrupted, final(tmp_path))


def test_sigkill_resumes_from_the_last_periodic_checkpoint(tmp_path, uninterrupted):
    """Checkpoints every 4 steps; SIGKILL in batch 25 (epoch 1, after the checkpoint of step 12): the rerun goes
    on from step 12."""
    args = [*ARGS, "--every_steps", "4", "--settle_saves"]
    kill = Interrupt(after=on("entered"), sig=signal.SIGKILL, args=("--signal_at", "step:25:KILL"))
    history = run_interrupted(tmp_path / "run", tmp_path / "final.safetensors", args, [kill], script=TRAIN_ACCELERATE)
    assert history.codes == [-signal.SIGKILL, 0], history.text
    assert [e["step"] for e in history.events_of("resume")] == [12], history.events_of("resume")
    assert_same_final(uninterrupted, final(tmp_path))


def test_sigterm_to_the_group_with_workers_resumes_bit_exact(tmp_path, uninterrupted):
    """Two DataLoader workers inside Accelerate's loader, SIGTERM to the whole process group (as ``timeout`` and
    SLURM send it): the workers are shielded, the process stops at its next optimizer step (exit 75); the rerun, with
    workers again, ends equal to the run without any."""
    args = [*ARGS, "--workers", "2"]
    cmd = train_cmd(tmp_path / "run", tmp_path / "final.safetensors", [*args, "--hold_at", "step:11"], TRAIN_ACCELERATE)
    p = Spawned(cmd, session=True)
    assert p.wait_event("holding", point="step", n=11) is not None, p.output
    os.killpg(p.proc.pid, signal.SIGTERM)
    assert p.finish() == PREEMPTED, p.output
    assert "exited unexpectedly" not in p.output
    assert [e["step"] for e in p.events_of("saving")] == [6]
    again = Spawned(train_cmd(tmp_path / "run", tmp_path / "final.safetensors", args, TRAIN_ACCELERATE))
    assert again.finish() == 0, again.output
    assert_same_final(uninterrupted, final(tmp_path))


def test_the_checkpoint_holds_the_unwrapped_model_export_and_a_plain_load(tmp_path, uninterrupted):
    """``preempt export`` of the final checkpoint loads into the plain model (no wrapper, no prefix), strictly, and
    holds the final weights."""
    import sys

    sys.path.insert(0, str(TRAIN_ACCELERATE.parent))
    from train_accelerate import Tiny

    run_dir = uninterrupted.parent / "run"
    out = tmp_path / "weights.safetensors"
    p = Spawned([sys.executable, "-m", "preempt", "export", str(run_dir), "--out", str(out)])
    assert p.finish() == 0, p.output
    model = Tiny()
    model.load_state_dict(load_file(str(out)), strict=True)
    want = load_file(str(uninterrupted))
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[f"model.{k}"]), k
