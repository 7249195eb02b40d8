"""The wait before a retry: the first delay, doubling with each attempt, up to a most. Pure: no clock, no sleep.

The mirror's uploader waits so between passes while the mirror fails, and between its looks for other nodes' parts;
the store before it takes up a download cut off mid-way. The caller waits (on its own event, so that a close ends the
wait) and counts the attempts.
"""

from __future__ import annotations

_MOST_DOUBLINGS = 30  # 2**30 times the first: past any cap in use, and no float overflow for any attempt


def delay(attempt: int, first: float, most: float) -> float:
    """Seconds to wait before retry number ``attempt`` (1, 2, ...): ``first``, doubled for each attempt after the
    first, at most ``most``. An ``attempt`` below 1 is the first."""
    return min(most, first * 2 ** max(0, min(attempt - 1, _MOST_DOUBLINGS)))
