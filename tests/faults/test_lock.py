"""One writer per save_dir: a second run fails fast naming the holder; a dead holder's lock is taken over."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import PREEMPTED, Spawned, train_cmd

from preempt import CheckpointManager, PreemptibleRun
from preempt.checkpoint.lock import LOCK, STALE_AFTER_S, DirLock, LockedError

SLOW = ["--epochs", "3", "--samples", "128", "--step_sleep", "0.2"]  # 24 steps, ~5 s: outlasts a second start


def test_a_second_process_fails_fast_naming_the_holder_and_the_first_goes_on(tmp_path):
    """The first run is long (200 steps, ~40 s) and is stopped by SIGTERM once the second has failed: however slow
    the second's start (under load it once outlasted a 5-second first run, which completed first), the first still
    holds the lock when the second looks."""
    save_dir = tmp_path / "run"
    first = Spawned(train_cmd(save_dir, None, [*SLOW, "--epochs", "25"]))
    assert first.wait_event("step", step=2), first.output
    t0 = time.monotonic()
    second = Spawned(train_cmd(save_dir, None, SLOW))
    assert second.finish() == 1, second.output
    waited = time.monotonic() - t0
    host = socket.gethostname()
    assert f"{save_dir} is in use by pid {first.proc.pid} on host {host} since " in second.output, second.output
    assert "ago), training (lock file" in second.output
    assert "^step" not in second.output
    assert first.proc.poll() is None, first.output  # the first went on
    first.signal(signal.SIGTERM)
    assert first.finish() == PREEMPTED, first.output
    assert (save_dir / LOCK).read_bytes() == b"", "the first released the lock as it left"
    print(f"the second process gave up after {waited:.2f} s (most of it starting Python and torch)")


def hold_lock(save_dir: Path, purpose: str = "other job") -> subprocess.Popen:
    """A real second process that holds ``save_dir``'s lock until its stdin closes (it says ``held`` first)."""
    code = (
        "import sys; from preempt.checkpoint.lock import DirLock; "
        f"l = DirLock({str(save_dir)!r}, purpose={purpose!r}); l.acquire(); print('held', flush=True); sys.stdin.read()"
    )
    save_dir.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_a_save_dir_held_by_another_process_ends_the_script_with_one_line_and_exit_1(tmp_path):
    """The script raising out of PreemptibleRun(...) shows LockedError's message on one line, no
    traceback, exit status 1 (before: a traceback around the message)."""
    save_dir = tmp_path / "run"
    holder = hold_lock(save_dir)
    try:
        second = Spawned(train_cmd(save_dir, None, SLOW))
        assert second.finish() == 1, second.output
    finally:
        holder.communicate("")  # stdin closed: the holder lets go and exits
    errors = [line for line in second.output.splitlines() if line.startswith("[preempt] error: ")]
    assert len(errors) == 1, second.output
    assert f"{save_dir} is in use by pid {holder.pid} on host {socket.gethostname()} since " in errors[0]
    assert "other job (lock file" in errors[0] and errors[0].endswith("or give this run another save_dir.")
    assert "Traceback" not in second.output and "LockedError" not in second.output, second.output
    assert not list(save_dir.glob("step_*")) and not (save_dir / "train.log").exists(), "the second wrote nothing"


def test_a_locked_error_caught_by_the_script_is_an_ordinary_exception(tmp_path):
    """Only an uncaught LockedError is shown plainly: a script that catches it (``from preempt import
    LockedError``) gets it with its holder, and its own exit."""
    save_dir = tmp_path / "run"
    holder = hold_lock(save_dir, purpose="caught")
    code = (
        "import sys, torch; from preempt import LockedError, PreemptibleRun\n"
        "try:\n"
        f"    with PreemptibleRun({str(save_dir)!r}, model=torch.nn.Linear(2, 2)):\n"
        "        pass\n"
        "except LockedError as e:\n"
        "    print('caught', e.holder['purpose'], flush=True)\n"
        "    sys.exit(3)\n"
    )
    try:
        p = Spawned([sys.executable, "-c", code])
        assert p.finish() == 3, p.output
    finally:
        holder.communicate("")
    assert "caught caught" in p.output and "[preempt] error:" not in p.output, p.output


@pytest.mark.parametrize("mode", ["background", "sync"])
def test_a_save_dir_deleted_and_made_again_stops_the_orphan_and_the_new_run_keeps_its_files(tmp_path, mode):
    """A process still training in a save_dir that was deleted and made again under it (an orphan of a
    cancelled job), while a new run uses the new directory: at its next checkpoint the orphan finds that the
    directory and lock file are not the ones it locked, writes nothing there and ends with one line (exit 1);
    the new run's files are untouched and it completes. Before: the orphan's checkpoint was written into the new
    run's directory and refused only at the rename, and the orphan trained on.

    The orphan is SIGKILLed if it ever reaches the manifest of a third checkpoint (``--signal_at``): a checkpoint
    written that far into the new run's directory would be left there, and the orphan's exit would be -9."""
    save_dir, gate_a, gate_b = tmp_path / "run", tmp_path / "go_a", tmp_path / "go_b"
    args = ["--epochs", "2", "--samples", "128", "--every_steps", "2", "--keep_last", "2"]
    # each process waits inside its step 5 with no write in flight (settled) and no pool written ahead (no recycling)
    quiet = ["--no_recycle", "--settle_at", "step:5"]
    orphan_args = [*quiet, "--wait_file_at", f"step:5:{gate_a}", "--signal_at", "before_manifest:3:KILL"]
    if mode == "sync":
        orphan_args.append("--sync_save")
    orphan = Spawned(train_cmd(save_dir, None, [*args, *orphan_args]))
    assert orphan.wait_event("waiting", point="step", n=5), orphan.output
    assert list(save_dir.glob("step_*")), orphan.output
    shutil.rmtree(save_dir)  # deleted; the new run's start makes it again
    new = Spawned(train_cmd(save_dir, None, [*args, *quiet, "--wait_file_at", f"step:5:{gate_b}"]))
    assert new.wait_event("waiting", point="step", n=5), new.output
    before = {p.name: p.stat().st_ino for p in save_dir.iterdir()}
    gate_a.touch()  # the orphan goes on, to its next checkpoint
    assert orphan.finish() == 1, orphan.output
    after_orphan = {p.name: p.stat().st_ino for p in save_dir.iterdir()}
    gate_b.touch()
    assert new.finish() == 0, new.output
    errors = [line for line in orphan.output.splitlines() if line.startswith("[preempt] error: ")]
    assert len(errors) == 1, orphan.output
    assert f"{save_dir} was replaced under this run (it locked directory inode " in errors[0], errors[0]
    assert f"{save_dir / LOCK} names pid {new.proc.pid} on host " in errors[0], errors[0]
    assert "Traceback" not in orphan.output and "done" not in orphan.output.splitlines(), orphan.output
    if mode == "sync":  # the checkpoint of step 6 is refused before its first file; a background one at a later step
        assert max(e["step"] for e in orphan.events_of("step")) == 6, orphan.events
    assert after_orphan == before, "the orphan wrote, removed or replaced something in the new run's directory"
    assert "resumed from" not in new.output, new.output  # the new run started fresh in the new directory
    manager = CheckpointManager(save_dir, owner=False)
    found = manager.list()
    assert found[0].step == 16 and all(c.status == "valid" for c in found), found
    assert all(manager.verify(c) == [] for c in found)


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path):
    save_dir = tmp_path / "run"
    first = Spawned(train_cmd(save_dir, None, [*SLOW, "--every_steps", "2"]))
    assert first.wait_event("step", step=5), first.output
    first.signal(signal.SIGKILL)
    assert first.finish() == -signal.SIGKILL
    assert str(first.proc.pid) in (save_dir / LOCK).read_text(), "the dead holder's details stay in the file"
    rerun = Spawned(train_cmd(save_dir, None, SLOW))
    assert rerun.finish() == 0, rerun.output
    assert f"took over the lock left by pid {first.proc.pid} on host {socket.gethostname()}" in rerun.output
    assert "resumed from" in rerun.output
    assert (save_dir / LOCK).read_bytes() == b"", "a clean exit leaves the lock file empty"


def test_two_runs_in_one_process(tmp_path):
    """POSIX locks do not see a second lock from the same process: the registry does."""
    model = torch.nn.Linear(2, 2)
    with PreemptibleRun(tmp_path, model=model, checkpoint_interval=None):
        with pytest.raises(LockedError, match=r"in use by pid \d+ .*training \(in this same process\)"):
            with PreemptibleRun(tmp_path, model=model, checkpoint_interval=None):
                pass
        assert DirLock(tmp_path).path.read_bytes(), "the failed attempt must not drop the first run's lock"
    with DirLock(tmp_path, purpose="after"):  # released: free again
        pass


def test_lock_timeout_waits_for_the_holder(tmp_path):
    holder = DirLock(tmp_path, purpose="holder")
    holder.acquire()
    threading.Timer(0.3, holder.release).start()
    with pytest.raises(LockedError):
        DirLock(tmp_path, timeout=0.0).acquire()
    waiter = DirLock(tmp_path, timeout=10.0)
    waiter.acquire()
    assert waiter.held
    waiter.release()


def test_lock_held_by_another_process_seen_from_here(tmp_path):
    code = (
        "import sys, time; from preempt.checkpoint.lock import DirLock; "
        f"l = DirLock({str(tmp_path)!r}, purpose='other job'); l.acquire(); print('held', flush=True); time.sleep(30)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        with pytest.raises(LockedError) as e:
            DirLock(tmp_path).acquire()
        assert e.value.holder["pid"] == p.pid and e.value.holder["purpose"] == "other job"
    finally:
        p.kill()
        p.wait()
    with DirLock(tmp_path) as lock:  # the kernel dropped the dead process's lock
        assert lock.previous["pid"] == p.pid


# ---------------------------------------------------- filesystems without record locks


def write_holder(d: Path, **holder) -> None:
    import json

    (d / LOCK).write_text(json.dumps(holder))


def test_fallback_refuses_a_live_holder_on_this_host(tmp_path):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        write_holder(tmp_path, pid=sleeper.pid, host=socket.gethostname(), since=time.time(), purpose="x")
        with pytest.raises(LockedError, match=rf"pid {sleeper.pid} on host"):
            DirLock(tmp_path, use_record_locks=False).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_fallback_takes_over_from_a_dead_holder_on_this_host(tmp_path, caplog):
    gone = subprocess.Popen(["true"])
    gone.wait()
    write_holder(tmp_path, pid=gone.pid, host=socket.gethostname(), since=time.time() - 60)
    with caplog.at_level(logging.WARNING, logger="preempt"):
        lock = DirLock(tmp_path, use_record_locks=False)
        lock.acquire()
    assert f"took over the lock left by pid {gone.pid}" in caplog.text
    assert lock._heartbeat is not None and lock._heartbeat.is_alive()
    lock.release()
    assert (tmp_path / LOCK).read_bytes() == b""


def test_fallback_a_reused_pid_is_not_the_holder(tmp_path):
    """Same pid, different start time: the pid was reused by an unrelated process; the lock is free."""
    write_holder(tmp_path, pid=os.getppid(), host=socket.gethostname(), since=time.time(), start=1)
    with DirLock(tmp_path, use_record_locks=False):
        pass


def test_fallback_another_host_fresh_then_stale(tmp_path):
    write_holder(tmp_path, pid=1234, host="node-elsewhere", since=time.time())
    with pytest.raises(LockedError, match="pid 1234 on host node-elsewhere"):
        DirLock(tmp_path, use_record_locks=False).acquire()
    old = time.time() - STALE_AFTER_S - 5
    os.utime(tmp_path / LOCK, (old, old))  # no heartbeat for longer than STALE_AFTER_S
    with DirLock(tmp_path, use_record_locks=False) as lock:
        assert lock.previous["host"] == "node-elsewhere"


def test_bad_timeout(tmp_path):
    with pytest.raises(ValueError, match="lock_timeout: expected seconds >= 0, got -1"):
        PreemptibleRun(tmp_path, lock_timeout=-1)
