"""Unit tests for preempt.cluster.signals.StopFlag: handlers only record; install/restore are exact.

Every test runs under a fixture that puts back the handlers of all the signals
touched here, so a failing test cannot leave the pytest process with odd handlers.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
from helpers import FakeClock

from preempt.cluster.signals import DEFAULT_SIGNALS, SIGINT_IGNORED, StopFlag, signal_name

TOUCHED = (*DEFAULT_SIGNALS, signal.SIGHUP)


@pytest.fixture(autouse=True)
def _restore_handlers():
    saved = {s: signal.getsignal(s) for s in TOUCHED}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)


def deliver(sig: int) -> None:
    """Sends ``sig`` to this process and lets the main thread run its Python handler."""
    os.kill(os.getpid(), sig)
    for _ in range(3):
        time.sleep(0.001)  # the handler runs at the next bytecode boundary at the latest


def test_signal_name():
    assert signal_name(15) == "SIGTERM"
    assert signal_name(signal.SIGUSR1) == "SIGUSR1"
    assert signal_name(None) == "no signal"
    assert signal_name(9999) == "signal 9999"


def test_request_without_signals():
    """request() records the first stop (signal, time) and counts every later one."""
    clock = FakeClock(100.0, tick=1.0)
    flag = StopFlag(clock=clock)
    assert (flag.requested, flag.signum, flag.received_at, flag.count) == (False, None, None, 0)
    flag.request()
    assert (flag.requested, flag.signum, flag.received_at, flag.count) == (True, None, 101.0, 1)
    flag.request(signal.SIGTERM)
    assert (flag.requested, flag.signum, flag.received_at, flag.count) == (True, None, 101.0, 2)
    assert not flag.installed


def test_first_signal_number_is_kept():
    flag = StopFlag(clock=FakeClock(100.0, tick=1.0))
    flag.request(signal.SIGUSR1)
    flag.request(signal.SIGTERM)
    assert flag.signum == signal.SIGUSR1 and flag.count == 2 and flag.received_at == 101.0


def test_signals_are_validated_and_deduplicated():
    assert StopFlag([signal.SIGTERM, 15, signal.SIGINT]).signals == (signal.SIGTERM, signal.SIGINT)
    assert StopFlag().signals == DEFAULT_SIGNALS
    with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
        StopFlag([signal.SIGTERM, signal.SIGKILL])
    with pytest.raises(ValueError, match="SIGSTOP cannot be caught"):
        StopFlag([signal.SIGSTOP])
    with pytest.raises(ValueError):
        StopFlag([0])
    with pytest.raises(ValueError):
        StopFlag([100000])


def test_sigterm_sets_the_flag():
    before = signal.getsignal(signal.SIGTERM)
    flag = StopFlag(clock=FakeClock(100.0, tick=1.0))
    try:
        assert flag.install() is True
        assert flag.installed
        assert signal.getsignal(signal.SIGTERM) == flag._handle
        deliver(signal.SIGTERM)
        assert flag.requested
        assert flag.signum == signal.SIGTERM
        assert flag.count == 1
        assert flag.received_at is not None
        deliver(signal.SIGTERM)  # a second SIGTERM only counts
        assert flag.count == 2 and flag.signum == signal.SIGTERM
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.usefixtures("sigint_handled")
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT])
def test_each_default_signal_is_recorded(sig):
    flag = StopFlag()
    try:
        flag.install()
        deliver(sig)
        assert flag.requested and flag.signum == sig
    finally:
        flag.restore()


def test_restore_puts_back_sig_dfl():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    flag = StopFlag([signal.SIGTERM, signal.SIGUSR1])
    try:
        flag.install()
        assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    assert not flag.installed


def test_restore_puts_back_a_custom_handler_and_does_not_chain():
    """The previous Python handler is restored exactly, and is not called while the flag is installed."""
    calls = []

    def custom(signum, frame):
        calls.append(signum)

    signal.signal(signal.SIGUSR1, custom)
    flag = StopFlag([signal.SIGUSR1])
    try:
        flag.install()
        deliver(signal.SIGUSR1)
        assert flag.requested
        assert calls == []
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGUSR1) is custom
    deliver(signal.SIGUSR1)
    assert calls == [signal.SIGUSR1]
    assert flag.count == 1  # the restored handler, not the flag, got the second one


def test_restore_puts_back_the_default_sigint_handler():
    signal.signal(signal.SIGINT, signal.default_int_handler)
    flag = StopFlag()
    try:
        flag.install()
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_install_and_restore_are_idempotent():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    flag = StopFlag([signal.SIGTERM])
    try:
        assert flag.install() and flag.install()
        handler = signal.getsignal(signal.SIGTERM)
        assert handler == flag._handle
    finally:
        flag.restore()
        flag.restore()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_only_listed_signals_are_touched():
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    flag = StopFlag([signal.SIGTERM])
    try:
        flag.install()
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
    finally:
        flag.restore()


@pytest.mark.usefixtures("sigint_handled")
def test_second_sigint_raises_keyboard_interrupt():
    flag = StopFlag()
    try:
        flag.install()
        deliver(signal.SIGINT)
        assert flag.requested and flag.count == 1
        with pytest.raises(KeyboardInterrupt):
            deliver(signal.SIGINT)
        assert flag.count == 2
    finally:
        flag.restore()


@pytest.mark.usefixtures("sigint_handled")
def test_sigint_after_sigterm_raises_keyboard_interrupt():
    """Any pending stop makes the next SIGINT an immediate interrupt (Ctrl+C after a scheduler's TERM)."""
    flag = StopFlag()
    try:
        flag.install()
        deliver(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            deliver(signal.SIGINT)
        assert flag.signum == signal.SIGTERM
    finally:
        flag.restore()


@pytest.mark.usefixtures("sigint_handled")
def test_second_sigint_inside_critical_is_only_counted():
    flag = StopFlag()
    try:
        flag.install()
        deliver(signal.SIGINT)
        with flag.critical():
            with flag.critical():
                deliver(signal.SIGINT)
            deliver(signal.SIGINT)  # still inside the outer section
        assert flag.count == 3
        assert flag.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            deliver(signal.SIGINT)  # outside again
        assert flag.count == 4
    finally:
        flag.restore()


def test_critical_section_unwinds_on_error():
    flag = StopFlag()
    with pytest.raises(RuntimeError):
        with flag.critical():
            raise RuntimeError("boom")
    assert flag._critical == 0


@pytest.mark.usefixtures("sigint_handled")  # ignored below; whatever it was is put back after
def test_ignored_sigint_stays_ignored(caplog):
    """A SIGINT ignored by inheritance (``cmd &`` in a script) is kept so, and the install says it once, with how to
    stop the run instead (Ctrl+C is never silently ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    flag = StopFlag()
    try:
        with caplog.at_level(logging.INFO, logger="preempt"):
            assert flag.install()
            assert flag.install()  # already installed: said once
        said = [r.getMessage() for r in caplog.records if "SIGINT is ignored" in r.getMessage()]
        assert said == [SIGINT_IGNORED % os.getpid()] and flag.sigint_ignored
        assert "Ctrl+C does not stop this run" in said[0] and f"kill -TERM {os.getpid()}" in said[0]
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == flag._handle
        deliver(signal.SIGINT)
        assert not flag.requested
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


@pytest.mark.usefixtures("sigint_handled")  # a suite started with & inherits SIGINT ignored (tests/stress.sh does)
def test_a_handled_sigint_says_nothing(caplog):
    flag = StopFlag()
    try:
        with caplog.at_level(logging.INFO, logger="preempt"):
            assert flag.install()
        assert not flag.sigint_ignored and "SIGINT is ignored" not in caplog.text
    finally:
        flag.restore()


def test_other_ignored_signals_are_taken_over_and_restored():
    """Only SIGINT keeps SIG_IGN; an ignored SIGTERM is caught while installed and ignored again after."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    flag = StopFlag([signal.SIGTERM])
    try:
        flag.install()
        deliver(signal.SIGTERM)
        assert flag.requested
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN


def test_install_off_the_main_thread_installs_nothing():
    before = {s: signal.getsignal(s) for s in DEFAULT_SIGNALS}
    flag = StopFlag()
    result = []
    t = threading.Thread(target=lambda: result.append(flag.install()), name="not-main")
    t.start()
    t.join(5)
    try:
        assert result == [False]
        assert not flag.installed
        assert {s: signal.getsignal(s) for s in DEFAULT_SIGNALS} == before
    finally:
        flag.restore()
    assert {s: signal.getsignal(s) for s in DEFAULT_SIGNALS} == before


def test_restore_without_install_changes_nothing():
    def custom(signum, frame):
        pass

    signal.signal(signal.SIGUSR2, custom)
    StopFlag().restore()
    assert signal.getsignal(signal.SIGUSR2) is custom


def test_reinstall_after_restore_records_again():
    flag = StopFlag([signal.SIGUSR1])
    try:
        flag.install()
        flag.restore()
        flag.install()
        deliver(signal.SIGUSR1)
        assert flag.requested and flag.signum == signal.SIGUSR1
    finally:
        flag.restore()


BLOCKED_FIRST = """
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # first, before any thread exists: every thread blocks it
from preempt.cluster.signals import StopFlag
os.kill(os.getpid(), signal.SIGTERM)  # pending; the default action (death) is not taken
assert signal.SIGTERM in signal.sigpending()
flag = StopFlag([signal.SIGTERM])
assert flag.install()
print("requested", flag.requested, flag.signum == signal.SIGTERM)
print("unblocked", signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, []))
flag.restore()
print("blocked again", signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []))
"""


def test_a_signal_that_came_while_blocked_is_delivered_once_installed_and_the_mask_is_put_back():
    """What a script that blocks SIGTERM before its imports relies on: SLURM's warning during the imports is
    pending, not lost, and not fatal. Would fail if install() left the mask alone (the flag would never be set).
    In a process of its own: a signal blocked in one thread is delivered to any other that does not block it."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", BLOCKED_FIRST], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:3] == ["requested True True", "unblocked True", "blocked again True"], r.stdout


def test_a_signal_not_blocked_before_install_stays_unblocked_after_restore():
    flag = StopFlag([signal.SIGTERM])
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    flag.install()
    flag.restore()
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
