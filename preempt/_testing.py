"""The test seam: every fault point of preempt, by name, the hook a test installs there, and the events a process
tells a test.

Production code marks a point with :func:`reach`; a test, or a training script of the test suite, installs a hook
with :func:`install` (or :func:`installed`, for a block) and makes the point fail, wait or count. With no hook
installed, reaching a point is one dictionary lookup. The points, and what their hooks are called with:

- ``"commit"``: each stage of the commit protocol (:data:`preempt.checkpoint.commit.STAGES`): the stage's name and
  the event that cancels this write (None outside a cancellable background write). A hook may raise (a failed
  write at that stage) or wait on the event (until the run cancels the write).
- ``"write"``: before a process writes its files of a checkpoint: the background writer's
  (:meth:`CheckpointManager.save_into`) and, under torch.distributed, each rank's in the distributed commit
  (:func:`preempt.cluster.distributed.save_ranked`); called with the checkpoint's temporary directory. An ``OSError``
  raised here is a failed write.
- ``"load"``: before a checkpoint file is read and verified on load: its path.
- ``"upload"``: each stage of a mirror upload (:data:`preempt.mirror.uploader.STAGES`): the stage's name and the step.

**Events.** With ``PREEMPT_TEST_EVENTS=1`` in its environment, a process writes each event of its run to its
standard output as one line, ``@preempt-event {"event": KIND, ...}`` (JSON, written whole with one ``write(2)``): every
marker of ``history.jsonl`` (start, resume, checkpoint, stop, complete, error, ...) and a few the history does not
keep (``saving``, ``cancelled``: a background write a stop cancelled, ``checkpoint_failed``: with the step of the
last good checkpoint, ``quarantined``: a checkpoint set aside, its name and the problem, ``loader_resumed``: what a
resumed epoch knows about its loader (:class:`preempt.data.resume_notice.ResumeFacts`), ``direct_write``: a file
written past the page cache, ``best_loaded``: the Trainer's best model loaded at the end, ``mirror_down``,
``mirror_up``). The test suite starts its processes with it and waits and asserts on these events; it reads the
wording of log lines only where a message a user reads is itself what a test is about. The suite's training scripts
emit their own (``holding``, ``waiting``, ``step``, ``eval``, ``reported``, ``epoch_end``, ...) through :func:`emit`
too. Without the variable, :func:`emit` returns at once.

No torch; a leaf every part may import.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

EVENTS_ENV = "PREEMPT_TEST_EVENTS"
EVENT_PREFIX = "@preempt-event "
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


def emit(kind: str, /, **fields: Any) -> None:
    """Writes the event ``kind`` with ``fields`` to standard output, when ``PREEMPT_TEST_EVENTS=1`` (else nothing)."""
    if os.environ.get(EVENTS_ENV) != "1":
        return
    doc = {"event": kind, **fields}
    line = EVENT_PREFIX + json.dumps(doc, separators=(",", ":"), default=str) + "\n"
    try:
        os.write(1, line.encode())  # one write: never interleaved with another thread's line
    except OSError:  # a closed stdout: the test has gone
        pass
