"""Every DataLoader iterated inside the run is protected from the process group's stop signal, not only the loader of
run.batches(): an evaluation loader with workers, iterated by the loop itself between run.step() calls.

``timeout``, Ctrl+C and SLURM without ``B:`` signal the whole process group. The test does the same (``os.killpg``)
while a worker of the evaluation loader holds inside ``__getitem__`` (tests/scripts/train.py ``--eval_hold``: the
worker prints a line and waits for a file the test creates after the signal), so the signal lands during the
evaluation however fast or slow the machine. Before the fix the evaluation's workers died of it and the main process
raised ``DataLoader worker (pid(s) ...) exited unexpectedly`` (exit 1); now the evaluation finishes, the run stops at
the next run.step() with a checkpoint (exit 75), and the rerun ends torch.equal to a run that was never stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers import PREEMPTED, Spawned, assert_same_final, train_cmd

# 16 steps in one epoch; an evaluation (64 samples, 4 batches, 2 workers) after every 5th step
EVAL = ["--epochs", "1", "--samples", "256", "--eval_loader_every", "5"]


# workers made anew for each evaluation under -m slow: tests/process/test_example_gpt2.py stops such an evaluation
# (the example's validation loader) by default
@pytest.mark.parametrize(
    "persistent", [pytest.param(False, marks=pytest.mark.slow), True], ids=["workers", "persistent_workers"]
)
def test_sigterm_to_the_process_group_during_evaluation_stops_after_it_and_resumes_exactly(
    tmp_path, reference, persistent
):
    args = [*EVAL, "--eval_persistent"] if persistent else EVAL
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = Spawned(train_cmd(save_dir, final, [*args, "--eval_hold", str(tmp_path)]), session=True)
    assert p.wait_event("holding", point="evaluation worker"), p.output
    os.killpg(p.proc.pid, signal.SIGTERM)  # the main process and every worker of the evaluation loader
    (tmp_path / "go").touch()  # after the signal: the worker goes on
    assert p.finish() == PREEMPTED, p.output
    assert "exited unexpectedly" not in p.output and "killed by signal" not in p.output, p.output
    # the evaluation after step 5 finished; the stop was taken in its run.report() (README_PREEMPTION.md,
    # "Evaluation in the loop"), with a checkpoint of step 5 that holds the state after the evaluation
    assert p.events_of("eval", step=5), p.events
    stop = p.events_of("stop", cause="SIGTERM", step=5, epoch=0, batch=5)
    assert stop and stop[0]["checkpoint"].endswith("step_000000005"), p.events
    rerun = Spawned(train_cmd(save_dir, final, args))
    assert rerun.finish() == 0, rerun.output
    assert rerun.events_of("resume", step=5, epoch=0, batch=5), rerun.events
    assert_same_final(reference(args), final)  # weights, optimizer, RNG, losses and every evaluation's result


PROTECTED = """
import os, signal, sys, torch
from torch.utils.data import DataLoader
from preempt import PreemptibleRun

if __name__ == "__main__":
    run = PreemptibleRun(sys.argv[1], model=torch.nn.Linear(1, 1))  # never entered: protect() alone
    loader = DataLoader(torch.arange(32), batch_size=4, num_workers=2, persistent_workers=True,
                        multiprocessing_context=sys.argv[2])
    run.protect(loader)
    assert sum(int(b.sum()) for b in loader) == 496
    for w in loader._iterator._workers:
        os.kill(w.pid, signal.SIGTERM)
    assert sum(int(b.sum()) for b in loader) == 496
    print("both epochs whole; leaving with the loader's persistent workers alive", flush=True)
"""


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_protected_loader_outside_the_run_survives_sigterm_and_does_not_hang_the_exit(tmp_path, context):
    """run.protect() before (or without) the run: the workers ignore SIGTERM, and the interpreter's exit, which ends
    daemon children with SIGTERM and waits for them, still returns (the workers are released first)."""
    script = tmp_path / "protected.py"
    script.write_text(textwrap.dedent(PROTECTED))
    try:
        r = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "run"), context], capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the process did not exit: {e.stdout}{e.stderr}") from None
    assert r.returncode == 0 and "both epochs whole" in r.stdout, r.stdout + r.stderr
