"""Whether the preempt being measured takes an option: the benchmarks run against older trees too (``--against``,
or an older checkout first on ``PYTHONPATH``), where an option may not exist yet."""

from __future__ import annotations

import dataclasses
import inspect


def takes(option: str) -> bool:
    """True when this preempt's ``PreemptibleRun`` takes ``option``: as a parameter of its own (older trees) or as a
    field of the ``RunConfig`` its keywords build (since they are typed as ``RunOptions``)."""
    from preempt import PreemptibleRun

    if option in inspect.signature(PreemptibleRun).parameters:
        return True
    try:
        from preempt.run.config import RunConfig
    except ImportError:
        return False
    return option in {f.name for f in dataclasses.fields(RunConfig)}
