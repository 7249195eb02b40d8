"""A Ray Train worker's stop signals caught for its run: the handler installed on the worker actor's main thread.

Ray runs ``train_loop_per_worker`` in a thread of the worker actor and keeps the actor's main thread in its task loop,
with Ray's own SIGTERM handler (it raises ``SystemExit`` there: the actor ends at once, mid-step). CPython installs a
handler only from the main thread, so :func:`held` has the main thread install it, by a task of the actor to itself:
Ray Train's worker actor is a synchronous actor, whose tasks run on its main thread, and its ``execute(fn, ...)``
method calls a function there (ray 2.60, Ray Train v2). The handler only records, as preempt's own do
(:mod:`preempt.cluster.signals`): it raises the run's stop flag, and the run saves and stops at its next step, the
other ranks with it. The main thread runs a Python handler only when Ray gives it a task, so a wakeup fd
(``signal.set_wakeup_fd``) read by a named daemon thread raises the flag as the signal arrives.
The previous handlers (Ray's) and wakeup fd are put back the same way when the run has left.

SIGINT is left to Ray: it is how Ray cancels a task (``ray.cancel``). The functions sent to the main thread are
module-level (Ray pickles them by name) and find the handler's target in :data:`_TARGETS`: the task runs in this
same process, so nothing of the run is pickled.

Where the actor has no such method (another Ray Train, a plain actor) or the task fails, the run goes on with Ray's
handler and says so once: a SIGTERM then ends the worker as before, and the group resumes from the newest durable
checkpoint.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

log = logging.getLogger("preempt")

#: The signals a Ray worker's run takes over: preempt's stop signals but SIGINT (Ray's task cancellation).
SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
MAIN_THREAD_TIMEOUT_S = 60.0  # the actor's main thread answers between Ray Train's polls of its status (~0.1 s)

_TARGETS: dict[int, Callable[[int], None]] = {}
_PREVIOUS: dict[int, dict[int, Any]] = {}
_WAKEUP = -1  # the key of (previous wakeup fd, ours) in _PREVIOUS[token]
_tokens = itertools.count(1)


def _install(token: int, signums: Sequence[int]) -> None:
    """On the actor's main thread: the handlers that call ``_TARGETS[token]`` with the signal's number, and the
    wakeup fd read by a thread that calls it at once."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("not run on the actor's main thread (an actor with threads of its own?)")
    target = _TARGETS[token]

    def record(signum: int, frame: Any) -> None:
        target(signum)

    previous = _PREVIOUS.setdefault(token, {})
    for sig in signums:
        previous[sig] = signal.getsignal(sig)
        signal.signal(sig, record)
    # CAUTION: the main thread runs a Python handler only when Ray hands it a task (Ray Train polls each worker about
    # once a second), but CPython's C handler writes the signal's number to the wakeup fd at once
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous[_WAKEUP] = (signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False), write_fd)
    wanted = set(signums)

    def wake() -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as r:
            while got := r.read(64):  # b"": the write end closed by _restore
                for signum in got:
                    if signum in wanted:
                        target(signum)

    threading.Thread(target=wake, name="preempt-ray-signals", daemon=True).start()


def _restore(token: int) -> None:
    """On the actor's main thread: the handlers and the wakeup fd that were there before :func:`_install`."""
    previous = _PREVIOUS.pop(token, {})
    if _WAKEUP in previous:
        old_fd, write_fd = previous.pop(_WAKEUP)
        signal.set_wakeup_fd(old_fd)
        os.close(write_fd)  # the thread's read ends
    for sig, handler in previous.items():
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _on_main_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on this Ray actor's main thread (a task of the actor to itself), its result."""
    import ray

    actor = ray.get_runtime_context().current_actor
    return ray.get(actor.execute.remote(fn, *args), timeout=MAIN_THREAD_TIMEOUT_S)


@contextlib.contextmanager
def held(
    on_signal: Callable[[int], None],
    signums: Sequence[int] = SIGNALS,
    *,
    on_main_thread: Callable[..., Any] = _on_main_thread,
) -> Iterator[bool]:
    """While inside: ``signums`` to this Ray worker call ``on_signal(signum)`` (from a thread that reads the wakeup
    fd, and again from the actor's main thread when it runs Python: it must only record). Yields whether the handlers
    are in place.

    Args:
        on_signal: What a signal calls, with its number.
        signums: The signals taken over.
        on_main_thread: ``on_main_thread(fn, *args)`` calls ``fn(*args)`` on the process's main thread and returns its
            result (default: a task of this Ray actor to itself).
    """
    token = next(_tokens)
    _TARGETS[token] = on_signal
    names = "/".join(signal.Signals(s).name for s in signums)
    try:
        on_main_thread(_install, token, tuple(int(s) for s in signums))
        installed = True
        log.info("ray: %s to this worker stop the run at its next step (preempt's handler, not Ray's)", names)
    except Exception as e:  # an actor without Ray Train's execute(), a main thread that did not answer
        installed = False
        _PREVIOUS.pop(token, None)
        log.warning(
            "ray: preempt's %s handler could not be installed on this worker actor's main thread (%s: %s): Ray's"
            " handler ends the worker on a SIGTERM, and the group resumes from the newest durable checkpoint",
            names,
            type(e).__name__,
            e,
        )
    try:
        yield installed
    finally:
        if installed:
            try:
                on_main_thread(_restore, token)
            except Exception as e:  # the actor is going anyway; its next run installs anew
                log.warning("ray: Ray's own signal handlers could not be put back (%s: %s)", type(e).__name__, e)
        _TARGETS.pop(token, None)
