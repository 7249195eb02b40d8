"""Loops that write the model's state behind autograd's back (``tests/scripts/users/behind_autograd.py``: a
word_language_model-style ``p.data`` update without an optimizer, a DINO teacher and an EMA inside the model
updated through ``.data``, WGAN's ``p.data.clamp_``, NumPy views, a parameter and a buffer replaced, a loader
wrapper that sets the sampler's epoch), with preempt's default options, writing in the background and not.

What each checkpoint holds is checked against the live state at its step (``helpers/kept.py``): every kept
checkpoint of an uninterrupted run, the final one included, and every kept checkpoint of a run stopped by SIGTERM
mid-epoch or SIGKILLed after a durable checkpoint and resumed, whose final state must also equal the uninterrupted
run's bit for bit. A checkpoint that holds an older step's tensors passes a test of the final state whenever the
run is not resumed from it; only this comparison sees it.

Every state is reached by events: a step that holds until the test's signal (``--hold_at_step``), a step that holds
once the checkpoint in flight is durable (``--hold_durable_at_step``), and background saves waited for where they
are due (``--settle``), so that the checkpoints' steps are the same on a fast machine and a slow one.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from helpers import PREEMPTED, ROOT, Interrupt, Script, Spawned, assert_same_final, history_events, on, run_interrupted
from helpers.kept import assert_kept_equal_live
from helpers.reference import References, run_to_end

BEHIND = Script(ROOT / "tests" / "scripts" / "users" / "behind_autograd.py")
SHAPES = ("sgd_data", "teacher", "ema_data", "clamp_data", "numpy_view", "replaced", "set_epoch_wrapper")
MODES = ("async", "sync")
STEPS, EVERY = 30, 3  # 3 epochs of 10 steps, a checkpoint every 3rd step
PERIODIC = list(range(EVERY, STEPS + 1, EVERY))
TERM_AT = 14  # epoch 1, its 4th batch: mid-epoch, no periodic checkpoint there (the stop writes its own)
# A background write that finds a frozen tensor changed between its step and its read is not committed (a warning
# says so; from then on that file is copied at the step): the first periodic checkpoint of a loop that writes a
# frozen submodule through .data or NumPy, when the writer reads it after the loop changed it (ema_data's,
# numpy_view's, as the machine's pace has it). At most one per process; the oracle compares the others and must
# compare all the periodic checkpoints but this many per process.
SPARED = 1
KILL_AT = 23  # epoch 2, its 3rd batch: step 21's checkpoint is durable, steps 22 and 23 are lost
# The stops run for every mode of these shapes by default (the rest under -m slow): a loop without an optimizer,
# a frozen submodule written through .data, and a sampler whose epoch a wrapper sets after a resume.
STOPPED_BY_DEFAULT = ("sgd_data", "teacher", "set_epoch_wrapper")
STOPS = {
    "sigterm": Interrupt(
        after=on("holding", point="step", n=TERM_AT), sig=signal.SIGTERM, args=("--hold_at_step", str(TERM_AT))
    ),
    "sigkill": Interrupt(
        after=on("holding", point="step", n=KILL_AT),
        sig=signal.SIGKILL,
        args=("--hold_durable_at_step", str(KILL_AT)),
    ),
}


def shape_args(shape: str, mode: str) -> list[str]:
    """The script's options for a shape: synchronous saves, or background saves waited for where one is due."""
    return ["--shape", shape, "--sync" if mode == "sync" else "--settle"]


def straight(reference: References, shape: str, mode: str) -> Path:
    """An uninterrupted run, made once per test session: ``run/`` (its save_dir), ``live/`` (the live state of
    every step) and ``final.safetensors``."""
    args = shape_args(shape, mode)

    def make(d: Path) -> None:
        cmd = BEHIND.command(d / "run", d / "final.safetensors", [*args, "--live_dir", str(d / "live")])
        run_to_end(Spawned(cmd))

    return reference.made(("python", str(BEHIND.path), *args), make)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_kept_checkpoint_holds_the_live_state_of_its_step(reference, shape, mode):
    """A run to its end: each of its 10 checkpoints, the final one (step 30) included, holds the model's and the
    optimizer's tensors of its step, bit for bit.

    Would catch: a tensor file carried (hard-linked) from an older checkpoint because its tensors' version counters
    and addresses did not move, while the loop wrote it through ``.data`` or a NumPy view; a background write that
    reads a frozen tensor after the loop changed it behind autograd (a later step's bytes)."""
    d = straight(reference, shape, mode)
    checks = assert_kept_equal_live(d / "run", d / "live", at_least=len(PERIODIC) - SPARED)
    steps = [c.step for c in checks]
    assert set(steps) <= set(PERIODIC) and STEPS in steps, steps
    assert [e["step"] for e in history_events(d / "run", "complete")] == [STEPS]


STOPPED = [
    pytest.param(shape, mode, stop, marks=[] if shape in STOPPED_BY_DEFAULT else [pytest.mark.slow])
    for shape in SHAPES
    for mode in MODES
    for stop in STOPS
]


@pytest.mark.parametrize(("shape", "mode", "stop"), STOPPED)
def test_stopped_and_resumed_ends_bit_exact_and_every_kept_checkpoint_is_live(tmp_path, reference, shape, mode, stop):
    """SIGTERM held inside step 14 (the stop writes step 14 and exits 75), or SIGKILL inside step 23 once step 21's
    checkpoint is durable; the rerun resumes from that checkpoint and runs to the end. Its final state equals the
    uninterrupted run's on every tensor, and every kept checkpoint, those of the stopped process and of the
    resumed one, holds the live state of its step.

    Would catch: a stale checkpoint that the resume starts from (the final state differs), one that it does not
    start from (only the oracle sees it), and a loader wrapper's ``set_epoch`` obeyed after a resume (its own count
    starts at 0 again: epoch 1 or 2 would replay epoch 0's order)."""
    save_dir, live, final = tmp_path / "run", tmp_path / "live", tmp_path / "final.safetensors"
    args = [*shape_args(shape, mode), "--live_dir", str(live)]
    h = run_interrupted(save_dir, final, args, [STOPS[stop]], script=BEHIND.path)
    if stop == "sigterm":
        assert h.codes == [PREEMPTED, 0], h.text
        assert h.count_events("checkpoint", step=TERM_AT, reason="preempt") == 1, h.events
        resumed_at = TERM_AT
    else:
        assert h.codes == [-signal.SIGKILL, 0], h.text
        (held,) = h.events_of("holding", point="step", n=KILL_AT)
        assert held["durable"] == "step_000000021", held
        resumed_at = 21
    assert [e["step"] for e in h.events_of("resume")] == [resumed_at], h.events

    # first what each checkpoint holds: a stale one the rerun resumed from is why the final state differs
    checks = assert_kept_equal_live(save_dir, live, at_least=len(PERIODIC) - 2 * SPARED)  # (two processes)
    steps = [c.step for c in checks]
    assert resumed_at in steps and STEPS in steps, steps
    assert_same_final(straight(reference, shape, mode) / "final.safetensors", final)
    if shape == "set_epoch_wrapper":
        # The wrapper's set_epoch(0) in the resumed process is ignored, and said once. preempt says so in a log
        # record alone (logger "preempt", ResumableSampler.set_epoch: "set_epoch(%d) from %s ignored; ..."), no
        # event: the wording is asserted until the history or the test event stream carries one.
        resumed = h.outputs[-1]
        assert "set_epoch(0) from" in resumed and "ignored" in resumed, resumed
