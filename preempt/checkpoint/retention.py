"""Pure decisions: which valid checkpoints survive pruning.

No clock, no disk, no torch: the checkpoint manager (``prune``) and ``preempt
prune`` list the valid checkpoints and ask :func:`select_kept`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from .names import MANIFEST


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """Which valid checkpoints survive pruning.

    Args:
        keep_last: The newest N valid checkpoints; None keeps all.
        keep_best: The N best by ``metric`` among checkpoints written because
            the metric improved.
        keep_every_steps: Checkpoints at multiples of this step, kept forever.
        metric: Name of the metric passed to ``run.step(metrics=...)`` or
            ``run.report(...)`` that decides "best".
        mode: ``"min"`` or ``"max"``.
        recycle: Keep the files of one pruned checkpoint for the next save to
            write over in place rather than delete them (see
            :mod:`preempt.checkpoint.commit`, "Recycling").
    """

    keep_last: int | None = 2
    keep_best: int = 0
    keep_every_steps: int | None = None
    metric: str | None = None
    mode: str = "min"
    recycle: bool = True

    def __post_init__(self) -> None:
        _check_positive_int_or_none("keep_last", self.keep_last)
        _check_positive_int_or_none("keep_every_steps", self.keep_every_steps)
        if not isinstance(self.keep_best, int) or isinstance(self.keep_best, bool) or self.keep_best < 0:
            raise ValueError(f"keep_best: expected an integer >= 0, got {self.keep_best!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"best_mode: expected 'min' or 'max', got {self.mode!r}")
        if self.metric is not None and (not isinstance(self.metric, str) or not self.metric):
            raise ValueError(f"best_metric: expected a metric name, got {self.metric!r}")
        if not isinstance(self.recycle, bool):
            raise ValueError(f"recycle_files: expected True or False, got {self.recycle!r}")
        if self.keep_best and self.metric is None:
            raise ValueError(f"keep_best={self.keep_best} needs best_metric= (the name of the metric to rank by)")

    def better(self, new: float, old: float | None) -> bool:
        """Whether ``new`` improves on ``old`` (NaN never does)."""
        if math.isnan(new):
            return False
        if old is None or math.isnan(old):
            return True
        return new < old if self.mode == "min" else new > old


@dataclasses.dataclass(frozen=True)
class Kept:
    """One checkpoint as retention sees it."""

    step: int
    best_value: float | None = None  # set on checkpoints written because the metric improved
    # (file, the step that wrote its bytes) of each file: checkpoints sharing a pair share an inode (hard links,
    # preempt.checkpoint.carry); empty when unknown
    origins: frozenset[tuple[str, int]] = frozenset()

    @property
    def carries(self) -> bool:
        """Some file of it is a hard link to bytes an earlier checkpoint wrote."""
        return any(origin != self.step for _, origin in self.origins)


def select_kept(policy: RetentionPolicy, checkpoints: Iterable[Kept]) -> set[int]:
    """Steps of the valid checkpoints to keep; every other valid one may go.

    Only valid checkpoints are passed in: corrupt or incomplete ones never count
    toward ``keep_last`` (they are moved aside by the manager, never pruned), so
    newer broken checkpoints cannot push out the last good one. The newest valid
    checkpoint is always kept.

    Shared files (:mod:`preempt.checkpoint.carry`): when the newest checkpoint
    carries a file and every other checkpoint kept shares a file with it (one
    inode: a flipped bit there damages them all), the newest older checkpoint
    that shares none is kept too, so that there is always one to fall back to.
    """
    items = sorted(checkpoints, key=lambda c: c.step, reverse=True)
    if not items:
        return set()
    kept = {items[0].step}
    if policy.keep_last is None:
        kept.update(c.step for c in items)
    else:
        kept.update(c.step for c in items[: policy.keep_last])
    if policy.keep_best:
        values = {c.step: c.best_value for c in items if c.best_value is not None and not math.isnan(c.best_value)}
        ranked = sorted(
            (c for c in items if c.step in values), key=lambda c: values[c.step], reverse=policy.mode == "max"
        )
        kept.update(c.step for c in ranked[: policy.keep_best])
    if policy.keep_every_steps:
        kept.update(c.step for c in items if c.step % policy.keep_every_steps == 0)
    newest = items[0]
    if newest.carries and all(c.origins & newest.origins for c in items if c.step in kept):
        apart = next((c for c in items[1:] if not c.origins & newest.origins), None)
        if apart is not None:
            kept.add(apart.step)
    return kept


def best_note(best: Mapping[str, Any], is_best: bool, step: int) -> str:
    """What a manifest's ``best`` says, for people: the value, the step it was measured at, and whether the
    checkpoint at ``step`` holds that state.

    The run records a metric at the step it belongs to (``run.report()`` after ``run.step()``), and a best
    checkpoint of that step holds it. One that could not be taken at that step (the metric reported inside a
    step, or under torch.distributed, between the ranks' meetings) is the first checkpoint after it, and says so.
    """
    at = best.get("step")
    head = f"{best.get('metric')} {best.get('mode', 'min')} = {best.get('value')} at step {at}"
    if not is_best:
        return f"{head} (not this checkpoint)"
    if at == step or isinstance(at, bool) or not isinstance(at, int):
        return f"{head} (this checkpoint holds it)"
    return f"{head} (this checkpoint, {step - at} step(s) later, is the first saved after it)"


def _check_positive_int_or_none(name: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive integer or None, got {value!r}")


@dataclasses.dataclass(frozen=True)
class BestRanking:
    """The checkpoints that hold a "best" state, best first, and the metric and mode that rank them."""

    ranked: list[Any]
    metric: str | None
    mode: str | None
    problem: str | None = None  # the newest best manifest records a mode that is neither min nor max


def rank_best(infos: Iterable[Any], default_mode: str = "min") -> BestRanking:
    """Ranks the valid checkpoints marked ``is_best`` by ``best.value``, with the mode their manifests record.

    The newest such manifest says the metric and the mode (``default_mode``
    when it records none); a checkpoint that records another metric or mode is
    a different ranking and is left out. The mode comes from the manifests, not
    from the caller's configuration, so that a tool or a run reading another
    run's directory ranks a "max" metric as its writer did.
    """
    marked = [
        c
        for c in infos
        if c.status == "valid" and c.manifest and (v := c.manifest.best_value) is not None and not math.isnan(v)
    ]
    marked.sort(key=lambda c: c.step, reverse=True)
    if not marked:
        return BestRanking([], None, None)

    def ranking(c: Any) -> tuple[Any, Any]:
        best = c.manifest.best or {}
        return best.get("metric"), best.get("mode", default_mode)

    metric, mode = ranking(marked[0])
    if mode not in ("min", "max"):
        problem = f"{marked[0].path / MANIFEST}: best.mode: expected 'min' or 'max', found {mode!r:.80}"
        return BestRanking([], metric, None, problem)
    same = [c for c in marked if ranking(c) == (metric, mode)]
    same.sort(key=lambda c: c.manifest.best_value, reverse=mode == "max")
    return BestRanking(same, metric, mode)
