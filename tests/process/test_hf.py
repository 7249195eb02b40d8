"""The Hugging Face Trainer with preempt.hf.install: real transformers, real DataLoader workers, real signals.

Each trial runs ``tests/scripts/train_hf.py``: a small GPT-2 with dropout, a random crop drawn in ``__getitem__`` in
2 workers, a collator that draws random token noise, AdamW (the Trainer's default, fused on the CPU) with a cosine
schedule and warm-up, 2 epochs of 24 steps. The process holds at a given optimizer step until the run has been asked
to stop, so the signal lands there whatever the machine's speed; the stopped run is rerun with the same command and
its final model and optimizer must equal an uninterrupted run's under ``torch.equal``.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from helpers import PREEMPTED, ROOT, Script, Spawned, assert_equal_finals, assert_same_final, ddp_finals, torchrun  # noqa: E402

from preempt.checkpoint.manager import CheckpointManager  # noqa: E402

SCRIPT = ROOT / "tests" / "scripts" / "train_hf.py"
HF = Script(SCRIPT)
command, stop_at, resume = HF.command, HF.stop_at, HF.resume


@pytest.mark.parametrize(
    ("args", "at", "where"),
    [
        # mid-epoch 1: the run starts the epoch at its 7th batch, the workers' crops and the collator's noise seeded
        # per sample
        ([], 30, (1, 6)),
        # gradient accumulation (12 steps per epoch): the 15th optimizer step ends the 6th micro-batch of epoch 1
        (["--accumulate", "2"], 15, (1, 6)),
        # the epoch's last step: the resumed run starts the next epoch
        ([], 24, (0, 24)),
    ],
    ids=["mid_epoch", "accumulate_2", "epoch_end"],
)
def test_sigterm_stops_at_a_step_and_the_rerun_is_bit_exact(tmp_path, reference, args, at, where):
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = stop_at(save_dir, args, at, signal.SIGTERM)
    assert p.finish() == PREEMPTED, p.output
    assert p.events_of("stop", cause="SIGTERM", step=at, epoch=where[0], batch=where[1]), p.events
    info = CheckpointManager(save_dir, owner=False).list()[0]
    assert info.step == at and info.status == "valid", info
    r = resume(save_dir, final, args)
    assert r.events_of("resume", step=at, epoch=where[0]), r.events
    steps = [e["step"] for e in r.events_of("step")]
    assert steps[0] == at + 1 and steps == list(range(at + 1, steps[-1] + 1)), r.events
    replayed = [e for e in r.events_of("loader_resumed") if e["kind"] != "seeded" and e["batch"]]
    assert not replayed and "replaying" not in r.output, r.events  # the sampler starts at the saved sample
    assert not list((tmp_path / "hf_out").glob("checkpoint-*")), "the Trainer's own checkpoints are off"
    assert_same_final(reference(args, SCRIPT), final)


def test_sigterm_to_the_process_group_with_the_workers_alive(tmp_path, reference):
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = stop_at(save_dir, [], 20, signal.SIGTERM, group=True)
    assert p.finish() == PREEMPTED, p.output
    resume(save_dir, final, [])
    assert_same_final(reference([], SCRIPT), final)


def test_sigkill_resumes_from_the_last_periodic_checkpoint(tmp_path, reference):
    args = ["--every_steps", "5", "--sync_save"]
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = stop_at(save_dir, args, 17, signal.SIGKILL)
    assert p.finish() == -signal.SIGKILL, p.output
    r = resume(save_dir, final, args)
    assert r.events_of("resume", step=15, epoch=0), r.events
    assert_same_final(reference(args, SCRIPT), final)


def test_a_completed_run_exits_0_at_once(tmp_path):
    save_dir = tmp_path / "run"
    resume(save_dir, tmp_path / "first.safetensors", ["--epochs", "1"])
    again = Spawned(command(save_dir, None, ["--epochs", "1"]))
    assert again.finish() == 0, again.output
    assert "is complete" in again.output and not again.events_of("step"), again.output  # said, and nothing trained


def test_peft_lora_carries_its_frozen_base_and_resumes_bit_exact(tmp_path, reference):
    """A PeftModel (LoRA on the attention) under the Trainer: its frozen base (6 MiB here) is written by the first
    checkpoint and carried by the next ones, which write the adapters, their moments and the rest (under 1 MiB)."""
    args = ["--peft", "--width", "256", "--every_steps", "5", "--sync_save"]
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = stop_at(save_dir, args, 30, signal.SIGTERM)
    assert p.finish() == PREEMPTED, p.output
    infos = sorted(CheckpointManager(save_dir, owner=False).list(), key=lambda i: i.step)
    assert [i.step for i in infos] == [25, 30], infos
    for info in infos:
        files = info.manifest.files
        assert files["base.safetensors"].size > 5 << 20 and files["base.safetensors"].carried_from == 5, files
        written = sum(f.size for f in files.values() if f.carried_from is None)
        assert written < 1 << 20, f"step {info.step} wrote {written} bytes beside its carried base"
    resume(save_dir, final, args)
    assert_same_final(reference(args, SCRIPT), final)


@pytest.mark.distributed
def test_torchrun_a_sigterm_to_one_rank_stops_both_at_one_step_and_the_rerun_is_bit_exact(tmp_path):
    """torchrun --nproc_per_node=2 (DDP through the Trainer's Accelerate, gloo): rank 1 alone is signalled; the
    ranks agree, both stop at its step with one checkpoint; each rank's model, optimizer and generator equal the
    uninterrupted run's."""
    args = ["--every_steps", "5"]
    ref = torchrun(tmp_path / "ref_run", tmp_path / "ref.safetensors", args, script=SCRIPT)
    assert ref.finish(timeout=240) == 0, ref.output
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = torchrun(save_dir, None, [*args, "--hold_at_step", "15", "--hold_rank", "1"], script=SCRIPT)
    assert p.wait_event("holding", point="step", n=15, rank=1, timeout=240), p.output
    os.kill(p.events_of("holding", point="step", n=15, rank=1)[0]["pid"], signal.SIGTERM)
    assert p.finish(timeout=240) != 0, p.output
    assert p.events_of("stop", cause="signal", step=15, epoch=1, batch=3), p.events  # (rank 1's signal)
    info = CheckpointManager(save_dir, owner=False).list()[0]
    assert info.step == 15 and {"rank_00001.json", "model.safetensors"} <= set(info.manifest.files), info
    r = torchrun(save_dir, final, args, script=SCRIPT)
    assert r.finish(timeout=240) == 0, r.output
    assert r.events_of("resume", step=15, epoch=1), r.events
    assert_equal_finals(ddp_finals(tmp_path / "ref.safetensors"), ddp_finals(final))


def test_a_stop_during_evaluation_lands_after_it_and_the_best_model_is_loaded_at_the_end(tmp_path, reference):
    """eval_strategy="steps" (every 6 steps) with load_best_model_at_end by eval_loss: the signal comes inside the
    second evaluation; the evaluation finishes, its metrics reach the run, and the stop is taken there (step 12).
    The rerun ends with the best checkpoint's weights loaded, as the uninterrupted run does."""
    args = ["--eval"]
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = Spawned(command(save_dir, None, [*args, "--hold_in_eval", "2"]))
    assert p.wait_event("holding", point="evaluation", n=2, step=12, timeout=120), p.output
    p.signal(signal.SIGTERM)
    assert p.finish() == PREEMPTED, p.output
    assert p.events_of("evaluated", step=12), p.events
    assert p.events_of("stop", cause="SIGTERM", step=12, epoch=0, batch=12), p.events
    r = resume(save_dir, final, args)
    (best,) = r.events_of("best_loaded", metric="eval_loss")
    assert_same_final(reference(args, SCRIPT), final)
    _, loaded = CheckpointManager(save_dir, owner=False).load(best["step"], weights_only=True)
    got = load_file(str(final))
    assert all(torch.equal(got[f"model.{k}"], v) for k, v in loaded.model.items()), "the model is the best one"


def test_max_steps_inside_an_epoch_and_tensorboard_across_a_stop(tmp_path):
    """max_steps=30 ends training inside epoch 1: the final checkpoint holds that position and a rerun exits 0 at
    once. report_to TensorBoard keeps working across the stop: the train loss is logged up to step 30."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install -e '.[test]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = ["--max_steps", "30", "--tensorboard"]
    env = {"TENSORBOARD_LOGGING_DIR": str(tmp_path / "tb")}
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = Spawned(command(save_dir, None, [*args, "--hold_at_step", "17"]), env)
    assert p.wait_event("holding", point="step", n=17, timeout=120), p.output
    p.signal(signal.SIGTERM)
    assert p.finish() == PREEMPTED, p.output
    r = Spawned(command(save_dir, final, args), env)
    assert r.finish() == 0, r.output
    assert r.events_of("complete", step=30, epoch=1), r.events
    info = CheckpointManager(save_dir, owner=False).list()[0]
    assert (info.step, info.manifest.cursor.epoch, info.manifest.cursor.batch) == (30, 1, 6), info.manifest.cursor
    again = Spawned(command(save_dir, None, args), env)
    assert again.finish() == 0 and "is complete" in again.output, again.output
    steps = set()
    for events in (tmp_path / "tb").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if "train/loss" in acc.Tags()["scalars"]:
            steps |= {e.step for e in acc.Scalars("train/loss")}
    assert steps == {5, 10, 15, 20, 25, 30}, steps


def test_a_stop_at_the_last_step_resumes_to_completion(tmp_path, reference):
    """Resumed at step 48 (epoch 1, batch 24 of 24): nothing is left to train; the run completes, bit-exact."""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = stop_at(save_dir, [], 48, signal.SIGTERM)
    assert p.finish() == PREEMPTED, p.output
    r = resume(save_dir, final, [])
    assert not r.events_of("step") and r.events_of("complete", step=48, epoch=2), r.events
    assert_same_final(reference([], SCRIPT), final)
