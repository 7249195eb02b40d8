"""The test seam: every fault point of preempt, by name, and the hook a test installs there.

Production code marks a point with :func:`reach`; a test, or a training script of the test suite, installs a hook
with :func:`install` (or :func:`installed`, for a block) and makes the point fail, wait or count. With no hook
installed, reaching a point is one dictionary lookup. The points, and what their hooks are called with:

- ``"commit"``: each stage of the commit protocol (:data:`preempt.checkpoint.commit.STAGES`): the stage's name and
  the event that cancels this write (None outside a cancellable background write). A hook may raise (a failed
  write at that stage) or wait on the event (until the run cancels the write).
- ``"write"``: before the background writer writes a checkpoint's files (:meth:`CheckpointManager.save_into`): the
  checkpoint's temporary directory. An ``OSError`` raised here is a failed write.
- ``"load"``: before a checkpoint file is read and verified on load: its path.
- ``"upload"``: each stage of a mirror upload (:data:`preempt.mirror.uploader.STAGES`): the stage's name and the step.

No torch; a leaf every part may import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

Hook = Callable[..., None]
POINTS = ("commit", "write", "load", "upload")
_hooks: dict[str, Hook] = {}


def reach(point: str, *args: Any) -> None:
    """Marks ``point`` (one of :data:`POINTS`); calls its hook with ``args``, if one is installed."""
    hook = _hooks.get(point)
    if hook is not None:
        hook(*args)


def install(point: str, hook: Hook | None) -> None:
    """Installs ``hook`` at ``point``, or with None removes it.

    Raises:
        ValueError: ``point`` is not one of :data:`POINTS`.
    """
    if point not in POINTS:
        raise ValueError(f"fault point {point!r}: expected one of {', '.join(POINTS)}")
    if hook is None:
        _hooks.pop(point, None)
    else:
        _hooks[point] = hook


@contextlib.contextmanager
def installed(point: str, hook: Hook) -> Iterator[None]:
    """``hook`` at ``point`` within the block."""
    install(point, hook)
    try:
        yield
    finally:
        install(point, None)
