"""``preempt supervise`` with real child processes: retries, limits, signals, process groups, live output.

Every child is ``child.py`` below, told what to do per attempt by ``plan.json``
(a list; attempt n uses entry n, the last entry repeats). It appends its argv,
pid, process group and ``PREEMPT_*`` environment to ``record.jsonl``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from preempt.errors import NONFINITE_EXIT_CODE, OOM_EXIT_CODE, PREEMPTED_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, signal, subprocess, sys, time
from pathlib import Path

here = Path(__file__).parent
attempt = int(os.environ.get("PREEMPT_SUPERVISE_ATTEMPT", "0"))
plans = json.loads((here / "plan.json").read_text())
plan = plans[min(max(attempt, 1), len(plans)) - 1]
env = {k: v for k, v in os.environ.items() if k.startswith("PREEMPT_") or k == "PYTHONUNBUFFERED"}
record = {"attempt": attempt, "argv": sys.argv[1:], "pid": os.getpid(), "pgid": os.getpgid(0), "env": env}
with open(here / "record.jsonl", "a") as f:
    f.write(json.dumps(record) + "\n")


def save(signum, frame):
    (here / f"saved_{attempt}").write_text(signal.Signals(signum).name)
    sys.exit(75)


if plan.get("on_term") == "save":
    signal.signal(signal.SIGTERM, save)
    signal.signal(signal.SIGINT, save)
elif plan.get("on_term") == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if plan.get("grandchild"):
    # in the same process group; a stubborn one ignores SIGTERM, so that only SIGKILL ends it
    up = here / f"grandchild_up_{attempt}"
    code = "import pathlib, signal, sys, time\n"
    if plan["grandchild"] == "stubborn":
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += "pathlib.Path(sys.argv[1]).write_text('')\ntime.sleep(60)\n"
    gc = subprocess.Popen([sys.executable, "-c", code, str(up)])
    (here / f"grandchild_{attempt}.pid").write_text(str(gc.pid))
    deadline = time.monotonic() + 10
    while not up.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
for text in plan.get("out", []):
    sys.stdout.buffer.write(text.encode("latin-1"))
    sys.stdout.flush()
for text in plan.get("err", []):
    sys.stderr.buffer.write(text.encode("latin-1"))
    sys.stderr.flush()
if plan.get("ready"):
    (here / f"ready_{attempt}").write_text("")
if "wait_for" in plan:
    deadline = time.monotonic() + 20
    while not (here / plan["wait_for"]).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
deadline = time.monotonic() + plan.get("sleep", 0)
while time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(plan.get("exit", 0))
"""

# this tree, whatever the installed copy points at; no PREEMPT_* or PYTHONUNBUFFERED from the outside
ENV = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPT_") and k != "PYTHONUNBUFFERED"}
ENV["PYTHONPATH"] = str(ROOT)

NAN_LINES = ["Loss is NaN at epoch 123", "Loss=nan", "loss: nan", "training/loss: nan", "hard_loss: nan", "loss is nan"]
OOM_LINES = [
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "Resource exhausted: OOM when allocating tensor",
    "XLA memory error",
    "Device memory exhausted",
    "OutOfMemoryError",
]


class Child:
    """The child script in a directory, its plan, and what its attempts recorded."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        self.script = d / "child.py"
        self.script.write_text(CHILD)
        self.started: list[subprocess.Popen] = []

    def plan(self, *attempts: dict) -> None:
        (self.dir / "plan.json").write_text(json.dumps(list(attempts)))

    @property
    def records(self) -> list[dict]:
        path = self.dir / "record.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def log(self) -> str:
        return (self.dir / "supervise.log").read_text()

    def argv(self, *options: str, cmd: tuple[str, ...] = ()) -> list[str]:
        return [
            sys.executable,
            "-m",
            "preempt",
            "supervise",
            "--log",
            str(self.dir / "supervise.log"),
            *options,
            "--",
            sys.executable,
            str(self.script),
            *cmd,
        ]

    def run(self, *options: str, cmd: tuple[str, ...] = (), env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.argv(*options, cmd=cmd), capture_output=True, cwd=self.dir, env=env or ENV, timeout=30
        )

    def start(self, *options: str, cmd: tuple[str, ...] = ()) -> subprocess.Popen:
        p = subprocess.Popen(
            self.argv(*options, cmd=cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=self.dir, env=ENV
        )
        self.started.append(p)
        return p

    def wait_file(self, name: str, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not (self.dir / name).exists():
            assert time.monotonic() < deadline, f"{name} did not appear within {timeout} s"
            time.sleep(0.01)


@pytest.fixture
def child(tmp_path: Path) -> Iterator[Child]:
    c = Child(tmp_path)
    yield c
    for p in c.started:  # a failed test must not leave a supervisor behind
        if p.poll() is None:
            p.kill()
            p.wait()


def gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def lr_bs(record: dict) -> tuple[str, str]:
    """The child's command line is ``--lr X --bs N``."""
    a = record["argv"]
    return a[a.index("--lr") + 1], a[a.index("--bs") + 1]


LR_BS = ("--lr", "0.001", "--batch-size", "32")
CMD = ("--lr", "{lr}", "--bs", "{batch_size}")


# ------------------------------------------------------------ retries


@pytest.mark.parametrize("line", NAN_LINES)
def test_each_nan_pattern_lowers_the_learning_rate(child, line):
    child.plan({"out": [f"step 7 {line}, acc=0.5\n"], "exit": 1}, {"exit": 0})
    r = child.run(*LR_BS, cmd=CMD)
    assert r.returncode == 0, r.stderr.decode()
    first, second = child.records
    assert lr_bs(first) == ("0.001", "32") and lr_bs(second) == ("0.000666667", "32")
    assert second["env"]["PREEMPT_LR"] == "0.000666667"
    assert second["env"]["PREEMPT_LR_SCALE"] == "0.666667"
    assert second["env"]["PREEMPT_BATCH_SIZE"] == "32"
    assert second["env"]["PREEMPT_SUPERVISE_CAUSE"] == "nonfinite"
    assert "non-finite loss: lr 0.001 -> 0.000666667 (retry 1 of 10)" in r.stderr.decode()


@pytest.mark.parametrize("line", OOM_LINES)
def test_each_oom_pattern_lowers_the_batch_size(child, line):
    child.plan({"err": ["Traceback (most recent call last):\n", f"{line}\n"], "exit": 1}, {"exit": 0})
    r = child.run(*LR_BS, cmd=CMD)
    assert r.returncode == 0, r.stderr.decode()
    first, second = child.records
    assert lr_bs(second) == ("0.001", "21")
    assert second["env"]["PREEMPT_BATCH_SIZE"] == "21"
    assert second["env"]["PREEMPT_LR_SCALE"] == "1"
    assert second["env"]["PREEMPT_SUPERVISE_CAUSE"] == "oom"
    assert "out of memory: batch_size 32 -> 21 (retry 1 of 10)" in r.stderr.decode()


def test_guard_exit_codes_chain_lr_and_batch_size(child):
    """78 and 79 count like the patterns: lr 0.001 -> 0.000667 -> 0.000444, bs 32 -> 21 -> 14."""
    child.plan(
        {"exit": NONFINITE_EXIT_CODE},
        {"exit": OOM_EXIT_CODE},
        {"exit": NONFINITE_EXIT_CODE},
        {"exit": OOM_EXIT_CODE},
        {"exit": 0},
    )
    r = child.run(*LR_BS, cmd=CMD)
    assert r.returncode == 0, r.stderr.decode()
    assert [lr_bs(rec) for rec in child.records] == [
        ("0.001", "32"),
        ("0.000666667", "32"),
        ("0.000666667", "21"),
        ("0.000444444", "21"),
        ("0.000444444", "14"),
    ]
    assert [rec["env"]["PREEMPT_SUPERVISE_ATTEMPT"] for rec in child.records] == ["1", "2", "3", "4", "5"]
    assert child.records[-1]["env"]["PREEMPT_LR_SCALE"] == "0.444444"


def test_the_last_pattern_decides(child):
    """A NaN logged early, then an OOM that kills the run: an OOM."""
    child.plan({"out": ["loss: nan\n"], "err": ["CUDA out of memory\n"], "exit": 1}, {"exit": 0})
    r = child.run(*LR_BS, cmd=CMD)
    assert r.returncode == 0
    assert lr_bs(child.records[1]) == ("0.001", "21")


def test_stops_at_the_minimum_batch_size_with_a_summary(child):
    child.plan({"err": ["CUDA out of memory\n"], "exit": 1})
    r = child.run(*LR_BS, "--min-batch-size", "10", cmd=CMD)
    assert r.returncode == 1
    assert [lr_bs(rec)[1] for rec in child.records] == ["32", "21", "14"]
    err = r.stderr.decode()
    assert "stop: out of memory, and batch_size 9 would be below --min-batch-size 10; exit 1" in err
    assert "summary: 3 attempt(s)" in err
    for n, bs in ((1, 32), (2, 21), (3, 14)):
        line = next(x for x in err.splitlines() if x.startswith(f"[preempt supervise]   attempt {n}: "))
        assert "exit 1, oom, stderr said 'CUDA out of memory'" in line and f"batch_size {bs}):" in line
        assert f"--bs {bs}" in line and " s (lr 0.001, " in line  # the command, the duration, the values
    # the log has the same events, one line each, with time and the supervisor's pid
    log = child.log
    assert "stop: out of memory, and batch_size 9 would be below --min-batch-size 10; exit 1" in log
    assert log.count("  attempt ") == 3
    assert all(" [" in line and "] " in line for line in log.splitlines())


def test_stops_at_the_minimum_learning_rate(child):
    child.plan({"out": ["loss=nan\n"], "exit": NONFINITE_EXIT_CODE})
    r = child.run(*LR_BS, "--min-lr", "0.0005", cmd=CMD)
    assert r.returncode == NONFINITE_EXIT_CODE
    assert [lr_bs(rec)[0] for rec in child.records] == ["0.001", "0.000666667"]
    assert "lr 0.000444444 would be below --min-lr 0.0005" in r.stderr.decode()


def test_stops_after_max_retries(child):
    child.plan({"exit": OOM_EXIT_CODE})
    r = child.run(*LR_BS, "--max-retries", "2", "--factor", "2", cmd=CMD)
    assert r.returncode == OOM_EXIT_CODE
    assert [lr_bs(rec)[1] for rec in child.records] == ["32", "16", "8"]
    assert "oom, and --max-retries 2 retries were made; exit 79" in r.stderr.decode()


def test_nan_without_lr_is_not_retried(child):
    child.plan({"out": ["loss: nan\n"], "exit": 1})
    r = child.run("--batch-size", "8", cmd=("--bs", "{batch_size}"))
    assert r.returncode == 1 and len(child.records) == 1
    assert "no --lr to lower" in r.stderr.decode()


# --------------------------------------------------- passthrough, preemption


@pytest.mark.parametrize(
    "plan, code",
    [
        ({"exit": 0, "out": ["loss: nan\n"]}, 0),  # a pattern in a run that completes changes nothing
        ({"exit": 3}, 3),  # a plain bug
        ({"exit": 74, "out": ["loss: nan\n"]}, 74),  # preempt's own codes keep their meaning
        ({"exit": 1, "out": ["loss: 0.25, nanoseconds: 12\n"]}, 1),  # no pattern
    ],
    ids=["complete", "unknown", "save-failed", "no-pattern"],
)
def test_exit_code_passthrough_without_retry(child, plan, code):
    child.plan(plan, {"exit": 0})
    r = child.run(*LR_BS, cmd=CMD)
    assert r.returncode == code, r.stderr.decode()
    assert len(child.records) == 1


def test_death_by_signal_is_reported_as_128_plus_n(child):
    script = child.dir / "die.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    r = subprocess.run(
        [sys.executable, "-m", "preempt", "supervise", "--no-log", "--", sys.executable, str(script)],
        capture_output=True,
        env=ENV,
        timeout=30,
    )
    assert r.returncode == 128 + signal.SIGSEGV
    assert "killed by SIGSEGV" in r.stderr.decode()


def test_preempted_child_is_restarted_unchanged(child):
    child.plan({"exit": PREEMPTED_EXIT_CODE}, {"exit": PREEMPTED_EXIT_CODE}, {"exit": 0})
    r = child.run(*LR_BS, cmd=CMD)
    assert r.returncode == 0, r.stderr.decode()
    recs = child.records
    assert [lr_bs(rec) for rec in recs] == [("0.001", "32")] * 3
    assert [rec["env"].get("PREEMPT_SUPERVISE_CAUSE") for rec in recs] == [None, "preempted", "preempted"]
    assert "preempted: restarting unchanged (restart 2 of 3)" in r.stderr.decode()


def test_max_preemptions(child):
    child.plan({"exit": PREEMPTED_EXIT_CODE})
    r = child.run("--max-preemptions", "1")
    assert r.returncode == PREEMPTED_EXIT_CODE and len(child.records) == 2
    assert "--max-preemptions 1 restarts were made" in r.stderr.decode()


# ------------------------------------------------------------ usage


@pytest.mark.parametrize(
    "options, cmd, message",
    [
        ((), ("--lr", "{lr}"), "the command uses {lr} but --lr is not given"),
        (("--lr", "0.1"), ("--lr", "0.1"), "--lr 0.1 is given but the command has no {lr}"),
        ((), ("--bs", "{batch_size}"), "the command uses {batch_size} but --batch-size is not given"),
        (("--batch-size", "4"), (), "--batch-size 4 is given but the command has no {batch_size}"),
        (("--factor", "1"), (), "--factor: expected a number > 1, found 1.0"),
        (("--lr", "1e-7"), ("{lr}",), "--lr 1e-07 is below --min-lr 1e-06; lower --min-lr"),
    ],
)
def test_usage_errors_start_nothing(child, options, cmd, message):
    child.plan({"exit": 0})
    r = child.run(*options, cmd=cmd)
    assert r.returncode == 2
    assert message in r.stderr.decode()
    assert child.records == []


def test_the_double_dash_is_required_and_missing_commands_are_127(child):
    r = subprocess.run([sys.executable, "-m", "preempt", "supervise", "true"], capture_output=True, env=ENV, timeout=30)
    assert r.returncode == 2 and "the -- is required" in r.stderr.decode()
    r = subprocess.run(
        [sys.executable, "-m", "preempt", "supervise", "--no-log", "--", str(child.dir / "no-such-program")],
        capture_output=True,
        env=ENV,
        timeout=30,
    )
    assert r.returncode == 127 and "cannot run" in r.stderr.decode()


def test_environment_of_the_child(child):
    """PREEMPT_LR* inherited by the supervisor is dropped when it has no --lr; PYTHONUNBUFFERED is set."""
    child.plan({"exit": 0})
    r = child.run(env={**ENV, "PREEMPT_LR": "9", "PREEMPT_LR_SCALE": "3", "PYTHONUNBUFFERED": ""})
    assert r.returncode == 0
    assert child.records[0]["env"] == {"PREEMPT_SUPERVISE_ATTEMPT": "1", "PYTHONUNBUFFERED": ""}
    child.plan({"exit": 0})
    (child.dir / "record.jsonl").unlink()
    r = child.run()
    assert child.records[0]["env"] == {"PREEMPT_SUPERVISE_ATTEMPT": "1", "PYTHONUNBUFFERED": "1"}


def test_the_log_goes_into_the_save_dir_or_nowhere_never_into_the_cwd(child):
    """No --log: without --save-dir the events go to stderr only; with it, to DIR/supervise.log. The cwd stays empty."""
    child.plan({"exit": 0})
    cwd = child.dir / "cwd"
    cwd.mkdir()
    sup = [sys.executable, "-m", "preempt", "supervise"]
    cmd = ["--", sys.executable, str(child.script)]
    r = subprocess.run([*sup, *cmd], cwd=cwd, capture_output=True, env=ENV, timeout=30)
    assert r.returncode == 0, r.stderr.decode()
    assert "[preempt supervise] attempt 1: exit 0" in r.stderr.decode()
    assert list(cwd.iterdir()) == [] and not (child.dir / "supervise.log").exists()

    save_dir = child.dir / "runs" / "exp1"  # not there yet: the run creates it, and so does the supervisor
    for attempt in (1, 2):  # appended to across requeues
        r = subprocess.run([*sup, "--save-dir", str(save_dir), *cmd], cwd=cwd, capture_output=True, env=ENV, timeout=30)
        assert r.returncode == 0, r.stderr.decode()
        assert list(cwd.iterdir()) == []
        log = (save_dir / "supervise.log").read_text()
        assert log.count("] stop: the command completed; exit 0") == attempt, log

    r = subprocess.run([*sup, "--save-dir", str(save_dir), "--no-log", *cmd], cwd=cwd, capture_output=True, env=ENV,
                       timeout=30)  # fmt: skip
    assert r.returncode == 0 and (save_dir / "supervise.log").read_text() == log
    mine = child.dir / "elsewhere" / "mine.log"  # --log wins over --save-dir
    r = subprocess.run([*sup, "--save-dir", str(save_dir), "--log", str(mine), *cmd], cwd=cwd, capture_output=True,
                       env=ENV, timeout=30)  # fmt: skip
    assert r.returncode == 0 and "attempt 1: exit 0" in mine.read_text()
    assert (save_dir / "supervise.log").read_text() == log and list(cwd.iterdir()) == []


def test_a_symlinked_log_in_the_save_dir_is_refused_and_nothing_starts(child):
    """The save_dir may be shared: a planted link is not followed (as for the run's own files there)."""
    child.plan({"exit": 0})
    save_dir = child.dir / "run"
    save_dir.mkdir()
    target = child.dir / "victim.txt"
    target.write_text("keep me\n")
    (save_dir / "supervise.log").symlink_to(target)
    r = subprocess.run(
        [sys.executable, "-m", "preempt", "supervise", "--save-dir", str(save_dir), "--", sys.executable,
         str(child.script)],
        capture_output=True, env=ENV, timeout=30, cwd=child.dir,
    )  # fmt: skip
    err = r.stderr.decode()
    assert r.returncode == 2, err
    assert f"--save-dir {save_dir}: cannot append to the log" in err
    assert f"{save_dir / 'supervise.log'}: expected a regular file, found a symbolic link" in err
    assert child.records == [] and target.read_text() == "keep me\n"


# ------------------------------------------------------ signals, groups


@pytest.mark.usefixtures("sigint_handled")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_is_forwarded_child_saves_supervisor_exits_75(child, sig):
    child.plan({"on_term": "save", "grandchild": "plain", "ready": True, "sleep": 20})
    p = child.start(*LR_BS, cmd=CMD)
    child.wait_file("ready_1")
    os.kill(p.pid, sig)
    out, err = p.communicate(timeout=20)
    assert p.returncode == PREEMPTED_EXIT_CODE, err.decode()
    assert (child.dir / "saved_1").read_text() == sig.name
    (rec,) = child.records  # not restarted
    assert gone(rec["pgid"]), "processes of the child's group survived"
    gc = int((child.dir / "grandchild_1.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(gc, 0)
    assert f"{sig.name} received; forwarded to process group {rec['pgid']}" in err.decode()
    assert f"{sig.name} forwarded to it; not starting another attempt; exit 75" in child.log


def test_grace_period_then_sigkill_of_the_whole_group(child):
    child.plan({"on_term": "ignore", "grandchild": "stubborn", "ready": True, "sleep": 20})
    p = child.start("--grace", "0.5")
    child.wait_file("ready_1")
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGTERM)
    _, err = p.communicate(timeout=20)
    took = time.monotonic() - t0
    assert p.returncode == 128 + signal.SIGKILL, err.decode()
    assert 0.5 <= took < 5, took
    assert "still running 0.5 s after the signal; SIGKILL" in err.decode()
    (rec,) = child.records
    assert gone(rec["pgid"])


def test_a_killed_supervisor_takes_its_child_along(child):
    """SIGKILL cannot be forwarded; the kernel sends the child SIGTERM (PR_SET_PDEATHSIG) and the child saves."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux-only")
    child.plan({"on_term": "save", "ready": True, "sleep": 20})
    p = child.start()
    child.wait_file("ready_1")
    p.kill()
    p.wait()
    child.wait_file("saved_1", timeout=10)
    assert (child.dir / "saved_1").read_text() == "SIGTERM"


def test_leftovers_in_the_group_are_killed_when_the_child_exits(child):
    """The child completes but leaves a grandchild that ignores SIGTERM: SIGTERM, then SIGKILL, nothing left."""
    child.plan({"grandchild": "stubborn", "exit": 0})
    r = child.run("--grace", "0.3")
    assert r.returncode == 0, r.stderr.decode()
    err = r.stderr.decode()
    assert "processes left in group" in err and "processes still in group" in err and "SIGKILL" in err
    (rec,) = child.records
    assert gone(rec["pgid"])
    with pytest.raises(ProcessLookupError):
        os.kill(int((child.dir / "grandchild_1.pid").read_text()), 0)


# ------------------------------------------------------------ output


def read_until(p: subprocess.Popen, fd: int, wanted: bytes, timeout: float = 15.0) -> bytes:
    got = b""
    deadline = time.monotonic() + timeout
    while wanted not in got:
        left = deadline - time.monotonic()
        assert left > 0, f"{wanted!r} not seen within {timeout} s; got {got!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            assert chunk, f"EOF before {wanted!r}; got {got!r}"
            got += chunk
    return got


def test_output_is_streamed_live(child):
    """The child prints "a" (no newline) and waits for a file that the test creates only after seeing the "a"."""
    child.plan({"out": ["a"], "wait_for": "go", "exit": 0})
    p = child.start()
    assert p.stdout is not None
    got = read_until(p, p.stdout.fileno(), b"a")
    (child.dir / "go").write_text("")
    out, _ = p.communicate(timeout=20)
    assert p.returncode == 0
    assert got + out == b"a"


def test_carriage_returns_and_streams_pass_through_byte_for_byte(child):
    bar = "  0%|          | 0/3\r 33%|###3      | 1/3\r100%|##########| 3/3\n"
    child.plan({"out": [bar, "no newline at the end \xff"], "err": ["to stderr\r\n", "\r 50%|#####"], "exit": 0})
    r = child.run()
    assert r.returncode == 0
    assert r.stdout == (bar + "no newline at the end \xff").encode("latin-1")
    # stderr: the child's bytes as they were; the supervisor's next message starts a new line after the open bar
    assert b"to stderr\r\n\r 50%|#####\n[preempt supervise] attempt 1: exit 0" in r.stderr
