"""Users' own shapes of a training, written here in the style of popular public scripts (tests/scripts/users/), each
stopped for real (SIGTERM to the process, SIGTERM to its process group with the DataLoader workers, SIGKILL) and
rerun with the same command: its final state equals an uninterrupted run's under ``torch.equal``, tensor by tensor.

- a nanoGPT-style loop: random windows drawn with ``torch.randint``, the next batch prefetched inside the step and
  tracked as the guide shows (its state first exists inside the run), gradient accumulation, a GradScaler, logging
  at WARNING (preempt's lines must still reach the user and train.log);
- a torchvision-style classifier: random crops and flips in 2 DataLoader workers, label smoothing, SGD with a
  per-epoch MultiStepLR, an EMA of the weights tracked;
- a Hydra + Lightning project: a LightningModule built by ``hydra.utils.instantiate`` with its ``net`` and
  ``functools.partial`` optimizer and scheduler factories given to ``save_hyperparameters()``, a LightningDataModule,
  callbacks listed in YAML (PreemptCallback among them), ``save_dir`` a fixed path outside Hydra's run folder.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest
from helpers import PREEMPTED, ROOT, Script, Spawned, assert_same_final

USERS = ROOT / "tests" / "scripts" / "users"
NANOGPT = USERS / "nanogpt_loop.py"
CLASSIFIER = USERS / "classifier.py"


NANOGPT_RUN, CLASSIFIER_RUN = Script(NANOGPT, timeout=180), Script(CLASSIFIER, timeout=180)


@pytest.mark.parametrize(
    ("sig", "group", "args", "resumed_at"),
    [
        (signal.SIGTERM, False, [], 10),
        (signal.SIGTERM, True, [], 10),
        (signal.SIGKILL, False, ["--every_steps", "5", "--sync_save"], 5),
    ],
    ids=["sigterm", "group_sigterm", "sigkill"],
)
def test_a_nanogpt_style_loop_with_its_prefetched_batch_tracked_resumes_bit_exact(
    tmp_path, reference, sig, group, args, resumed_at
):
    save_dir, final = tmp_path / "run", tmp_path / "final"
    # at step 10 an evaluation is due: nanoGPT's loop evaluates at the top of the next iteration, which the resumed
    # run does first (its draws and result are the uninterrupted run's: the losses are compared)
    p = NANOGPT_RUN.stop_at(save_dir, args, 10 if sig == signal.SIGTERM else 7, sig, group=group)
    assert p.finish() == (PREEMPTED if sig == signal.SIGTERM else -signal.SIGKILL), p.output
    if sig == signal.SIGTERM:
        # logging.basicConfig(level=WARNING), as transformers' example scripts do: the stop is still said (the line
        # is the feature), to the console (through the script's own handler, in its format) and to train.log
        assert p.events_of("stop", cause="SIGTERM", step=10), p.events
        for said in (p.output, (save_dir / "train.log").read_text()):
            assert re.search(r"INFO(:preempt:| )stopping on SIGTERM .* at step 10\b", said), said
    r = NANOGPT_RUN.resume(save_dir, final, args)
    assert r.events_of("resume", step=resumed_at), r.events
    assert "INFO:preempt:run complete: step 24" in r.output and r.output.count("run complete: step 24") == 1, r.output
    again = NANOGPT_RUN.resume(save_dir, None, args)  # complete: said, not silent
    assert re.search(r"INFO:preempt:.* is complete \(step 24, epoch 0\); nothing to do", again.output), again.output
    assert_same_final(reference(args, NANOGPT), final)


def test_a_torchvision_style_classifier_with_augmenting_workers_resumes_bit_exact(tmp_path, reference):
    """Two stops by SIGTERM to the process group (the workers get it too): mid-epoch 0, then at the epoch's last
    step (the classic off-by-one); each rerun replays the epoch's batches through its own shuffled loader."""
    save_dir, final = tmp_path / "run", tmp_path / "final"
    for step, sig in ((5, signal.SIGTERM), (14, signal.SIGTERM)):
        p = CLASSIFIER_RUN.stop_at(save_dir, [], step, sig, group=True)
        assert p.finish() == PREEMPTED, p.output
    r = CLASSIFIER_RUN.resume(save_dir, final)
    assert r.events_of("resume", step=14), r.events
    assert_same_final(reference([], CLASSIFIER), final)


def test_a_torchvision_style_classifier_killed_resumes_from_its_periodic_checkpoint_bit_exact(tmp_path, reference):
    save_dir, final = tmp_path / "run", tmp_path / "final"
    p = CLASSIFIER_RUN.stop_at(save_dir, ["--every_steps", "4"], 18, signal.SIGKILL)
    assert p.finish() == -signal.SIGKILL, p.output
    r = CLASSIFIER_RUN.resume(save_dir, final, ["--every_steps", "4"])
    assert r.events_of("resume", step=16, epoch=1), r.events
    assert_same_final(reference([], CLASSIFIER), final)


HYDRA = USERS / "hydra_lightning" / "train.py"


def hydra_run(root: Path, overrides: list[str], final: Path | None = None, *, group: bool = False) -> Spawned:
    pytest.importorskip("hydra", reason="Hydra is not installed (pip install -e '.[test]')")
    pytest.importorskip("lightning", reason="Lightning is not installed (pip install -e '.[lightning]')")
    env = {"FINAL_OUT": str(final)} if final else {}
    return Spawned([sys.executable, str(HYDRA), f"paths.root_dir={root}", *overrides], env, session=group)


@pytest.mark.parametrize(
    ("sig", "group", "overrides", "resumed_at"),
    [
        (signal.SIGTERM, False, [], 12),
        (signal.SIGTERM, True, [], 12),
        (
            signal.SIGKILL,
            False,
            ["+callbacks.preempt.checkpoint_every_steps=5", "+callbacks.preempt.async_save=false"],
            10,
        ),
    ],
    ids=["sigterm", "group_sigterm", "sigkill"],
)
def test_a_hydra_lightning_project_resumes_bit_exact(tmp_path, sig, group, overrides, resumed_at):
    """Stopped at step 12: the last step of epoch 0, with a validation due after it (val_check_interval=6), which
    runs before the stop's checkpoint. Its ModelCheckpoint, EarlyStopping and logged validation losses end as the
    uninterrupted run's; the module's ``net`` and ``functools.partial`` hyper-parameters do not block the run."""
    root = tmp_path / "project"
    ref = hydra_run(tmp_path / "ref", overrides, tmp_path / "ref.safetensors")
    assert ref.finish(timeout=300) == 0, ref.output
    assert "Lightning hyper-parameters net, optimizer, scheduler are kept in checkpoints by type" in ref.output
    p = hydra_run(root, [*overrides, "callbacks.steps.hold_at=12"], group=group)
    assert p.wait_event("holding", point="step", n=12, timeout=180), p.output
    if group:
        os.killpg(p.proc.pid, sig)
    else:
        p.signal(sig)
    assert p.finish(timeout=180) == (PREEMPTED if sig == signal.SIGTERM else -signal.SIGKILL), p.output
    r = hydra_run(root, overrides, tmp_path / "final.safetensors")
    assert r.finish(timeout=300) == 0, r.output
    assert r.events_of("resume", step=resumed_at), r.events
    assert not r.events_of("warning", message=lambda m: "Hydra output folder" in str(m)), r.events
    assert_same_final(tmp_path / "ref.safetensors", tmp_path / "final.safetensors")


def test_a_save_dir_inside_hydras_run_folder_is_warned_about_at_the_start(tmp_path):
    """The template's mistake: ``save_dir: ${paths.output_dir}/preempt``, a folder Hydra makes anew at every run, so a
    rerun starts fresh. The start says so, naming the fix, before any training."""
    p = hydra_run(tmp_path, ["callbacks.preempt.save_dir=${paths.output_dir}/preempt", "trainer.max_epochs=1"])
    assert p.finish(timeout=300) == 0, p.output
    warned = [e for e in p.events_of("warning") if "Hydra output folder" in str(e.get("message"))]
    assert len(warned) == 1, p.events
    assert "save_dir: ${paths.root_dir}/preempt/${task_name}" in warned[0]["message"], warned
