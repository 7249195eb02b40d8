"""A Ray worker's stop signals (preempt.ray.signals): the handler and the wakeup fd installed on the main thread, the
signal heard by the fd's thread, the previous handler and fd put back; without Ray (the main thread is pytest's)."""

from __future__ import annotations

import os
import signal
import threading

from preempt.ray.signals import held


def _here(fn, *args):
    return fn(*args)


def test_a_signal_calls_the_target_from_the_fd_s_thread_and_the_previous_handlers_come_back():
    before = signal.getsignal(signal.SIGUSR1)
    heard: list[int] = []
    got = threading.Event()

    def on_signal(signum: int) -> None:
        heard.append(signum)
        got.set()

    with held(on_signal, [signal.SIGUSR1], on_main_thread=_here) as installed:
        assert installed
        assert signal.getsignal(signal.SIGUSR1) is not before
        os.kill(os.getpid(), signal.SIGUSR1)
        assert got.wait(10)
    assert heard and set(heard) == {signal.SIGUSR1}  # the fd's thread, and the handler on the main thread
    assert signal.getsignal(signal.SIGUSR1) is before
    assert signal.set_wakeup_fd(-1) == -1  # no wakeup fd left behind (pytest sets none)


def test_no_main_thread_to_install_on_is_said_and_nothing_changes(caplog):
    before = signal.getsignal(signal.SIGUSR2)

    def refused(fn, *args):
        raise RuntimeError("no actor")

    with held(lambda s: None, [signal.SIGUSR2], on_main_thread=refused) as installed:
        assert not installed
    assert signal.getsignal(signal.SIGUSR2) is before
    assert any("could not be installed" in r.getMessage() for r in caplog.records)


def test_off_the_main_thread_the_install_refuses():
    outcome: list[BaseException] = []

    def elsewhere(fn, *args):
        t = threading.Thread(target=lambda: _catch(fn, args, outcome))
        t.start()
        t.join()
        if outcome:
            raise outcome[0]

    with held(lambda s: None, [signal.SIGUSR2], on_main_thread=elsewhere) as installed:
        assert not installed
    assert isinstance(outcome[0], RuntimeError)


def _catch(fn, args, into):
    try:
        fn(*args)
    except BaseException as e:
        into.append(e)
