"""A loop held inside a step until its run has been asked to stop, for the tests that train in their own process
(the training scripts of ``tests/scripts/`` hold with ``train.wait_for_stop``, the same loop)."""

from __future__ import annotations

import time
from typing import Any

HOLD_LIMIT_S = 60.0  # a hold that nothing releases ends here, and the test that set it fails on what follows


def wait_for_stop(run: Any, limit_s: float = HOLD_LIMIT_S) -> None:
    """Returns once ``run.stop_requested`` (a signal, a notice, a request), at most ``limit_s``: the state is reached
    by the stop itself; the short polls only let another thread or the signal handler run."""
    deadline = time.monotonic() + limit_s
    while not run.stop_requested and time.monotonic() < deadline:
        time.sleep(0.005)

