"""What a run inside ``preempt check`` records beside its checkpoints: its live state at each checkpoint step.

A checkpoint is compared with the live state of its step only if something saw that state: :class:`CheckRecorder`
writes, at each step the check names, a :class:`~preempt.checkpoint.live_record.LiveRecord` (digests of every live
tensor, of the batches the step consumed, the steps at which the epochs ended, and the global random generators at
step 1) into the check's directory
(:attr:`~preempt.cluster.environment.CheckSpec.live_dir`). Made only inside a check, by rank 0 of a run whose model
is not sharded; every other run has none and pays nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import xxhash

from ..checkpoint import live_record, state
from ..data import rng
from .loop_state import LoopState


class CheckRecorder:
    """Records the live state at the steps of a check (one per run, inside ``preempt check`` only)."""

    def __init__(self, directory: str, steps: frozenset[int], components: state.Components, loop: LoopState) -> None:
        self.directory = directory
        self.steps = steps  # the steps whose checkpoint the check compares: their batches are digested
        self.components = components
        self.loop = loop
        self._batches: dict[int, Any] = {}  # step -> the xxh3 of the batches it consumed so far
        self._ends: list[tuple[int, int]] = []
        self._generators: dict[str, str] = {}

    def watching(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches`` unchanged; each one that a recorded step consumes (several under gradient accumulation) is
        folded into that step's digest as the loop receives it."""
        for item in batches:
            step = self.loop.global_step + 1  # the run.step() that this batch comes before
            if step in self.steps:
                h = self._batches.get(step)
                if h is None:
                    h = self._batches[step] = xxhash.xxh3_64()
                h.update(_describe(item).encode())
            yield item

    def first_step(self) -> None:
        """Step 1 of a process that started at step 0: the global generators' states, in every later record (the
        script has seeded them by now, wherever it does)."""
        self._generators = {
            name: xxhash.xxh3_64_hexdigest(_describe(tree).encode())
            for name, tree in rng.to_tree(rng.capture()).items()
        }

    def epoch_ended(self, epoch: int, step: int) -> None:
        self._ends.append((epoch, step))

    def record(self, step: int) -> None:
        """The live state now, at ``step``, just after its checkpoint was written."""
        h = self._batches.pop(step, None)
        rec = live_record.LiveRecord(
            step=step,
            tensors=self.live_tensors(),
            batch=None if h is None else h.hexdigest(),
            epoch_ends=tuple(self._ends),
            generators=self._generators,
        )
        live_record.write(self.directory, rec)

    def live_tensors(self) -> dict[str, tuple[str, tuple[int, ...], str]]:
        """path -> digest of every live tensor. The model's are its parameters and buffers themselves: a
        ``state_dict()`` (a hook, an override) that hands out an older copy does not hide what the model holds."""
        c = self.components
        tree: dict[str, Any] = {}
        if c.model is not None:
            model = state.unwrap_model(c.model)
            own = dict(model.named_buffers(remove_duplicate=False))
            own.update(model.named_parameters(remove_duplicate=False))
            tree["model"] = own
        if c.optimizer is not None:
            tree["optimizer"] = c.optimizer.state_dict()
        if c.scheduler is not None:
            tree["scheduler"] = c.scheduler.state_dict()
        if c.scaler is not None:
            tree["scaler"] = c.scaler.state_dict()
        tree["tracked"] = {name: obj.state_dict() for name, obj in c.tracked.items()}
        flat: dict[str, Any] = {}
        live_record.flatten(tree, "", flat)
        return {p: live_record.tensor_digest(v) for p, v in flat.items() if _plain(v)}


def _plain(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.layout == torch.strided and v.device.type != "meta"


def _describe(batch: Any) -> str:
    """A batch as text that equal batches share: each tensor's digest, every other leaf's repr."""
    flat: dict[str, Any] = {}
    live_record.flatten(batch, "", flat)
    parts = []
    for path, v in flat.items():
        if _plain(v):
            parts.append(f"{path}={live_record.tensor_digest(v)}")
        elif isinstance(v, (str, int, float, bool, bytes, type(None))):
            parts.append(f"{path}={v!r}")
        else:
            parts.append(f"{path}:{type(v).__qualname__}")
    return ";".join(parts)
