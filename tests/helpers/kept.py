"""Every kept checkpoint against the live state at its step: the records a training script writes as it trains, and
the oracle that reads them beside the checkpoints.

A checkpoint taken at step N holds the state the loop had at ``run.step()`` of step N (a periodic one, a stop's,
the final one: the loop changes nothing between one ``run.step()`` and the next step's work). A proxy that says
"unchanged" (a version counter, an address) can be wrong for a loop that writes behind autograd (``p.data``, a NumPy
view); comparing a checkpoint with the previous one, or only the final state, cannot see a checkpoint that holds an
older step's tensors. This compares what each kept checkpoint holds with what the loop held at its step.

The records: ``LIVE_DIR/step_NNNNNNNNN.safetensors`` per step, written by :func:`record_live` (clones of the
model's ``state_dict()`` as ``model.KEY`` and of the optimizer's per-parameter state as ``optim.PARAM.KEY``), one
file per step, the latest process's wins (a resumed process redoes the steps after its checkpoint).

Imports only torch, safetensors and preempt (no pytest, no other helper): a training script imports this module by
path (``sys.path`` + ``tests/helpers``), so that the records are written and read by one module.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

RECORD = "step_{step:09d}.safetensors"


def live_tensors(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Copies of the tensors a checkpoint holds of ``model`` and ``optimizer``, named as the records name them."""
    out: dict[str, torch.Tensor] = {}
    if model is not None:
        out.update({f"model.{k}": v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)})
    if optimizer is not None:
        out.update(_optimizer_tensors(optimizer.state_dict()))
    return out


def _optimizer_tensors(opt_state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for pid, per_param in opt_state.get("state", {}).items():
        for k, v in per_param.items():
            if torch.is_tensor(v):
                out[f"optim.{pid}.{k}"] = v.detach().clone()
    return out


def record_live(
    live_dir: str | os.PathLike[str],
    step: int,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Path:
    """Writes the live state of step ``step`` (after its ``run.step()``) to ``live_dir``, replacing a record of that
    step (atomic rename: a process killed meanwhile leaves the older record or none, never half of one)."""
    live = Path(live_dir)
    live.mkdir(parents=True, exist_ok=True)
    path = live / RECORD.format(step=step)
    tmp = live / f".{path.name}.{os.getpid()}.tmp"
    save_file({k: v.contiguous() for k, v in live_tensors(model, optimizer).items()}, str(tmp))
    os.replace(tmp, path)
    return path


@dataclasses.dataclass(frozen=True)
class KeptCheck:
    """One kept checkpoint against the live record of its step."""

    name: str  # step_NNNNNNNNN
    step: int
    problem: str | None = None  # not valid, no live record: nothing could be compared
    differing: tuple[str, ...] = ()  # tensors whose values (or dtype, shape) differ
    missing: tuple[str, ...] = ()  # in the live record, not in the checkpoint
    unexpected: tuple[str, ...] = ()  # in the checkpoint, not in the live record
    compared: int = 0  # tensors compared

    @property
    def equal(self) -> bool:
        return self.problem is None and not (self.differing or self.missing or self.unexpected)

    def describe(self) -> str:
        if self.problem is not None:
            return f"{self.name}: {self.problem}"
        parts = []
        for what, names in (("differ", self.differing), ("missing", self.missing), ("unexpected", self.unexpected)):
            if names:
                shown = ", ".join(names[:8]) + (f", ... ({len(names) - 8} more)" if len(names) > 8 else "")
                parts.append(f"{len(names)} of {self.compared} {what}: {shown}")
        return f"{self.name}: " + ("; ".join(parts) or "equal")


def check_kept(
    save_dir: str | os.PathLike[str], live_dir: str | os.PathLike[str], *, optimizer: bool = True
) -> list[KeptCheck]:
    """Each checkpoint in ``save_dir`` (oldest first), read and verified as a resume reads it
    (``CheckpointManager.read``: ``model.safetensors`` and ``base.safetensors`` merged, the optimizer's state from
    ``state.json``), against ``live_dir``'s record of its step: every tensor under ``torch.equal``."""
    from preempt import CheckpointManager

    manager = CheckpointManager(save_dir, owner=False)
    out = []
    for info in sorted(manager.list(), key=lambda c: c.step):
        if info.status != "valid":
            out.append(KeptCheck(info.name, info.step, problem=f"{info.status}: {info.problem}"))
            continue
        record = Path(live_dir) / RECORD.format(step=info.step)
        if not record.is_file():
            problem = f"no live record of step {info.step} ({record}): the script did not record the step it saved"
            out.append(KeptCheck(info.name, info.step, problem=problem))
            continue
        live = load_file(str(record))
        loaded = manager.read(info)
        held = {f"model.{k}": v for k, v in loaded.model.items()}
        if optimizer:
            held.update(_optimizer_tensors(loaded.tree.get("optimizer") or {}))
        else:
            live = {k: v for k, v in live.items() if k.startswith("model.")}
        common = sorted(live.keys() & held.keys())
        out.append(
            KeptCheck(
                info.name,
                info.step,
                differing=tuple(k for k in common if not _same(live[k], held[k])),
                missing=tuple(sorted(live.keys() - held.keys())),
                unexpected=tuple(sorted(held.keys() - live.keys())),
                compared=len(common),
            )
        )
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def assert_kept_equal_live(
    save_dir: str | os.PathLike[str],
    live_dir: str | os.PathLike[str],
    *,
    at_least: int = 1,
    optimizer: bool = True,
) -> list[KeptCheck]:
    """Every kept checkpoint of ``save_dir`` holds, bit for bit, the live state recorded at its step
    (:func:`check_kept`), and at least ``at_least`` checkpoints were compared: a kept checkpoint without a record,
    or one that is not valid, fails, so that the oracle cannot pass by comparing nothing.

    Returns:
        The checks, oldest first (for a test's further assertions or its report).
    """
    checks = check_kept(save_dir, live_dir, optimizer=optimizer)
    bad = [c for c in checks if not c.equal]
    summary = (
        f"{len(bad)} of {len(checks)} kept checkpoints of {save_dir} differ from the live state at their step"
        f" (steps {[c.step for c in bad]}):\n" + "\n".join(c.describe() for c in bad)
    )
    assert not bad, summary
    assert len(checks) >= at_least, (
        f"{save_dir}: {len(checks)} kept checkpoints ({[c.name for c in checks]}) compared with the live state,"
        f" expected at least {at_least}"
    )
    return checks
