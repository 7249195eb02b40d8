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
from helpers import PREEMPTED, ROOT, Spawned, assert_same_final

USERS = ROOT / "tests" / "scripts" / "users"
NANOGPT = USERS / "nanogpt_loop.py"
CLASSIFIER = USERS / "classifier.py"


def run_to_end(cmd: list[str]) -> Spawned:
    p = Spawned(cmd)
    assert p.finish(timeout=300) == 0, p.output
    return p


def stop_at(cmd: list[str], step: int, sig: int, *, group: bool = False) -> Spawned:
    """Runs ``cmd`` (which holds at its ``step``-th step until asked to stop) and signals it there."""
    p = Spawned([*cmd, "--hold_at_step", str(step)], session=group)
    assert p.wait_event("holding", point="step", timeout=180), p.output
    if group:
        os.killpg(p.proc.pid, sig)
    else:
        p.signal(sig)
    return p


_references: dict[tuple[str, ...], Path] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """An uninterrupted run's final state for a script and its arguments, made once per module."""

    def get(script: Path, args: list[str]) -> Path:
        key = (str(script), *args)
        if key not in _references:
            d = tmp_path_factory.mktemp("ref")
            run_to_end([sys.executable, str(script), "--save_dir", str(d / "run"), "--final_out", str(d / "f"), *args])
            _references[key] = d / "f"
        return _references[key]

    return get


@pytest.mark.parametrize(
    ("sig", "group", "args", "resumed_at"),
    [
        (signal.SIGTERM, False, [], 7),
        (signal.SIGTERM, True, [], 7),
        (signal.SIGKILL, False, ["--every_steps", "5", "--sync_save"], 5),
    ],
    ids=["sigterm", "group_sigterm", "sigkill"],
)
def test_a_nanogpt_style_loop_with_its_prefetched_batch_tracked_resumes_bit_exact(
    tmp_path, reference, sig, group, args, resumed_at
):
    save_dir, final = tmp_path / "run", tmp_path / "final"
    base = [sys.executable, str(NANOGPT), "--save_dir", str(save_dir), *args]
    p = stop_at(base, 7, sig, group=group)
    assert p.finish() == (PREEMPTED if sig == signal.SIGTERM else -signal.SIGKILL), p.output
    if sig == signal.SIGTERM:
        # logging.basicConfig(level=WARNING), as transformers' example scripts do: the stop is still said, to the
        # console (through the script's own handler, in its format) and to train.log
        assert re.search(r"INFO:preempt:stopping on SIGTERM .* at step 7\b", p.output), p.output
        assert re.search(r"stopping on SIGTERM .* at step 7\b", (save_dir / "train.log").read_text())
    r = run_to_end([*base, "--final_out", str(final)])
    assert r.events_of("resume", step=resumed_at), r.events
    assert "INFO:preempt:run complete: step 24" in r.output and r.output.count("run complete: step 24") == 1, r.output
    again = run_to_end(base)  # complete: said, not silent
    assert re.search(r"INFO:preempt:.* is complete \(step 24, epoch 0\); nothing to do", again.output), again.output
    assert_same_final(reference(NANOGPT, args), final)


def test_a_torchvision_style_classifier_with_augmenting_workers_resumes_bit_exact(tmp_path, reference):
    save_dir, final = tmp_path / "run", tmp_path / "final"
    base = [sys.executable, str(CLASSIFIER), "--save_dir", str(save_dir)]
    for step, sig in ((5, signal.SIGTERM), (14, signal.SIGTERM)):  # mid-epoch 0, then the epoch's last step
        p = stop_at(base, step, sig, group=True)
        assert p.finish() == PREEMPTED, p.output
    r = run_to_end([*base, "--final_out", str(final)])
    assert r.events_of("resume", step=14), r.events
    assert_same_final(reference(CLASSIFIER, []), final)
