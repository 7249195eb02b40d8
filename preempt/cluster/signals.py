"""Stop signals: record them, never act on them inside the handler.

A handler runs between two bytecodes of whatever the main thread is doing,
possibly in the middle of an optimizer step or of a checkpoint write. So the
handler only records that a stop was asked for; the run polls the record at
its next step boundary, where the state is consistent, and saves there.

Knows nothing of torch.

Rules, each one a bug seen elsewhere:

* Handlers are installed only from the main thread (CPython allows nothing
  else) and the previous handlers are restored when the run ends, so a signal
  that arrives before the run is entered or after it is left gets the
  process's normal behaviour.
* Previous handlers are not chained. A handler installed before the run
  usually exits or raises (that is what ``SIG_DFL`` and most custom handlers
  do), which would kill the process mid-step: exactly what the run prevents.
* A second SIGINT while a stop is already pending raises KeyboardInterrupt at
  once (a person pressing Ctrl+C twice wants out), except inside a
  :meth:`StopFlag.critical` section such as a checkpoint write, where it is
  only counted; the write finishes and the run exits as planned.
* A SIGINT that is ignored when the run starts stays ignored: a
  non-interactive shell starts a background job (``python train.py &`` in a
  script) that way, so that a Ctrl+C meant for the script does not reach it,
  and the process inherits it. The shell asked for it, so the run keeps it, and
  says so once as it installs its handlers (:data:`SIGINT_IGNORED`): Ctrl+C
  does nothing to such a run; SIGTERM stops it the same way.
* A stop signal that is *blocked* when the run starts is unblocked once the
  handlers are in place (and blocked again when the run ends). A signal that
  came while it was blocked is pending, not lost: it is delivered then, and
  the run stops at its first step boundary. A script can block the stop
  signals as its first statement, before seconds of imports, and so never be
  killed by a stop that comes before the run is entered (SLURM may send its
  ``--signal`` warning up to 60 s before the time it was asked for).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)

_Handler = Callable[[int, Any], Any] | int | None
log = logging.getLogger("preempt")
SIGINT_IGNORED = (
    "SIGINT is ignored in this process, as a non-interactive shell leaves it for a command it starts in the"
    " background (`python train.py &` in a script), and the run keeps it so: Ctrl+C does not stop this run. Stop"
    " it with SIGTERM instead (kill -TERM %d): it saves at the next step and exits 75, as Ctrl+C would"
)


def signal_name(signum: int | None) -> str:
    """``15`` -> ``"SIGTERM"``; tolerant of unknown numbers and None."""
    if signum is None:
        return "no signal"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopFlag:
    """Records stop signals while installed.

    The hot path reads the plain attribute :attr:`requested` (a few ns).

    Args:
        signals: The signals that ask for a stop.
        clock: Monotonic clock, injectable for tests.
    """

    def __init__(
        self,
        signals: Iterable[int] = DEFAULT_SIGNALS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        sigs = []
        for s in signals:
            sig = signal.Signals(s)  # raises ValueError for a non-signal
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                raise ValueError(f"signals: {sig.name} cannot be caught")
            if sig not in sigs:
                sigs.append(sig)
        self.signals: tuple[signal.Signals, ...] = tuple(sigs)
        self._clock = clock
        self.requested = False
        self.held = False  # a request lowered until release() (see hold())
        self.signum: int | None = None
        self.received_at: float | None = None
        self.count = 0
        self._critical = 0
        self._previous: dict[int, _Handler] = {}
        self._unblocked: set[int] = set()  # stop signals blocked before install(), unblocked by it
        self.sigint_ignored = False  # SIGINT was SIG_IGN at install() and stays so
        self.installed = False

    def request(self, signum: int | None = None) -> None:
        """Records a stop request (what the handler does; callable directly)."""
        self.count += 1
        if not self.requested:
            self.signum = signum
            self.received_at = self._clock()
            self.requested = True

    def hold(self) -> None:
        """Lowers the request, to be raised again by :meth:`release` (a stop taken later than it came); a signal
        meanwhile raises it at once."""
        self.requested, self.held = False, True

    def release(self) -> None:
        """Raises a held request again (its signal and time kept)."""
        if self.held:
            self.requested, self.held = True, False

    def _handle(self, signum: int, frame: Any) -> None:
        second = self.requested
        self.request(signum)
        if second and signum == signal.SIGINT and self._critical == 0:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """A section that a second SIGINT must not interrupt."""
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1

    def install(self) -> bool:
        """Installs the handlers; returns False (and installs nothing) off the main thread."""
        if self.installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        self.sigint_ignored = False
        for sig in self.signals:
            previous = signal.getsignal(sig)
            if sig == signal.SIGINT and previous == signal.SIG_IGN:
                self.sigint_ignored = True  # inherited from the shell that started us: left as it is
                continue
            self._previous[sig] = previous
            signal.signal(sig, self._handle)
        if hasattr(signal, "pthread_sigmask"):  # blocked until now: a pending one is delivered to the handler
            self._unblocked = set(self._previous) & signal.pthread_sigmask(signal.SIG_BLOCK, [])
            if self._unblocked:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, self._unblocked)
        self.installed = True
        if self.sigint_ignored:
            log.info(SIGINT_IGNORED, os.getpid())
        return True

    def restore(self) -> None:
        """Puts back the handlers that were there before :meth:`install`."""
        if not self.installed:
            return
        if self._unblocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, self._unblocked)
            self._unblocked = set()
        for sig, previous in self._previous.items():
            # getsignal() returns None for a handler installed outside Python;
            # SIG_DFL is the best we can put back then.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()
        self.installed = False
