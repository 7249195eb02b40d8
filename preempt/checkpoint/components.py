"""The objects a run saves and restores, checked once when the user hands them over.

:class:`Components` holds the model, optimizer, scheduler, scaler and any
further object with ``state_dict()``/``load_state_dict()`` by name;
:mod:`preempt.checkpoint.state` captures and applies their state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

import torch


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


@dataclasses.dataclass
class Components:
    """The objects a run saves and restores."""

    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Stateful | None = None
    scaler: Stateful | None = None
    tracked: dict[str, Stateful] = dataclasses.field(default_factory=dict)

    @classmethod
    def checked(
        cls, model: Any, optimizer: Any, scheduler: Any, scaler: Any, tracked: Mapping[str, Any] | None
    ) -> Components:
        """The components a user passed, each of the expected kind.

        Raises:
            TypeError: One is not (the message names it); ValueError: a bad name for a tracked object.
        """
        if scaler is None:
            scaler = accelerate_scaler(optimizer)
        optimizer = unwrapped(optimizer)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        for name, obj in (("scheduler", scheduler), ("scaler", scaler)):
            check_stateful(name, obj)
        out = cls(model, optimizer, scheduler, scaler)
        for name, obj in (tracked or {}).items():
            out.track(name, obj)
        return out

    def track(self, name: str, obj: Any) -> None:
        """Adds ``obj`` to the tracked objects under ``name``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"track: expected a non-empty name, got {name!r}")
        if name in self.tracked:
            raise ValueError(f"track: the name {name!r} is already tracked")
        check_stateful(f"track[{name!r}]", obj)
        self.tracked[name] = obj


def unwrapped(optimizer: Any) -> Any:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (``accelerator.prepare(optimizer)``), else
    ``optimizer`` itself. The wrapper is an Optimizer that never ran ``Optimizer.__init__`` (it has no step hooks);
    it steps the inner one, skipping the step while gradients accumulate, and its state is the inner one's."""
    inner = getattr(optimizer, "optimizer", None)
    if _accelerated(optimizer) and isinstance(inner, torch.optim.Optimizer):
        return inner
    return optimizer


def _accelerated(optimizer: Any) -> bool:
    return type(optimizer).__module__.split(".")[0] == "accelerate"


def accelerate_scaler(optimizer: Any) -> Any:
    """The GradScaler of Accelerate's fp16 mixed precision (``AcceleratedOptimizer.scaler``), else None: saved and
    restored as the run's scaler when none is given."""
    scaler = getattr(optimizer, "scaler", None) if _accelerated(optimizer) else None
    return scaler if callable(getattr(scaler, "state_dict", None)) else None


def gradient_sync(optimizer: Any) -> Any:
    """Accelerate's gradient state (``AcceleratedOptimizer.gradient_state``), whose ``sync_gradients`` says whether
    the micro-batch that just ran ended an accumulation (``accelerator.accumulate``); None for another optimizer."""
    gradients = getattr(optimizer, "gradient_state", None) if _accelerated(optimizer) else None
    return gradients if hasattr(gradients, "sync_gradients") else None


def check_stateful(name: str, obj: Any) -> None:
    """``obj`` is None or has state_dict() and load_state_dict(); else a TypeError naming it."""
    if obj is None:
        return
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise TypeError(f"{name}: expected an object with state_dict() and load_state_dict(), got {type(obj).__name__}")
