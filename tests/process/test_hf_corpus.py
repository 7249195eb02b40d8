"""Users' Trainer scripts as they are written, with preempt's one line: stopped by real signals, rerun, and equal to
an uninterrupted run in every tensor and in every figure the user reads.

The corpus, written here in the shape of the public templates (``tests/scripts``):

- ``train_hf_clm.py``: transformers' ``run_clm.py`` example's shape: logging at WARNING, ``datasets`` ``map`` to
  tokenize and to group texts, ``default_data_collator``, ``save_steps``, an evaluation every 3 steps,
  ``load_best_model_at_end`` and an ``EarlyStoppingCallback`` that ends training at step 21 of 45;
- ``train_trl_sft.py``: trl's ``SFTTrainer`` on prompt/completion pairs (a tiny Llama), and the same with a PEFT
  LoRA adapter (``peft_config=``).

Each in 2 DataLoader workers. A trial holds the script at an optimizer step until the run has been asked to stop (so
the signal lands there however busy the machine is), signals it (SIGTERM to the process, SIGTERM to its process
group with the workers, or SIGKILL), reruns the same command to the end, and compares with the uninterrupted run:

- every tensor of the final model, optimizer and generator, and of the final checkpoint (its RNG states, the
  Trainer's counters) under ``torch.equal``, and the rest of that checkpoint's state (the Trainer's state, the data
  cursor's records) equal, the clock's figures left out;
- what the user reads: ``TrainOutput.training_loss``, the final ``train_loss``, ``total_flos``,
  ``num_input_tokens_seen``, the whole log history (each ``loss``, the first one after the resume too, each
  evaluation, trl's ``num_tokens``, ``entropy`` and ``mean_token_accuracy``), ``best_metric``, ``best_global_step``
  and the early-stopping counter.

The default tier runs two trials (``run_clm`` stopped by SIGTERM at an epoch's last step where an evaluation is due,
trl with PEFT by SIGTERM to its process group); the others, each shape under each signal, are ``slow``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
pytest.importorskip("datasets", reason="datasets is not installed (pip install -e '.[test]')")
pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[test]')")

from helpers import PREEMPTED, ROOT, Spawned, assert_same_final  # noqa: E402
from helpers.reference import References, run_to_end  # noqa: E402

from preempt.checkpoint.manager import CheckpointManager  # noqa: E402

SCRIPTS = ROOT / "tests" / "scripts"
SHAPES: dict[str, tuple[Path, list[str], int]] = {
    # the script, its arguments, its save_steps (where a SIGKILL's rerun resumes from)
    "run_clm": (SCRIPTS / "train_hf_clm.py", [], 3),
    "sft": (SCRIPTS / "train_trl_sft.py", [], 4),
    "sft_peft": (SCRIPTS / "train_trl_sft.py", ["--peft"], 4),
}
# the clock's figures, and how many processes ran: not compared
TIMING = ("_runtime", "_per_second")
APART = {("epoch", "seconds"), ("epoch", "processes"), ("tracked", "transformers", "counters", "seconds")}


def command(shape: str, save_dir: Path, final: Path | None, extra: list[str] = ()) -> list[str]:
    script, args, _ = SHAPES[shape]
    cmd = [sys.executable, str(script), "--save_dir", str(save_dir), *args, *extra]
    return cmd + (["--final_out", str(final)] if final else [])


def uninterrupted(reference: References, shape: str) -> Path:
    """The uninterrupted run of a shape (preempt installed): its final tensors' file and its save_dir."""
    make = lambda d: run_to_end(Spawned(command(shape, d / "run", d / "final.safetensors")))  # noqa: E731
    return reference.made(("hf_corpus", shape), make)


def final_tree(save_dir: Path) -> dict[str, Any]:
    """The final checkpoint's state (model and optimizer apart: they are in the final tensors' file)."""
    manager = CheckpointManager(save_dir, owner=False)
    newest = max(manager.list(), key=lambda i: i.step)
    _, loaded = manager.load(newest.step)
    return {k: v for k, v in loaded.tree.items() if k not in ("model", "optimizer")}


def assert_same_tree(want: Any, got: Any, at: tuple[str, ...] = ()) -> None:
    """Tensors under torch.equal, floats equal to the bit, the rest ==; the clock's figures left out."""
    where = ".".join(at) or "the state"
    if at in APART or (at and any(at[-1].endswith(t) for t in TIMING)):
        return
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(want, got), f"{where}: {want} != {got}"
    elif isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: {type(got).__name__}, expected a dict"
        keys = {k for k in want.keys() | got.keys() if (*at, k) not in APART and not str(k).endswith(TIMING)}
        assert {k for k in want if k in keys} == {k for k in got if k in keys}, f"{where}: {sorted(want)} {sorted(got)}"
        for k in keys:
            assert_same_tree(want[k], got[k], (*at, str(k)))
    elif isinstance(want, list):
        assert isinstance(got, list) and len(want) == len(got), f"{where}: {len(want)} items, got {got}"
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            assert_same_tree(a, b, (*at, str(i)))
    elif isinstance(want, float) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), f"{where}: nan != {got}"
    else:
        assert want == got, f"{where}: {want!r} != {got!r} (uninterrupted != resumed)"


def trial(tmp_path: Path, reference: References, shape: str, how: str, at: int) -> tuple[Spawned, Spawned]:
    """Holds the script at step ``at``, stops it ``how``, reruns it to the end, and compares with the reference."""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    sig = signal.SIGKILL if how == "sigkill" else signal.SIGTERM
    p = Spawned(command(shape, save_dir, None, ["--hold_at_step", str(at)]), session=how == "group")
    assert p.wait_event("holding", point="step", n=at, timeout=240), p.output
    if how == "group":  # the script and its DataLoader workers, as SLURM and timeout signal a job
        os.killpg(p.proc.pid, sig)
    else:
        p.signal(sig)
    assert p.finish(timeout=240) == (-signal.SIGKILL if how == "sigkill" else PREEMPTED), p.output
    if how != "sigkill":
        assert p.events_of("stop", step=at), p.events
    r = Spawned(command(shape, save_dir, final))
    assert r.finish(timeout=240) == 0, r.output
    every = SHAPES[shape][2]
    resumed_at = at if how != "sigkill" else at - at % every
    assert r.events_of("resume", step=resumed_at), r.events
    ref = uninterrupted(reference, shape)
    assert_same_final(ref / "final.safetensors", final)
    want = json.loads((ref / "final.safetensors.json").read_text())
    got = json.loads(Path(f"{final}.json").read_text())
    assert_same_tree(want, got)
    assert_same_tree(final_tree(ref / "run"), final_tree(save_dir))
    return p, r


def test_run_clm_a_stop_at_an_epochs_last_step_evaluates_first_and_resumes_exact(tmp_path, reference):
    """Step 15 ends epoch 0, an evaluation is due there and the loss of step 15 is not logged yet (logs every 2
    steps): the stopped process evaluates before its checkpoint, the rerun does not evaluate step 15 again, and
    starts epoch 1. The early-stopping counter (1 at step 15) goes on to end training at step 21, as uninterrupted."""
    p, r = trial(tmp_path, reference, "run_clm", "sigterm", 15)
    assert p.events_of("evaluated", step=15), p.events
    assert not r.events_of("evaluated", step=15) and r.events_of("evaluated", step=18), r.events
    got = json.loads((tmp_path / "final.safetensors.json").read_text())
    assert got["callbacks"]["EarlyStoppingCallback"]["early_stopping_patience_counter"] == 3, got["callbacks"]
    assert got["metrics"]["epoch"] == 1.4 and got["best_global_step"] == 18, got


def test_sft_with_peft_lora_a_sigterm_to_the_process_group_with_its_workers(tmp_path, reference):
    """Step 10: trl's metrics gathered since the log at step 9 and its token count continue in the rerun, LoRA
    adapters and their moments exact."""
    trial(tmp_path, reference, "sft_peft", "group", 10)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shape", "how", "at"),
    [
        ("run_clm", "group", 10),
        ("run_clm", "sigkill", 17),
        ("sft", "sigterm", 16),  # the epoch's last step, an evaluation and a save step
        ("sft", "group", 10),
        ("sft", "sigkill", 23),
        ("sft_peft", "sigterm", 7),
        ("sft_peft", "sigkill", 18),  # the rerun resumes at step 16 (save_steps=4)
        ("sft_peft", "group", 28),
    ],
)
def test_every_shape_under_every_signal(tmp_path, reference, shape, how, at):
    trial(tmp_path, reference, shape, how, at)
