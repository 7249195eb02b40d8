"""examples/latentwire_train.py, the showcase: stopped by a real SIGTERM, resumed with --auto_resume, bit-exact.

The example runs in subprocesses at tiny settings (a few seconds each). Its
argument checks are tested in this process, through its own parser.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from helpers import PREEMPTED, ROOT, Spawned, assert_same_final, history_events, run_python

SCRIPT = ROOT / "examples" / "latentwire_train.py"
EXAMPLE = [sys.executable, str(SCRIPT)]
# 2 epochs of 12 steps; a progress line per step so that the test can signal after a chosen one.
TINY = [
    "--samples", "192", "--batch_size", "16", "--epochs", "2", "--warmup_steps", "10", "--max_bytes", "96",
    "--latent_len", "8", "--d_z", "32", "--log_every", "1", "--checkpoint_interval", "0",
]  # fmt: skip
STEPS_PER_EPOCH, TOTAL = 12, 24
# The flags seed 001 asks for, plus the ones the example adds.
REQUIRED_FLAGS = [
    "--samples", "--epochs", "--batch_size", "--latent_len", "--d_z", "--K", "--first_token_ce_weight",
    "--warm_anchor_text", "--save_dir", "--checkpoint_interval", "--auto_resume", "--debug",
    "--dataset", "--data_file", "--llama_id", "--qwen_id", "--final_out",
]  # fmt: skip


def example_module():
    spec = importlib.util.spec_from_file_location("latentwire_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return run_python([*EXAMPLE, *args], timeout=timeout, cwd=ROOT, env=env)


def test_sigterm_mid_epoch_then_auto_resume_equals_uninterrupted(tmp_path, capsys):
    lw = example_module()
    # A different stop step on each run of the suite; the seed is in every failure message to replay it.
    seed = int(os.environ.get("LATENTWIRE_TEST_SEED", time.time_ns() % 10**6))
    stop = random.Random(seed).choice([s for s in range(2, TOTAL - 1) if s % STEPS_PER_EPOCH])
    why = f"(SIGTERM after step {stop}; LATENTWIRE_TEST_SEED={seed} replays it)"

    ref = run([*TINY, "--save_dir", str(tmp_path / "ref"), "--final_out", str(tmp_path / "ref.safetensors")])
    assert ref.returncode == 0, ref.stdout + ref.stderr

    run_dir, final = tmp_path / "run", tmp_path / "run.safetensors"
    args = [*TINY, "--save_dir", str(run_dir), "--final_out", str(final)]
    p = Spawned([*EXAMPLE, *args])
    assert p.wait_for(rf"^step +{stop}/{TOTAL} "), f"{why}\n{p.output}"
    p.signal(signal.SIGTERM)
    assert p.finish() == PREEMPTED, f"{why}\n{p.output}"
    assert p.events_of("stop", cause="SIGTERM") and not final.exists(), f"{why}\n{p.output}"

    # The same command without --auto_resume refuses to start the run over (checked before any set-up).
    with pytest.raises(SystemExit) as refused:
        lw.check_save_dir(lw.parse_args(args))
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "already holds checkpoints" in err and "--auto_resume" in err and "--restart" in err, err

    resumed = run([*args, "--auto_resume"])
    assert resumed.returncode == 0, f"{why}\n{resumed.stdout}{resumed.stderr}"
    assert "resumed from" in resumed.stderr, resumed.stderr
    # The stop lands at the first step boundary after the signal: step `stop`, or a little later.
    (at,) = history_events(run_dir, "resume")
    assert stop <= at["step"] < TOTAL, f"{why}\n{resumed.stdout}"
    assert_same_final(tmp_path / "ref.safetensors", final)

    # A requeue of the finished job: exits 0 at once.
    done = run([*args, "--auto_resume"])
    assert done.returncode == 0 and "is complete" in done.stderr, done.stdout + done.stderr
    assert "training from scratch" not in done.stdout and "resuming" not in done.stdout, done.stdout


def test_local_squad_json(tmp_path):
    """--dataset squad reads a local SQuAD JSON file (here one written from the synthetic set)."""
    lw = example_module()
    examples = lw.synthetic_squad(48, seed=5)
    doc = {
        "version": "1.1",
        "data": [
            {
                "title": "synthetic",
                "paragraphs": [
                    {
                        "context": e.context,
                        "qas": [
                            {
                                "id": str(i),
                                "question": e.question,
                                "answers": [{"text": e.answer, "answer_start": e.context.find(e.answer)}],
                            }
                        ],
                    }
                    for i, e in enumerate(examples)
                ],
            }
        ],
    }
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(doc))
    assert lw.read_squad(path, 10) == examples[:10]
    r = run(
        ["--dataset", "squad", "--data_file", str(path), "--samples", "48", "--epochs", "1", "--batch_size", "24",
         "--warmup_steps", "2", "--latent_len", "4", "--d_z", "16", "--save_dir", str(tmp_path / "run")]
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "48 examples" in r.stdout and "epoch 0 done" in r.stdout, r.stdout


def test_help_lists_every_flag(capsys):
    lw = example_module()
    with pytest.raises(SystemExit) as e:
        lw.parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    parser_flags = {s for a in lw.build_parser()._actions for s in a.option_strings}
    assert set(REQUIRED_FLAGS) <= parser_flags
    missing = [f for f in sorted(parser_flags) if f not in text]
    assert not missing, f"--help does not mention {missing}"
    assert "--monitor_gpu" not in text  # comes with the GPU monitor, not as a placeholder
    assert "our reading of seed 001" in text  # --K says how it is interpreted


def test_bad_flag_value_is_a_clear_error_from_the_command_line(tmp_path):
    r = run(["--latent_len", "0", "--save_dir", str(tmp_path / "x")], timeout=60)
    assert r.returncode == 2
    assert "argument --latent_len: expected an integer >= 1, got '0'" in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--K", "-1"], "argument --K: expected an integer >= 0, got '-1'"),
        (["--samples", "many"], "argument --samples: expected an integer >= 1, got 'many'"),
        (["--first_token_ce_weight", "nan"], "argument --first_token_ce_weight: expected a finite number >= 0"),
        (["--checkpoint_interval", "-5"], "argument --checkpoint_interval: expected seconds > 0, or 0"),
        (["--dataset", "squad"], "--dataset squad needs --data_file PATH"),
        (["--data_file", "x.json"], "--data_file is read only with --dataset squad"),
        (["--auto_resume", "--restart"], "--auto_resume and --restart exclude each other"),
        (["--dataset", "imagenet"], "argument --dataset: invalid choice: 'imagenet'"),
    ],
)
def test_bad_flag_values(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        example_module().parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_hugging_face_decoders_are_optional(tmp_path, capsys):
    lw = example_module()
    with pytest.raises(SystemExit):
        lw.parse_args(["--llama_id", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    if importlib.util.find_spec("transformers") is None:
        assert "--llama_id needs the optional 'transformers' package" in err, err
    else:
        assert "expected a local Hugging Face model directory" in err, err
