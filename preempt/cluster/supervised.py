"""The contract between ``preempt supervise`` and the process it runs: the environment variables it sets.

The supervisor (:mod:`preempt.supervise.command`) writes them; the training process reads them through
:meth:`Supervised.from_env` (the run applies ``PREEMPT_LR_SCALE`` to the learning rates it restores). A module of
its own, so that the run does not import the supervisor's command-line tool. No torch here.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping

ENV_ATTEMPT = "PREEMPT_SUPERVISE_ATTEMPT"
ENV_CAUSE = "PREEMPT_SUPERVISE_CAUSE"
ENV_LR = "PREEMPT_LR"
ENV_LR_SCALE = "PREEMPT_LR_SCALE"
ENV_BATCH_SIZE = "PREEMPT_BATCH_SIZE"


@dataclasses.dataclass(frozen=True)
class Supervised:
    """What ``preempt supervise`` told this process through its environment (the child's side of the contract).

    Attributes:
        attempt: 1 for the first run, then 2, 3, ...
        cause: Why this attempt was started (the previous one's cause); None on attempt 1.
        lr: ``PREEMPT_LR``, or None when the supervisor was given no ``--lr``.
        lr_scale: ``PREEMPT_LR_SCALE`` (1.0 when absent): multiply learning rates restored from a checkpoint by it.
        batch_size: ``PREEMPT_BATCH_SIZE``, or None.
    """

    attempt: int
    cause: str | None = None
    lr: float | None = None
    lr_scale: float = 1.0
    batch_size: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Supervised | None:
        """Reads the variables; None when this process was not started by ``preempt supervise``.

        Raises:
            ValueError: A variable that does not parse, named with its value.
        """
        env = os.environ if environ is None else environ
        if ENV_ATTEMPT not in env:
            return None

        def number(name: str, kind: Callable[[str], float]) -> float | None:
            text = env.get(name)
            if text is None:
                return None
            try:
                value = kind(text)
            except ValueError:
                raise ValueError(f"{name}={text!r}: expected a positive {kind.__name__}") from None
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={text!r}: expected a positive {kind.__name__}")
            return value

        attempt, lr, scale, bs = (
            number(ENV_ATTEMPT, int),
            number(ENV_LR, float),
            number(ENV_LR_SCALE, float),
            number(ENV_BATCH_SIZE, int),
        )
        assert attempt is not None
        return cls(
            attempt=int(attempt),
            cause=env.get(ENV_CAUSE) or None,
            lr=lr,
            lr_scale=1.0 if scale is None else scale,
            batch_size=None if bs is None else int(bs),
        )
