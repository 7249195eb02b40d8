"""Reading a checkpoint costs memory in proportion to what it holds, not a multiple of it.

An honest 8 MB string in the user state made `preempt verify` use ~1 GB: the scan that measures a JSON document's
nesting before it is parsed kept a backtracking frame per character of each string. Each command runs in a
process of its own, which reports its peak resident memory (``VmHWM``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from preempt.checkpoint import safe_io
from preempt.checkpoint.manager import CheckpointManager

STRING = 8_000_000  # characters in the user state
PEAK_LIMIT = 300 << 20  # what a command may use for it: the string a few times over, far below ~1 GB


# The command in-process, then its peak resident memory: VmHWM of /proc/self/status belongs to the process's own
# image since its exec (the rusage of a child counts the forked parent's pages before the exec too).
MEASURED = """
import os, sys
from preempt.cli.main import main
code = main(sys.argv[1:])
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
with open(os.environ["PEAK_RSS_OUT"], "w") as out:  # the test's own channel, apart from what preempt printed
    out.write(str(int(hwm.split()[1]) * 1024))
sys.exit(code)
"""


def peak_rss(args: list[str]) -> tuple[int, int, str]:
    """Runs ``preempt *args`` in a process of its own; returns its exit code, its peak RSS in bytes, its output."""
    with tempfile.TemporaryDirectory() as tmp:
        peak = Path(tmp) / "peak"
        env = {**os.environ, "PYTHONPATH": str(Path(safe_io.__file__).resolve().parents[2]), "PEAK_RSS_OUT": str(peak)}
        r = subprocess.run(
            [sys.executable, "-c", MEASURED, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env
        )
        assert peak.exists(), r.stdout + r.stderr
        return r.returncode, int(peak.read_text()), r.stdout + r.stderr


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bounded") / "run"
    model = torch.nn.Linear(4, 4)
    text = "x" * (STRING // 2) + 'a "quoted" \\ part' * 16 + "y" * (STRING // 2)  # escapes inside the long string
    CheckpointManager(d).save_state(step=1, model=model, user_state={"notes": text})
    return d


@pytest.mark.parametrize("command", ["verify", "inspect", "ls"])
def test_a_long_string_in_the_user_state_costs_no_more_than_a_few_times_itself(run_dir, command):
    code, peak, out = peak_rss([command, str(run_dir)])
    assert code == 0, out
    assert "Traceback" not in out
    assert peak < PEAK_LIMIT, f"{command}: peak RSS {peak >> 20} MiB for an {STRING / 1e6:.0f} MB string"


def test_the_nesting_scan_skips_strings_with_escapes_and_counts_the_rest():
    doc = {"a": ['x "[[[" \\" {{', [{"b": "]]]\\\\"}]], "c": "\\\\"}
    assert safe_io.json_depth(json.dumps(doc).encode()) == 4  # { a: [ [ { : the brackets in strings do not count
    assert safe_io.json_depth(b'"unterminated [[[') == 3  # not a string (no closing quote): its brackets count


def test_every_command_and_a_resume_on_a_long_string_in_both_modes(tmp_path):
    """The same checkpoint beside test_bad_input's under every command and a resume, as root and without
    capabilities (tests/faults/test_hostile_files.py's sweep): no traceback, nothing moved."""
    from test_bad_input import STEP2, build
    from test_hostile_files import sweep

    def make(root: Path) -> Path:
        d = root / "run"
        model = build()[0]
        m = CheckpointManager(d)
        m.save_state(step=1, model=model)
        m.save_state(step=2, model=model, user_state={"notes": "x" * STRING})
        return d

    got = sweep(make, tmp_path)
    for mode, r in got.items():
        assert r["cmd"]["verify"]["rc"] == 0, (mode, r["cmd"]["verify"])
        # save_state() keeps no RNG, so the run refuses it by name (a documented PreemptError), after reading it
        assert STEP2 in r["doc"]["resume"].get("message", ""), (mode, r["doc"]["resume"])
