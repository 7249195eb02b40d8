"""The lock's pure check of what a run locked against what the paths name now, and how an uncaught LockedError
ends a process. No threads, no sleeps; the hook is called as Python would call it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import preempt
from preempt.checkpoint.lock import DirLock, replaced
from preempt.errors import LockedError, LockLostError, PreemptError

LOCKED = {"dir": [2049, 100], "lock": (2049, 101)}
LOCK = Path("/runs/x/lock")


def test_the_same_directory_and_lock_file_is_no_problem():
    assert replaced(LOCK, LOCKED, {"dir": [2049, 100], "lock": (2049, 101)}) is None


def test_a_directory_made_again_is_named_with_both_identities():
    problem = replaced(LOCK, LOCKED, {"dir": [2049, 300], "lock": (2049, 301)})
    assert problem == (
        "/runs/x was replaced under this run (it locked directory inode 100 on device 2049 and lock file inode 101"
        " on device 2049; the path names directory inode 300 on device 2049 with lock file inode 301 on device 2049"
        " now)"
    )


def test_a_directory_made_again_without_a_lock_file_yet():
    problem = replaced(LOCK, LOCKED, {"dir": [2049, 300], "lock": None})
    assert problem is not None and problem.endswith("directory inode 300 on device 2049 with no lock file now)")


def test_the_same_directory_with_its_lock_file_replaced_or_removed():
    assert "with lock file inode 555 on device 2049 now" in str(
        replaced(LOCK, LOCKED, {"dir": [2049, 100], "lock": (2049, 555)})
    )
    assert "with no lock file now" in str(replaced(LOCK, LOCKED, {"dir": [2049, 100], "lock": None}))


def test_a_directory_moved_to_another_device_differs_by_its_device():
    assert replaced(LOCK, LOCKED, {"dir": [2050, 100], "lock": (2050, 101)}) is not None


def test_a_removed_directory():
    problem = replaced(LOCK, LOCKED, {"dir": None, "lock": None})
    assert problem == (
        "/runs/x was removed under this run (it locked directory inode 100 on device 2049 and lock file inode 101"
        " on device 2049; nothing has that name now)"
    )


def test_check_of_a_held_lock_sees_its_directory_made_again(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    lock = DirLock(d)
    lock.acquire()
    try:
        lock.check()  # untouched: nothing to say
        (d / "lock").rename(tmp_path / "elsewhere")
        d.rmdir()
        d.mkdir()
        with pytest.raises(LockLostError) as e:
            lock.check()
        assert e.value.expected["dir"] != e.value.found["dir"] and e.value.found["lock"] is None
        assert str(e.value).startswith(f"{d} was replaced under this run (it locked directory inode ")
        assert "writes nothing more there" in str(e.value)
    finally:
        lock.release()


def test_the_errors_are_exported_and_ordinary_exceptions():
    assert preempt.LockedError is LockedError and preempt.LockLostError is LockLostError
    assert {"LockedError", "LockLostError"} <= set(preempt.__all__)
    assert issubclass(LockLostError, LockedError) and issubclass(LockedError, PreemptError)
    assert issubclass(LockedError, Exception)  # `except Exception` sees it; not a SystemExit


def test_an_uncaught_locked_error_is_one_line_on_stderr(capsys, monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)  # as in a fresh process
    error = LockedError("runs/x is in use by pid 7 on host n1\nsince yesterday", {"pid": 7})  # installs the hook
    assert sys.excepthook is not sys.__excepthook__
    sys.excepthook(LockedError, error, None)
    assert capsys.readouterr().err == "[preempt] error: runs/x is in use by pid 7 on host n1 since yesterday\n"


def test_an_uncaught_unreadable_checkpoint_is_one_line_on_stderr_too(capsys, monkeypatch):
    """A checkpoint that cannot be read (permission, memory, I/O) ended the run in a traceback, where a locked
    save_dir gets one clear line; its message names the path and the cause, which is the whole story too."""
    from preempt.errors import CheckpointUnreadableError

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    error = CheckpointUnreadableError("runs/x/step_000000002/model.safetensors: Permission denied (EACCES)")
    sys.excepthook(CheckpointUnreadableError, error, None)
    said = capsys.readouterr().err
    assert said == "[preempt] error: runs/x/step_000000002/model.safetensors: Permission denied (EACCES)\n"


def test_other_uncaught_errors_go_to_the_hook_that_was_there(capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(value))
    LockedError("made once: installs the hook, chained")
    other = ValueError("not ours")
    sys.excepthook(ValueError, other, None)
    assert seen == [other] and capsys.readouterr().err == ""
