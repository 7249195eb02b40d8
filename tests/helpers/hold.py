"""A loop held inside a step until its run has been asked to stop, for the tests that train in their own process
(the training scripts of ``tests/scripts/`` hold with ``train.wait_for_stop``, the same loop)."""

from __future__ import annotations

import json
import time
from typing import Any

HOLD_LIMIT_S = 60.0  # a hold that nothing releases ends here, and the test that set it fails on what follows


def wait_for_stop(run: Any, limit_s: float = HOLD_LIMIT_S) -> None:
    """Returns once ``run.stop_requested`` (a signal, a notice, a request), at most ``limit_s``: the state is reached
    by the stop itself; the short polls only let another thread or the signal handler run."""
    deadline = time.monotonic() + limit_s
    while not run.stop_requested and time.monotonic() < deadline:
        time.sleep(0.005)


def stop_marker(save_dir: Any) -> dict[str, Any]:
    """The one ``stop`` line of a run's ``history.jsonl``."""
    lines = [json.loads(x) for x in (save_dir / "history.jsonl").read_text().splitlines()]
    (stop,) = [d for d in lines if d.get("event") == "stop"]
    return stop
