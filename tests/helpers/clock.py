"""The suite's one fake clock: the monotonic time a test sets by hand."""

from __future__ import annotations


class FakeClock:
    """A clock the test moves: ``clock()`` returns ``clock.t``; with ``tick``, each call first moves it by that much.

    Pass it where the code takes ``clock=time.monotonic`` (or ``time.time``); set ``clock.t`` or call
    :meth:`advance` to make time pass.
    """

    def __init__(self, t: float = 1000.0, *, tick: float = 0.0) -> None:
        self.t = t
        self.tick = tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t
