"""Cancelling a write before its rename: an event per writing thread, looked at while the bytes go out.

A background write runs under :func:`cancellable`; :func:`check_cancelled` is called by the hashed writes every
:data:`preempt.checkpoint.hashed_io.WRITE_CHUNK` bytes and by the commit protocol at each stage before the rename
(:func:`preempt.checkpoint.commit.stage`). After the rename the checkpoint is committed and the write completes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class WriteCancelled(Exception):
    """A write under :func:`cancellable` was cancelled before its rename; its directory is recycled or removed."""


_cancel = threading.local()


@contextlib.contextmanager
def cancellable(event: threading.Event) -> Iterator[None]:
    """Within the block, this thread's writes stop with :class:`WriteCancelled` once ``event`` is set.

    They look at every 64 MiB written and at each stage before the rename; after the rename the checkpoint
    is committed and the write completes.
    """
    _cancel.event = event
    try:
        yield
    finally:
        _cancel.event = None


def cancel_event() -> threading.Event | None:
    """The event that cancels this thread's write (None outside :func:`cancellable`)."""
    return getattr(_cancel, "event", None)


def check_cancelled() -> None:
    event = cancel_event()
    if event is not None and event.is_set():
        raise WriteCancelled("the write was cancelled")
