"""The ``preempt`` logger.

A run says a few important things (where it resumed from, that it saved and
why it stopped), and they must be seen without any logging setup. So when
neither the ``preempt`` logger nor the root logger has a handler, one stderr
handler is attached; an application that configures logging itself keeps
full control.
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


def setup(level: str | None = None) -> logging.Logger:
    """Attaches the default handler when nothing is configured; applies ``level`` (e.g. from PREEMPT_LOG_LEVEL)."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Format())
        log.addHandler(handler)
        log.propagate = False
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)
    if level:
        log.setLevel(level.upper())
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
