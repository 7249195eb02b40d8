"""A save_dir that cannot be used is said when the run starts, not at the first checkpoint hours later."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from preempt import PreemptibleRun
from preempt.errors import CheckpointError


def enter(save_dir: Path) -> list[str]:
    """Enters a run on save_dir; returns what the body did (nothing, when entering fails)."""
    did = []
    model = torch.nn.Linear(2, 2)
    with PreemptibleRun(save_dir, model=model, checkpoint_interval=None):
        did.append("body")
    return did


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A read-only bind mount of an empty directory (root ignores permission bits, not a read-only mount)."""
    src, where = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    where.mkdir()
    r = subprocess.run(["mount", "--bind", str(src), str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(where)], check=True, capture_output=True)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_file_where_the_directory_should_be(tmp_path):
    f = tmp_path / "runs"
    f.write_text("not a directory")
    with pytest.raises(CheckpointError, match=rf"save_dir {f}: expected a directory, found a file"):
        enter(f)
    assert f.read_text() == "not a directory"


def test_a_file_in_the_middle_of_the_path(tmp_path):
    (tmp_path / "runs").write_text("x")
    with pytest.raises(CheckpointError, match=r"save_dir .*runs/exp1: not a writable directory \(Not a directory\)"):
        enter(tmp_path / "runs" / "exp1")


def test_a_read_only_directory(read_only):
    with pytest.raises(CheckpointError, match=rf"save_dir {read_only}: not a writable directory \(Read-only"):
        enter(read_only)


def test_a_missing_directory_under_a_read_only_one(read_only):
    with pytest.raises(CheckpointError, match=r"save_dir .*/ro/exp1: not a writable directory \(Read-only"):
        enter(read_only / "exp1")


def test_a_missing_directory_is_created_with_its_parents(tmp_path):
    d = tmp_path / "a" / "b" / "exp1"
    assert enter(d) == ["body"]
    assert d.is_dir() and (d / "complete.json").is_file()
