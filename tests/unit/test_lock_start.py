"""A lock judged by its content (a filesystem without record locks): a holder on this host is the same process only
if its start, in clock ticks after boot, is the one the lock file says. The start is read with psutil and written as
every earlier version wrote it (``/proc/<pid>/stat``'s ``starttime``), so a lock file of either version is judged
alike by the other."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from preempt.checkpoint.lock import LOCK, DirLock
from preempt.errors import LockedError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the start's ticks are Linux's /proc")


def proc_starttime(pid: int) -> int:
    """``starttime`` of ``/proc/<pid>/stat`` (field 22), read as the earlier versions read it."""
    raw = Path(f"/proc/{pid}/stat").read_bytes()
    return int(raw[raw.rindex(b")") + 2 :].split()[19])


@pytest.fixture
def sleeper():
    """A live process for as long as the test holds it (``cat`` waits on a pipe only the test writes)."""
    p = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    yield p
    p.kill()
    p.wait()
    p.stdin.close()


def hold(d: Path, pid: int, start: int | None) -> None:
    holder = {"pid": pid, "host": socket.gethostname(), "since": time.time(), "purpose": "training", "start": start}
    (d / LOCK).write_text(json.dumps(holder))


def test_a_live_holder_whose_start_an_earlier_version_wrote_keeps_the_lock(tmp_path, sleeper):
    hold(tmp_path, sleeper.pid, proc_starttime(sleeper.pid))
    with pytest.raises(LockedError, match=rf"pid {sleeper.pid} on host"):
        DirLock(tmp_path, use_record_locks=False).acquire()


def test_the_same_pid_started_at_another_tick_is_a_reused_pid_and_the_lock_is_free(tmp_path, sleeper):
    hold(tmp_path, sleeper.pid, proc_starttime(sleeper.pid) + 1)
    with DirLock(tmp_path, use_record_locks=False) as lock:
        assert lock.previous["pid"] == sleeper.pid


def test_the_start_written_is_the_one_an_earlier_version_reads(tmp_path):
    with DirLock(tmp_path, use_record_locks=False):
        written = json.loads((tmp_path / LOCK).read_text())
    assert written["pid"] == os.getpid() and written["start"] == proc_starttime(os.getpid())
