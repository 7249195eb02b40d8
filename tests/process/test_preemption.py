"""Real training processes stopped by real signals, rerun until done, compared bit for bit.

Every test ends with the final model, optimizer, scheduler, GradScaler, RNG
states and the whole loss history of the interrupted run equal (torch.equal)
to those of an uninterrupted run with the same training arguments.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    PREEMPTED,
    Interrupt,
    Spawned,
    assert_same_final,
    on,
    run_interrupted,
    run_python,
    select,
    train_cmd,
)

from preempt.checkpoint.names import checkpoint_name

# Arguments that change the training (the reference run uses the same ones).
WORKERS0 = ["--epochs", "3", "--samples", "256", "--dropout", "0.3"]  # 48 steps
WORKERS2 = [*WORKERS0, "--num_workers", "2"]
# Arguments that only change when checkpoints happen and how fast steps go.
PACE = ["--step_sleep", "0.03"]


# augment0: the dataset itself draws from the global RNGs (python, numpy, torch) in the main process.
AUGMENT0 = [*WORKERS0, "--augment"]


# Repetitions under -m slow: test_data_replay.py's headline stops three processes inside steps (2 workers,
# augmentation in them, and in the main process once resumed with 0 workers); these stop them at random moments.
@pytest.mark.parametrize(
    "model_args",
    [pytest.param(a, marks=pytest.mark.slow) for a in (WORKERS0, WORKERS2, AUGMENT0)],
    ids=["workers0", "workers2", "augment0"],
)
def test_three_sigterms_at_random_points(tmp_path, reference, model_args):
    """Three SIGTERMs at random moments; each run saves and exits 75; the last rerun completes bit-exact."""
    rnd = random.Random(sum(map(ord, "".join(model_args))))
    interrupts = [Interrupt(after=on("step"), delay=rnd.uniform(0.0, 0.3)) for _ in range(3)]
    args = [*model_args, *PACE, "--every_steps", "5"]
    h = run_interrupted(tmp_path / "run", tmp_path / "final.safetensors", args, interrupts)
    assert h.codes[:3] == [PREEMPTED] * 3, h.text
    assert h.count_events("stop", cause="SIGTERM") == 3, h.events
    assert h.count_events("resume") >= 3, h.events
    assert_same_final(reference(model_args), tmp_path / "final.safetensors")


def test_sigterm_during_first_step_between_epochs_and_during_a_save(tmp_path, reference):
    """The awkward moments: the first step, the epoch boundary (end-of-epoch code), and a checkpoint write."""
    model_args = WORKERS0  # "during a save" is reached by a hold before its manifest, whatever the save's size
    # Synchronous saves: "during a save" is then the whole write (tests/faults/test_async_signals.py has a signal
    # during a background write). Each stopped process holds at its point until the signal has come: inside its
    # first step, in its first end-of-epoch code, and before the manifest of its first save (a periodic one).
    args = [*model_args, "--every_steps", "3", "--sync_save"]
    interrupts = [
        Interrupt(after=on("holding", point="step", n=1), args=("--hold_at", "step:1")),
        Interrupt(after=on("holding", point="epoch_end", n=1), args=("--hold_at", "epoch_end:1")),
        Interrupt(after=on("holding", point="before_manifest", n=1), args=("--hold_at", "before_manifest:1")),
    ]
    h = run_interrupted(
        tmp_path / "run", tmp_path / "final.safetensors", args, interrupts, env={"PREEMPT_LOG_LEVEL": "DEBUG"}
    )
    assert h.codes[:3] == [PREEMPTED] * 3, h.text
    first, boundary, during_save = h.events[:3]
    # Stopped during the first step: that step completes, is saved, and the run exits.
    assert [(e["step"], e["reason"]) for e in select(first, "checkpoint")] == [(1, "preempt")], first
    # Stopped in end-of-epoch code: the save happens at the boundary, before epoch 1's first batch.
    assert select(boundary, "stop", cause="SIGTERM", epoch=1, batch=0), boundary
    # Stopped while writing: that write completes and no second save is needed.
    saved = select(during_save, "saving")[-1]["step"]
    assert select(during_save, "checkpoint", step=saved, reason="steps"), during_save
    (stop,) = select(during_save, "stop", cause="SIGTERM")
    assert Path(stop["checkpoint"]).name == checkpoint_name(saved), (stop, saved)
    assert_same_final(reference(model_args), tmp_path / "final.safetensors")


def test_timeout_signal_term(tmp_path, reference):
    """`timeout --signal=TERM` (which signals its whole process group, DataLoader workers included). Its limit is
    made to expire while the run holds inside step 6, by the SIGALRM that timeout's own timer delivers; the rerun
    completes bit-exact. (A stop of a resumed process: the other tests of this file and test_data_replay.py.)"""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    model_args = [*WORKERS2, "--augment"]  # the workers draw: their random state must survive the group's signal
    args = [*model_args, "--every_steps", "4"]
    p = Spawned(["timeout", "--signal=TERM", "600", *train_cmd(save_dir, final, [*args, "--hold_at", "step:6"])])
    assert p.wait_event("holding", point="step", n=6), p.output
    p.signal(signal.SIGALRM)  # the limit expires now: timeout sends SIGTERM to its process group
    assert p.finish() == 124, p.output  # timeout's exit code when its limit expired
    assert p.events_of("stop", cause="SIGTERM", step=6), p.events
    assert "killed by signal" not in p.output, p.output  # the workers were shielded (DataLoader's own error)
    rerun = Spawned(train_cmd(save_dir, final, args))
    assert rerun.finish() == 0, rerun.output
    assert rerun.events_of("resume", step=6), rerun.events
    assert_same_final(reference(model_args), final)


def test_worker_randomness_replays_from_an_epoch_boundary(tmp_path, reference):
    """Augmentation drawn inside two DataLoader workers: a stop at an epoch boundary resumes bit-exact.
    (Mid-epoch stops, persistent workers and other worker counts: tests/process/test_data_replay.py.)"""
    model_args = [*WORKERS2, "--augment"]
    # the stopped process holds in its first end-of-epoch code until the signal has come
    interrupts = [Interrupt(after=on("holding", point="epoch_end", n=1), args=("--hold_at", "epoch_end:1"))]
    h = run_interrupted(tmp_path / "run", tmp_path / "final.safetensors", model_args, interrupts)
    assert h.codes == [PREEMPTED, 0], h.text
    assert h.count_events("stop", cause="SIGTERM", epoch=1, batch=0) == 1, h.events
    assert_same_final(reference(model_args), tmp_path / "final.safetensors")


# A repetition under -m slow: test_data_replay.py kills two processes inside steps with a checkpoint written at
# every step (and augmentation in workers), and tests/faults/test_kill.py kills writes at each of their stages.
@pytest.mark.slow
def test_sigkill_at_random_points(tmp_path, reference):
    """SIGKILL (no handler, no save) at random moments with a checkpoint every step: every rerun
    resumes from a valid checkpoint, and the end is still bit-exact."""
    rnd = random.Random(5)
    interrupts = [Interrupt(after=on("step"), delay=rnd.uniform(0.0, 0.25), sig=signal.SIGKILL) for _ in range(4)]
    args = [*WORKERS0, "--step_sleep", "0.04", "--every_steps", "1", "--keep_last", "2"]
    h = run_interrupted(tmp_path / "run", tmp_path / "final.safetensors", args, interrupts)
    assert h.codes.count(-signal.SIGKILL) >= 3, h.text
    resumed = [e["step"] for e in h.events_of("resume")]
    assert len(resumed) >= 3, h.text
    assert not h.events_of("quarantined"), h.events
    assert not list((tmp_path / "run").glob(".tmp-*")), "a partial checkpoint was left behind"
    assert_same_final(reference(WORKERS0), tmp_path / "final.safetensors")


# Under -m slow: by default tests/faults/test_carry_sharing.py flips a bit in a newest checkpoint's own file and in
# its shared base (warned, quarantined, an older one resumed, bit-exact), test_forged_state.py falls back from forged
# content, and test_cli.py and test_tensorfile.py reject truncated files.
@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_newest_checkpoint_falls_back(tmp_path, reference, damage):
    """A flipped byte or a truncated file in the newest checkpoint: warned, quarantined, older one used."""
    save_dir = tmp_path / "run"
    args = [*WORKERS0, *PACE, "--every_steps", "4", "--keep_last", "3"]

    def break_newest(_: int) -> None:
        newest = sorted(save_dir.glob("step_*"))[-1]
        victim = newest / "model.safetensors"
        data = bytearray(victim.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0x01
        else:
            data = data[: len(data) // 2]
        victim.write_bytes(bytes(data))
        break_newest.name = newest.name  # type: ignore[attr-defined]

    h = run_interrupted(
        save_dir, tmp_path / "final.safetensors", args, [Interrupt(after=on("step", step=20))], between=break_newest
    )
    rerun = h.events[1]
    bad = break_newest.name  # type: ignore[attr-defined]
    expected = "xxh3 mismatch" if damage == "flip" else "size"
    (aside,) = select(rerun, "quarantined", name=bad)
    assert f"{bad}/model.safetensors: {expected}" in aside["problem"], aside
    assert (save_dir / "quarantine" / bad).is_dir()
    (older,) = select(rerun, "resume")
    assert older["step"] < int(bad.split("_")[1]), rerun
    assert_same_final(reference(WORKERS0), tmp_path / "final.safetensors")


def test_gradient_accumulation_saves_only_after_optimizer_steps(tmp_path, reference):
    """With 3 micro-batches per optimizer step, checkpoints land on optimizer steps and resume exactly."""
    model_args = [*WORKERS0, "--accum", "3"]
    args = [*model_args, *PACE, "--every_steps", "2"]
    interrupts = [Interrupt(after=on("step"), delay=0.05)]
    h = run_interrupted(tmp_path / "run", tmp_path / "final.safetensors", args, interrupts)
    assert h.codes == [PREEMPTED, 0], h.text
    batches = [e["batch"] for e in h.events_of("resume")]
    assert batches and all(b % 3 == 0 for b in batches), h.text
    assert_same_final(reference(model_args), tmp_path / "final.safetensors")


# under -m slow: by default tests/process/test_after_training.py reruns a finished run (it exits at once) and the
# README demo's third command does the same
@pytest.mark.slow
def test_completed_run_exits_zero_without_training(tmp_path):
    save_dir = tmp_path / "run"
    cmd = train_cmd(save_dir, None, [*WORKERS0, "--epochs", "1"])
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "is complete" in r.stderr
    assert "step 1 " not in r.stdout and "start" not in r.stdout


def test_signal_before_the_run_is_entered_keeps_default_behaviour(tmp_path):
    """Outside the with-block SIGTERM does what it always does: the process dies of it."""
    code = (
        "import os, signal, sys\n"
        "from preempt import PreemptibleRun\n"
        "import torch\n"
        f"with PreemptibleRun({str(tmp_path / 'r')!r}, model=torch.nn.Linear(2, 2)) as run:\n"
        "    pass\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('still alive')\n"
    )
    r = run_python([sys.executable, "-c", code], timeout=120)
    assert r.returncode == -signal.SIGTERM, (r.returncode, r.stderr)
    assert "still alive" not in r.stdout


# under -m slow: tests/faults/test_awkward_signals.py presses Ctrl+C twice outside a save by default (and reruns)
@pytest.mark.slow
@pytest.mark.usefixtures("sigint_handled")
def test_second_sigint_raises_keyboard_interrupt(tmp_path):
    """First Ctrl+C asks for a save at the next step; a second one, outside a save, ends the process at once."""
    # Two presses between step 1's safe point and step 2's: the process sends them to itself one after the other,
    # and the first one's handler has run before the second is sent (signals sent at once would coalesce).
    p = Spawned(train_cmd(tmp_path / "run", None, [*WORKERS0, "--kill_at_step", "1:INT,1:INT"]))
    rc = p.finish()
    # CPython ends an uncaught KeyboardInterrupt by dying of SIGINT, as shells expect
    assert rc == -signal.SIGINT and "KeyboardInterrupt" in p.output, p.output
    assert not list((tmp_path / "run").glob("step_*")), "no checkpoint is written when the person wants out"


def test_save_dir_listing_after_interruptions(tmp_path):
    """`preempt ls` and `preempt verify` on a real save_dir."""
    save_dir = tmp_path / "run"
    run_interrupted(save_dir, tmp_path / "f.safetensors", [*WORKERS0, *PACE, "--every_steps", "8"], [Interrupt()])
    ls = run_python([sys.executable, "-m", "preempt", "ls", str(save_dir)])
    assert ls.returncode == 0 and "valid (latest)" in ls.stdout and "run complete" in ls.stdout, ls.stdout
    ok = subprocess.run(["preempt", "verify", str(save_dir)], capture_output=True, text=True)
    assert ok.returncode == 0 and "DAMAGED" not in ok.stdout, ok.stdout
    victim = sorted(save_dir.glob("step_*"))[-1] / "state.json"
    victim.write_bytes(victim.read_bytes().replace(b"{", b"[", 1))
    bad = subprocess.run(["preempt", "verify", str(save_dir)], capture_output=True, text=True)
    assert bad.returncode == 1 and f"{victim.parent.name}: DAMAGED" in bad.stdout, bad.stdout
    assert "xxh3 mismatch" in bad.stdout


def test_help_lists_exit_codes():
    r = subprocess.run(["preempt", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "exit codes" in r.stdout


def test_save_dir_is_a_file(tmp_path: Path):
    f = tmp_path / "taken"
    f.write_text("x")
    r = run_python(train_cmd(f, None, WORKERS0))
    assert r.returncode == 1
    assert f"save_dir {f}: expected a directory, found a file" in r.stderr


PERSISTENT = """
import sys, time, torch
from torch.utils.data import DataLoader, TensorDataset
from preempt import PreemptibleRun, _testing
data = TensorDataset(torch.randn(64, 4))
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
# module level on purpose: the loader (and its persistent workers) is still alive when the interpreter exits
with PreemptibleRun(sys.argv[1], model=model, optimizer=opt, checkpoint_interval=None) as run:
    loader = DataLoader(data, batch_size=8, sampler=run.sampler(data, seed=0), num_workers=2, persistent_workers=True)
    for epoch in run.epochs(3):
        for (x,) in run.batches(loader):
            model(x).sum().backward(); opt.step(); opt.zero_grad()
            _testing.emit("step", step=run.global_step + 1)
            time.sleep(float(sys.argv[2]))
            run.step()
"""


# a run that completes under -m slow: test_data_replay.py's persistent-worker trials complete theirs by default
@pytest.mark.parametrize("stop", [pytest.param(False, marks=pytest.mark.slow), True], ids=["completes", "sigterm"])
def test_persistent_workers_do_not_hang_the_exit(tmp_path, stop):
    """Shielded workers ignore SIGTERM, which multiprocessing's exit handler sends them: the run stops them first."""
    script = tmp_path / "persistent.py"
    script.write_text(PERSISTENT)
    p = Spawned([sys.executable, str(script), str(tmp_path / "run"), "0.05" if stop else "0"])
    if stop:
        assert p.wait_event("step", step=10)
        p.signal(signal.SIGTERM)
    assert p.finish(timeout=60) == (PREEMPTED if stop else 0), p.output
