"""Evaluation in the loop, with real processes and real signals.

tests/scripts/train.py evaluates after ``run.step()`` every 5 steps and at each epoch's end (``run.report``), keeps
the best checkpoint by ``val_loss``, and records the training loss at every step. Each test stops it with a real
SIGTERM at a point it holds the process at, reruns it to the end, and compares with an uninterrupted run: the final
state bit for bit, and what the run says (the epoch summary, the best checkpoint, ``preempt inspect``, the history).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from helpers import PREEMPTED, Interrupt, Spawned, assert_same_final, on, run_interrupted, run_python, select, train_cmd

from preempt.health.history import read_history

# 16 steps per epoch, 32 in all; evaluations at steps 5, 10, 15, 16 (epoch 0's end), 20, 25, 30, 32
ARGS = ["--epochs", "2", "--samples", "256", "--metrics", "--eval_every", "5", "--eval_epoch", "--best"]
EVALUATED = [5, 10, 15, 16, 20, 25, 30, 32]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, str]:
    """The final state and the output of the run without a stop."""
    d = tmp_path_factory.mktemp("uninterrupted")
    p = Spawned(train_cmd(d / "run", d / "final.safetensors", ARGS))
    assert p.finish() == 0, p.output
    return d / "final.safetensors", p.output


def summary(output: str, epoch: int) -> tuple[str, str]:
    """The epoch summary line's head (``epoch 0 done ...``) and the rest (means, best)."""
    line = next(x for x in output.splitlines() if f"epoch {epoch} done" in x)
    head, _, rest = line.partition(" | ")
    return head, rest


@pytest.mark.parametrize("stop", ["step:7", "step:16"], ids=["inside-the-epoch", "at-the-epochs-last-step"])
def test_after_a_stop_the_epoch_summary_covers_the_whole_epoch(tmp_path, uninterrupted, stop):
    """The rerun's summary of epoch 0 has the means of the uninterrupted run (every step's loss, every evaluation)
    and says which part it ran. A stop at the epoch's last step: the rerun trains no batch of epoch 0, runs its
    end-of-epoch code (the evaluation) once, and goes on to epoch 1."""
    reference, ref_output = uninterrupted
    point, n = stop.split(":")
    first = Interrupt(after=on("holding", point=point, n=int(n)), args=("--hold_at", stop))
    h = run_interrupted(tmp_path / "run", tmp_path / "final.safetensors", ARGS, [first])
    assert h.codes == [PREEMPTED, 0], h.text
    rerun = h.outputs[1]
    head, rest = summary(rerun, 0)
    assert rest == summary(ref_output, 0)[1], (rerun, ref_output)
    # the summary line is what the user reads: it says the epoch ran over two processes
    assert re.fullmatch(r".*epoch 0 done: [\d.]+ s over 2 processes \(this one [\d.]+ s\)", head), head
    assert summary(rerun, 1)[1] == summary(ref_output, 1)[1]
    if n == "16":
        first, again = h.events[:2]
        assert not select(again, "step", epoch=0), again
        assert len(select(again, "reported", step=16, epoch_end=True)) == 1, again
        assert len(select(again, "epoch_end", epoch=0)) == 1, again
        assert not select(first, "reported", step=16), first
    assert_same_final(reference, tmp_path / "final.safetensors")


def test_a_stop_during_an_evaluation_saves_that_steps_best_and_inspect_agrees(tmp_path, uninterrupted):
    """SIGTERM while the evaluation after step 10 runs: the stop is taken where it reports, with the checkpoint of
    step 10, best at step 10 (``preempt inspect`` says so); the history has each evaluation once, at its step."""
    reference, _ = uninterrupted
    run = tmp_path / "run"
    during = Interrupt(after=on("holding", point="eval", n=2), args=("--hold_at", "eval:2"))
    seen: dict[str, object] = {}

    def after_the_stop(_: int) -> None:  # before the rerun's later best checkpoints prune step 10
        seen["manifest"] = json.loads((run / "step_000000010" / "manifest.json").read_text())
        cmd = [sys.executable, "-m", "preempt", "inspect", str(run), "10", "--json"]
        seen["inspect"] = run_python(cmd)

    h = run_interrupted(run, tmp_path / "final.safetensors", ARGS, [during], between=after_the_stop)
    assert h.codes == [PREEMPTED, 0], h.text
    assert h.count_events("stop", cause="SIGTERM", step=10, epoch=0, batch=10) == 1, h.events
    assert not h.events_of("reported", step=10), h.events  # stopped inside run.report(); the rerun goes on after it
    best = seen["manifest"]["best"]  # type: ignore[index]
    assert best["step"] == 10 and seen["manifest"]["is_best"], best  # type: ignore[index]
    shown = seen["inspect"]
    assert shown.returncode == 0, shown.stderr  # type: ignore[attr-defined]
    said = json.loads(shown.stdout)["manifest"]  # type: ignore[attr-defined]
    assert said["best"]["step"] == 10 and said["best"]["metric"] == "val_loss" and said["is_best"], said
    records = [d for d in read_history(run) if "event" not in d]
    assert [d["step"] for d in records if "val_loss" in d["metrics"]] == EVALUATED
    assert_same_final(reference, tmp_path / "final.safetensors")
