"""Hostile save directories: the files around the checkpoints, planted by someone else.

For each case: no hang (an alarm turns one into a failure), no traceback from the tools, nothing read or
written outside the save_dir, ``preempt verify`` exits 1 on damage, and the run resumes from the newest
valid checkpoint or refuses with an error naming the path, what it expected and what it found.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_bad_input
import torch
from helpers import run_python
from test_bad_input import STEP1, STEP2, build, forbidden, resign

from preempt import PreemptibleRun
from preempt.checkpoint import lock, safe_io
from preempt.cli import main as cli
from preempt.errors import CheckpointError

PREEMPT = [sys.executable, "-m", "preempt"]


# A test that blocks (a FIFO opened for reading, /dev/zero read to the end) fails after 60 s instead.
pytestmark = pytest.mark.timeout(60)


def tool(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """A command of the ``preempt`` command line in its own process (a hang is killed; a traceback is seen)."""
    r = run_python([*PREEMPT, *args], timeout=timeout, errors="backslashreplace")
    assert "Traceback" not in r.stderr, r.stderr
    return r


def resume(save_dir: Path) -> PreemptibleRun:
    """Enters a run on save_dir and leaves at once; returns it (resumed_from, global_step)."""
    model, opt, sched, _ = build(seed=7)
    with PreemptibleRun(save_dir, model=model, optimizer=opt, scheduler=sched, checkpoint_interval=None) as run:
        pass
    return run


# test_bad_input's save_dir (checkpoints of steps 1 and 2), registered here under its own names
template, save_dir = test_bad_input.template, test_bad_input.save_dir


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file of someone else's, outside the save_dir."""
    f = tmp_path / "elsewhere" / "precious.txt"
    f.parent.mkdir()
    f.write_text("someone else's data\n")
    return f


# ---------------------------------------------------------------- symlinks: nothing written outside


def test_a_symlinked_lock_is_neither_truncated_by_prune_nor_overwritten_by_a_run(save_dir, outside):
    (save_dir / "lock").unlink(missing_ok=True)
    (save_dir / "lock").symlink_to(outside)
    r = tool("prune", str(save_dir), "--keep-last", "1", "--yes")
    assert r.returncode == cli.EXIT_USAGE
    assert "lock: expected a regular file, found a symbolic link" in r.stderr and "Nothing" not in r.stdout
    with pytest.raises(OSError, match=r"run/lock: expected a regular file, found a symbolic link"):
        resume(save_dir)
    assert outside.read_text() == "someone else's data\n"
    assert sorted(p.name for p in save_dir.glob("step_*")) == [STEP1, STEP2]  # prune deleted nothing


@pytest.mark.parametrize("name", ["train.log", "history.jsonl"])
def test_symlinked_logs_are_not_written_through_and_the_run_goes_on(save_dir, outside, name, caplog):
    (save_dir / name).unlink(missing_ok=True)
    (save_dir / name).symlink_to(outside)
    run = resume(save_dir)
    assert run.resumed_from == save_dir / STEP2
    assert outside.read_text() == "someone else's data\n"
    assert f"{name}: expected a regular file, found a symbolic link" in caplog.text


def test_complete_json_symlinked_to_a_marker_elsewhere_does_not_make_the_run_complete(save_dir, tmp_path, caplog):
    fake = tmp_path / "fake_complete.json"
    fake.write_text(json.dumps({"checkpoint": STEP2, "step": 2, "epoch": 0}))
    (save_dir / "complete.json").symlink_to(fake)
    run = resume(save_dir)  # a complete run would raise RunComplete (exit 0) and train nothing
    assert run.resumed_from == save_dir / STEP2
    assert "complete.json: expected a regular file, found a symbolic link" in caplog.text


# ---------------------------------------------------------------- no hang


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_complete_json_as_a_fifo_or_dev_zero_hangs_nothing(save_dir, kind):
    marker = save_dir / "complete.json"
    if kind == "fifo":
        os.mkfifo(marker)
    else:
        marker.symlink_to("/dev/zero")
    for args in (["ls", str(save_dir)], ["verify", str(save_dir)], ["prune", str(save_dir), "--keep-last", "1"]):
        r = tool(*args)
        assert r.returncode == cli.EXIT_OK, (args, r.stdout, r.stderr)
    assert "complete.json: expected a regular file, found" in tool("ls", str(save_dir)).stderr
    assert resume(save_dir).resumed_from == save_dir / STEP2


def test_a_lock_that_is_a_fifo_is_an_error_naming_it_not_a_hang(save_dir):
    (save_dir / "lock").unlink(missing_ok=True)
    os.mkfifo(save_dir / "lock")
    with pytest.raises(OSError, match=r"run/lock: expected a regular file, found a FIFO"):
        resume(save_dir)
    r = tool("prune", str(save_dir), "--keep-last", "1", "--yes")
    assert r.returncode == cli.EXIT_USAGE and "found a FIFO" in r.stderr


# ---------------------------------------------------------------- deep JSON


def deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


def test_a_deeply_nested_complete_json_is_ignored(save_dir):
    (save_dir / "complete.json").write_bytes(deep(990))
    r = tool("ls", str(save_dir))
    assert r.returncode == cli.EXIT_OK and "JSON nested 990 levels deep" in r.stderr
    assert resume(save_dir).resumed_from == save_dir / STEP2


def test_a_deeply_nested_manifest_is_corrupt_and_the_run_falls_back(save_dir):
    (save_dir / STEP2 / "manifest.json").write_bytes(b'{"format": "preempt-checkpoint", "x": ' + deep(990) + b"}")
    r = tool("verify", str(save_dir))
    assert r.returncode == cli.EXIT_DAMAGED and "JSON nested 991 levels deep" in r.stdout
    assert tool("ls", str(save_dir)).returncode == cli.EXIT_OK
    assert tool("inspect", str(save_dir / STEP2)).returncode != 0
    run = resume(save_dir)
    assert run.resumed_from == save_dir / STEP1 and (save_dir / "quarantine" / STEP2).is_dir()


def test_a_deeply_nested_state_json_that_matches_its_digest_is_refused(save_dir):
    (save_dir / STEP2 / "state.json").write_bytes(b'{"x": ' + deep(990) + b"}")
    resign(save_dir / STEP2, rehash=("state.json",))
    r = tool("inspect", str(save_dir / STEP2))
    # what inspect tells the user (a refusal of the command, no event)
    assert re.search(r"nested (991 levels deep|deeper than 64 levels)", r.stdout + r.stderr), r.stdout + r.stderr
    assert tool("verify", str(save_dir)).returncode == cli.EXIT_DAMAGED
    assert resume(save_dir).resumed_from == save_dir / STEP1


# ---------------------------------------------------------------- lock fields, escapes, surrogates


@pytest.mark.parametrize("since", [1e300, float("nan"), -1e300, "yesterday", True])
def test_lock_content_out_of_range_is_described_not_raised(since):
    text = lock.describe({"pid": 12, "host": "n1\x1b[2J", "since": since, "purpose": "training"})
    assert text.startswith("pid 12 on host n1\\x1b[2J, training") and "\x1b" not in text


def test_escape_sequences_and_lone_surrogates_in_a_manifest_are_printed_escaped(save_dir):
    resign(save_dir / STEP2, lambda raw: raw.update(reason="\x1b[2J\x1b]0;pwned\x07\ud800"))
    for args in (["ls", str(save_dir)], ["inspect", str(save_dir / STEP2)], ["verify", str(save_dir)]):
        r = tool(*args)
        assert r.returncode == cli.EXIT_OK, (args, r.stderr)
        assert "\x1b" not in r.stdout and "\x07" not in r.stdout, args
    assert "\\x1b[2J" in tool("ls", str(save_dir)).stdout


def test_odd_types_in_provenance_are_shown_not_raised(save_dir):
    resign(save_dir / STEP2, lambda raw: raw.update(provenance={"argv": 7, "git": [1], "slurm": "x", "host": {}}))
    r = tool("inspect", str(save_dir / STEP2))
    assert r.returncode == cli.EXIT_OK and "argv: 7" in r.stdout


# ---------------------------------------------------------------- verify, ls and the run agree on "valid"


def test_a_copy_named_as_another_step_is_damaged_for_verify_and_skipped_by_the_run(save_dir):
    shutil.copytree(save_dir / STEP1, save_dir / "step_000000006")  # its manifest says step 1
    r = tool("verify", str(save_dir))
    assert r.returncode == cli.EXIT_DAMAGED and "step_000000006: CORRUPT" in r.stdout
    assert "records step 1, directory says 6" in r.stdout
    ls = tool("ls", str(save_dir)).stdout
    row = next(line for line in ls.splitlines() if line.startswith("step_000000006"))
    assert "corrupt" in row and "latest" not in row
    assert "latest" in next(line for line in ls.splitlines() if line.startswith(STEP2))
    assert resume(save_dir).resumed_from == save_dir / STEP2


def test_a_checkpoint_listing_a_missing_file_is_not_resumed_from(save_dir):
    resign(save_dir / STEP2, lambda raw: raw["files"].update({"extra.bin": {"size": 3, "xxh3_128": "0" * 32}}))
    r = tool("verify", str(save_dir))
    assert r.returncode == cli.EXIT_DAMAGED and "extra.bin: missing" in r.stdout
    run = resume(save_dir)
    assert run.resumed_from == save_dir / STEP1 and (save_dir / "quarantine" / STEP2).is_dir()


def test_a_manifest_listing_70000_files_is_refused_at_once(save_dir):
    def many(raw: dict) -> None:
        raw["files"].update({f"f{i}": {"size": 1, "xxh3_128": "0" * 32} for i in range(70_000)})

    resign(save_dir / STEP2, many)
    t0 = time.monotonic()
    r = tool("verify", str(save_dir))
    assert r.returncode == cli.EXIT_DAMAGED and "lists 70003 files; a checkpoint holds at most 65536" in r.stdout
    assert len(r.stdout.splitlines()) < 20 and time.monotonic() - t0 < 30
    assert resume(save_dir).resumed_from == save_dir / STEP1


# ---------------------------------------------------------------- full disk, odd names


def test_a_full_disk_at_start_is_an_error_naming_the_lock(tmp_path):
    where = tmp_path / "fs"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        (where / "run").mkdir()
        fd = os.open(where / "filler", os.O_WRONLY | os.O_CREAT)
        try:  # fill the filesystem to the last block
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        with pytest.raises((OSError, CheckpointError)) as err:
            with PreemptibleRun(where / "run", model=torch.nn.Linear(2, 2), checkpoint_interval=None):
                pass
        assert str(where / "run") in str(err.value) and "No space left" in str(err.value), str(err.value)
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_save_dir_whose_name_is_not_utf8_keeps_its_log(tmp_path):
    """Log lines naming such a path once turned train.log off for the rest of the run (a UnicodeEncodeError)."""
    save_dir = os.fsencode(tmp_path) + b"/run-\xff\xfe"
    script = (
        "import os, sys, torch\nfrom preempt import PreemptibleRun\n"
        "with PreemptibleRun(os.fsdecode(sys.argv[1].encode('utf-8', 'surrogateescape')),"
        " model=torch.nn.Linear(2, 2), checkpoint_interval=None) as run:\n"
        "    for _ in run.epochs(1):\n        run.step()\n"
    )
    r = run_python([sys.executable, "-c", script, os.fsdecode(save_dir)], timeout=120)
    assert r.returncode == 0, r.stderr
    with open(save_dir + b"/train.log", "rb") as f:
        log_text = f.read()
    assert b"==== start (fresh)" in log_text and b"run complete" in log_text, log_text
    assert b"run-\\udcff\\udcfe/step_000000001" in log_text  # the name escaped, the log going on
    r = tool("ls", os.fsdecode(save_dir))
    assert r.returncode == cli.EXIT_OK and "step_000000001" in r.stdout


def test_safe_io_refuses_what_is_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "fifo")
    (tmp_path / "big").write_bytes(b"x" * 100)
    for name, found in (("fifo", "a FIFO"), ("link", "a symbolic link")):
        with pytest.raises(safe_io.UnsafeFileError, match=f"expected a regular file, found {found}"):
            safe_io.read_bytes(tmp_path / name, 10)
    with pytest.raises(safe_io.UnsafeFileError, match="expected at most 10 bytes, found 100 bytes"):
        safe_io.read_bytes(tmp_path / "big", 10)
    with forbidden(tmp_path / "elsewhere"):
        pass


def test_deep_json_in_the_lock_and_in_history_is_ignored(save_dir):
    (save_dir / "lock").write_bytes(deep(5000))  # a dead holder's "details", planted
    with open(save_dir / "history.jsonl", "ab") as f:
        f.write(deep(5000) + b"\n")
    run = resume(save_dir)
    assert run.resumed_from == save_dir / STEP2
    from preempt.health.history import read_history

    records = read_history(save_dir)
    assert records and all(isinstance(r, dict) for r in records)
