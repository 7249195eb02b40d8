"""When a process started (``preempt.run.reporting.process_start``, the ``proc_start`` of history.jsonl's start and
resume markers): to the clock's tick, not to the boot time's whole second, so that ``preempt report`` can tell a
process's start-up from the time between processes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from preempt.run.reporting import process_start

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CLOCK_BOOTTIME and the ticks are Linux's")
TICK = 0.01  # a clock tick (USER_HZ) is 10 ms on Linux: the start is known to one tick, and the wall clock read twice


def test_a_process_started_now_says_it_started_now():
    before = time.time()
    code = "from preempt.run.reporting import process_start; print(repr(process_start()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    after = time.time()
    started = float(out)
    assert before - 2 * TICK <= started <= after, (before, started, after)


def test_this_process_started_before_now_and_says_so_alike_each_time():
    first = process_start()
    assert first is not None and first < time.time()
    assert process_start() == pytest.approx(first, abs=2 * TICK)
