"""Fixtures shared by the fault tests of bad and hostile save directories."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_bad_input import STEP1, STEP2, train

from preempt import Preempted


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save_dir with the checkpoints of steps 1 and 2 (stopped at step 2: no completion marker)."""
    d = tmp_path_factory.mktemp("template") / "run"
    with pytest.raises(Preempted):
        train(d, stop_after=2, checkpoint_every_steps=1, keep_last=None)
    assert sorted(p.name for p in d.glob("step_*")) == [STEP1, STEP2]
    return d


@pytest.fixture
def save_dir(template: Path, tmp_path: Path) -> Path:
    d = tmp_path / "run"
    shutil.copytree(template, d, symlinks=True)
    return d
