"""examples/gpt2_iterable.py, a new user's script, stopped by real signals and resumed bit for bit.

A Hugging Face GPT-2 (2 layers, dropout on), AdamW, warm-up and cosine LambdaLR, 2 micro-batches per step,
clipping; a stateful IterableDataset over 4 shard files split across 2 persistent DataLoader workers, masking
drawn in the workers; evaluation on a 2-worker validation loader every 4 steps and at each epoch's end, reported
with run.report; keep_best by val_loss. 3 epochs of 6 steps: evaluations at steps 4, 6, 8, 12, 16 and 18.

Each case runs the example as the leader of a process group of its own and signals the whole group, DataLoader
workers included (what SLURM without ``B:``, ``timeout`` and Ctrl+C do). The state each signal lands in is
reached by the example's test hook ``--hold_at`` (it prints ``test hook: holding ...`` and waits there until the
run is asked to stop), never by a delay. Every case ends with every tensor of the final state (model, optimizer,
scheduler, random generators, the recorded losses and evaluations) torch.equal to an uninterrupted run.

The selected tests' trials (the reference, up to three interrupted runs, and one of the fallback model) go side by
side, each in a thread of the module's fixture: each GPT-2 process spends most of its time importing transformers
(~7 s of CPU here), and the trials need nothing of each other.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from helpers import PREEMPTED, ROOT, Spawned, assert_same_final, select

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
gpt2 = pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="the example's GPT-2 needs transformers (pip install -e '.[test]' installs it)"
)

EXAMPLE = ROOT / "examples" / "gpt2_iterable.py"
ARGS = [
    *["--epochs", "3", "--steps_per_epoch", "6", "--eval_every", "4", "--checkpoint_every_steps", "3"],
    *["--batch_size", "4", "--seq_len", "32", "--n_embd", "32", "--val_sequences", "8"],
]
ACCUM = 2  # the example's default: batches per optimizer step
# exec'ed in a session of its own: its pid is the group's id, which the test signals
LEADER = [
    sys.executable,
    "-c",
    "import os, sys; os.setsid(); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])",
]
# transformers made unimportable (a None entry in sys.modules), as where it is not installed
NO_TRANSFORMERS = [
    sys.executable,
    "-c",
    "import runpy, sys; sys.modules['transformers'] = None; sys.argv = sys.argv[1:];"
    " runpy.run_path(sys.argv[0], run_name='__main__')",
]
FALLBACK = "transformers is not installed: using the built-in tiny causal transformer"  # what the example says
WAIT_S = 300.0  # generous: the trials share a loaded machine; each waits on an event, not on this


@dataclass
class Trial:
    """Every process of one run: exit codes, outputs and events."""

    final: Path
    codes: list[int] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    events: list[list[dict[str, Any]]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n----\n".join(self.outputs)


def command(root: Path, args: Sequence[str], prefix: Sequence[str]) -> list[str]:
    """The example with the trial's directories (the shards shared by every trial) and ``args``."""
    dirs = ["--save_dir", str(root / "run"), "--data_dir", str(root.parent / "data")]
    return [*prefix, str(EXAMPLE), *dirs, "--final_out", str(root / "final.safetensors"), *ARGS, *args]


def trial(root: Path, hold: str | None, sig: int, args: Sequence[str] = (), prefix: Sequence[str] = LEADER) -> Trial:
    """Runs the example (held at ``hold`` and signalled there, group-wide, with ``sig``); reruns it once after an
    interruption that left a state to continue from (exit 75, or killed)."""
    t = Trial(root / "final.safetensors")
    held = ["--hold_at", hold] if hold else []
    p = Spawned(command(root, [*args, *held], prefix))
    if hold and p.wait_event("holding", timeout=WAIT_S):
        os.killpg(p.proc.pid, sig)
    t.codes.append(p.finish(WAIT_S))
    t.outputs.append(p.output)
    t.events.append(list(p.events))
    if t.codes[-1] in (PREEMPTED, -signal.SIGKILL):
        again = Spawned(command(root, args, prefix))
        t.codes.append(again.finish(WAIT_S))
        t.outputs.append(again.output)
        t.events.append(list(again.events))
    return t


# the trial each test reads. Under -m slow, two GPT-2 processes each (~8 s of CPU): the SIGKILL case
# (tests/faults/test_kill.py and tests/process/test_data_replay.py kill runs with workers mid-epoch by default) and
# the SIGTERM inside a step (test_data_replay.py stops a stateful IterableDataset's workers mid-epoch by default; the
# example's own stop and bit-exact rerun run by default in the evaluation case)
TRIAL_OF = {
    "test_sigterm_to_the_group_during_training": "train",
    "test_sigterm_to_the_group_during_evaluation": "eval",
    "test_sigkill_of_the_group": "kill",
    "test_fallback_model_without_transformers": "fallback",
}


@pytest.fixture(scope="module")
def trials(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[Trial]]]:
    """The trials of the tests selected in this session (and the reference, where one of them compares with it)."""
    root = tmp_path_factory.mktemp("gpt2")
    wanted = {TRIAL_OF[item.name] for item in request.session.items if item.module is request.module}
    jobs = {
        "reference": (None, 0),
        "train": ("step:4", signal.SIGTERM),  # inside step 4: an evaluation step, mid-epoch 0
        "eval": ("eval:1", signal.SIGTERM),  # in the evaluation after step 4, its workers alive
        "kill": ("step:11", signal.SIGKILL),  # inside step 11 (mid-epoch 1), the newest checkpoint durable
    }
    jobs = {
        k: v
        for k, v in jobs.items()
        if HAS_TRANSFORMERS and (k in wanted or (k == "reference" and wanted - {"fallback"}))
    }
    with ThreadPoolExecutor(max_workers=len(jobs) + 1, thread_name_prefix="gpt2-trial") as pool:
        futures = {name: pool.submit(trial, root / name, hold, sig) for name, (hold, sig) in jobs.items()}
        if "fallback" in wanted:
            futures["fallback"] = pool.submit(trial, root / "fallback", None, 0, prefix=NO_TRANSFORMERS)
        yield futures


def stop_of(events: list[dict[str, Any]]) -> tuple[int, int, int]:
    (stop,) = select(events, "stop", cause="SIGTERM")
    return stop["step"], stop["epoch"], stop["batch"]


def checked_reference(trials: dict[str, Future[Trial]]) -> Path:
    ref = trials["reference"].result()
    assert ref.codes == [0], ref.text
    assert FALLBACK not in ref.text, ref.text  # transformers' GPT-2, not the fallback
    return ref.final


@gpt2
@pytest.mark.slow
def test_sigterm_to_the_group_during_training(trials):
    """Stopped inside step 4 (mid-epoch, an evaluation step): saved at step 4 before its evaluation ran; the
    rerun continues each worker where it stood and does that evaluation first."""
    t = trials["train"].result()
    assert t.codes == [PREEMPTED, 0], t.text
    assert stop_of(t.events[0]) == (4, 0, 4 * ACCUM), t.events[0]
    assert "evaluation at step 4" not in t.outputs[0], t.outputs[0]
    assert select(t.events[1], "resume", step=4, epoch=0, batch=8), t.events[1]
    assert "IterableDataset's 2 worker(s) continue where each stood" in t.outputs[1], t.outputs[1]
    assert "evaluation at step 4:" in t.outputs[1], t.outputs[1]
    assert_same_final(checked_reference(trials), t.final)


@gpt2
def test_sigterm_to_the_group_during_evaluation(trials):
    """Stopped while the validation loader's workers are alive: the evaluation finishes, the
    stop is taken in its run.report() (step 4, the state after the evaluation), and the rerun ends bit-exact."""
    t = trials["eval"].result()
    assert "test hook: holding in eval 1 at step 4" in t.outputs[0], t.outputs[0]
    assert t.codes == [PREEMPTED, 0], t.text
    assert "exited unexpectedly" not in t.text and "killed by signal" not in t.text, t.text
    assert "evaluation at step 4:" in t.outputs[0], t.outputs[0]
    assert stop_of(t.events[0]) == (4, 0, 4 * ACCUM), t.events[0]
    assert_same_final(checked_reference(trials), t.final)


@gpt2
@pytest.mark.slow
def test_sigkill_of_the_group(trials):
    """SIGKILL inside step 11 (nothing runs, nothing is saved): the rerun says what it recomputes from the newest
    durable checkpoint (inside epoch 1: each worker continues from its saved position) and ends bit-exact."""
    t = trials["kill"].result()
    assert t.codes == [-signal.SIGKILL, 0], t.text
    (resumed,) = select(t.events[1], "resume")
    at, since = resumed["crashed"]["died_at"], resumed["step"]
    assert at == 10 and 6 < since <= at, resumed
    assert resumed["epoch"] == 1 and resumed["batch"] > 0, resumed
    # what the user reads: where the previous process died and what is recomputed
    said = f"died without stopping (killed: SIGKILL, out of memory, or its node failed) at step {at}: the {at - since}"
    assert said in t.outputs[1], t.outputs[1]
    assert "IterableDataset's 2 worker(s) continue where each stood" in t.outputs[1], t.outputs[1]
    assert_same_final(checked_reference(trials), t.final)


def test_fallback_model_without_transformers(trials):
    """Where transformers cannot be imported (--model auto), the example trains its own tiny causal transformer."""
    t = trials["fallback"].result()
    assert t.codes == [0], t.text
    assert FALLBACK in t.text and "finished at step 18" in t.text, t.text  # said, and trained to the end
