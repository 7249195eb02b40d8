"""A fine-tuning run passed whole (a frozen base with adapters inside it, a BatchNorm): its checkpoints write what
training changed, not the base, and two SIGTERMs and a SIGKILL still end bit for bit as an uninterrupted run."""

from __future__ import annotations

import os
import signal

from helpers import PREEMPTED, MiB, assert_same_final, assert_writes_what_changed, in_step, run_interrupted
from helpers.kept import assert_kept_equal_live

from preempt.checkpoint.manager import CheckpointManager

LORA = [
    "--lora",
    "--width",
    "1024",
    "--epochs",
    "3",
    "--samples",
    "256",
]  # 48 steps; a base of ~4.3 MiB, ~0.3 MiB trained


def test_lora_checkpoints_write_what_changed_and_resume_bit_exact(tmp_path, reference):
    save_dir = tmp_path / "run"
    # every checkpoint kept, to measure each; the base's fresh copy never comes in 48 steps (carry_limit 1000);
    # synchronous saves: a checkpoint at every 4th step exactly (a background write in flight postpones the next)
    args = [*LORA, "--every_steps", "4", "--keep_last", "1000", "--carry_limit", "1000", "--sync_save"]
    interrupts = [in_step(10), in_step(9, signal.SIGKILL), in_step(12)]  # at global steps 10, 19, 28
    h = run_interrupted(save_dir, tmp_path / "final.safetensors", args, interrupts)
    assert h.codes[:3] == [PREEMPTED, -signal.SIGKILL, PREEMPTED], h.text
    assert h.count_events("resume") == 3, h.events
    assert_same_final(reference(LORA), tmp_path / "final.safetensors")

    ckpts = sorted(save_dir.glob("step_*"))
    assert [int(c.name[5:]) for c in ckpts] == sorted([*range(4, 49, 4), 10])  # every 4th, and the first stop's
    base_size = os.stat(ckpts[0] / "base.safetensors").st_size
    assert base_size > 4 * MiB
    report = assert_writes_what_changed(ckpts)
    print("checkpoint, bytes written, bytes changed:", report, "base", base_size)
    # every checkpoint is whole on its own: preempt verify re-hashes every file of every one
    from preempt.cli.main import main

    assert main(["verify", str(save_dir)]) == 0
    assert h.count_events("checkpoint", step=28, reason="preempt") == 1, h.events
    (stop,) = [i for i in CheckpointManager(save_dir, owner=False).list() if i.step == 28]
    assert stop.manifest.files["base.safetensors"].carried_from is not None, stop.manifest.files
    # every kept checkpoint, carried base and all, holds the live state of its step (an uninterrupted run's: the
    # resumes above are bit-exact), not only one whose bytes are unchanged since the checkpoint before
    assert_kept_equal_live(save_dir, reference.recorded(LORA), at_least=len(ckpts))
