"""Hostile surroundings, round 2: what ``preempt report`` reads, what the run reads from its environment,
and what a resume says before its train.log is open.

* ``preempt report`` gives a report of every history it can read, whatever its lines hold: a line over the cap of a
  history line (a 200 MB one) is skipped with a note naming the file and the line, in bounded memory (the command
  runs under a 1 GiB address-space limit); non-finite metrics are shown as such; absurd or non-finite times and
  counts are set aside with a note naming the value; ``--json`` is strict JSON (no NaN/Infinity tokens); ``--plot``
  draws. A history it cannot open is one line naming it, exit 2.
* An environment variable the run reads, holding a value it cannot use, is one warning naming the variable, the
  value and what was expected, and the run goes on with the default: a bad ``SLURM_JOB_END_TIME`` is no deadline.
* The warnings of a resume that quarantines a checkpoint and falls back reach train.log and history.jsonl, not only
  stderr.

Every ``preempt`` command runs in its own process and imports the same preempt as this test (so that a crash, a
memory blow-up or a hang is seen, not suffered); none may print a traceback, and pytest-timeout bounds each test.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_bad_input
from test_bad_input import STEP1, STEP2, build, train
from test_hostile_files import copy_of, sweep

import preempt
from preempt import PreemptibleRun
from preempt.cluster import slurm
from preempt.cluster.environment import Environment
from preempt.errors import SlurmError

pytestmark = pytest.mark.timeout(120)

# The preempt this test imported: the commands it starts import the same one (not the checkout that conftest puts on
# PYTHONPATH), so that running this file against another tree (PYTHONSAFEPATH=1 PYTHONPATH=/that/tree) tests it.
CODE = str(Path(preempt.__file__).resolve().parents[1])
T0 = 1_750_000_000.0  # June 2025
GiB = 1 << 30


def preempt_cmd(*args: str, cwd: Path, address_space: int | None = None, prefix: tuple[str, ...] = ()) -> Any:
    """``python -m preempt ARGS`` in its own process; ``address_space`` caps its memory (RLIMIT_AS)."""

    def limit() -> None:
        if address_space is not None:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    r = subprocess.run(
        [*prefix, sys.executable, "-m", "preempt", *args],
        capture_output=True,
        text=True,
        errors="backslashreplace",
        timeout=90,
        cwd=cwd,  # not the checkout: `-m` puts the working directory first on sys.path
        env={**os.environ, "PYTHONPATH": CODE, "MPLBACKEND": "Agg"},
        preexec_fn=limit,
    )
    assert "Traceback" not in r.stderr, r.stderr
    return r


def strict_json(text: str) -> Any:
    """Parses ``text`` as RFC 8259 JSON: Python's NaN, Infinity and -Infinity tokens are refused."""

    def refuse(token: str) -> Any:
        raise AssertionError(f"not JSON: the token {token} in {text[:2000]}")

    return json.loads(text, parse_constant=refuse)


def write_history(d: Path, *lines: dict[str, Any] | str) -> Path:
    """``d/history.jsonl`` with one line per item: a dict as Python's json writes it (NaN allowed), a str as is."""
    d.mkdir(parents=True, exist_ok=True)
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    (d / "history.jsonl").write_text(text)
    return d


def start(t: float = T0, **extra: Any) -> dict[str, Any]:
    return {"t": t, "event": "start", "step": 0, "pid": 1, "proc_start": t - 10.0, **extra}


def point(t: float, step: int, loss: Any) -> dict[str, Any]:
    return {"t": t, "step": step, "epoch": 0, "metrics": {"loss": loss}}


def every_form(d: Path, tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    """The text report, and the --json one with --plot's account (parsed strictly); each must succeed."""
    text = preempt_cmd("report", str(d), cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    png = tmp_path / "plot.png"
    js = preempt_cmd("report", str(d), "--json", "--plot", str(png), cwd=tmp_path)
    assert js.returncode == 0, js.stderr
    assert png.stat().st_size > 0
    return text, strict_json(js.stdout)


# ---------------------------------------------------------------- report: a line too long to read


@pytest.fixture
def big_line(tmp_path: Path) -> Iterator[Path]:
    """A run whose history's second line is 200 MB (a JSON array of 100 million zeros); removed afterwards."""
    d = tmp_path / "run"
    d.mkdir()
    with open(d / "history.jsonl", "wb") as f:
        f.write(json.dumps(start()).encode() + b"\n")
        f.write(b'{"t":%.1f,"step":5,"epoch":0,"metrics":{"loss":[' % (T0 + 5))
        chunk = b"0," * (1 << 20)  # 2 MiB
        for _ in range(100):
            f.write(chunk)
        f.write(b"0]}}\n")
        f.write(json.dumps(point(T0 + 6, 6, 0.5)).encode() + b"\n")
        f.write(json.dumps({"t": T0 + 7, "event": "stop", "step": 12, "cause": "SIGTERM"}).encode() + b"\n")
    assert (d / "history.jsonl").stat().st_size > 200_000_000
    yield d
    (d / "history.jsonl").unlink()  # pytest keeps the last runs' tmp_path: not 200 MB of them


def test_a_200_mb_history_line_is_skipped_with_a_note_and_memory_stays_bounded(big_line, tmp_path):
    d = big_line
    where = f"{d / 'history.jsonl'} line 2"
    text = preempt_cmd("report", str(d), cwd=tmp_path, address_space=GiB)
    assert text.returncode == 0, text.stderr
    assert text.stderr.count(where) == 1 and "skipped" in text.stderr, text.stderr
    assert "1 process(es)" in text.stdout and "steps 0 -> 12" in text.stdout, text.stdout
    js = preempt_cmd("report", str(d), "--json", cwd=tmp_path, address_space=GiB)
    assert js.returncode == 0, js.stderr
    doc = strict_json(js.stdout)
    assert doc["final_step"] == 12 and doc["stops"][0]["cause"] == "SIGTERM"
    assert [n for n in doc["notes"] if where in n and "skipped" in n], doc["notes"]


# ---------------------------------------------------------------- report: non-finite and absurd values


def test_non_finite_metrics_are_shown_as_such(tmp_path):
    d = write_history(
        tmp_path / "run",
        start(),
        point(T0 + 1, 1, 1.0),
        point(T0 + 2, 2, float("nan")),  # a bare NaN token, as Python's json writes it
        point(T0 + 3, 3, "inf"),  # as History writes a non-finite number
        point(T0 + 4, 4, "-inf"),
        point(T0 + 5, 5, float("inf")),
        point(T0 + 6, 6, 0.5),
        {"t": T0 + 7, "event": "stop", "step": 6, "cause": "SIGTERM"},
    )
    text, doc = every_form(d, tmp_path)
    shown = [line for line in text.stdout.splitlines() if "non-finite" in line]
    assert shown and "loss" in shown[0] and "nan" in shown[0] and "inf" in shown[0], text.stdout
    assert doc["nonfinite_metrics"]["loss"]["count"] == 4, doc
    assert doc["nonfinite_metrics"]["loss"]["steps"] == [2, 3, 4, 5], doc
    assert doc["plot"]["points"] == 2 and doc["plot"]["off_scale"] == 4, doc["plot"]


ABSURD = {
    # the value each history holds, and the text of it the report's note shows
    "proc_start_of_-1e308": ([start(proc_start=-1e308), point(T0 + 1, 1, 1.0)], "-1e+308"),
    "t_beyond_time_t": ([start(), point(T0 + 1, 1, 1.0), {"t": 1e18, "event": "resume", "step": 1}], "1e+18"),
    "t_of_1e308": ([start(), point(T0 + 1, 1, 1.0), point(1e308, 2, 2.0)], "1e+308"),
    "stalls_adding_up_to_infinity": (
        [start(), point(T0 + 1, 1, 1.0)]
        + [{"t": T0 + 2, "event": "checkpoint", "step": 1, "stall_s": 1e308, "write_s": 1e308} for _ in range(2)],
        "1e+308",
    ),
    "a_crash_at_step_10**400": (
        [
            start(),
            point(T0 + 1, 1, 1.0),
            point(T0 + 2, 2, 1.0),
            {"t": T0 + 9, "event": "resume", "step": 1, "crashed": {"died_at": 10**400}},
        ],
        "401 digits",
    ),
    "a_loss_of_1e308": ([start(), point(T0 + 1, 1, 1.0), point(T0 + 2, 2, 1e308), point(T0 + 3, 3, -1e308)], None),
}


@pytest.mark.parametrize("case", ABSURD, ids=list(ABSURD))
def test_absurd_times_counts_and_metrics_give_a_report_in_strict_json_and_a_plot(tmp_path, case):
    lines, shown = ABSURD[case]
    d = write_history(tmp_path / "run", *lines)
    text, doc = every_form(d, tmp_path)
    assert doc["processes"] >= 1 and doc["final_step"] >= 1, doc
    if shown is not None:  # the value set aside is named, as it is, in a note
        assert [n for n in doc["notes"] if shown in n], doc["notes"]
        assert shown in text.stdout, text.stdout
    else:  # a finite value too large to draw is marked at the edge of the plot
        assert doc["plot"]["points"] == 1 and doc["plot"]["off_scale"] == 2, doc["plot"]


# ---------------------------------------------------------------- report: a history it cannot open

SETPRIV = ("setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search")


def unreadable_as_root(path: Path) -> bool:
    """``path`` cannot be read by a process started through SETPRIV (root without the capabilities that bypass file
    permissions: the tests run as root; an unprivileged user could not run this python, which lives under /root)."""
    if shutil.which("setpriv") is None:
        return False
    probe = subprocess.run([*SETPRIV, sys.executable, "-c", f"open({str(path)!r}).close()"], capture_output=True)
    return probe.returncode != 0 and b"PermissionError" in probe.stderr


@pytest.mark.parametrize("kind", ["mode_000", "a_directory", "a_fifo"])
def test_a_history_that_cannot_be_opened_is_one_line_naming_it(tmp_path, kind):
    d = tmp_path / "run"
    d.mkdir()
    path = d / "history.jsonl"
    prefix: tuple[str, ...] = ()
    if kind == "mode_000":
        write_history(d, start(), point(T0 + 1, 1, 1.0))
        path.chmod(0)
        if not unreadable_as_root(path):
            pytest.skip("setpriv cannot drop CAP_DAC_OVERRIDE here: a mode-000 file stays readable")
        prefix, why = SETPRIV, "Permission denied"
    elif kind == "a_directory":
        path.mkdir()
        why = "expected a regular file, found a directory"
    else:
        os.mkfifo(path)
        why = "expected a regular file, found a FIFO"
    r = preempt_cmd("report", str(d), cwd=tmp_path, prefix=prefix)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.strip().splitlines() == [f"preempt report: {path}: cannot be read: {why}"], r.stderr
    r = preempt_cmd("report", str(d), "--json", cwd=tmp_path, prefix=prefix)
    assert r.returncode == 2 and strict_json(r.stdout)["exit_code"] == 2, r


# ---------------------------------------------------------------- the environment


@pytest.fixture
def no_scontrol(monkeypatch):
    """A SLURM job without a reachable scontrol (the real one is never called)."""

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise SlurmError("scontrol: not found on PATH (test)", missing=True)

    for name in ("show_job", "requeue"):
        monkeypatch.setattr(slurm, name, missing)
    monkeypatch.setattr(slurm, "kill_wait", lambda **kw: None)
    for key in list(os.environ):
        if key.startswith("SLURM_") or key in ("RANK", "PREEMPT_LOG_LEVEL", "PREEMPT_LOG_ALL_RANKS"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")


def warnings_about(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    """The warnings that begin ``NAME=``: what the run says of a variable's value."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.getMessage().startswith(name)]


@pytest.mark.parametrize("value", ["abc", "-5", "1e400", "99999999999999999999"])
def test_a_bad_slurm_job_end_time_is_one_warning_and_no_deadline(tmp_path, no_scontrol, monkeypatch, caplog, value):
    monkeypatch.setenv("SLURM_JOB_END_TIME", value)
    caplog.set_level(logging.INFO, logger="preempt")
    train(tmp_path / "run")  # one epoch of 5 steps; a deadline in the past would stop it at the first step
    said = warnings_about(caplog, "SLURM_JOB_END_TIME=")
    assert len(said) == 1 and repr(value) in said[0] and "expected" in said[0], said
    assert "walltime:" not in caplog.text, caplog.text
    assert json.loads((tmp_path / "run" / "history.jsonl").read_text().splitlines()[-1])["event"] == "complete"


def test_a_bad_preempt_log_level_is_one_warning_and_the_run_goes_on(tmp_path, no_scontrol, monkeypatch, caplog):
    monkeypatch.setenv("PREEMPT_LOG_LEVEL", "loud")
    caplog.set_level(logging.INFO, logger="preempt")
    train(tmp_path / "run")
    said = warnings_about(caplog, "PREEMPT_LOG_LEVEL=")
    assert len(said) == 1 and "'loud'" in said[0] and "DEBUG" in said[0], said
    assert logging.getLogger("preempt").getEffectiveLevel() == logging.INFO


@pytest.mark.parametrize(
    "name, value",
    [
        ("RANK", "zero"),
        ("SLURM_PROCID", "-1"),
        ("SLURM_RESTART_COUNT", "many"),
        ("PREEMPT_LOG_ALL_RANKS", "maybe"),
        ("SLURM_JOB_ID", "12 34"),
        ("SLURM_ARRAY_TASK_ID", "x"),
    ],
)
def test_every_variable_the_run_reads_is_checked_in_one_place(name, value):
    env = Environment.from_env({"SLURM_JOB_ID": "4242", name: value})
    assert len(env.problems) == 1 and env.problems[0].startswith(f"{name}={value!r}: expected "), env.problems
    ignored = Environment.from_env({"SLURM_JOB_ID": "4242"} if name != "SLURM_JOB_ID" else {})
    assert env == dataclasses.replace(ignored, problems=env.problems)  # the value is ignored: the default holds


# ---------------------------------------------------------------- a resume's warnings, in train.log and history

template, save_dir = test_bad_input.template, test_bad_input.save_dir


def damage(step_dir: Path) -> None:
    """Flips the last byte of the model's weights: the manifest's digest no longer matches."""
    f = step_dir / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("damaged", [[STEP2], [STEP1, STEP2]], ids=["the_newest", "every_checkpoint"])
def test_a_resume_that_quarantines_says_so_in_train_log_and_history(save_dir, damaged, caplog):
    for name in damaged:
        damage(save_dir / name)
    model, opt, sched, _ = build(seed=7)
    with PreemptibleRun(save_dir, model=model, optimizer=opt, scheduler=sched, checkpoint_interval=None) as run:
        pass
    assert run.resumed_from == (None if STEP1 in damaged else save_dir / STEP1)
    assert all((save_dir / "quarantine" / name).is_dir() for name in damaged)
    # train.log: after this process's start line, each quarantine, as the console said it
    log = (save_dir / "train.log").read_text()
    this = log.rsplit("==== start", 1)[1]
    for name in damaged:
        said = [line for line in this.splitlines() if "WARNING" in line and f"{name}/model.safetensors" in line]
        assert said and "quarantine" in said[0], this
    if STEP1 in damaged:
        assert "starting fresh" in this, this
    # history.jsonl: a warning event per quarantine, after this process's start marker
    events = [json.loads(line) for line in (save_dir / "history.jsonl").read_text().splitlines()]
    begun = max(i for i, e in enumerate(events) if e.get("event") in ("start", "resume"))
    warned = [e["message"] for e in events[begun:] if e.get("event") == "warning"]
    for name in damaged:
        assert [m for m in warned if f"{name}/model.safetensors" in m and "quarantine" in m], warned


# ---------------------------------------------------------------- every command, on a save_dir with such a history

EVERY_COMMAND = (
    ("ls",),
    ("verify",),
    ("inspect",),
    ("export", "--out", "{tmp}/model.safetensors"),
    ("prune", "--keep-last", "1"),
    ("report",),
    ("report", "--json"),
)


@pytest.mark.parametrize("history", ["hostile_lines", "a_fifo"])
def test_every_command_on_a_save_dir_with_a_hostile_history(save_dir, tmp_path, history):
    """Real checkpoints beside a history that holds a bit of every case above (or a FIFO in its place)."""
    path = save_dir / "history.jsonl"
    path.unlink()
    if history == "a_fifo":
        os.mkfifo(path)
    else:
        lines = [line for case in ABSURD.values() for line in case[0]]
        write_history(save_dir, *lines, point(T0 + 2, 2, float("nan")), "x" * (2 << 20))  # a 2 MiB line
    for command in EVERY_COMMAND:
        args = [a.format(tmp=tmp_path) for a in command[1:]]
        r = preempt_cmd(command[0], str(save_dir), *args, cwd=tmp_path)
        ok = (0, 2) if command[0] == "report" and history == "a_fifo" else (0,)
        assert r.returncode in ok, (command, r.returncode, r.stderr)
        if "--json" in command:
            strict_json(r.stdout)
    assert (save_dir / STEP2).is_dir() and (tmp_path / "model.safetensors").is_file()  # prune without --yes


@pytest.mark.parametrize("history", ["hostile_lines", pytest.param("a_fifo", marks=pytest.mark.slow)])
def test_every_command_and_a_resume_beside_a_hostile_history_in_both_modes(template, tmp_path, history):
    """The same save_dirs under every command and a resume (tests/scripts/every_command.py), as root and without
    capabilities: no traceback, no hang, nothing outside the save_dir changed, no checkpoint moved."""

    def make(root: Path) -> Path:
        d = copy_of(template, root)
        path = d / "history.jsonl"
        path.unlink()
        if history == "a_fifo":
            os.mkfifo(path)
        else:
            lines = [line for case in ABSURD.values() for line in case[0]]
            write_history(d, *lines, point(T0 + 2, 2, float("nan")), "x" * (2 << 20))
        return d

    got = sweep(make, tmp_path)
    for mode, r in got.items():
        assert r["cmd"]["report"]["rc"] == (2 if history == "a_fifo" else 0), (mode, r["cmd"]["report"])
        assert r["doc"]["resume"].get("resumed_from", "").endswith(STEP2), (mode, r["doc"]["resume"])


BAD_ENV = {
    "SLURM_JOB_END_TIME": "-5",
    "PREEMPT_LOG_LEVEL": "loud",
    "RANK": "zero",
    "SLURM_PROCID": "-1",
    "SLURM_RESTART_COUNT": "many",
    "PREEMPT_LOG_ALL_RANKS": "maybe",
    "SLURM_ARRAY_TASK_ID": "x",
}


@pytest.mark.parametrize(
    "env",
    [BAD_ENV, *(pytest.param({"SLURM_JOB_END_TIME": v}, marks=pytest.mark.slow) for v in ("abc", "1e400", "9" * 20))],
    ids=["every_variable_at_once", "end_time_abc", "end_time_1e400", "end_time_20_digits"],
)
def test_every_command_and_a_resume_with_bad_environment_values_in_both_modes(template, tmp_path, env):
    """Every variable the run reads, set to a value it cannot use: every command and a resume, as root and without
    capabilities, answer without a traceback, and the resume goes on from the newest checkpoint."""
    got = sweep(lambda root: copy_of(template, root), tmp_path, env=env)
    for mode, r in got.items():
        assert r["doc"]["resume"].get("resumed_from", "").endswith(STEP2), (mode, r["doc"]["resume"])
