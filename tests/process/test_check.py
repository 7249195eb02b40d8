"""``preempt check`` on real training commands: real processes, real stops and SIGKILLs, real frameworks.

Each test runs ``python -m preempt check --json ... -- python tests/scripts/check_*.py`` and asserts the verdict,
the first diverging step it names and what it says differs, and which runs the check made (an exact resume needs no
second reference). The default tier holds an exact loop, one pattern that breaks a resume, a checkpoint that holds
a tensor from an older step, gradient accumulation's default stops and the checks that cannot be made; the other
frameworks, SIGKILL and the other patterns are ``slow`` (each check is two to five runs of a script).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import rank_launcher
from helpers.processes import RANK_LAUNCHER, ROOT, TRAIN_DDP

SCRIPTS = ROOT / "tests" / "scripts"
LOOP = SCRIPTS / "check_loop.py"
LIGHTNING = SCRIPTS / "check_lightning.py"
HF = SCRIPTS / "train_hf.py"


def python(script: Path, *args: str) -> list[str]:
    """``python SCRIPT ARGS`` as the check runs it: through ``tests/rank_launcher.py``, which forks it from one of the
    suite's servers that imported torch once (``tests/forkserver.py``), or starts it fresh where it cannot."""
    return [sys.executable, "-u", str(RANK_LAUNCHER), str(script), *args]


def run_check(tmp_path: Path, options: list[str], command: list[str]) -> tuple[int, dict[str, Any], str]:
    """``preempt check --json OPTIONS -- COMMAND`` in ``tmp_path``: its exit code, its document, its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}  # the scratch space under tmp_path too
    env |= rank_launcher.servers_named()
    p = subprocess.run(
        [sys.executable, "-m", "preempt", "check", "--json", *options, "--", *command],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    doc = json.loads(p.stdout) if p.stdout.strip() else {}
    return p.returncode, doc, p.stderr


def files_under(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def assert_exact(code: int, doc: dict[str, Any], err: str, nondeterministic: set[str] | None = None) -> None:
    assert code == 0, (doc, err)
    assert doc["verdict"] == "exact" and doc["first_diverging_step"] is None, doc
    assert set(doc["nondeterministic"]) <= (nondeterministic or set()), doc  # each script seeds what it draws from
    if not nondeterministic:  # the trial equals the first reference: no second one to tell nondeterminism apart
        assert doc["runs"] == ["reference", "trial"], doc


def assert_diverges_at(code: int, doc: dict[str, Any], err: str, step: int, differs: str) -> None:
    assert code == 1, (doc, err)
    assert doc["verdict"] == "not exact", doc
    assert doc["first_diverging_step"] == step, doc
    assert differs in doc["differs"], doc
    assert "first step after the resume" in doc["hint"], doc


def test_an_exact_loop_with_workers_and_augmentation_and_the_users_files_untouched(tmp_path):
    """Stops chosen by the check (mid-epoch, the step after, the epoch's end); the script's save_dir (with a
    checkpoint of its own in it), its mirror and its TensorBoard logs are never touched."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    before = files_under(user)
    mirror = tmp_path / "mirror"
    command = python(LOOP, "--save_dir", str(user), "--tensorboard", "--mirror", f"file://{mirror}")
    code, doc, err = run_check(tmp_path, ["--steps", "14"], command)
    assert_exact(code, doc, err)
    assert doc["stops"] == [6, 7, 12]  # 12 batches per epoch: mid-epoch, right after that resume, the epoch's end
    assert doc["compared_steps"] == list(range(6, 15))
    assert doc["processes"]["trial"] == [75, 75, 75, 81]
    assert files_under(user) == before
    assert not mirror.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("preempt-check-")] == []  # scratch freed


def test_a_batch_drawn_before_run_step_diverges_at_the_first_step_after_the_resume(tmp_path):
    command = python(LOOP, "--save_dir", str(tmp_path / "user"), "--pattern", "prefetch")
    code, doc, err = run_check(tmp_path, ["--stop-at", "5", "--steps", "9"], command)
    assert_diverges_at(code, doc, err, 6, "the global torch RNG")
    assert any(d.startswith("model.") for d in doc["differs"]), doc
    assert doc["runs"] == ["reference", "trial", "reference-2"], doc  # a difference: nondeterminism told apart


def test_a_checkpoint_that_holds_a_tensor_from_an_older_step_is_named_with_its_step_and_tensor(tmp_path):
    """The model's state_dict() hands out its first weight as the previous call saw it: each checkpoint holds that
    tensor from an older step. Not "nondeterministic", not "state carried between steps": that checkpoint."""
    command = python(LOOP, "--save_dir", str(tmp_path / "user"), "--workers", "0", "--pattern", "stale_state_dict")
    code, doc, err = run_check(tmp_path, ["--stop-at", "5", "--steps", "8"], command)
    assert code == 1, (doc, err)
    assert doc["verdict"] == "stale checkpoint", doc
    stale = doc["stale_checkpoint"]
    assert (stale["run"], stale["step"], stale["paths"]) == ("trial", 5, ["model.0.weight"]), doc
    assert doc["hint"].startswith("step 5's checkpoint (trial run) holds model.0.weight from an older step"), doc
    assert doc["nondeterministic"] == [] and doc["first_diverging_step"] is None, doc


def test_gradient_accumulation_stops_mid_epoch_at_optimizer_steps(tmp_path):
    """12 batches an epoch, 2 per optimizer step: 6 run.step() calls an epoch. The default stops are optimizer
    steps: mid-epoch (step 3, batch 6 of 12), the step after, the epoch's end (step 6), not batches (6, 7, 12)."""
    command = python(LOOP, "--save_dir", str(tmp_path / "user"), "--workers", "0", "--accumulate", "2")
    code, doc, err = run_check(tmp_path, ["--steps", "12"], command)
    assert_exact(code, doc, err)
    assert doc["steps_per_epoch"] == 6 and doc["stops"] == [3, 4, 6], doc


@pytest.mark.parametrize(
    ("command", "says"),
    [
        ([sys.executable, "-c", "print('no preempt here')"], "never entered a preempt run"),
        (python(LOOP, "--save_dir", "x", "--crash_at", "3"), "crashed on purpose at step 3"),
        (python(LOOP, "--save_dir", "x", "--epochs", "1"), "ended at step 12, before step 20"),
    ],
    ids=["no-preempt", "crash", "steps-beyond-the-end"],
)
def test_a_check_that_cannot_be_made_exits_2_with_one_line(tmp_path, command, says):
    code, doc, err = run_check(tmp_path, ["--stop-at", "2", "--steps", "20"], command)
    assert code == 2, (doc, err)
    assert doc["exit_code"] == 2 and says in doc["error"], doc
    assert err.count("\n") == 1 and err.startswith("preempt check: ") and says in err, err  # one line, no traceback
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_an_epoch_reset_by_a_loader_wrapper_is_named_as_the_data_order_at_the_epochs_start(tmp_path):
    """A sampler of the script's own inside a wrapper that calls set_epoch with its own count (as Fabric's does):
    resumed at the first epoch's end, the wrapper counts from 0 again and epoch 1 comes in epoch 0's order."""
    command = python(LOOP, "--save_dir", str(tmp_path / "user"), "--workers", "0", "--pattern", "epoch_reset")
    code, doc, err = run_check(tmp_path, ["--stop-at", "12", "--steps", "14"], command)
    assert code == 1 and doc["verdict"] == "not exact" and doc["first_diverging_step"] == 13, (doc, err)
    assert doc["hint"].startswith("the data order of epoch 1 after the resume at step 12"), doc
    assert "set_epoch" in doc["hint"] and "state carried between steps" not in doc["hint"], doc
    assert doc["nondeterministic"] == [], doc


@pytest.mark.slow
def test_preempts_sampler_inside_an_epoch_counting_wrapper(tmp_path):
    """The same wrapper around run.sampler(): the sampler holds the run's epoch against the wrapper's calls, and the
    resume is exact (a sampler whose epoch the wrapper did set is named by the hint: test_check_decisions)."""
    command = python(LOOP, "--save_dir", str(tmp_path / "user"), "--workers", "0", "--pattern", "epoch_reset_preempt")
    code, doc, err = run_check(tmp_path, ["--stop-at", "12", "--steps", "14"], command)
    assert_exact(code, doc, err)


@pytest.mark.slow
def test_an_exact_loop_killed_by_sigkill(tmp_path):
    command = python(LOOP, "--save_dir", str(tmp_path / "user"))
    code, doc, err = run_check(
        tmp_path, ["--signal", "KILL", "--stop-at", "5", "--stop-at", "12", "--steps", "15"], command
    )
    assert_exact(code, doc, err)
    assert doc["processes"]["trial"] == [-9, -9, 81]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pattern", "differs"),
    [("private_random", "model.0.weight"), ("numpy_generator", "model.0.weight")],
)
def test_a_generator_of_the_scripts_own_diverges_at_the_first_step_after_the_resume(tmp_path, pattern, differs):
    command = python(LOOP, "--save_dir", str(tmp_path / "user"), "--pattern", pattern)
    code, doc, err = run_check(tmp_path, ["--stop-at", "4", "--steps", "8"], command)
    assert_diverges_at(code, doc, err, 5, differs)
    assert "the global torch RNG" not in doc["differs"], doc  # what the run tracks came back


@pytest.mark.slow
def test_the_guides_fix_of_a_private_random_resumes_exactly(tmp_path):
    command = python(LOOP, "--save_dir", str(tmp_path / "user"), "--pattern", "private_random_tracked")
    code, doc, err = run_check(tmp_path, ["--stop-at", "4", "--steps", "8"], command)
    assert_exact(code, doc, err)


@pytest.mark.slow
def test_a_lightning_module_resumes_exactly(tmp_path):
    command = python(LIGHTNING, "--save_dir", str(tmp_path / "user"))
    code, doc, err = run_check(tmp_path, ["--stop-at", "5", "--stop-at", "12", "--steps", "14"], command)
    assert_exact(code, doc, err)
    assert not (tmp_path / "user").exists()


@pytest.mark.slow
def test_a_lightning_counter_outside_state_dict_diverges_at_the_first_step_after_the_resume(tmp_path):
    command = python(LIGHTNING, "--save_dir", str(tmp_path / "user"), "--counter")
    code, doc, err = run_check(tmp_path, ["--stop-at", "5", "--steps", "8"], command)
    assert_diverges_at(code, doc, err, 6, "model.net.0.weight")


@pytest.mark.slow
def test_a_trainer_resumes_exactly(tmp_path):
    command = python(HF, "--save_dir", str(tmp_path / "user"))
    code, doc, err = run_check(tmp_path, ["--stop-at", "4", "--steps", "7"], command)
    assert_exact(code, doc, err)
    assert not (tmp_path / "user").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_torchrun_job_of_two_ranks_resumes_exactly_on_every_rank(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(RANK_LAUNCHER)]
    command += [str(TRAIN_DDP)]
    command += ["--save_dir", str(tmp_path / "user"), "--epochs", "2", "--samples", "192"]
    code, doc, err = run_check(tmp_path, ["--stop-at", "4", "--steps", "7"], command)
    # train_ddp.py seeds torch and NumPy, not Python's random: its global generator differs between any two runs, on
    # each rank, and nothing in the loop draws from it (not what decides the verdict)
    unseeded = {"Python's global random", "Python's global random at the epoch's start"}
    assert_exact(code, doc, err, unseeded | {f"rank 1: {u}" for u in unseeded})
    assert any(p.startswith("rank 1: ") for p in doc["nondeterministic_paths"]), doc  # rank 1's own state compared
