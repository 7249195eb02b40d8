"""A Hugging Face model wrapped by peft and passed whole: a tiny GPT-2 from its config, LoRA on its
attention, dropout on. Its checkpoints write what training changed (the adapters, their AdamW moments, the RNG), not
the frozen base, and two SIGTERMs and a SIGKILL at different steps still end bit for bit as an uninterrupted run."""

from __future__ import annotations

import importlib.util
import json
import os
import signal

import pytest
from helpers import PREEMPTED, MiB, assert_same_final, assert_writes_what_changed, in_step, run_interrupted

# A guard only (the test extra installs both): looked up, not imported, since importing them here would cost this
# process ~5 s of CPU for nothing (the training processes import them)
missing = [m for m in ("peft", "transformers") if importlib.util.find_spec(m) is None]
# Under -m slow: the same trial as test_carry_lora.py (a frozen base with adapters, two SIGTERMs and a SIGKILL, bytes
# written against bytes changed) with a real PeftModel; each of its processes spends ~3 s of CPU importing
# transformers and peft, and test_example_gpt2.py already stops and resumes a transformers model in the default suite.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(missing), reason=f"the PEFT trial needs {missing}: pip install -e .[test]"),
]

# GPT-2 with n_embd 192, 2 layers, 1000 tokens, 32 per sample: a frozen base of ~5 MiB (the tied embedding and head
# among it), ~48 KiB of adapters; 128 samples in batches of 16, 3 epochs: 24 steps
PEFT = ["--peft", "--width", "192", "--dim", "32", "--epochs", "3", "--samples", "128"]


def test_peft_model_checkpoints_write_what_changed_and_resume_bit_exact(tmp_path, reference):
    save_dir = tmp_path / "run"
    # every checkpoint kept, to measure each; synchronous saves: one at every 4th step exactly
    args = [*PEFT, "--every_steps", "4", "--keep_last", "1000", "--sync_save"]
    interrupts = [in_step(6), in_step(5, signal.SIGKILL), in_step(7)]  # at global steps 6, 11 (lost: 8 kept), 15
    h = run_interrupted(save_dir, tmp_path / "final.safetensors", args, interrupts)
    assert h.codes[:3] == [PREEMPTED, -signal.SIGKILL, PREEMPTED], h.text
    assert h.count_events("resume") == 3, h.events
    # every model tensor (frozen and trained) and every AdamW moment, the RNG states and the losses: torch.equal
    assert_same_final(reference(PEFT), tmp_path / "final.safetensors")

    ckpts = sorted(save_dir.glob("step_*"))
    assert [int(c.name[5:]) for c in ckpts] == [4, 6, 8, 12, 15, 16, 20, 24]  # every 4th, and the two SIGTERMs'
    files = json.loads((ckpts[0] / "manifest.json").read_text())["files"]
    assert "base.safetensors" in files and "carried_from" not in files["base.safetensors"]
    assert os.stat(ckpts[0] / "base.safetensors").st_size > 4 * MiB
    # the base is carried by every later checkpoint, the first ones of the resumed processes too, and each one
    # writes at most twice what changed + 1 MiB: a base written again (5 MiB) fails here
    report = assert_writes_what_changed(ckpts)
    print("checkpoint, bytes written, bytes changed:", report)
    from preempt.cli.main import main

    assert main(["verify", str(save_dir)]) == 0  # every file of every checkpoint re-hashed against its manifest
