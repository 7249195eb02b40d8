"""A rerun's LightningCLI config file (preempt.lightning.cli_config): the decision, and a real SaveConfigCallback
let through or left as it is, with a real Trainer and parser (no process; tests/process/test_lightning_cli.py runs
the jobs)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="Lightning is not installed (pip install -e '.[lightning]')")
pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse (pip install -e '.[lightning]')")

import lightning.pytorch as L  # noqa: E402
from lightning.pytorch.cli import LightningArgumentParser, SaveConfigCallback  # noqa: E402

from preempt.lightning.cli_config import began, let_rerun_write, same_run  # noqa: E402


@pytest.mark.parametrize(
    ("began_", "written", "ours", "own"),
    [
        (True, "a: 1\n", "a: 1\n", True),
        (True, "a: 1\n", "a: 2\n", False),  # another config
        (True, None, "a: 1\n", False),  # no file: nothing to let through
        (False, "a: 1\n", "a: 1\n", False),  # the same config, but a save_dir with nothing of the run
    ],
)
def test_the_file_is_the_runs_own_only_when_the_run_began_and_it_holds_this_processs_config(began_, written, ours, own):
    assert same_run(began=began_, written=written, ours=ours) is own


def test_a_run_began_where_its_history_or_a_checkpoint_is(tmp_path):
    assert not began(tmp_path / "missing")
    assert not began(tmp_path)
    (tmp_path / "step_4").mkdir()  # not a checkpoint's name (step_000000004)
    (tmp_path / "lock").write_text("")
    assert not began(tmp_path)
    (tmp_path / "step_000000004").mkdir()
    assert began(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "history.jsonl").write_text("")
    assert began(other)


def _setting(tmp_path: Path, args: list[str] | None = None, **kwargs) -> tuple[L.Trainer, SaveConfigCallback, Path]:
    """A process's trainer and LightningCLI's SaveConfigCallback, with a config parsed from ``args``."""
    parser = LightningArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    callback = SaveConfigCallback(parser, parser.parse_args(args or []), **kwargs)
    trainer = L.Trainer(
        logger=False, default_root_dir=tmp_path / "root", callbacks=[callback], enable_progress_bar=False
    )
    return trainer, callback, tmp_path / "root" / "config.yaml"


def _first_process(tmp_path: Path) -> str:
    """The job's first process: its SaveConfigCallback writes config.yaml (with lr 0.1); returns what it wrote."""
    trainer, callback, path = _setting(tmp_path)
    callback.setup(trainer, trainer.lightning_module, "fit")
    return path.read_text()


def _began(save_dir: Path) -> Path:
    save_dir.mkdir(parents=True, exist_ok=True)
    (save_dir / "history.jsonl").write_text("")
    return save_dir


def test_the_runs_own_config_is_written_again_for_this_setup_only(tmp_path):
    written = _first_process(tmp_path)
    trainer, callback, path = _setting(tmp_path)
    own = let_rerun_write(trainer, [callback], _began(tmp_path / "run"))
    assert callback.overwrite and len(own.notes) == 1 and str(path) in own.notes[0]
    callback.setup(trainer, trainer.lightning_module, "fit")  # Lightning's own check: passes, the same file
    assert path.read_text() == written and callback.already_saved
    own.undo()
    assert callback.overwrite is False


@pytest.mark.parametrize("case", ["changed", "fresh_save_dir", "multifile", "overwrite_already"])
def test_lightning_decides_where_the_file_is_not_the_runs_own(tmp_path, case):
    written = _first_process(tmp_path)
    args = ["--lr", "0.2"] if case == "changed" else []
    trainer, callback, path = _setting(
        tmp_path, args, multifile=case == "multifile", overwrite=case == "overwrite_already"
    )
    save_dir = tmp_path / "run" if case == "fresh_save_dir" else _began(tmp_path / "run")
    own = let_rerun_write(trainer, [callback], save_dir)
    assert own.notes == [] and callback.overwrite is (case == "overwrite_already")
    if case != "overwrite_already":
        with pytest.raises(RuntimeError, match="to NOT exist"):
            callback.setup(trainer, trainer.lightning_module, "fit")
        assert path.read_text() == written


def test_callbacks_that_already_ran_are_not_looked_at(tmp_path):
    """Only the callbacks whose setup is still to run (after PreemptCallback) are given: none, nothing done."""
    _first_process(tmp_path)
    trainer, callback, _ = _setting(tmp_path)
    own = let_rerun_write(trainer, [], _began(tmp_path / "run"))
    assert own.notes == [] and callback.overwrite is False
