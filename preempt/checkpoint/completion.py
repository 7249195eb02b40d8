"""The completion marker, ``complete.json``: what it records and when it is believed.

A run that finishes writes the marker naming its final checkpoint; a rerun
that finds it believed exits at once (exit code 0) instead of training. The
marker is not signed, so a stale one (copied from another run, left from an
abandoned timeline) or a forged one would make a rerun say "complete"
without training. It is believed only when it names a checkpoint that is
there and valid, by name, step and the time that checkpoint's manifest records
it was created: the identity of the checkpoint it was written for (a
checkpoint of another run or timeline at the same step was created at
another time; the manifest's checksum would do too, but it changes when a
tool rewrites the manifest of the same checkpoint). A marker that
is not believed is reported and ignored; the run resumes from its newest
valid checkpoint, and one that was truly complete finds itself at the end
and writes the marker again. The run also reads and checks the content of the
checkpoint the marker names before it believes it (``Starter.completed`` in
:mod:`preempt.run.restore`); this module decides from the manifests alone, as
the commands that never import torch do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from . import safe_io
from .manifest import Manifest


class CheckpointInfo(Protocol):
    """What this module reads of a :class:`~preempt.checkpoint.manager.CheckpointInfo` (which imports it)."""

    @property
    def name(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def status(self) -> str: ...
    @property
    def manifest(self) -> Manifest | None: ...
    @property
    def problem(self) -> str | None: ...


def record(info: CheckpointInfo, completed: float) -> dict[str, Any]:
    """The marker for a run that finished with checkpoint ``info`` at unix time ``completed``."""
    m = info.manifest
    return {
        "checkpoint": info.name,
        "step": info.step,
        "epoch": m.cursor.epoch if m else None,
        "checkpoint_created": m.created if m else None,
        "completed": completed,
    }


def read(path: Path, infos: Callable[[], Sequence[CheckpointInfo]]) -> tuple[dict[str, Any] | None, str | None]:
    """The marker at ``path`` and None when it is believed; else None and why not (None, None: there is none).

    ``infos``: the save_dir's checkpoints, listed only when there is a marker to judge. A marker that is not a
    small regular file holding a JSON object (a symlink, a FIFO, deep or broken JSON) is not ours.
    """
    try:
        doc = safe_io.read_json(path, safe_io.SMALL)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        text = safe_io.describe_error(path, e) if isinstance(e, OSError) else str(e)
        return None, f"{text}; not a completion marker of ours: ignored"
    why = problem(doc, infos())
    if why is None:
        return doc, None
    return None, f"{path}: {why}; not believed: a rerun goes on from the newest valid checkpoint"


def problem(doc: Any, infos: Sequence[CheckpointInfo]) -> str | None:
    """Why the marker ``doc`` is not believed (None: it is), given the save_dir's checkpoints (``infos``)."""
    if not isinstance(doc, dict):
        return f"expected an object, found {type(doc).__name__}"
    name, step, created = doc.get("checkpoint"), doc.get("step"), doc.get("checkpoint_created")
    if not (isinstance(name, str) and type(step) is int and isinstance(created, float)):
        return (
            "expected the checkpoint's name, step and creation time (as a run writes them), found"
            f" checkpoint={_short(name)}, step={_short(step)}, checkpoint_created={_short(created)}"
        )
    info = next((c for c in infos if c.name == name), None)
    if info is None:
        return f"names {_short(name)}, which is not there"
    if info.status != "valid" or info.manifest is None:
        return f"names {name}, which is {info.status}: {info.problem}"
    if info.step != step:
        return f"names {name} at step {step}, but that checkpoint is of step {info.step}"
    if info.manifest.created != created:
        return f"names {name} created at {created!r}, but that checkpoint was created at {info.manifest.created!r}"
    return None


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
