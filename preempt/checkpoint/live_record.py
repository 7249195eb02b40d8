"""The record a run inside ``preempt check`` keeps of its live state at each checkpoint step, and what it proves.

A checkpoint is meant to hold the live state of its step. ``preempt check`` (:mod:`preempt.cli.check`) cannot see a
run's live state, only what its checkpoints hold; so inside a check the run writes, beside its scratch save_dir
(:attr:`preempt.cluster.environment.CheckSpec.live_dir`), one small JSON document per checkpoint step: an xxh3-64
digest of every tensor it holds at that step, read where the tensors live (the model's parameters and buffers, not
what its ``state_dict()`` says; the optimizer's, scheduler's, scaler's and tracked objects' ``state_dict()``), a
digest of the batches that step consumed, the steps at which its epochs ended, and a digest of each global random
generator at step 1 (a process that started at step 0: two uninterrupted runs that differ there were not seeded
alike, and only that generator's state may tell them apart). The check compares each
checkpoint's tensors with the record of its step (:func:`stale`): a tensor that differs is one the checkpoint holds
from another moment than its step, whatever made it so.

Paths are those of :func:`flatten` over the state as a checkpoint stores it (``model.fc.weight``,
``optimizer.state.0.exp_avg``, ``tracked.x.t``). The record holds digests only: no tensor, no pickle. Written by
rank 0 of a run whose model is not sharded. No torch here: a tensor's bytes come from
:func:`preempt.checkpoint.tensorfile.tensor_bytes`, and the callers tell tensors apart.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from .tensorfile import tensor_bytes


def flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    """``out[path] = leaf`` for every leaf of a state tree (dicts and lists walked, in order)."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            flatten(v, f"{prefix}.{i}", out)
        if not value:
            out[prefix] = type(value)()
    else:
        out[prefix] = value


def tensor_digest(t: Any) -> tuple[str, tuple[int, ...], str]:
    """(dtype, shape, xxh3-64 of the bytes) of a dense tensor, wherever it lives."""
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), xxhash.xxh3_64_hexdigest(tensor_bytes(t))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LiveRecord:
    """The live state of a run at one checkpoint step.

    Attributes:
        step: The step.
        tensors: path -> (dtype, shape, digest) of every live tensor (:func:`tensor_digest`).
        batch: A digest of the batches this step consumed (from ``run.batches()``), or None when none went through it.
        epoch_ends: (epoch, the step at its end) for each epoch this process ended, in order.
        generators: A digest of each global random generator's state (``torch``, ``python``, ``numpy``, ``cuda``) at
            step 1, in a process that started at step 0; empty in one that resumed.
    """

    step: int
    tensors: dict[str, tuple[str, tuple[int, ...], str]]
    batch: str | None = None
    epoch_ends: tuple[tuple[int, int], ...] = ()
    generators: dict[str, str] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tensors": {p: [d, list(s), h] for p, (d, s, h) in self.tensors.items()},
            "batch": self.batch,
            "epoch_ends": [list(e) for e in self.epoch_ends],
            "generators": self.generators,
        }

    @classmethod
    def parse(cls, tree: Any, where: str) -> LiveRecord:
        """Raises ValueError naming ``where`` for a document no run wrote."""
        try:
            tensors = {str(p): (str(d), tuple(int(n) for n in s), str(h)) for p, (d, s, h) in tree["tensors"].items()}
            step, batch = int(tree["step"]), tree["batch"]
            ends = tuple((int(e), int(s)) for e, s in tree["epoch_ends"])
            generators = {str(k): str(v) for k, v in tree["generators"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{where}: not a live record ({type(e).__name__}: {e})") from None
        if batch is not None and not isinstance(batch, str):
            raise ValueError(f"{where}: batch: expected a digest or null, found {batch!r}")
        return cls(step=step, tensors=tensors, batch=batch, epoch_ends=ends, generators=generators)


def record_path(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(directory) / f"step_{step:09d}.json"


def write(directory: str | os.PathLike[str], record: LiveRecord) -> None:
    """Writes ``record`` whole or not at all (a temporary file renamed): a process killed right after leaves it."""
    path = record_path(directory, record.step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record.to_json()))
    os.replace(tmp, path)


def read_all(directory: str | os.PathLike[str]) -> dict[int, LiveRecord]:
    """Every record in ``directory`` by step (none when the run wrote none: a sharded model, no run).

    Raises:
        ValueError: A record that does not parse; the message names the file.
    """
    out: dict[int, LiveRecord] = {}
    root = Path(directory)
    if not root.is_dir():
        return out
    for f in sorted(root.glob("step_*.json")):
        try:
            tree = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{f}: cannot be read as JSON ({e})") from None
        record = LiveRecord.parse(tree, str(f))
        out[record.step] = record
    return out


def stale(record: LiveRecord, held: Mapping[str, tuple[str, tuple[int, ...], str]]) -> list[str]:
    """The paths whose tensor in a checkpoint (``held``: path -> :func:`tensor_digest`) is not the live one of the
    record's step, in the record's order. Only tensors of the same dtype and shape are compared: a ``state_dict()``
    that converts (another dtype, a merged shape) says nothing about the moment its values come from."""
    out = []
    for path, (dtype, shape, digest) in record.tensors.items():
        h = held.get(path)
        if h is not None and h[:2] == (dtype, shape) and h[2] != digest:
            out.append(path)
    return out


def unseeded(one: LiveRecord | None, other: LiveRecord | None) -> set[str]:
    """The global generators whose state at step 1 differs between two uninterrupted runs' records (not seeded, or
    seeded apart); none when either record has no state at step 1."""
    if one is None or other is None or not one.generators or not other.generators:
        return set()
    return {g for g, d in one.generators.items() if other.generators.get(g, d) != d}


def live_at(records: Mapping[int, LiveRecord], before: int, path: str, digest: str) -> int | None:
    """The latest recorded step before ``before`` whose live tensor at ``path`` has ``digest``: the step whose value
    a stale checkpoint holds, when it is one of the recorded ones."""
    for step in sorted((s for s in records if s < before), reverse=True):
        t = records[step].tensors.get(path)
        if t is not None and t[2] == digest:
            return step
    return None


def steps_per_epoch(record: LiveRecord | None, epoch: int, batch: int, batches_per_epoch: int, last: int) -> int | None:
    """The run.step() calls of the first epoch (its optimizer steps, whatever the gradient accumulation), from an
    uninterrupted run's record at ``last`` and where its checkpoint there stands (``epoch``, ``batch`` of
    ``batches_per_epoch``); None when the first epoch does not end by ``last`` or the run has no epochs. Without a
    record (a sharded model's run records none), the batches of an epoch: its steps, but for gradient accumulation."""
    if record is None:
        return batches_per_epoch if batches_per_epoch > 0 else None
    ends = dict(record.epoch_ends)
    if 0 in ends and ends[0] > 0:
        return ends[0]
    if epoch == 0 and 0 < batches_per_epoch <= batch:
        return last  # the first epoch's last batch was the step at ``last``
    return None
