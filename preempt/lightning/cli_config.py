"""LightningCLI's ``config.yaml`` at a rerun: the file an earlier process of the same run wrote does not stop it.

LightningCLI appends a ``SaveConfigCallback`` to the trainer's callbacks. In ``setup`` it writes the parsed config to
``trainer.log_dir``, and unless ``save_config_kwargs={"overwrite": True}`` it first refuses to go on when a file of
that name is already there ("expected .../config.yaml to NOT exist. Aborting to avoid overwriting results of a
previous run"). The log directory is the same in every process of a job when there is no logger (the trainer's
``default_root_dir``) or when the logger keeps one directory (W&B's ``save_dir``); a CSV or TensorBoard logger makes
a new ``version_N`` each process. So a job stopped by preempt and rerun with the same command would die there,
before preempt could resume it.

A resumed run is the same run. :func:`let_rerun_write` runs in PreemptCallback's ``setup``, which Lightning calls
before SaveConfigCallback's (LightningCLI appends that callback after the configured ones). For each such callback
yet to run that would refuse the file, the global-zero process (the one SaveConfigCallback checks on) asks
:func:`same_run` with three facts: the save_dir holds an earlier process's traces of this run (its history or a
checkpoint), the file exists, and it holds exactly what this process would write (the parser's dump that
SaveConfigCallback writes). The answer is broadcast, as SaveConfigCallback broadcasts its own. When it is yes, that one
callback may overwrite the file for this setup (with the same content; ``save_config``, a subclass's hook, runs as in
the first process), and :meth:`OwnConfig.undo` puts its setting back. A different config, a fresh save_dir, or a
config saved as several files (``multifile=True``, not compared) keep Lightning's refusal and its message.

A SaveConfigCallback placed before PreemptCallback in a hand-made trainer's callbacks runs its check first and is
left as it is. A first process killed after SaveConfigCallback wrote the file and before the run began (its history
is written when the fit starts, seconds later) leaves a file its rerun refuses.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint.names import parse_checkpoint_name
from ..health.history import HISTORY_FILE

if TYPE_CHECKING:
    import lightning.pytorch as pl


def same_run(*, began: bool, written: str | None, ours: str | None) -> bool:
    """Whether the config file in the log directory is this run's own: an earlier process of the run began in its
    save_dir (``began``), and the file there (``written``, None: none) holds what this process writes (``ours``)."""
    return began and written is not None and written == ours


def began(save_dir: str | os.PathLike[str]) -> bool:
    """Whether an earlier process began this run in ``save_dir``: its history is there, or a checkpoint."""
    path = Path(save_dir)
    if (path / HISTORY_FILE).is_file():
        return True
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(parse_checkpoint_name(name) is not None for name in names)


class OwnConfig:
    """The SaveConfigCallbacks allowed to overwrite the run's own config file for this setup, and their settings.

    Args:
        allowed: The callbacks allowed.
        notes: What to tell once the run logs (at ``setup`` the run's logger is not set up yet).
    """

    def __init__(self, allowed: list[Any], notes: list[str]) -> None:
        self.notes = list(notes)
        self._allowed = [(callback, callback.overwrite) for callback in allowed]
        for callback, _ in self._allowed:
            callback.overwrite = True

    def undo(self) -> None:
        """Gives each callback its own setting back (it has written the file by now: ``already_saved``)."""
        for callback, overwrite in self._allowed:
            callback.overwrite = overwrite
        self._allowed = []


def let_rerun_write(trainer: pl.Trainer, pending: list[Any], save_dir: str | os.PathLike[str]) -> OwnConfig:
    """Lets each SaveConfigCallback of ``pending`` (the callbacks whose ``setup`` is still to run) that would refuse
    the run's own config file write it again. Called by every process: ``trainer.log_dir`` and the broadcast are
    collective, as in SaveConfigCallback's ``setup``."""
    cli = sys.modules.get("lightning.pytorch.cli")  # not imported: no SaveConfigCallback exists
    if cli is None:
        return OwnConfig([], [])
    refusing = [
        cb
        for cb in pending
        if isinstance(cb, cli.SaveConfigCallback)
        and cb.save_to_log_dir
        and not cb.overwrite
        and not cb.multifile
        and not cb.already_saved
    ]
    if not refusing:
        return OwnConfig([], [])
    log_dir = trainer.log_dir  # broadcasts the directory
    assert log_dir is not None  # (as SaveConfigCallback asserts: the default_root_dir without a logger)
    verdicts = [False] * len(refusing)
    if trainer.is_global_zero and began(save_dir):
        verdicts = [_is_own(cb, log_dir) for cb in refusing]
    verdicts = trainer.strategy.broadcast(verdicts)
    allowed = [cb for cb, own in zip(refusing, verdicts, strict=True) if own]
    notes = [
        f"PreemptCallback: {os.path.join(log_dir, cb.config_filename)} was written by an earlier process of this run"
        f" ({save_dir}) and holds this process's config: {type(cb).__name__} wrote it again"
        for cb in allowed
    ]
    return OwnConfig(allowed, notes)


def _is_own(callback: Any, log_dir: str) -> bool:
    from lightning.fabric.utilities.cloud_io import get_filesystem

    path = os.path.join(log_dir, callback.config_filename)
    fs = get_filesystem(log_dir)
    try:
        if not fs.isfile(path):
            return False
        with fs.open(path, "r") as f:
            written = f.read()
    except (OSError, UnicodeDecodeError):
        return False  # unreadable: SaveConfigCallback decides
    # what SaveConfigCallback's parser.save writes (multifile=False): the parser's dump of the config, asked as
    # Lightning asks it; jsonargparse's deprecation of skip_none is Lightning's to show, from its own call
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ours = callback.parser.dump(callback.config, skip_none=False)
    return same_run(began=True, written=written, ours=ours)
