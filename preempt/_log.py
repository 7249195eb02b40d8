"""The ``preempt`` logger.

A run says a few important things (where it resumed from, that it saved and
why it stopped, that it is complete), and they must be seen whatever the script
does to logging: nothing at all, ``basicConfig(level=logging.WARNING)`` as
transformers' example scripts do, or a framework that quiets the root logger.
So the ``preempt`` logger has a level of its own, INFO, unless ``log_level=``,
``PREEMPT_LOG_LEVEL`` or the application set one on it (``logging.getLogger(
"preempt").setLevel(...)`` is how to quiet it); and a stderr handler of its own
prints each record that no console handler of the application would print (a
stream handler other than a file's, on the loggers a record propagates to, at
a level that takes it). A script that logs at INFO sees each line once, in its
own format; one at WARNING sees preempt's INFO lines in preempt's.
"""

from __future__ import annotations

import logging
import math
import sys

log = logging.getLogger("preempt")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # what PREEMPT_LOG_LEVEL and log_level= accept


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return f"[preempt] {level}{record.getMessage()}"


class _Console(logging.StreamHandler):
    """preempt's own stderr handler: prints what no console handler of the application prints."""

    def __init__(self) -> None:
        super().__init__()  # sys.stderr as it is when a record comes (pytest's capture swaps it)
        self.setFormatter(_Format())

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass

    def filter(self, record: logging.LogRecord) -> bool:
        return not _shown_elsewhere(record) and bool(super().filter(record))


def _shown_elsewhere(record: logging.LogRecord) -> bool:
    """Whether a console handler of the application takes ``record`` on its way up from the preempt logger."""
    logger: logging.Logger | None = log
    while logger is not None:
        for h in logger.handlers:
            console = isinstance(h, logging.StreamHandler) and not isinstance(h, (logging.FileHandler, _Console))
            if console and record.levelno >= h.level:
                return True
        logger = logger.parent if logger.propagate else None
    return False


def setup(level: str | None = None) -> logging.Logger:
    """Gives the ``preempt`` logger its level (``level``, e.g. from PREEMPT_LOG_LEVEL; else INFO unless the
    application set one) and its stderr handler, once."""
    if level:
        log.setLevel(level.upper())
    elif log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not any(isinstance(h, _Console) for h in log.handlers):
        log.addHandler(_Console())
    return log


def duration(seconds: float) -> str:
    """``253.4`` -> ``"4m13s"``; ``0.12`` -> ``"0.12 s"``; ``inf`` -> ``"inf s"``."""
    if not math.isfinite(seconds):
        return f"{seconds} s"
    if seconds < 60:
        return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.0f} s"
    m, s = divmod(int(seconds), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h}h{m:02d}m"
    return f"{h // 24}d{h % 24:02d}h"


def size(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``3 << 30`` -> ``"3.0 GiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError
