"""Where a run starts: fresh, continuing its own timeline, or a new timeline from a requested checkpoint.

Pure: the run lists its checkpoints and asks. A resume request other than
plain ``"latest"`` (``"best"``, a step, another save_dir or checkpoint,
``weights_only``) is applied once: the checkpoints written after it record the
request in their lineage, and a rerun that finds it there continues that
timeline instead of branching again.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from ..checkpoint.names import MANIFEST, parse_checkpoint_name
from ..errors import NoCheckpointError

NO_CHECKPOINT = object()  # the save_dir holds no valid checkpoint


@dataclasses.dataclass(frozen=True)
class StartPlan:
    """``fresh``: no state loaded (``supersede``: move existing checkpoints aside); ``latest``: continue the
    newest checkpoint (a branch when it turns out not to follow ``request``); ``branch``: apply ``request``."""

    kind: str
    request: dict[str, Any] | None = None
    supersede: bool = False


def request_of(resume: Any, weights_only: bool) -> dict[str, Any] | None:
    """The resume request as recorded in lineage; None for plain "latest"."""
    if resume == "latest" and not weights_only:
        return None
    target: Any = resume
    if isinstance(target, (str, os.PathLike)) and target not in ("latest", "best"):
        target = str(Path(target).resolve())
    return {"resume": target, "weights_only": weights_only}


def plan_start(*, fresh: bool, request: dict[str, Any] | None, latest_request: Any = NO_CHECKPOINT) -> StartPlan:
    """Args: fresh: starting over is asked; request: :func:`request_of`; latest_request: the newest valid
    checkpoint's lineage request, or NO_CHECKPOINT."""
    if fresh:
        return StartPlan("fresh", None, supersede=True)
    if request is None or (latest_request is not NO_CHECKPOINT and latest_request == request):
        return StartPlan("latest", request)  # plain "latest", or the requested timeline already exists
    return StartPlan("branch", request)


def is_new_request(request: dict[str, Any] | None, latest_request: Any = NO_CHECKPOINT) -> bool:
    """A resume request that the newest checkpoint does not record yet (a completed run trains again)."""
    return request is not None and (latest_request is NO_CHECKPOINT or latest_request != request)


def request_source(resume: Any, save_dir: Path) -> tuple[Path, Any]:
    """The save_dir to load a request from, and the selector within it.

    Raises:
        NoCheckpointError: The path is neither a save_dir nor a checkpoint directory named step_<N>.
    """
    if resume in ("latest", "best") or isinstance(resume, int):
        return save_dir.resolve(), resume
    path = Path(resume).resolve()
    if (path / MANIFEST).is_file():
        step = parse_checkpoint_name(path.name)
        if step is None:
            raise NoCheckpointError(f"resume={resume!r}: {path} holds a manifest but is not named step_<N>")
        return path.parent, step
    if not path.is_dir():
        raise NoCheckpointError(f"resume={resume!r}: {path} is neither a save_dir nor a checkpoint directory")
    return path, "latest"
