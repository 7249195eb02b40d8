"""Deleting directory trees: at once (:func:`remove_tree`) or by a background thread (:class:`Deleter`).

A pruned, replaced or leftover checkpoint is first renamed out of sight by the protocol
(:func:`preempt.checkpoint.commit.trash`); deleting a large tree is slow, so the run hands it to the deleter and
goes on. A failed deletion costs disk space, never data.
"""

from __future__ import annotations

import logging
import queue
import shutil
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def remove_tree(path: Path) -> None:
    """Deletes a directory tree; a file or an already-missing path is fine too."""
    if path.is_dir() and not path.is_symlink():

        def gone_already(func: Any, p: str, exc: Any) -> None:
            # Another process may be cleaning the same leftover (a run that starts while its
            # predecessor's deleter is still busy): what is gone is gone.
            err = exc if isinstance(exc, BaseException) else exc[1]
            if not isinstance(err, FileNotFoundError):
                raise err

        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=gone_already)
        else:
            shutil.rmtree(path, onerror=gone_already)
    else:
        path.unlink(missing_ok=True)


class Deleter:
    """A named daemon thread that deletes directory trees handed to it.

    Failures are logged and kept in :attr:`errors` (a failed deletion costs
    disk space, never data, so it does not stop training).
    """

    def __init__(self) -> None:
        self._queue: queue.Queue[Path | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    def submit(self, paths: Iterable[Path]) -> None:
        for p in paths:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="preempt-deleter", daemon=True)
                self._thread.start()
            self._queue.put(p)

    def _run(self) -> None:
        while (path := self._queue.get()) is not None:
            try:
                remove_tree(path)
            except OSError as e:
                self.errors.append(f"{path}: {e}")
                logging.getLogger("preempt").warning("could not delete %s: %s", path, e)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def close(self, timeout: float | None = None) -> bool:
        """Lets the thread finish what it was given, then end; False if it is still busy after ``timeout``.

        A thread still deleting when the process exits dies with it (it is a
        daemon); the leftover ``.trash-`` directories are deleted at the next start.
        """
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        self._queue.put(None)
        thread.join(timeout)
        return not thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until every submitted path is gone; False on timeout."""
        if self._thread is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True
