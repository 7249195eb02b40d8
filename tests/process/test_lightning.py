"""Lightning with PreemptCallback: real Lightning, real DataLoader workers, real signals; resumed bit-exact.

Each trial runs ``tests/scripts/train_lightning.py`` (its LightningCLI twin: test_lightning_cli.py): a map-style set
with random augmentation in 2 workers, dropout, a global-RNG draw per step, AdamW with a per-step scheduler, 3 epochs
of 12 batches. The process holds at a given optimizer step until the run has been asked to stop (``--hold_at_step``),
so the signal lands there whatever the machine's speed; the stopped run is rerun with the same command and its final
model, optimizer and losses must equal an uninterrupted run's under ``torch.equal``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("lightning", reason="Lightning is not installed (pip install -e '.[lightning]')")

from helpers import PREEMPTED, ROOT, Script, Spawned, assert_same_final, flip_bit  # noqa: E402

from preempt.checkpoint.manager import CheckpointManager  # noqa: E402

SCRIPT = ROOT / "tests" / "scripts" / "train_lightning.py"
LIGHTNING = Script(SCRIPT)
command, stop_at, resume = LIGHTNING.command, LIGHTNING.stop_at, LIGHTNING.resume


@pytest.mark.parametrize(
    ("args", "at", "where"),
    [
        # mid-epoch 1: the loader remade with preempt's sampler, the workers' draws seeded per sample
        ([], 17, (1, 5)),
        # a sampler of the user's own, kept: the resumed epoch replays its first batches through the same workers
        (["--custom_sampler"], 17, (1, 5)),
        # float16 autocast with the precision plugin's GradScaler, whose state (its growth tracker) is kept
        (["--scaler"], 17, (1, 5)),
        # gradient accumulation (6 steps per epoch): the 9th optimizer step ends the 6th micro-batch of epoch 1
        (["--accumulate", "2"], 9, (1, 6)),
        # the epoch's last step: the resumed run starts the next epoch
        ([], 12, (0, 12)),
        # a validation every 5 batches, and the stop at a step followed by one
        (["--validate"], 10, (0, 10)),
    ],
    ids=["mid_epoch", "own_sampler", "grad_scaler", "accumulate_2", "epoch_end", "validation"],
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
    # the resumed process starts after the stopped step: no batch is trained twice, none skipped
    steps = [e["step"] for e in r.events_of("step")]
    assert steps[0] == at + 1 and steps == list(range(at + 1, steps[-1] + 1)), r.events
    # preempt's sampler starts at the saved sample; a sampler of the user's own is replayed, and the log says so
    replayed = [(e["epoch"], e["batch"]) for e in r.events_of("loader_resumed") if e["kind"] != "seeded" and e["batch"]]
    if "--custom_sampler" in args:
        assert replayed == [where], r.events
        assert f"replaying {where[1]} batch(es) of epoch {where[0]}" in r.output, r.output  # what the user reads
    else:
        assert not replayed and "replaying" not in r.output, r.events
    assert not list(tmp_path.rglob("*.ckpt")) and not list(ROOT.glob("*.ckpt")), "no Lightning checkpoint is written"
    if "--scaler" in args:
        assert load_file(str(final))["scaler._growth_tracker"] == 36, "the scaler's state counts every step"
    assert_same_final(reference(args, SCRIPT), final)


@pytest.mark.parametrize(
    ("data", "at"),
    [("datamodule", 17), ("datamodule_state", 12), ("positional", 10), ("loaders", 17)],
)
def test_every_way_of_giving_the_data_resumes_bit_exact(tmp_path, reference, data, at):
    """The guide's own shape, ``trainer.fit(model, datamodule=dm)`` with a plain LightningDataModule (it used to crash
    at the first checkpoint), a datamodule with state and Lightning 1.x's hooks, one given positionally, and
    ``fit(train_dataloaders=..., val_dataloaders=...)`` (it used to refuse to start): each stopped and resumed, with a
    validation every 5 batches, equals the uninterrupted run whose loaders come from the module's own hooks."""
    args = ["--validate", "--data", data]
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = stop_at(save_dir, args, at, signal.SIGTERM)
    assert p.finish() == PREEMPTED, p.output
    assert p.events_of("stop", cause="SIGTERM", step=at), p.events
    r = resume(save_dir, final, args)
    assert r.events_of("resume", step=at), r.events
    if data == "datamodule_state":  # its state_dict and its 1.x hooks' extras came back
        assert r.events_of("datamodule", loaders_made=2, note="saved after 1 loader(s)"), r.events
    assert_same_final(reference(["--validate"], SCRIPT), final)


def test_a_stop_during_validation_lands_when_it_ends_bit_exact(tmp_path, reference):
    """The signal comes inside the second validation (after step 10): the validation finishes, and its end is the
    stop's safe point (step 10's run.step() waited for it), so the checkpoint holds what it logged; the rerun
    equals the uninterrupted run, the validations' losses included."""
    args = ["--validate"]
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = Spawned(command(save_dir, None, [*args, "--hold_in_validation", "2"]))
    assert p.wait_event("holding", point="validation", n=2, step=10, timeout=120), p.output
    p.signal(signal.SIGTERM)
    assert p.finish() == PREEMPTED, p.output
    assert p.events_of("stop", cause="SIGTERM", step=10, epoch=0, batch=10), p.events
    resume(save_dir, final, args)
    assert_same_final(reference(args, SCRIPT), final)


def test_sigterm_to_the_process_group_with_the_workers_alive(tmp_path, reference):
    """As `timeout` and SLURM signal: the workers get the signal too; preempt's shield keeps them working."""
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
    assert r.events_of("resume", step=15, epoch=1), r.events
    assert_same_final(reference(args, SCRIPT), final)


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_older_one_used(tmp_path, reference):
    args = ["--every_steps", "5", "--sync_save"]
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = stop_at(save_dir, args, 17, signal.SIGTERM)
    assert p.finish() == PREEMPTED, p.output
    flip_bit(save_dir / "step_000000017" / "model.safetensors")
    r = resume(save_dir, final, args)
    assert r.events_of("resume", step=15), r.events
    assert r.events_of("quarantined", name="step_000000017"), r.events
    assert (save_dir / "quarantine" / "step_000000017").is_dir(), r.output
    assert_same_final(reference(args, SCRIPT), final)


def test_a_completed_run_exits_0_at_once(tmp_path):
    save_dir = tmp_path / "run"
    resume(save_dir, tmp_path / "first.safetensors", [])
    again = Spawned(command(save_dir, None, []))
    assert again.finish() == 0, again.output
    assert "is complete" in again.output and not again.events_of("step"), again.output  # said, and nothing trained


@pytest.mark.distributed
def test_ddp_a_sigterm_to_one_rank_stops_both_at_one_step_and_the_rerun_is_bit_exact(tmp_path, reference):
    """strategy="ddp" with 2 CPU processes (gloo; Lightning starts rank 1 from rank 0): rank 1 alone is signalled,
    as a scheduler that signals one node would; the ranks agree, both stop at its step, one checkpoint."""
    args = ["--ddp", "2", "--every_steps", "5"]
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = Spawned(command(save_dir, None, [*args, "--hold_at_step", "8", "--hold_rank", "1"]))
    assert p.wait_event("holding", point="step", n=8, rank=1, timeout=180), p.output
    os.kill(p.events_of("holding", point="step", n=8, rank=1)[0]["pid"], signal.SIGTERM)
    assert p.finish(timeout=180) == PREEMPTED, p.output
    assert p.events_of("stop", cause="signal", step=8, epoch=1, batch=2), p.events  # (rank 1's signal)
    info = CheckpointManager(save_dir, owner=False).list()[0]
    assert info.step == 8 and {"rank_00001.json", "model.safetensors"} <= set(info.manifest.files), info
    p = Spawned(command(save_dir, final, args))
    assert p.finish(timeout=180) == 0, p.output
    assert p.events_of("resume", step=8, epoch=1), p.events
    expected = reference(args, SCRIPT)
    for rank in (0, 1):
        want = load_file(str(expected.with_suffix(f".rank{rank}.safetensors")))
        got = load_file(str(final.with_suffix(f".rank{rank}.safetensors")))
        if rank:  # the module's losses in a checkpoint are rank 0's (its on_save_checkpoint), as in Lightning's own
            del want["losses"], got["losses"]
        assert want.keys() == got.keys() and len(want) >= 30, sorted(want.keys() ^ got.keys())
        differing = [k for k in sorted(want) if not torch.equal(want[k], got[k])]
        assert not differing, f"rank {rank}: {len(differing)} of {len(want)} tensors differ: {differing[:8]}"


@pytest.mark.parametrize("at", [16, 10], ids=["no_validation_due", "validation_due"])
def test_the_users_callbacks_and_logger_keep_working_and_the_commands_read_the_run(tmp_path, at):
    """ModelCheckpoint (top 2 by val_loss), EarlyStopping, LearningRateMonitor and a CSVLogger beside the callback:
    their state is kept across the stop (their final best score, kept files and wait count equal the uninterrupted
    run's), and preempt ls, verify and report read the save_dir. At step 10 a validation is due: it runs before the
    stop's checkpoint, so its logged loss, ModelCheckpoint's choice and EarlyStopping's count are those of the
    uninterrupted run (a stop there used to skip that validation)."""

    def args(where: str) -> list[str]:
        return ["--validate", "--user_callbacks", str(tmp_path / where)]

    ref = Spawned(command(tmp_path / "ref_run", tmp_path / "ref.safetensors", args("ref_user")))
    assert ref.finish() == 0, ref.output
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = stop_at(save_dir, args("user"), at, signal.SIGTERM)  # 16: epoch 1, batch 4; 10: a validation follows
    assert p.finish() == PREEMPTED, p.output
    resume(save_dir, final, args("user"))
    assert "model_checkpoint.best_model_score" in load_file(str(final)) and "early_stopping.wait_count" in load_file(
        str(final)
    )
    assert_same_final(tmp_path / "ref.safetensors", final)
    assert len(list((tmp_path / "user" / "ckpt").glob("*.ckpt"))) == 2
    logged = list((tmp_path / "user" / "logs").rglob("metrics.csv"))
    assert logged and all("lr-AdamW" in f.read_text().splitlines()[0] for f in logged), logged
    for command_ in (["ls"], ["verify"]):
        r = subprocess.run([sys.executable, "-m", "preempt", *command_, str(save_dir)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "preempt", "report", str(save_dir), "--json"], capture_output=True, text=True, check=True
    )
    report = json.loads(r.stdout)
    assert report["processes"] == 2 and report["complete"] and report["final_step"] == 36, report


def test_a_stop_at_the_last_step_of_the_last_epoch_resumes_to_completion(tmp_path, reference):
    """Resumed at step 36 (epoch 2, batch 12 of 12), Lightning ends the fit without asking for a batch: the run
    finishes its epoch, marks the run complete, and the state is the uninterrupted run's (as under SLURM, whose
    warning can land on any step)."""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = stop_at(save_dir, [], 36, signal.SIGTERM)
    assert p.finish() == PREEMPTED, p.output
    assert p.events_of("stop", cause="SIGTERM", step=36, epoch=2, batch=12), p.events
    r = resume(save_dir, final, [])
    assert not r.events_of("step") and r.events_of("complete", step=36, epoch=3), r.events
    assert_same_final(reference([], SCRIPT), final)
