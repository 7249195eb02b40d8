"""Exact resume where users load data: augmentation inside DataLoader workers, persistent workers, other
worker counts, iterable datasets (preempt/data/replay.py).

The training is tests/scripts/train.py, the Quick start loop: run.sampler + DataLoader + run.epochs + run.batches
+ run.step, with augmentation drawn inside the dataset from torch, NumPy and Python's random, dropout, AdamW,
OneCycleLR, gradient accumulation of 4, clipping and GradScaler("cpu"). Every test ends with every tensor of the
final state (model, optimizer, scheduler, scaler, RNGs, the loss history) torch.equal to an uninterrupted run.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest
from helpers import PREEMPTED, History, Interrupt, Spawned, assert_same_final, in_step, on, run_interrupted, train_cmd

# 512 samples, batches of 16, 4 micro-batches per optimizer step: 32 batches and 8 steps per epoch, 24 steps.
QUICKSTART = [
    *["--epochs", "3", "--samples", "512", "--dropout", "0.3", "--augment"],
    *["--accum", "4", "--onecycle", "--clip", "1.0"],
]
WORKERS2 = [*QUICKSTART, "--num_workers", "2"]
PACE = ["--step_sleep", "0.15"]
BATCHES_PER_EPOCH = 32


def stops(h: History) -> list[tuple[int, int]]:
    """(epoch, batch) of every stop on SIGTERM of the run's processes."""
    return [(e["epoch"], e["batch"]) for e in h.events_of("stop", cause="SIGTERM")]


def resumes(h: History) -> list[int]:
    """The batch of every resume."""
    return [e["batch"] for e in h.events_of("resume")]


def continued(h: History) -> list[dict]:
    """The resumed epochs whose IterableDataset workers each continued where they stood (nothing replayed)."""
    found = h.events_of("loader_resumed", stateful=True, positions=True, batch=lambda b: b > 0)
    return [e for e in found if e["kind"] == "iterable"]  # (the event's own field "kind": not a keyword here)


def mid_epoch(batch: int) -> bool:
    return 0 < batch < BATCHES_PER_EPOCH


def test_worker_augmentation_exact_after_three_mid_epoch_sigterms(tmp_path, reference):
    """The headline: augmentation inside 2 workers, 3 SIGTERMs inside epochs, final state bit-exact."""
    interrupts = [in_step(k) for k in (2, 8, 9)]  # at steps 2, 10 and 19 (each process counts from its resume)
    h = run_interrupted(tmp_path / "run", tmp_path / "final.safetensors", WORKERS2, interrupts)
    assert h.codes[:3] == [PREEMPTED] * 3, h.text
    assert len(stops(h)) == 3 and all(mid_epoch(b) for _, b in stops(h)), stops(h)
    assert_same_final(reference(WORKERS2), tmp_path / "final.safetensors")


def test_worker_augmentation_exact_after_two_sigkills(tmp_path, reference):
    """SIGKILL (no handler runs) twice, the second in a resumed process, with a checkpoint every step; each rerun
    says what it recomputes. (Random SIGKILLs mid-write: tests/faults/test_kill.py, 50 more under -m slow.)"""
    # killed inside each process's 3rd and 6th step; with a checkpoint every step (written in the background,
    # 0.15 s per step) each resumes inside an epoch whether the newest write had ended or not
    interrupts = [in_step(k, signal.SIGKILL) for k in (3, 6)]
    args = [*WORKERS2, *PACE, "--every_steps", "1"]
    h = run_interrupted(tmp_path / "run", tmp_path / "final.safetensors", args, interrupts)
    assert h.codes == [-signal.SIGKILL] * 2 + [0], h.text
    assert len(resumes(h)) == 2 and all(mid_epoch(b) for b in resumes(h)), h.events
    # each rerun knows where its predecessor died (its lock's beacon), and that the steps since are recomputed
    crashed = [(e["step"], e.get("crashed")) for e in h.events_of("resume")]
    assert all(c is not None and c["died_at"] >= step for step, c in crashed), crashed
    assert_same_final(reference(WORKERS2), tmp_path / "final.safetensors")


def test_persistent_workers_exact_mid_epoch_and_at_an_epoch_boundary(tmp_path, reference):
    """persistent_workers=True, stopped inside an epoch and between epochs: equal to the run without them."""
    args = [*WORKERS2, "--persistent_workers"]
    # inside step 3; then in the resumed process's second end-of-epoch code (epoch 1's)
    interrupts = [in_step(3), Interrupt(after=on("holding", point="epoch_end", n=2), args=("--hold_at", "epoch_end:2"))]
    h = run_interrupted(tmp_path / "run", tmp_path / "final.safetensors", args, interrupts)
    assert h.codes[:2] == [PREEMPTED] * 2, h.text
    assert [b for _, b in stops(h)][0] != 0 and stops(h)[1] == (2, 0), stops(h)
    assert_same_final(reference(WORKERS2), tmp_path / "final.safetensors")


def test_changing_the_number_of_workers_between_runs_stays_exact(tmp_path, reference):
    """2 workers, stopped; resumed with 0 workers, stopped; finished with 3: the same as 2 workers throughout."""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    h = History()
    for workers, hold in (("2", "step:5"), ("0", "step:8"), ("3", None)):  # stopped at steps 5 and 13
        held = ["--hold_at", hold] if hold else []
        p = Spawned(train_cmd(save_dir, final, [*QUICKSTART, "--num_workers", workers, *held]))
        if hold is not None:
            point, n = hold.split(":")
            assert p.wait_event("holding", point=point, n=int(n)), p.output
            p.signal(signal.SIGTERM)
        assert p.finish() == (PREEMPTED if hold else 0), p.output
        h.events.append(list(p.events))
    assert len(resumes(h)) == 2 and all(mid_epoch(b) for b in resumes(h)), h.events
    assert_same_final(reference(WORKERS2), final)
    # and the uninterrupted runs agree among themselves: a sample's draws do not depend on who fetched it
    assert_same_final(reference(WORKERS2), reference([*QUICKSTART, "--num_workers", "0"]))


# under -m slow: it shows a documented limitation of the opt-out, no path of a resume that must be exact
@pytest.mark.slow
def test_per_sample_rng_off_is_not_exact_mid_epoch(tmp_path, reference):
    """The opt-out really turns it off: with run.sampler(per_sample_rng=False) the workers' draws restart
    from the epoch's seed, so a mid-epoch resume changes the training (the documented limitation)."""
    model_args = [*WORKERS2, "--no_per_sample_rng"]
    h = run_interrupted(tmp_path / "run", tmp_path / "final.safetensors", model_args, [in_step(3)])
    assert h.codes[0] == PREEMPTED and mid_epoch(stops(h)[0][1]), h.events
    with pytest.raises(AssertionError, match="tensors differ"):
        assert_same_final(reference(model_args), tmp_path / "final.safetensors")


# An IterableDataset sharded over the workers (worker w of n yields samples w, w + n, ...). Three micro-batches
# per step, so that a stop after step 3 lands after batch 9: the next batch belongs to worker 1, not worker 0.
STREAM = ["--epochs", "2", "--samples", "384", "--dropout", "0.3", "--augment", "--accum", "3"]


# without workers (the dataset's own state in the main process) a repetition, under -m slow
@pytest.mark.parametrize("workers", [pytest.param("0", marks=pytest.mark.slow), "2"])
def test_stateful_iterable_dataset_resumes_each_worker_where_it_stood(tmp_path, reference, workers):
    model_args = [*STREAM, "--iterable", "stateful", "--num_workers", workers]
    interrupts = [in_step(3), in_step(9)]  # at steps 3 and 12
    h = run_interrupted(tmp_path / "run", tmp_path / "final.safetensors", model_args, interrupts)
    assert h.codes[:2] == [PREEMPTED] * 2, h.text
    assert len(continued(h)) == 2, h.events
    assert "replaying" not in h.text, h.text
    assert_same_final(reference(model_args), tmp_path / "final.safetensors")


def test_an_iterable_dataset_with_set_epoch_and_persistent_workers_resumes_exactly_in_its_second_epoch(
    tmp_path, reference
):
    """The trial: the stream's order changes with the epoch (set_epoch, called by the loop in the main process
    as users do), 2 persistent workers that keep their own copies of it. The run tells each worker the epoch, so the
    uninterrupted run's epoch 1 is epoch 1 in the workers too, and a run stopped inside epoch 1 resumes there exactly
    (before: the workers of the uninterrupted run stayed at epoch 0, the resumed ones were made at epoch 1, and 170
    tensors differed at the end)."""
    model_args = [*STREAM, "--iterable", "epochs", "--num_workers", "2", "--persistent_workers"]
    h = run_interrupted(tmp_path / "run", tmp_path / "final.safetensors", model_args, [in_step(11)])  # 8 per epoch
    assert h.codes[0] == PREEMPTED and stops(h)[0][0] == 1 and stops(h)[0][1] > 0, h.events
    assert [e["workers"] for e in continued(h)] == [2], h.events
    assert_same_final(reference(model_args), tmp_path / "final.safetensors")


def test_iterable_dataset_without_state_dict_replays_and_says_so(tmp_path, reference):
    model_args = [*STREAM, "--iterable", "plain", "--num_workers", "2"]
    h = run_interrupted(tmp_path / "run", tmp_path / "final.safetensors", model_args, [in_step(3)])
    assert h.codes[0] == PREEMPTED, h.text
    batch = stops(h)[0][1]
    # the warning is the feature: the user reads which loader replays and why
    assert re.search(
        rf"the loader of run.batches\(\) \(a DataLoader over Stream, an IterableDataset, 2 worker\(s\)\): has no"
        rf" state_dict\(\)/load_state_dict\(\): replaying {batch} batch\(es\) of epoch 0 from its start",
        h.text,
    ), h.text
    assert_same_final(reference(model_args), tmp_path / "final.safetensors")


RAISES = """
import sys, torch
from torch.utils.data import DataLoader, Dataset
from preempt import PreemptibleRun
class Broken(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        if i == 21:
            raise ValueError("sample 21 is broken")
        return torch.zeros(2)
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with PreemptibleRun(sys.argv[1], model=model, optimizer=opt, checkpoint_interval=None) as run:
    data = Broken()
    loader = DataLoader(data, batch_size=4, sampler=run.sampler(data, shuffle=False), num_workers=2)
    for epoch in run.epochs(2):
        for x in run.batches(loader):
            run.step()
"""


def test_an_error_in_a_worker_ends_the_process(tmp_path):
    """The exception's traceback keeps the epoch's iterator alive; its workers ignore SIGTERM (shielded), so
    multiprocessing's exit handler would wait for them forever. The run stops them when it ends."""
    script = tmp_path / "raises.py"
    script.write_text(RAISES)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True, timeout=90)
    assert r.returncode == 1 and "sample 21 is broken" in r.stderr, r.stderr
