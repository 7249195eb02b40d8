"""The optimizer's, scheduler's and scaler's saved numbers, checked against what torch accepts.

``Optimizer.load_state_dict`` and a scheduler's ``load_state_dict`` take whatever
a checkpoint holds: a learning rate that is a string or NaN, ``betas`` of three
values, a negative ``step`` (Adam divides by ``1 - beta**step``: zero), a
``step_size`` of 0 (``StepLR`` takes ``last_epoch % step_size``). Each fails
later, at the first step after the resume, or never fails and trains on
nonsense. These checks are pure functions of the saved tree and the name of
the live class that will take it, so that a forged but well-formed checkpoint
is refused like a damaged one and the run falls back to an older checkpoint.

Only what torch's own classes require is refused (the ranges their
constructors check, finite numbers, flags that are booleans, no NaN), and
only for torch's own classes, named by the live object (the one that would
use the values, whatever class the checkpoint claims): another library's
optimizer or scheduler may give the same name another meaning, or keep a NaN
on purpose. The one rule for every optimizer: a learning rate is a finite
number >= 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import torch

from ..errors import CorruptCheckpointError

Rule = Callable[[Any], bool]


def _real(v: Any) -> float | None:
    """A real number, or a one-element real tensor (a learning rate may be a tensor), as a float; else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not (v.dtype.is_complex or v.dtype == torch.bool):
        return float(v.item())
    return None


def _finite(v: Any) -> bool:
    x = _real(v)
    return x is not None and math.isfinite(x)


def _where(test: Callable[[float], bool]) -> Rule:
    """A finite real number (as :func:`_real` reads it) that passes ``test``."""

    def rule(v: Any) -> bool:
        x = _real(v)
        return x is not None and math.isfinite(x) and test(x)

    return rule


def _at_least(lo: float) -> Rule:
    return _where(lambda x: x >= lo)


def _count(lo: int) -> Rule:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _list_of(rule: Rule, length: int | None = None) -> Rule:
    return lambda v: isinstance(v, (list, tuple)) and (length is None or len(v) == length) and all(map(rule, v))


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


_in_unit = _where(lambda x: 0.0 <= x < 1.0)


def _eps(v: Any) -> bool:
    """A number >= 0, or Adafactor's pair ``(None or a number >= 0, a number >= 0)``."""
    if isinstance(v, (list, tuple)):
        return len(v) > 0 and all(x is None or _at_least(0.0)(x) for x in v)
    return _at_least(0.0)(v)


def _etas(v: Any) -> bool:
    """Rprop: ``0 < etaminus < 1 < etaplus``."""
    return _list_of(_finite, 2)(v) and _where(lambda x: 0.0 < x < 1.0)(v[0]) and _where(lambda x: x > 1.0)(v[1])


_NONNEG = _at_least(0.0)

# Any optimizer's: the learning rate (and the schedulers' initial_lr) is a finite number >= 0.
_ANY_GROUP: dict[str, tuple[Rule, str]] = {
    "lr": (_NONNEG, "a finite number >= 0"),
    "initial_lr": (_NONNEG, "a finite number >= 0"),
}
# torch.optim's: the ranges its constructors check, and its flags.
_TORCH_GROUP: dict[str, tuple[Rule, str]] = {
    **_ANY_GROUP,
    "eps": (_eps, "a finite number >= 0"),
    "weight_decay": (_NONNEG, "a finite number >= 0"),
    "momentum": (_NONNEG, "a finite number >= 0"),
    "dampening": (_finite, "a finite number"),
    "betas": (_list_of(_in_unit, 2), "a pair of numbers in [0, 1)"),
    "rho": (_where(lambda x: 0.0 <= x <= 1.0), "a number in [0, 1]"),
    "lr_decay": (_NONNEG, "a finite number >= 0"),
    "initial_accumulator_value": (_NONNEG, "a finite number >= 0"),
    "momentum_decay": (_NONNEG, "a finite number >= 0"),
    "etas": (_etas, "a pair (etaminus, etaplus) with 0 < etaminus < 1 < etaplus"),
    **{
        flag: (_is_bool, "true or false")
        for flag in ("amsgrad", "maximize", "nesterov", "centered", "capturable", "differentiable")
    },
    "decoupled_weight_decay": (_is_bool, "true or false"),
    "foreach": (lambda v: v is None or isinstance(v, bool), "null, true or false"),
    "fused": (lambda v: v is None or isinstance(v, bool), "null, true or false"),
}
# A scheduler's state (torch.optim.lr_scheduler), names shared by its classes.
_SCHEDULER: dict[str, tuple[Rule, str]] = {
    "last_epoch": (_count(-1), "an integer >= -1"),
    "_step_count": (_count(0), "an integer >= 0"),
    "base_lrs": (_list_of(_NONNEG), "a list of finite numbers >= 0"),
    "_last_lr": (_list_of(_NONNEG), "a list of finite numbers >= 0"),
    "min_lrs": (_list_of(_NONNEG), "a list of finite numbers >= 0"),
    "step_size": (_count(1), "an integer >= 1"),  # StepLR: last_epoch % step_size
    "T_max": (_where(lambda x: x > 0), "a finite number > 0"),
    "total_steps": (_count(1), "an integer >= 1"),
    "gamma": (_finite, "a finite number"),
    "eta_min": (_finite, "a finite number"),
}
# torch.amp.GradScaler: the asserts of its constructor, and a scale that can multiply a loss.
_SCALER: dict[str, tuple[Rule, str]] = {
    "scale": (_where(lambda x: x > 0), "a finite number > 0"),
    "growth_factor": (_where(lambda x: x > 1.0), "a finite number > 1"),
    "backoff_factor": (_where(lambda x: 0.0 < x < 1.0), "a number in (0, 1)"),
    "growth_interval": (_count(1), "an integer >= 1"),
    "_growth_tracker": (_count(0), "an integer >= 0"),
}


def _bad(where: str, field: str, expected: str, found: Any) -> NoReturn:
    raise CorruptCheckpointError(f"{where}: {field}: expected {expected}, found {_show(found)}")


def _show(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {tuple(v.shape)}" + (f" holding {v.item()!r}" if v.numel() == 1 else "")
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _check(
    values: Mapping[Any, Any], rules: Mapping[str, tuple[Rule, str]], where: str, field: str, *, nan: bool
) -> None:
    """Each value a rule names must pass it; with ``nan``, no NaN anywhere in the JSON values either."""
    for key, value in values.items():
        rule = rules.get(key) if isinstance(key, str) else None
        if rule is not None and not rule[0](value):
            _bad(where, f"{field}.{key}", rule[1], value)
        at = _first_nan(value) if nan else None
        if at is not None:
            _bad(where, f"{field}.{key}{at}", "a number", float("nan"))


def _first_nan(v: Any, depth: int = 0) -> str | None:
    """Where a NaN sits in a JSON-like value ('' for the value itself), or None. Tensors are not searched."""
    if isinstance(v, float):
        return "" if math.isnan(v) else None
    if depth < 8 and isinstance(v, (list, tuple)):
        return next((f"[{i}]{p}" for i, x in enumerate(v) if (p := _first_nan(x, depth + 1)) is not None), None)
    if depth < 8 and isinstance(v, dict):
        return next((f".{k}{p}" for k, x in v.items() if (p := _first_nan(x, depth + 1)) is not None), None)
    return None


def _torch_class(cls: str | None, package: str) -> bool:
    return isinstance(cls, str) and cls.startswith(package)


def check_optimizer(state: Any, where: str, cls: str | None) -> None:
    """An optimizer's saved ``state_dict()``: hyperparameters by type and range, each parameter's ``step`` and dtypes.

    Args:
        state: The saved state (``param_groups`` and ``state``); other shapes are left to the checks
            against the live optimizer (:func:`preempt.checkpoint.state.apply`).
        where: The file, for messages.
        cls: The live optimizer's class (``"torch.optim.adam.Adam"``): torch's own get every rule.

    Raises:
        CorruptCheckpointError: Naming the group or parameter, the field, what was expected and what was found.
    """
    if not isinstance(state, dict):
        return
    ours = _torch_class(cls, "torch.optim.")
    rules = _TORCH_GROUP if ours else _ANY_GROUP
    groups = state.get("param_groups")
    saved = state.get("state")
    per_param = saved if isinstance(saved, dict) else {}
    for gi, group in enumerate(groups if isinstance(groups, list) else []):
        if not isinstance(group, dict):
            continue
        _check(group, rules, where, f"optimizer.param_groups[{gi}]", nan=ours)
        if ours and group.get("amsgrad") is True:
            # Adam(W) reads max_exp_avg_sq of every parameter that has state: without it, the next step raises.
            for pid in group.get("params") or []:
                entry = per_param.get(pid) if isinstance(pid, int) else None
                if isinstance(entry, dict) and entry and "max_exp_avg_sq" not in entry:
                    _bad(
                        where,
                        f"optimizer.state.{pid}",
                        f"max_exp_avg_sq, which amsgrad=true in param_groups[{gi}] needs",
                        f"only {sorted(map(str, entry))}",
                    )
    for pid, entry in per_param.items() if ours else ():
        if not isinstance(entry, dict):
            continue
        if "step" in entry:
            step = entry["step"]
            x = _real(step)
            if x is None or not math.isfinite(x) or x < 0 or x != int(x):
                _bad(where, f"optimizer.state.{pid}.step", "a whole number >= 0 (a count of steps)", step)
        for name, value in entry.items():  # torch.optim keeps every tensor but step in its parameter's dtype
            if name != "step" and isinstance(value, torch.Tensor) and not _inexact(value):
                _bad(where, f"optimizer.state.{pid}.{name}", "a floating-point (or complex) tensor", value)


def _inexact(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def check_scheduler(state: Any, where: str, cls: str | None, field: str = "scheduler") -> None:
    """A scheduler's saved ``state_dict()`` (and those of the schedulers it chains): counters and rates.

    Args:
        state: The saved state.
        where: The file, for messages.
        cls: The live scheduler's class: only torch's (``torch.optim.lr_scheduler.*``) are checked.
        field: The state's place in the file, for messages.

    Raises:
        CorruptCheckpointError: Naming the field, what was expected and what was found.
    """
    if not isinstance(state, dict) or not _torch_class(cls, "torch.optim.lr_scheduler."):
        return
    _check(state, _SCHEDULER, where, field, nan=True)
    inner = state.get("_schedulers")
    for i, sub in enumerate(inner if isinstance(inner, list) else []):  # SequentialLR, ChainedScheduler
        check_scheduler(sub, where, cls, f"{field}._schedulers[{i}]")


def check_scaler(state: Any, where: str, cls: str | None) -> None:
    """A ``GradScaler``'s saved ``state_dict()`` (empty for a disabled one); only torch's scalers are checked.

    Raises:
        CorruptCheckpointError: Naming the field, what was expected and what was found.
    """
    if isinstance(state, dict) and _torch_class(cls, "torch."):
        _check(state, _SCALER, where, "scaler", nan=True)
