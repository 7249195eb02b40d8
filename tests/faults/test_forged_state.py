"""Forged but well-formed state: a checkpoint whose content was changed and whose manifest was re-signed.

A re-signed manifest is what an attacker or a buggy tool produces: every digest matches, only the values are
hostile. Each case forges one value of the newest checkpoint (step 3) of a real training (tests/scripts/train.py,
stopped by SIGTERM at step 3, checkpoints of steps 1, 2 and 3), recomputes that file's size and digest in the
manifest with the library's own digest function, and then asserts:

* the commands (``ls``, ``verify``, ``inspect``) answer without an exception;
* the rerun of the same training, in its own process (a forged RNG state can crash the interpreter), exits 0,
  never by a signal and without a traceback; it reports step 3 like a damaged checkpoint (its path, the field,
  what was expected and what was found), moves it to quarantine/ (and nothing else), resumes from step 2 and
  ends bit for bit where an uninterrupted run ends.

By default one rerun meets every case at once (a checkpoint forged by each, steps 15 down to 3, falling back past
all of them to step 2); each case alone, as above, runs under -m slow.

A forged ``complete.json`` must not make the rerun exit "complete" without training.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import Spawned, assert_same_final, train_cmd
from safetensors.torch import load_file, save_file
from test_bad_input import resign
from test_hostile_files import copy_of, sweep

from preempt.checkpoint.manager import CheckpointManager
from preempt.cli import main as cli

# 8 steps. --augment draws from Python's, NumPy's and torch's global generators in the loop's process, and
# --no_per_sample_rng leaves them as restored (per-sample seeding would reseed them before each sample's draws).
ARGS = ["--epochs", "2", "--samples", "64", "--batch_size", "16", "--augment", "--no_per_sample_rng"]
ARGS += ["--every_steps", "1", "--keep_last", "3", "--sync_save"]
# 16 steps: room for a checkpoint forged by each case (steps 3 to 15) and a step to train after the fallback
LADDER = ["--epochs", "2", "--samples", "128", *ARGS[4:]]
STEP2, STEP3 = "step_000000002", "step_000000003"

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save_dir with the checkpoints of steps 1, 2 and 3: the training stopped by SIGTERM at step 3."""
    d = tmp_path_factory.mktemp("forged") / "run"
    p = Spawned(train_cmd(d, None, [*ARGS, "--signal_at", "step:3:TERM"]))
    assert p.finish() == 75, p.output
    assert sorted(e.name for e in d.glob("step_*")) == ["step_000000001", STEP2, STEP3]
    return d


@pytest.fixture
def save_dir(template: Path, tmp_path: Path) -> Path:
    d = tmp_path / "run"
    shutil.copytree(template, d, symlinks=True)
    return d


# ---------------------------------------------------------------- the forger's tools


def rewrite(step_dir: Path, name: str, data: bytes) -> None:
    """Replaces one file of a checkpoint (a new inode: a carried file is a hard link) and re-signs the manifest."""
    (step_dir / name).unlink()
    (step_dir / name).write_bytes(data)
    resign(step_dir, rehash=(name,))


def forge_json(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    """Edits the decoded state.json (tensor references left as they are)."""

    def forge(step_dir: Path) -> None:
        tree = json.loads((step_dir / "state.json").read_bytes())
        edit(tree)
        rewrite(step_dir, "state.json", json.dumps(tree, separators=(",", ":"), allow_nan=True).encode())

    return forge


def forge_tensor(key: str, change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path], None]:
    """Replaces one tensor of state.safetensors."""

    def forge(step_dir: Path) -> None:
        tensors = load_file(str(step_dir / "state.safetensors"))
        tensors[key] = change(tensors[key]).contiguous()
        tmp = step_dir.parent / "forged.safetensors"
        save_file(tensors, str(tmp))
        data = tmp.read_bytes()
        tmp.unlink()
        rewrite(step_dir, "state.safetensors", data)

    return forge


def _set(*path: str | int, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(tree: dict[str, Any]) -> None:
        node = tree
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _word(index: int, value: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def change(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[index] = value
        return t

    return change


def _torch_left_zero(t: torch.Tensor) -> torch.Tensor:
    raw = bytearray(t.numpy().tobytes())
    raw[8:12] = struct.pack("<i", 0)  # CPUGeneratorImplState.legacy_pod.left
    return torch.frombuffer(raw, dtype=torch.uint8).clone()


def _cuda_state(step_dir: Path) -> None:
    """A CUDA generator state of 15 bytes (torch.cuda.get_rng_state() gives 16), in both files."""
    forge_tensor("rng.now.torch", lambda t: t)(step_dir)  # the same tensors, rewritten below with one more
    tensors = load_file(str(step_dir / "state.safetensors"))
    tensors["rng.now.cuda.0"] = torch.zeros(15, dtype=torch.uint8)
    tmp = step_dir.parent / "forged.safetensors"
    save_file(tensors, str(tmp))
    rewrite(step_dir, "state.safetensors", tmp.read_bytes())
    tmp.unlink()
    forge_json(_set("rng", "now", "cuda", value=[{"__tensor__": "rng.now.cuda.0"}]))(step_dir)


RNG = ("rng", "now")
GROUP = ("optimizer", "param_groups", 0)

# (forge, the message expected after "<step 3>/state.json: "); what each does without the checks is in the id.
CASES = [
    pytest.param(
        forge_json(_set(*RNG, "numpy", "pos", value=10**9)),
        r"rng\.now\.numpy\.pos: expected an integer in 0\.\.624, found 1000000000",
        id="numpy-pos-far-past-the-key-segfaults-at-the-first-draw",
    ),
    pytest.param(
        forge_json(_set(*RNG, "numpy", "pos", value=625)),
        r"rng\.now\.numpy\.pos: expected an integer in 0\.\.624, found 625",
        id="numpy-pos-just-past-the-key-reads-out-of-bounds-silently",
    ),
    pytest.param(
        forge_tensor("rng.now.numpy.key", torch.zeros_like),
        r"rng\.now\.numpy\.key: expected a Mersenne Twister key that is not all zero, found 'an all-zero key'",
        id="numpy-key-all-zero-yields-zeros-forever",
    ),
    pytest.param(
        forge_tensor("rng.now.python.state", _word(624, 625)),
        r"rng\.now\.python\.state\[624\]: expected an index in 0\.\.624, found 625",
        id="python-index-raises-valueerror",
    ),
    pytest.param(
        forge_tensor("rng.now.python.state", _word(0, 2**32)),
        r"rng\.now\.python\.state\[0\]: expected a 32-bit word \(0\.\.4294967295\), found 4294967296",
        id="python-word-of-33-bits-is-truncated-silently",
    ),
    pytest.param(
        forge_tensor("rng.now.torch", _torch_left_zero),
        r"rng\.now\.torch: expected a state torch\.set_rng_state accepts, found .*Invalid mt19937 state",
        id="torch-state-refused-by-torch-raises-runtimeerror",
    ),
    pytest.param(
        forge_tensor("rng.now.torch", lambda t: t.to(torch.float32)),
        r"rng\.now\.torch: expected a uint8 tensor of one dimension .*, found a torch\.float32 tensor",
        id="torch-state-of-another-dtype-is-cast-silently",
    ),
    pytest.param(
        _cuda_state,
        r"rng\.now\.cuda\.0: expected a uint8 tensor of shape \(16,\) .*, found a torch\.uint8 tensor of shape \(15,\)",
        id="cuda-state-of-another-size-is-ignored-without-cuda",
    ),
    pytest.param(
        forge_json(_set(*GROUP, "lr", value="fast")),
        r"optimizer\.param_groups\[0\]\.lr: expected a finite number >= 0, found 'fast'",
        id="optimizer-lr-a-string-raises-typeerror-at-the-first-step",
    ),
    pytest.param(
        forge_json(_set(*GROUP, "amsgrad", value=True)),
        r"optimizer\.state\.0: expected max_exp_avg_sq, which amsgrad=true in param_groups\[0\] needs",
        id="optimizer-amsgrad-without-its-state-raises-keyerror-at-the-first-step",
    ),
    pytest.param(
        forge_tensor("optimizer.state.0.step", lambda t: torch.full_like(t, -1.0)),
        r"optimizer\.state\.0\.step: expected a whole number >= 0 \(a count of steps\), found .*-1\.0",
        id="optimizer-step-negative-divides-by-zero",
    ),
    pytest.param(
        forge_json(_set("scheduler", "step_size", value=0)),
        r"scheduler\.step_size: expected an integer >= 1, found 0",
        id="scheduler-step-size-zero-raises-zerodivisionerror",
    ),
    pytest.param(
        forge_json(_set("scaler", "scale", value=float("nan"))),
        r"scaler\.scale: expected a finite number > 0, found nan",
        id="scaler-scale-nan-skips-every-step-silently",
    ),
]


def commands_answer(save_dir: Path) -> None:
    """ls, verify and inspect answer (in this process: none of them uses a generator's state)."""
    for args in (["ls", str(save_dir)], ["verify", str(save_dir)], ["inspect", str(save_dir / STEP3)]):
        assert cli.main(args) in (cli.EXIT_OK, cli.EXIT_DAMAGED), args


def rerun(save_dir: Path, final: Path, args: list[str] = ARGS) -> Spawned:
    """Runs the training again in its own process; asserts it completed (exit 0, no signal, no traceback)."""
    p = Spawned(train_cmd(save_dir, final, args))
    rc = p.finish()
    assert rc == 0, f"the rerun exited {rc} ({'killed by a signal' if rc < 0 else 'an error'}):\n{p.output}"
    assert "Traceback" not in p.output, p.output
    return p


def reported(p: Spawned, save_dir: Path, name: str) -> str:
    """What the run said was wrong with checkpoint ``name``'s state.json when it set it aside, like damage (the
    path, the field, what was expected and what was found)."""
    (aside,) = p.events_of("quarantined", name=name)
    head, _, problem = aside["problem"].partition(f"{save_dir / name}/state.json: ")
    assert not head and problem.endswith("; falling back to an older checkpoint"), aside
    return problem


def assert_fell_back(save_dir: Path, p: Spawned, expected: str) -> None:
    """Step 3 was reported like damage, with the field, and quarantined; the run resumed from step 2."""
    said = reported(p, save_dir, STEP3)
    assert re.search(expected, said), f"{expected!r} not in {said!r}"
    assert p.events_of("resume", step=2, **{"from": str(save_dir / STEP2)}), p.events
    assert sorted(e.name for e in (save_dir / "quarantine").iterdir()) == [STEP3]


@pytest.fixture(scope="module")
def ladder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save_dir with the checkpoints of steps 1 to 15: the training of LADDER stopped by SIGTERM at step 15."""
    d = tmp_path_factory.mktemp("ladder") / "run"
    p = Spawned(train_cmd(d, None, [*LADDER, "--keep_last", "16", "--signal_at", "step:15:TERM"]))
    assert p.finish() == 75, p.output
    assert len(list(d.glob("step_*"))) == 15, sorted(e.name for e in d.iterdir())
    return d


def test_every_forged_value_is_refused_like_damage_by_one_rerun_that_falls_back_past_them_all(
    ladder, tmp_path, reference
):
    """Every case at once, each in a checkpoint of its own: steps 15 down to 3 are forged by the cases in order.
    One rerun, in one process, meets them newest first: it reports each like damage (its path, the field, what was
    expected and what was found), moves each to quarantine/ (and nothing else), resumes from step 2 and ends bit for
    bit where an uninterrupted run ends. (Each case alone, in a process of its own: the test below, under -m slow.)
    """
    save_dir = tmp_path / "run"
    shutil.copytree(ladder, save_dir, symlinks=True)
    forged = {}
    for step, case in zip(range(15, 2, -1), CASES, strict=True):
        forge, expected = case.values
        forge(save_dir / f"step_{step:09d}")
        forged[f"step_{step:09d}"] = (case.id, expected)
    commands_answer(save_dir)
    final = tmp_path / "final.safetensors"
    p = rerun(save_dir, final, LADDER)
    for name, (case, expected) in forged.items():
        said = reported(p, save_dir, name)
        assert re.search(expected, said), f"{name} ({case}): {expected!r} not in {said!r}"
    assert p.events_of("resume", step=2, **{"from": str(save_dir / STEP2)}), p.events
    assert sorted(e.name for e in (save_dir / "quarantine").iterdir()) == sorted(forged)
    assert_same_final(reference(LADDER), final)


# Each case alone under -m slow: by default the test above meets every case in one rerun (a process per case costs
# ~4 s of CPU, most of it importing torch)
@pytest.mark.slow
@pytest.mark.parametrize(("forge", "expected"), CASES)
def test_forged_state_is_refused_like_damage_and_the_run_falls_back(save_dir, tmp_path, reference, forge, expected):
    forge(save_dir / STEP3)
    commands_answer(save_dir)
    final = tmp_path / "final.safetensors"
    p = rerun(save_dir, final)
    assert_same_final(reference(ARGS), final)
    assert_fell_back(save_dir, p, expected)


# The same cases under every command and a resume (tests/scripts/every_command.py), as root and without
# capabilities: no traceback, no hang, no crash, nothing outside the save_dir changed, nothing but the forged
# checkpoint set aside. One case in the default suite, every case under -m slow.
@pytest.mark.parametrize(
    ("forge", "expected"), [c if i == 0 else pytest.param(*c.values, id=c.id, marks=pytest.mark.slow)
                            for i, c in enumerate(CASES)],
)  # fmt: skip
def test_every_command_and_a_resume_as_root_and_without_capabilities(template, tmp_path, forge, expected):
    def make(root: Path) -> Path:
        d = copy_of(template, root)
        shutil.rmtree(d / "step_000000001")  # two checkpoints: the sweep's `prune --keep-last 2 --yes` keeps both
        forge(d / STEP3)
        return d

    got = sweep(make, tmp_path, set_aside=frozenset({STEP3}))
    for mode, r in got.items():
        assert "traceback" not in r["doc"]["resume"], mode
        assert r["cmd"]["verify"]["rc"] == 0, (mode, r["cmd"]["verify"])  # forged, not damaged: digests match


# ---------------------------------------------------------------- complete.json


def marker(save_dir: Path, name: str, step: int) -> None:
    """A complete.json as a run writes it, naming ``name`` (with its creation time when it is there)."""
    info = next((c for c in CheckpointManager(save_dir, owner=False).list() if c.name == name), None)
    created = info.manifest.created if info is not None and info.manifest is not None else 1.0
    doc = {"checkpoint": name, "step": step, "epoch": 0, "checkpoint_created": created, "completed": 0.0}
    (save_dir / "complete.json").write_text(json.dumps(doc))


def test_complete_json_naming_a_missing_checkpoint_does_not_end_the_rerun(save_dir, tmp_path, reference):
    marker(save_dir, "step_000000099", 99)
    commands_answer(save_dir)
    final = tmp_path / "final.safetensors"
    p = rerun(save_dir, final)
    assert "names 'step_000000099', which is not there; not believed" in p.output, p.output  # what the user reads
    assert p.events_of("resume", step=3, **{"from": str(save_dir / STEP3)}), p.events
    assert_same_final(reference(ARGS), final)


def test_complete_json_naming_a_forged_checkpoint_does_not_end_the_rerun(save_dir, tmp_path, reference):
    forge_json(_set(*RNG, "numpy", "pos", value=10**9))(save_dir / STEP3)
    marker(save_dir, STEP3, 3)  # believable by its manifest: only the content of the checkpoint is forged
    commands_answer(save_dir)
    final = tmp_path / "final.safetensors"
    p = rerun(save_dir, final)
    assert "complete.json is not believed" in p.output, p.output  # what the user reads
    assert_fell_back(save_dir, p, r"rng\.now\.numpy\.pos: expected an integer in 0\.\.624, found 1000000000")
    assert_same_final(reference(ARGS), final)


# naming a missing checkpoint under -m slow: the rerun's side of it runs by default (the test above); the forged one,
# with a checkpoint to set aside, is the harder case for the sweep
@pytest.mark.parametrize(
    "forged",
    [pytest.param(False, marks=pytest.mark.slow), True],
    ids=["naming_a_missing_checkpoint", "naming_a_forged_checkpoint"],
)
def test_complete_json_under_every_command_and_a_resume_in_both_modes(template, tmp_path, forged):
    def make(root: Path) -> Path:
        d = copy_of(template, root)
        shutil.rmtree(d / "step_000000001")  # two checkpoints: the sweep's `prune --keep-last 2 --yes` keeps both
        if forged:
            forge_json(_set(*RNG, "numpy", "pos", value=10**9))(d / STEP3)
            marker(d, STEP3, 3)
        else:
            marker(d, "step_000000099", 99)
        return d

    got = sweep(make, tmp_path, set_aside=frozenset({STEP3}) if forged else frozenset())
    for mode, r in got.items():
        resume = r["doc"]["resume"]
        assert "traceback" not in resume, mode
        assert "resumed_from" in resume or resume.get("error") == "IncompatibleStateError", (mode, resume)
