"""Metrics to TensorBoard and Weights & Biases, one run across stops, kills and requeues.

``PreemptibleRun(..., loggers=["tensorboard", "wandb"])`` hands every metric given to ``run.step(metrics=...)``
and ``run.report(...)`` to each logger, at its step (rank 0 only). The packages are optional extras
(``pip install 'preempt-torch[tensorboard]'``, ``'preempt-torch[wandb]'``) and are imported only when a run asks for
them.

What a restart does to each:

* **TensorBoard** writes ``save_dir/tensorboard`` (or :class:`TensorBoard` ``(log_dir=...)``) with
  ``torch.utils.tensorboard.SummaryWriter``. A process that resumed from the checkpoint of step N opens its writer
  with ``purge_step=N + 1``: TensorBoard's readers then drop what an earlier process logged after that
  checkpoint (the steps a stop or a kill made it recompute), so every step has one value. A fresh start uses
  ``purge_step=0``: nothing of an earlier timeline in that directory is shown.
* **Weights & Biases**: ``wandb.init(id=..., resume="allow", dir=save_dir)``. The id is made when a run starts
  fresh and kept in ``save_dir/wandb.json``; every process that resumes from a checkpoint of that run reuses it,
  so a requeued job appends to the same W&B run. W&B drops a step lower than the run's latest (the steps a
  killed process had logged after its last checkpoint and its successor recomputes: the same values, since the
  resume is exact); they are not sent again. A stop marks the W&B run preempting before it finishes with the
  stop's exit code. In offline mode (``WANDB_MODE=offline``) each process writes ``save_dir/wandb/offline-run-*``
  with the same id, which ``wandb sync`` uploads as one run.

A logger is secondary to the training: one that fails to open or to log is reported once (a warning naming it
and the error) and left out for the rest of the process; the run goes on. A logger of your own is any object with
``open(save_dir, first_step, resumed)``, ``log(step, metrics)`` and ``close(exit_code, preempted)``.

Limit: a resume request that starts a new timeline inside the same save_dir (``resume="best"``, a step) keeps the
W&B run, which then drops the new timeline's steps up to the old one's last; TensorBoard purges the old
timeline's steps after the branch point as after any resume. Give such a run its own W&B run by deleting
``save_dir/wandb.json`` first.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import stat
import string
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .. import _log
from ..checkpoint import commit, safe_io

log = _log.log
WANDB_ID_FILE = "wandb.json"
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")


class TensorBoard:
    """Scalars into TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``).

    Args:
        log_dir: Where the event files go; default ``save_dir/tensorboard``. One directory per run: another run's
            events in it would be purged by this one's restarts.
        flush_secs: How often the writer flushes to disk (SummaryWriter's own default is 120 s).
    """

    name = "tensorboard"
    package = "tensorboard"

    def __init__(self, log_dir: str | os.PathLike[str] | None = None, *, flush_secs: int = 30) -> None:
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.flush_secs = flush_secs
        self.writer: Any = None

    def open(self, save_dir: Path, first_step: int, resumed: bool) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = self.log_dir if self.log_dir is not None else _own_dir(save_dir / "tensorboard")
        self.writer = SummaryWriter(str(log_dir), purge_step=first_step, flush_secs=self.flush_secs)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self, exit_code: int | None, preempted: bool) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandB:
    """Metrics into a Weights & Biases run whose id is kept in ``save_dir/wandb.json`` (module docstring).

    Args:
        project: The W&B project (default: W&B's, from ``WANDB_PROJECT``).
        dir: Where W&B keeps its files; default ``save_dir`` (``save_dir/wandb/``).
        **init: Further keyword arguments of ``wandb.init`` (``entity``, ``name``, ``config``, ``tags``,
            ``mode``, ``settings``, ...); ``id`` and ``resume`` are the run's own.
    """

    name = "wandb"
    package = "wandb"

    def __init__(self, *, project: str | None = None, dir: str | os.PathLike[str] | None = None, **init: Any) -> None:
        taken = sorted({"id", "resume"} & set(init))
        if taken:
            raise ValueError(f"WandB: {', '.join(taken)} are set by the run (its id is kept in {WANDB_ID_FILE})")
        self.project = project
        self.dir = None if dir is None else Path(dir)
        self.init = init
        self.run: Any = None

    def open(self, save_dir: Path, first_step: int, resumed: bool) -> None:
        import wandb

        run_id = wandb_run_id(save_dir, resumed, new_run_id)
        where = self.dir if self.dir is not None else save_dir
        _own_dir(where / "wandb")
        self.run = wandb.init(id=run_id, resume="allow", project=self.project, dir=str(where), **self.init)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if step >= self.run.step:  # a lower one W&B drops with a warning: what a killed predecessor logged
            self.run.log(dict(metrics), step=step)

    def close(self, exit_code: int | None, preempted: bool) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        if preempted:
            run.mark_preempting()  # stopped to be continued: W&B shows the run preempted, not failed
        run.finish(exit_code=exit_code)


def _own_dir(path: Path) -> Path:
    """``path`` when it is a directory of its own or absent: the package writes there without preempt's checks, so a
    symlink or a file planted in the save_dir under that name is refused (:mod:`preempt.checkpoint.safe_io`)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    if not stat.S_ISDIR(mode):
        raise ValueError(f"{path}: expected a directory, found {safe_io.kind(mode)}")
    return path


def new_run_id() -> str:
    """Eight random lowercase letters and digits, as W&B makes its own run ids."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def wandb_run_id(save_dir: Path, resumed: bool, new_id: Any) -> str:
    """The W&B run id of this run: the one in ``save_dir/wandb.json`` when the process resumed from a checkpoint
    and the file holds one, else ``new_id()``, written there first (atomically).

    Raises:
        ValueError: ``wandb.json`` is not ``{"id": "<1-64 letters, digits, - or _>"}`` (its path, what was
            expected and what was found).
    """
    path = save_dir / WANDB_ID_FILE
    if resumed:
        try:
            doc = safe_io.read_json(path)
        except FileNotFoundError:
            doc = None
        if doc is not None:
            run_id = doc.get("id")
            if not isinstance(run_id, str) or not _ID.match(run_id):
                raise ValueError(
                    f'{path}: expected {{"id": "<1-64 letters, digits, - or _>"}}, found id'
                    f" {safe_io.printable(repr(run_id))[:80]}; delete the file to start a new W&B run"
                )
            return run_id
    run_id = str(new_id())
    commit.write_atomic(path, [json.dumps({"id": run_id}).encode() + b"\n"])
    return run_id


KNOWN = {"tensorboard": TensorBoard, "wandb": WandB}


def checked(loggers: Iterable[Any] | None) -> tuple[Any, ...]:
    """``loggers=`` as logger objects: names made into :class:`TensorBoard` or :class:`WandB`, objects kept.

    Raises:
        ValueError: A name that is not ``"tensorboard"`` or ``"wandb"``, an object without ``open``, ``log`` and
            ``close``, or one listed twice.
        ImportError: A logger's package is not installed (with the command that installs it).
    """
    if loggers is None:
        return ()
    if isinstance(loggers, (str, bytes)) or not isinstance(loggers, Iterable):
        loggers = [loggers]
    out: list[Any] = []
    for item in loggers:
        if isinstance(item, str):
            factory = KNOWN.get(item.lower())
            if factory is None:
                raise ValueError(
                    f"loggers: expected 'tensorboard', 'wandb' or a logger object, got {safe_io.printable(repr(item))}"
                )
            item = factory()
        missing = [m for m in ("open", "log", "close") if not callable(getattr(item, m, None))]
        if missing:
            has_not = ", ".join(f"{m}()" for m in missing)
            raise ValueError(f"loggers: {safe_io.printable(repr(item))} has no {has_not}: expected a logger object")
        package = getattr(item, "package", None)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ImportError(
                f"loggers: {getattr(item, 'name', package)} needs the {package} package, which is not installed:"
                f" pip install 'preempt-torch[{package}]'"
            )
        out.append(item)
    names: list[str] = [n for i in out if (n := getattr(i, "name", None)) is not None]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"loggers: {', '.join(twice)} listed twice")
    return tuple(out)


class Loggers:
    """The run's loggers, opened at the start and closed at the end; failures are said once, never raised."""

    def __init__(self, loggers: Iterable[Any]) -> None:
        self.loggers = list(loggers)

    def open(self, save_dir: Path, step: int, resumed: bool) -> None:
        """Opens each logger; the first step this process can log is ``step + 1`` resumed, else 0."""
        first = step + 1 if resumed else 0
        for logger in list(self.loggers):
            self._call(logger, "open", save_dir, first, resumed)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if not metrics:
            return
        for logger in list(self.loggers):
            self._call(logger, "log", step, metrics)

    def close(self, exit_code: int | None = None, preempted: bool = False) -> None:
        """Closes each logger with how the process ends (``exit_code`` None: not known)."""
        for logger in list(self.loggers):
            self._call(logger, "close", exit_code, preempted)
        self.loggers = []

    def _call(self, logger: Any, what: str, *args: Any) -> None:
        try:
            getattr(logger, what)(*args)
        except Exception as e:  # a logger never stops the training
            name = getattr(logger, "name", type(logger).__name__)
            log.warning("logger %s: %s failed (%s: %s); left out from now on", name, what, type(e).__name__, e)
            self.loggers.remove(logger)
