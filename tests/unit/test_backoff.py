"""The wait before a retry (``preempt.mirror.backoff.delay``): pure, so tested without a clock or a sleep."""

from __future__ import annotations

import pytest

from preempt.mirror.backoff import delay


def test_the_wait_doubles_up_to_its_most():
    assert [delay(n, 1.0, 30.0) for n in (1, 2, 3, 4, 5, 6, 7, 100)] == [1, 2, 4, 8, 16, 30, 30, 30]


@pytest.mark.parametrize("attempt", [0, -3])
def test_an_attempt_below_the_first_waits_as_the_first(attempt):
    assert delay(attempt, 0.2, 4.0) == 0.2


def test_a_huge_attempt_is_the_most_without_overflow():
    assert delay(10**9, 0.1, 2.0) == 2.0


def test_the_stores_resumes_wait_as_they_did():
    # a download cut off mid-way is taken up again after 0.1 s, 0.2 s, ... at most 2 s
    assert [delay(n + 1, 0.1, 2.0) for n in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0])
