"""What a checkpoint holds, taken from live objects and put back into them.

A checkpoint is three files besides its manifest:

* ``model.safetensors``: the model's ``state_dict()`` as is, without the
  ``module.`` (DDP) or ``_orig_mod.`` (``torch.compile``) prefixes, so other
  tools can load it as plain weights;
* ``state.safetensors``: every other tensor (optimizer moments, RNG states,
  tensors of tracked objects);
* ``state.json``: everything else (param groups, scheduler counters, GradScaler
  scale, the user's dict), with references into ``state.safetensors``.

Nothing is copied when capturing: the payload refers to the live tensors and
must be written before the loop goes on (a later asynchronous mode copies it
into host buffers first; the format does not change).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from . import codec
from .errors import IncompatibleStateError, UnsupportedStateError
from .tensorfile import check_tensor

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.safetensors"
STATE_JSON = "state.json"
_PREFIXES = ("module.", "_orig_mod.")


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP/DataParallel wrappers and ``torch.compile``."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def strip_prefixes(keys: list[str], wanted: set[str]) -> dict[str, str]:
    """Maps checkpoint keys onto model keys when a wrapper prefix is the only difference.

    Returns ``{checkpoint_key: model_key}``; the identity when no known prefix
    applies to every key.
    """
    mapping = {k: k for k in keys}
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if mapping and all(v.startswith(prefix) for v in mapping.values()) and not set(mapping.values()) <= wanted:
                mapping = {k: v[len(prefix) :] for k, v in mapping.items()}
                changed = True
    return mapping


@dataclasses.dataclass
class Components:
    """The objects a run saves and restores."""

    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Stateful | None = None
    scaler: Stateful | None = None
    tracked: dict[str, Stateful] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Payload:
    """Files to write: tensor files (tensors, metadata) and JSON documents."""

    tensor_files: dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]]
    json_files: dict[str, Any]


def capture(components: Components, run_state: Mapping[str, Any]) -> Payload:
    """Takes the state of every component, plus ``run_state`` (RNG and user dict), without copying.

    Raises:
        UnsupportedStateError: Some state is neither tensor nor JSON; the message names it.
    """
    model_tensors: dict[str, torch.Tensor] = {}
    tree: dict[str, Any] = {"model_extra": {}}
    if components.model is not None:
        for key, value in unwrap_model(components.model).state_dict().items():
            if isinstance(value, torch.Tensor):
                model_tensors[key] = value
            else:
                tree["model_extra"][key] = value
    if components.optimizer is not None:
        tree["optimizer"] = components.optimizer.state_dict()
    if components.scheduler is not None:
        tree["scheduler"] = components.scheduler.state_dict()
    if components.scaler is not None:
        tree["scaler"] = components.scaler.state_dict()
    tree["tracked"] = {name: obj.state_dict() for name, obj in components.tracked.items()}
    tree.update(run_state)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = {}
    for name, sub in tree.items():
        skeleton[name] = codec.encode(sub, name, tensors)
    for key, t in [*model_tensors.items(), *tensors.items()]:
        try:
            check_tensor(key, t)
        except TypeError as e:
            raise UnsupportedStateError(str(e)) from None
    return Payload(
        tensor_files={MODEL_FILE: (model_tensors, {"format": "pt"}), STATE_FILE: (tensors, {})},
        json_files={STATE_JSON: skeleton},
    )


@dataclasses.dataclass
class Loaded:
    """A verified checkpoint's content in memory."""

    path: str
    model: dict[str, torch.Tensor]
    tree: dict[str, Any]  # decoded state.json (empty for a weights-only read)


def check_model(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Matches checkpoint weights to the model's keys and shapes.

    Returns:
        The weights keyed as the unwrapped model names them.

    Raises:
        IncompatibleStateError: Listing missing and unexpected keys and shape mismatches.
    """
    target = unwrap_model(model).state_dict()
    wanted = {k for k, v in target.items() if isinstance(v, torch.Tensor)}
    mapping = strip_prefixes(list(tensors), wanted)
    weights = {mapping[k]: v for k, v in tensors.items()}
    missing = sorted(wanted - weights.keys())
    unexpected = sorted(weights.keys() - wanted)
    shapes = [
        f"{k}: checkpoint {tuple(weights[k].shape)}, model {tuple(target[k].shape)}"
        for k in sorted(wanted & weights.keys())
        if tuple(weights[k].shape) != tuple(target[k].shape)
    ]
    if missing or unexpected or shapes:
        parts = []
        for label, items in (("missing in checkpoint", missing), ("not in model", unexpected), ("shape", shapes)):
            if items:
                shown = ", ".join(items[:10]) + (f", ... ({len(items)} in all)" if len(items) > 10 else "")
                parts.append(f"{label}: {shown}")
        raise IncompatibleStateError(f"{where}: the model does not match the checkpoint; " + "; ".join(parts))
    return weights


def load_model(model: torch.nn.Module, loaded: Loaded, extra: Mapping[str, Any] | None = None) -> None:
    """Copies verified weights into the model (checked first, so a mismatch changes nothing)."""
    weights = check_model(model, loaded.model, f"{loaded.path}/{MODEL_FILE}")
    state: dict[str, Any] = dict(weights)
    if extra:
        state.update(extra)
    with torch.no_grad():
        unwrap_model(model).load_state_dict(state, strict=True)


def _check_optimizer(optimizer: torch.optim.Optimizer, state: Any, where: str) -> None:
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list):
        raise IncompatibleStateError(f"{where}: optimizer state has no param_groups list")
    have = [len(g["params"]) for g in optimizer.param_groups]
    saved = [len(g.get("params", [])) if isinstance(g, dict) else -1 for g in groups]
    if have != saved:
        raise IncompatibleStateError(
            f"{where}: the optimizer has {len(have)} parameter group(s) with {have} parameters,"
            f" the checkpoint {len(saved)} with {saved}"
        )


def apply(components: Components, loaded: Loaded) -> None:
    """Restores every component from a verified checkpoint (checks first, then loads).

    Raises:
        IncompatibleStateError: A component does not fit, or the checkpoint lacks
            state for a component the run has.
    """
    where = f"{loaded.path}/{STATE_JSON}"
    tree = loaded.tree
    needed = [
        (name, obj)
        for name, obj in (
            ("optimizer", components.optimizer),
            ("scheduler", components.scheduler),
            ("scaler", components.scaler),
        )
        if obj is not None
    ]
    for name, _ in needed:
        if name not in tree:
            raise IncompatibleStateError(
                f"{where}: the run has a {name} but the checkpoint holds no {name} state;"
                " resume with weights_only=True to start it fresh"
            )
    if components.optimizer is not None:
        _check_optimizer(components.optimizer, tree["optimizer"], where)
    if components.model is not None:
        load_model(components.model, loaded, tree.get("model_extra") or None)
    for name, obj in needed:
        try:
            obj.load_state_dict(tree[name])
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise IncompatibleStateError(f"{where}: {name} state does not load: {e}") from e
    saved_tracked = tree.get("tracked", {})
    for name, obj in components.tracked.items():
        load_tracked(name, obj, saved_tracked, where)


def load_tracked(name: str, obj: Stateful, saved: Mapping[str, Any], where: str) -> bool:
    """Loads one tracked object's state; False when the checkpoint has none for it."""
    if name not in saved:
        return False
    try:
        obj.load_state_dict(saved[name])
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise IncompatibleStateError(f"{where}: tracked object {name!r} does not load its state: {e}") from e
    return True
