"""The pure parts of ``preempt supervise``: patterns, classification, the retry plan, the env contract, usage."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from preempt.cli import main as cli
from preempt.cluster.supervised import Supervised
from preempt.errors import NONFINITE_EXIT_CODE, OOM_EXIT_CODE, PREEMPTED_EXIT_CODE
from preempt.supervise.policy import (
    COMPLETE,
    FAILED,
    NONFINITE,
    OOM,
    PATTERNS,
    PREEMPTED,
    Scanner,
    SuperviseConfig,
    child_env,
    classify,
    find_patterns,
    plan_next,
    substitute,
)
from preempt.supervise.process import exit_code

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------- patterns


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: p.regex.pattern.decode())
def test_every_documented_example_matches_its_pattern(pattern):
    for example in pattern.examples:
        found = find_patterns(f"epoch 3 | {example} | lr 0.1\n".encode())
        assert found and found[-1].cause == pattern.cause, example
    for example in pattern.examples:  # case-insensitive
        assert find_patterns(example.upper().encode())[-1].cause == pattern.cause


def test_the_module_docstring_lists_every_pattern():
    from preempt.supervise import command as supervise

    for p in PATTERNS:
        shown = re.escape(p.regex.pattern.decode().replace("(?:", "("))
        assert re.search(rf"^``{p.cause}`` +``{shown}``", supervise.__doc__ or "", re.M), p.regex.pattern


@pytest.mark.parametrize(
    "text",
    ["loss: 0.25", "loss: nanoseconds", "loss is not nan", "loss: information", "nan", "memory: 3 GiB", "OOM"],
)
def test_ordinary_lines_match_nothing(text):
    assert find_patterns(text.encode()) == []


def test_matches_come_in_order_of_position():
    found = find_patterns(b"CUDA out of memory\nloss: nan\n")
    assert [m.cause for m in found] == [OOM, NONFINITE]


def test_scanner_finds_a_pattern_cut_across_chunks_once_its_line_ends():
    s = Scanner("stdout")
    data = b"step 1 loss: 0.5\rstep 2 loss: nan\rstep 3"
    found = [m for byte in range(len(data)) for m in s.feed(data[byte : byte + 1])]
    assert [(m.cause, m.text) for m in found] == [(NONFINITE, "loss: nan")]
    assert s.close() == []


def test_scanner_scans_an_unfinished_last_line_at_close_and_very_long_lines():
    s = Scanner("stderr")
    assert s.feed(b"RuntimeError: CUDA out of mem") == []
    assert s.feed(b"ory") == []
    (m,) = s.close()
    assert (m.cause, m.stream) == (OOM, "stderr")
    s = Scanner("stdout")
    found = s.feed(b"x" * (1 << 17) + b" loss=nan") + s.feed(b"y" * (1 << 17)) + s.close()
    assert {m.cause for m in found} == {NONFINITE}


# ------------------------------------------------------------ the decisions


@pytest.mark.parametrize(
    "code, pattern, cause",
    [
        (0, NONFINITE, COMPLETE),
        (PREEMPTED_EXIT_CODE, OOM, PREEMPTED),
        (NONFINITE_EXIT_CODE, None, NONFINITE),
        (OOM_EXIT_CODE, NONFINITE, OOM),  # the code wins
        (1, NONFINITE, NONFINITE),
        (137, OOM, OOM),
        (74, NONFINITE, FAILED),  # preempt's own codes mean what they say
        (77, OOM, FAILED),
        (1, None, FAILED),
    ],
)
def test_classify(code, pattern, cause):
    assert classify(code, pattern) == cause


def cfg(**kw) -> SuperviseConfig:
    cmd = ("train", *(["{lr}"] if kw.get("lr") else []), *(["{batch_size}"] if kw.get("batch_size") else []))
    return SuperviseConfig(cmd=cmd, **kw)


def test_batch_size_sequence_and_minimum():
    c = cfg(batch_size=32, min_batch_size=2)
    bs, seen, retries = 32, [32], 0
    while True:
        plan = plan_next(c, OOM, lr=None, batch_size=bs, retries=retries, preemptions=0)
        if plan.action == "stop":
            break
        assert plan.action == "retry" and plan.batch_size is not None
        bs, retries = plan.batch_size, retries + 1
        seen.append(bs)
    assert seen == [32, 21, 14, 9, 6, 4, 2]
    assert plan.reason == "out of memory, and batch_size 1 would be below --min-batch-size 2"


def test_learning_rate_sequence_minimum_and_retries():
    c = cfg(lr=1e-3, min_lr=3e-4)
    p1 = plan_next(c, NONFINITE, lr=1e-3, batch_size=None, retries=0, preemptions=0)
    assert p1.action == "retry" and p1.lr == pytest.approx(1e-3 / 1.5)
    p2 = plan_next(c, NONFINITE, lr=p1.lr, batch_size=None, retries=1, preemptions=0)
    assert p2.lr == pytest.approx(1e-3 / 2.25)
    p3 = plan_next(c, NONFINITE, lr=p2.lr, batch_size=None, retries=2, preemptions=0)
    assert p3.action == "stop" and "lr 0.000296296 would be below --min-lr 0.0003" in p3.reason
    c = cfg(lr=1e-3, max_retries=1)
    assert plan_next(c, NONFINITE, lr=1e-3, batch_size=None, retries=1, preemptions=0).action == "stop"


def test_preemption_restarts_unchanged_up_to_its_own_limit():
    c = cfg(lr=1e-3, batch_size=8, max_preemptions=2, max_retries=0)
    p = plan_next(c, PREEMPTED, lr=1e-3, batch_size=8, retries=0, preemptions=1)
    assert (p.action, p.lr, p.batch_size) == ("restart", 1e-3, 8)
    assert plan_next(c, PREEMPTED, lr=1e-3, batch_size=8, retries=0, preemptions=2).action == "stop"


def test_nothing_to_lower_and_plain_failures_stop():
    c = cfg()
    assert "no --lr to lower" in plan_next(c, NONFINITE, lr=None, batch_size=None, retries=0, preemptions=0).reason
    assert "no --batch-size" in plan_next(c, OOM, lr=None, batch_size=None, retries=0, preemptions=0).reason
    assert plan_next(c, FAILED, lr=None, batch_size=None, retries=0, preemptions=0).action == "stop"
    assert plan_next(c, COMPLETE, lr=None, batch_size=None, retries=0, preemptions=0).action == "stop"


def test_exit_code_of_a_death_by_signal():
    assert exit_code(-9) == 137 and exit_code(-15) == 143 and exit_code(3) == 3


# ------------------------------------------------------------- the contract


def test_substitute_touches_only_the_placeholders():
    cmd = ["python", "t.py", "--lr={lr}", '--cfg={"a": {"b": 1}, "c": "{x}"}', "bs={batch_size}x{batch_size}"]
    assert substitute(cmd, 1e-3 / 1.5, 21) == [
        "python",
        "t.py",
        "--lr=0.000666667",
        '--cfg={"a": {"b": 1}, "c": "{x}"}',
        "bs=21x21",
    ]


def test_child_env_and_from_env_round_trip():
    inherited = {"HOME": "/h", "PREEMPT_LR": "9", "PREEMPT_BATCH_SIZE": "9", "PREEMPT_LOG_LEVEL": "debug"}
    env = child_env(inherited, attempt=3, cause=NONFINITE, lr=1e-3 / 2.25, lr_scale=1 / 2.25, batch_size=None)
    assert env == {
        "HOME": "/h",
        "PREEMPT_LOG_LEVEL": "debug",  # not ours: kept
        "PYTHONUNBUFFERED": "1",
        "PREEMPT_SUPERVISE_ATTEMPT": "3",
        "PREEMPT_SUPERVISE_CAUSE": "nonfinite",
        "PREEMPT_LR": "0.000444444",
        "PREEMPT_LR_SCALE": "0.444444",
    }
    s = Supervised.from_env(env)
    assert s == Supervised(attempt=3, cause="nonfinite", lr=0.000444444, lr_scale=0.444444, batch_size=None)
    assert Supervised.from_env({"HOME": "/h"}) is None
    assert Supervised.from_env({"PREEMPT_SUPERVISE_ATTEMPT": "1"}) == Supervised(attempt=1)
    with pytest.raises(ValueError, match=r"PREEMPT_BATCH_SIZE='21.5': expected a positive int"):
        Supervised.from_env({"PREEMPT_SUPERVISE_ATTEMPT": "2", "PREEMPT_BATCH_SIZE": "21.5"})


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"cmd": ()}, "no command"),
        ({"cmd": ("t",), "factor": 0.5}, "--factor: expected a number > 1, found 0.5"),
        ({"cmd": ("t",), "grace": -1.0}, "--grace: expected seconds >= 0, found -1.0"),
        ({"cmd": ("t",), "max_retries": -1}, "--max-retries: expected an integer >= 0, found -1"),
        ({"cmd": ("t", "{lr}"), "lr": 0.0}, "--lr: expected a number > 0, found 0.0"),
        ({"cmd": ("t", "{batch_size}"), "batch_size": 4, "min_batch_size": 8}, "--batch-size 4 is below"),
        ({"cmd": ("t", "{lr}")}, "the command uses {lr} but --lr is not given"),
        ({"cmd": ("t",), "lr": 0.1}, "--lr 0.1 is given but the command has no {lr}"),
    ],
)
def test_config_validation_names_the_option(kw, message):
    with pytest.raises(ValueError, match="^" + message.replace("{", r"\{").replace("}", r"\}").replace("+", r"\+")):
        SuperviseConfig(**kw)


# -------------------------------------------------------------- the command


def test_help_lists_supervise_and_its_exit_codes(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0 and "supervise" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["supervise", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for text in ("PREEMPT_LR_SCALE", "75   preempted", "78   ", "79   ", "2    bad usage", "127", "128+N"):
        assert text in out, text


def test_preempt_lists_supervise_with_the_parser_supervise_parses_with(capsys):
    from preempt.supervise import command as supervise

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert " ".join(supervise.SUMMARY.split()) in " ".join(capsys.readouterr().out.split())
    options = ["--lr", "0.1", "--batch-size", "8", "--factor", "2", "--grace", "5", "--no-log"]
    listed = vars(cli.build_parser().parse_args(["supervise", *options]))
    assert listed.pop("command") == "supervise"
    assert listed == vars(supervise.build_parser().parse_args(options))


@pytest.mark.parametrize(
    "options, where",
    [
        ([], None),  # stderr only: nothing lands in the current directory
        (["--save-dir", "runs/x"], "runs/x/supervise.log"),
        (["--save-dir", "runs/x", "--log", "other.log"], "other.log"),
        (["--log", "other.log"], "other.log"),
        (["--save-dir", "runs/x", "--no-log"], None),
    ],
)
def test_where_the_log_goes(options, where):
    from preempt.supervise import command as supervise

    path = supervise.log_path(supervise.build_parser().parse_args(options))
    assert path == (None if where is None else Path(where))


def test_supervise_imports_no_torch():
    code = "import sys, preempt.cli.main, preempt.supervise.command; sys.exit('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0
