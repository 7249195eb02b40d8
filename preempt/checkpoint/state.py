"""What a checkpoint holds, taken from live objects and put back into them.

A checkpoint is three or four files besides its manifest:

* ``model.safetensors``: the model's ``state_dict()`` as is, without the
  ``module.`` (DDP) or ``_orig_mod.`` (``torch.compile``) prefixes, so other
  tools can load it as plain weights;
* ``base.safetensors`` (when carrying unchanged files, :mod:`preempt.checkpoint.carry`):
  the model's parameters with ``requires_grad=False`` that no optimizer param
  group holds, taken out of ``model.safetensors``: the frozen base of a
  fine-tuning run, likely unchanged from one checkpoint to the next. Every
  buffer, trainable parameter and frozen parameter an optimizer holds stays
  in ``model.safetensors``. The split only groups; whether a file is carried
  is decided from its tensors, so a wrong guess costs bytes, never
  correctness. Absent when nothing is frozen. The model's weights are both
  files together (``preempt export`` merges them);
* ``state.safetensors``: every other tensor (optimizer moments, RNG states,
  tensors of tracked objects);
* ``state.json``: everything else (param groups, scheduler counters, GradScaler
  scale, the user's dict), with references into ``state.safetensors``.

Nothing is copied when capturing: the payload refers to the live tensors and
must be written before the loop goes on (a later asynchronous mode copies it
into host buffers first; the format does not change).

Putting state back checks before it changes anything (:func:`apply`): model
keys and shapes (:func:`compare_model` lists every difference), optimizer
groups, parameter counts and the shapes of per-parameter buffers, and the
presence and type of every other component's state. A mismatch leaves the
live objects as they were and raises IncompatibleStateError naming the file.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._torch_compat import compiled_original
from ..errors import IncompatibleStateError, UnsupportedStateError
from . import codec
from .components import Components, Stateful
from .names import BASE_FILE, MODEL_FILE, SHARD_BASE, SHARD_PIECES, STATE_FILE, STATE_JSON, is_shard_file  # noqa: F401
from .tensorfile import check_tensor

RANK_FILE = "rank_{rank:05d}.safetensors"  # rank r's own state in a distributed checkpoint (its RNG)
RANK_JSON = "rank_{rank:05d}.json"


def shard_files(rank: int) -> tuple[str, str]:
    """The names of rank ``rank``'s files of pieces in a checkpoint of sharded state: of the frozen base (carried
    while unchanged), and of the rest of the model and optimizer (:func:`preempt.cluster.sharded.pieces_apart`)."""
    return SHARD_BASE.format(rank=rank), SHARD_PIECES.format(rank=rank)


def rank_files(rank: int) -> tuple[str, str]:
    """The names of rank ``rank``'s own files in a checkpoint written by several ranks."""
    return RANK_FILE.format(rank=rank), RANK_JSON.format(rank=rank)


_PREFIXES = ("module.", "_orig_mod.")

log = logging.getLogger("preempt")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP/DataParallel wrappers and ``torch.compile``."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif (inner := compiled_original(model)) is not None:
            model = inner
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
class Payload:
    """Files to write: tensor files (tensors, metadata) and JSON documents."""

    tensor_files: dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]]
    json_files: dict[str, Any]
    # Files linked from the previous checkpoint instead of written: name -> preempt.checkpoint.carry.Carry
    carried: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The digests (FileDigest), hashed at the step, of the files that a writer may read where they live after it: what
    # it writes of them must hash the same, or the checkpoint is not committed (preempt.checkpoint.carry)
    at_step: dict[str, Any] = dataclasses.field(default_factory=dict)
    # A staged payload's tensors that were not copied but are read where they live, by the writer, and what must
    # still hold once it has read them: preempt.checkpoint.staging.LiveTensors (None: every tensor is a copy)
    live: Any = None


def frozen_keys(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> set[str]:
    """The state_dict keys of the model's parameters with ``requires_grad=False`` that no optimizer group holds; none
    without an optimizer."""
    if optimizer is None:
        return set()  # no optimizer: the loop trains by hand (``p.data.add_``), whatever requires_grad says
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return {
        name
        for name, p in unwrap_model(model).named_parameters(remove_duplicate=False)
        if not p.requires_grad and id(p) not in held
    }


def capture(
    components: Components,
    run_state: Mapping[str, Any],
    *,
    group_frozen: bool = False,
    unready: list[tuple[str, Exception]] | None = None,
) -> Payload:
    """Takes the state of every component, plus ``run_state`` (RNG and user dict), without copying.

    Args:
        components: The live objects.
        run_state: The run's own state.
        group_frozen: Put the model's frozen parameters that no optimizer holds in ``base.safetensors``
            (:func:`frozen_keys`; no such file when there are none).
        unready: Given (at the run's start), a tracked object whose ``state_dict()`` raises is left out and
            named here with its error, instead of failing: its state may not exist yet (a batch the loop draws
            first inside the run). What a ``state_dict()`` returns is checked all the same.

    Raises:
        UnsupportedStateError: Some state is neither tensor nor JSON; the message names it.
    """
    model_tensors: dict[str, torch.Tensor] = {}
    base_tensors: dict[str, torch.Tensor] = {}
    tree: dict[str, Any] = {"model_extra": {}}
    if components.model is not None:
        frozen = frozen_keys(components.model, components.optimizer) if group_frozen else set()
        for key, value in unwrap_model(components.model).state_dict().items():
            if isinstance(value, torch.Tensor):
                (base_tensors if key in frozen else model_tensors)[key] = value
            else:
                tree["model_extra"][key] = value
    if components.optimizer is not None:
        tree["optimizer"] = components.optimizer.state_dict()
        # For `preempt inspect` only; loading ignores it (a checkpoint may move to another optimizer class).
        tree["optimizer_class"] = f"{type(components.optimizer).__module__}.{type(components.optimizer).__qualname__}"
    if components.scheduler is not None:
        tree["scheduler"] = components.scheduler.state_dict()
    if components.scaler is not None:
        tree["scaler"] = components.scaler.state_dict()
    tree["tracked"] = tracked = {}
    for name, obj in components.tracked.items():
        try:
            tracked[name] = obj.state_dict()
        except Exception as e:
            if unready is None:
                raise
            unready.append((name, e))
    tree.update(run_state)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = {}
    for name, sub in tree.items():
        skeleton[name] = codec.encode(sub, name, tensors)
    for key, t in [*model_tensors.items(), *base_tensors.items(), *tensors.items()]:
        try:
            check_tensor(key, t)
        except TypeError as e:
            raise UnsupportedStateError(str(e)) from None
    files = {MODEL_FILE: (model_tensors, {"format": "pt"})}
    if base_tensors:
        files[BASE_FILE] = (base_tensors, {"format": "pt"})
    files[STATE_FILE] = (tensors, {})
    return Payload(tensor_files=files, json_files={STATE_JSON: skeleton})


@dataclasses.dataclass
class Loaded:
    """A verified checkpoint's content in memory."""

    path: str
    model: dict[str, torch.Tensor]
    tree: dict[str, Any]  # decoded state.json (empty for a weights-only read)
    mapped: tuple[tuple[int, int], ...] = ()  # (address, bytes) of file mappings the tensors may view
    sharded: bool = False  # model and optimizer tensors are DCP pieces in the checkpoint (preempt.cluster.sharded)
    pieces: tuple[tuple[str, dict[str, torch.Tensor], dict[str, str]], ...] = ()  # the ranks' (path, tensors, meta)


def own_small_state(tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` with every tensor copied into its own memory except the optimizer's per-parameter state.

    Loaded tensors view a private mapping of the checkpoint file. What the run
    keeps beyond loading (RNG states, tracked state) must not pin that file:
    it may be pruned, and a file truncated by someone else while mapped
    faults on access. These tensors are small; the optimizer's, which are
    not, are handled by :func:`apply` once it knows their device.
    """

    def owned(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.clone()
        if isinstance(obj, dict):
            return {k: owned(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(owned(v) for v in obj)
        return obj

    out = {}
    for key, value in tree.items():
        if key == "optimizer" and isinstance(value, dict):
            out[key] = {k: (v if k == "state" else owned(v)) for k, v in value.items()}
        else:
            out[key] = owned(value)
    return out


def _release_mappings(optimizer: torch.optim.Optimizer, mapped: Sequence[tuple[int, int]]) -> None:
    """Copies the optimizer's state tensors that still view a checkpoint file's mapping into their own memory.

    Loading moves each tensor to its parameter's device and dtype; those on
    the GPU were copied there straight from the mapping and need nothing.
    """
    if not mapped:
        return
    for per_param in optimizer.state.values():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                ptr = value.data_ptr()
                if any(start <= ptr < start + size for start, size in mapped):
                    per_param[key] = value.clone()


# Per-parameter buffers of torch.optim that always have their parameter's shape (moments, momentum,
# accumulators). Other per-parameter tensors are not checked: Adafactor's row_var/col_var are factored,
# LBFGS keeps flat vectors of every parameter on the first one, and other libraries keep preconditioners.
_PARAM_SHAPED = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "momentum_buffer",
        "square_avg",
        "acc_delta",
        "grad_avg",
        "sum",
        "exp_inf",
        "ax",
        "prev",
        "step_size",
        "variance",
    }
)
_SHOWN = 20  # items of one kind listed in a message; the rest are counted


@dataclasses.dataclass(frozen=True)
class ModelDiff:
    """How checkpoint weights line up with a model, keyed as the unwrapped model names them.

    Attributes:
        weights: The checkpoint tensors whose key and shape match the model.
        missing: Model keys the checkpoint lacks.
        unexpected: Checkpoint keys the model lacks.
        shapes: ``(key, checkpoint shape, model shape)`` for keys in both with different shapes.
    """

    weights: dict[str, torch.Tensor]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    shapes: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]

    @property
    def matches(self) -> bool:
        return not (self.missing or self.unexpected or self.shapes)

    def describe(self) -> str:
        """A count of each kind of difference, then one line per kind listing the keys (the first 20, and how many)."""
        counts = [
            f"{len(items)} {label}"
            for items, label in (
                (self.shapes, "of another shape"),
                (self.missing, "missing in checkpoint"),
                (self.unexpected, "not in model"),
            )
            if items
        ]
        lines = [f"({', '.join(counts)})"]
        if self.shapes:
            shapes = [f"{k}: checkpoint {tuple(a)}, model {tuple(b)}" for k, a, b in self.shapes]
            lines.append(f"  shape: {_listing(shapes, '; ')}")
        if self.missing:
            lines.append(f"  missing in checkpoint: {_listing(self.missing)}")
        if self.unexpected:
            lines.append(f"  not in model: {_listing(self.unexpected)}")
        hint = _prefix_hint(self.missing, self.unexpected)
        if hint:
            lines.append(f"  hint: {hint}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class SkippedKeys:
    """What a non-strict :func:`load_model` left out (both empty after a strict load).

    Attributes:
        missing: Model keys the checkpoint lacks; they keep the model's values.
        unexpected: Checkpoint keys the model lacks; ignored.
    """

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()


def compare_model(
    model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], extra: Mapping[str, Any] | None = None
) -> ModelDiff:
    """Matches checkpoint weights to the model's keys and shapes; never raises.

    Args:
        model: The model (wrappers are seen through).
        tensors: The checkpoint's weights.
        extra: The checkpoint's non-tensor model state (``get_extra_state``), whose
            keys are compared too; None (a weights-only read) compares tensors only.
    """
    target = unwrap_model(model).state_dict()
    wanted = {k for k, v in target.items() if isinstance(v, torch.Tensor)}
    mapping = strip_prefixes(list(tensors), wanted)
    weights = {mapping[k]: v for k, v in tensors.items()}
    wanted_extra = set() if extra is None else set(target) - wanted
    given_extra = set(extra or ())
    missing = sorted((wanted - weights.keys()) | (wanted_extra - given_extra))
    unexpected = sorted((weights.keys() - wanted) | (given_extra - wanted_extra))
    shapes = tuple(
        (k, tuple(weights[k].shape), tuple(target[k].shape))
        for k in sorted(wanted & weights.keys())
        if tuple(weights[k].shape) != tuple(target[k].shape)
    )
    bad = {k for k, _, _ in shapes}
    matched = {k: v for k, v in weights.items() if k in wanted and k not in bad}
    return ModelDiff(matched, tuple(missing), tuple(unexpected), shapes)


def load_model(
    model: torch.nn.Module, loaded: Loaded, extra: Mapping[str, Any] | None = None, *, strict: bool = True
) -> SkippedKeys:
    """Copies verified weights into the model, after checking them all (a mismatch changes nothing).

    Args:
        model: The model (wrappers are seen through).
        loaded: A verified checkpoint's content.
        extra: The model's non-tensor state (``get_extra_state``), from ``state.json``.
        strict: When False, load the tensors whose key and shape match and
            skip the rest: model keys the checkpoint lacks keep their current
            values, checkpoint keys the model lacks are ignored; both are
            logged and returned. A key present in both with another shape is
            still an error: that name holds something else now (a resized
            embedding or head), and silently keeping the fresh values for a
            tensor the user believes loaded is the failure this option must
            not hide. ``torch.nn.Module.load_state_dict(strict=False)`` decides
            the same way. To drop such a tensor, delete it from the model or
            rename it.

    Returns:
        What was skipped (nothing after a strict load).

    Raises:
        IncompatibleStateError: Listing every difference that is not allowed.
    """
    where = f"{loaded.path}/{MODEL_FILE}"
    diff = compare_model(model, loaded.model, extra)
    _raise_unless_fits(diff, where, strict)
    return _load_checked(model, diff, extra, where)


def _raise_unless_fits(diff: ModelDiff, where: str, strict: bool) -> None:
    if diff.shapes or (strict and not diff.matches):
        allowed = "" if strict else " even with strict=False, which skips missing and unexpected keys, not shapes"
        raise IncompatibleStateError(f"{where}: the model does not match the checkpoint{allowed} {diff.describe()}")


def _load_checked(model: torch.nn.Module, diff: ModelDiff, extra: Mapping[str, Any] | None, where: str) -> SkippedKeys:
    state: dict[str, Any] = dict(diff.weights)
    if extra:
        state.update({k: v for k, v in extra.items() if k not in diff.unexpected})
    try:
        with torch.no_grad():
            # strict=False: the keys were checked already; what is left out is diff.missing.
            unwrap_model(model).load_state_dict(state, strict=False)
    except Exception as e:  # a module's own set_extra_state or _load_from_state_dict refused
        raise IncompatibleStateError(f"{where}: the model does not load its state: {type(e).__name__}: {e}") from e
    skipped = SkippedKeys(diff.missing, diff.unexpected)
    if skipped.missing or skipped.unexpected:
        log.warning(
            "%s: loaded %d of the model's tensors (strict=False)%s%s",
            where,
            len(diff.weights),
            f"; left as they were, not in the checkpoint: {_listing(skipped.missing)}" if skipped.missing else "",
            f"; ignored, not in the model: {_listing(skipped.unexpected)}" if skipped.unexpected else "",
        )
    return skipped


def _check_optimizer(optimizer: torch.optim.Optimizer, state: Any, where: str) -> None:
    """Everything torch's ``Optimizer.load_state_dict`` would take without complaint but should not.

    Groups and parameter counts, and the shapes of the per-parameter buffers
    (a different parameter order with equal counts shows up here: ``exp_avg``
    of a bias lands on a weight).
    """
    groups = state.get("param_groups") if isinstance(state, dict) else None
    saved_state = state.get("state") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not isinstance(saved_state, dict):
        raise IncompatibleStateError(f"{where}: optimizer state must hold a param_groups list and a state dict")
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise IncompatibleStateError(
            f"{where}: optimizer param_groups: each group must be an object with a params list"
        )
    have = [len(g["params"]) for g in optimizer.param_groups]
    saved = [len(g["params"]) for g in groups]
    if have != saved:
        raise IncompatibleStateError(
            f"{where}: the optimizer has {len(have)} parameter group(s) with {have} parameters,"
            f" the checkpoint {len(saved)} with {saved}"
        )
    ids = [i for g in groups for i in g["params"]]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids) or len(set(ids)) != len(ids):
        raise IncompatibleStateError(f"{where}: optimizer param_groups: parameter ids must be distinct integers")
    wrong = []
    for gi, (group, saved_group) in enumerate(zip(optimizer.param_groups, groups, strict=True)):
        for pi, (param, pid) in enumerate(zip(group["params"], saved_group["params"], strict=True)):
            entry = saved_state.get(pid)
            if entry is None:
                continue
            if not isinstance(entry, dict):
                raise IncompatibleStateError(
                    f"{where}: optimizer state of group {gi} parameter {pi}: expected an object,"
                    f" found {type(entry).__name__}"
                )
            for name, value in entry.items():
                if (
                    name in _PARAM_SHAPED
                    and isinstance(value, torch.Tensor)
                    and tuple(value.shape) != tuple(param.shape)
                ):
                    wrong.append(
                        f"group {gi} parameter {pi} {name}: checkpoint {tuple(value.shape)},"
                        f" parameter {tuple(param.shape)}"
                    )
    if wrong:
        raise IncompatibleStateError(
            f"{where}: the optimizer state does not fit the parameters ({len(wrong)} buffer(s) of another shape;"
            f" were the parameters passed in another order?): {_listing(wrong, '; ')}"
        )


def _check_like(name: str, obj: Stateful, saved: Any, where: str) -> None:
    """The cheap checks of a scheduler's or scaler's saved state against the live object's own."""
    live = obj.state_dict()
    if isinstance(live, dict) and not isinstance(saved, dict):
        raise IncompatibleStateError(f"{where}: {name} state: expected an object, found {type(saved).__name__}")
    if isinstance(live, dict):
        # Torch's schedulers load with ``self.__dict__.update(state)``: an unknown key naming a method
        # or the optimizer would replace it, and fail (or worse) at the next step(), far from here.
        shadowing = sorted(str(k) for k in saved if k not in live and (k == "optimizer" or hasattr(type(obj), k)))
        if shadowing:
            raise IncompatibleStateError(
                f"{where}: {name} state holds {', '.join(shadowing[:_SHOWN])}, which this"
                f" {type(obj).__name__} does not save and which would replace its attribute(s) of that name"
            )
    if isinstance(live, dict) and live and saved == {}:
        # GradScaler.state_dict() of a disabled scaler is {}; an enabled one refuses it.
        raise IncompatibleStateError(
            f"{where}: the checkpoint holds an empty {name} state (saved from a disabled {type(obj).__name__}?)"
            f" but this {name} has state ({', '.join(sorted(map(str, live))[:_SHOWN])})"
        )


def apply(components: Components, loaded: Loaded, *, strict: bool = True) -> SkippedKeys:
    """Restores every component from a verified checkpoint: checks everything, then loads.

    Every check that can be made without loading (presence of each
    component's state, model keys and shapes, optimizer groups, counts and
    buffer shapes, the type of the scheduler's and scaler's state, the
    tracked state's container) is made before any object is changed, so a
    mismatch leaves every object as it was. What cannot be known before
    loading is whether the scheduler, the scaler and the tracked objects
    accept their state (their ``load_state_dict`` is theirs): they are loaded
    first, and the model and optimizer, which are fully checked, last. So a
    refusal leaves the model and optimizer untouched too; the objects of
    that first group loaded before the one that refused keep their new state.

    Args:
        components: The live objects.
        loaded: The checkpoint's content.
        strict: Passed to :func:`load_model` for the model; the optimizer's
            state only fits a model whose parameters are all there, so a
            non-strict load is for weights-only use in practice.

    Returns:
        The model keys a non-strict load skipped.

    Raises:
        IncompatibleStateError: A component does not fit, or the checkpoint lacks
            state for a component the run has.
    """
    where = f"{loaded.path}/{STATE_JSON}"
    tree = loaded.tree
    opaque = [
        (name, obj)
        for name, obj in (("scheduler", components.scheduler), ("scaler", components.scaler))
        if obj is not None
    ]
    for name in ["optimizer"] * (components.optimizer is not None) + [n for n, _ in opaque]:
        if name not in tree:
            raise IncompatibleStateError(
                f"{where}: the run has a {name} but the checkpoint holds no {name} state;"
                " resume with weights_only=True to start it fresh"
            )
    for name, obj in opaque:
        _check_like(name, obj, tree[name], where)
    saved_tracked = tree.get("tracked", {})
    if not isinstance(saved_tracked, dict):
        raise IncompatibleStateError(f"{where}: tracked: expected an object, found {type(saved_tracked).__name__}")
    extra = tree.get("model_extra", {})
    if not isinstance(extra, dict):
        raise IncompatibleStateError(f"{where}: model_extra: expected an object, found {type(extra).__name__}")
    model_file = f"{loaded.path}/{MODEL_FILE}"
    diff = None
    if components.model is not None:  # first: a changed model is the likely cause of an optimizer misfit too
        diff = compare_model(components.model, loaded.model, extra)
        _raise_unless_fits(diff, model_file, strict)
    if components.optimizer is not None:
        _check_optimizer(components.optimizer, tree["optimizer"], where)

    # Checked. The objects whose acceptance only loading can tell come first.
    for name, obj in opaque:
        try:
            obj.load_state_dict(tree[name])
        except Exception as e:
            raise IncompatibleStateError(f"{where}: {name} state does not load: {type(e).__name__}: {e}") from e
    for name, obj in components.tracked.items():
        load_tracked(name, obj, saved_tracked, where)
    if components.optimizer is not None:
        try:
            components.optimizer.load_state_dict(tree["optimizer"])
        except Exception as e:
            raise IncompatibleStateError(f"{where}: optimizer state does not load: {type(e).__name__}: {e}") from e
        _release_mappings(components.optimizer, loaded.mapped)
    if components.model is None or diff is None:
        return SkippedKeys()
    return _load_checked(components.model, diff, extra, model_file)


def load_tracked(name: str, obj: Stateful, saved: Mapping[str, Any], where: str) -> bool:
    """Loads one tracked object's state; False when the checkpoint has none for it."""
    if not isinstance(saved, Mapping) or name not in saved:
        return False
    try:
        obj.load_state_dict(saved[name])
    except Exception as e:  # the object's own load_state_dict: any refusal is a misfit, said with its name
        raise IncompatibleStateError(
            f"{where}: tracked object {name!r} does not load its state: {type(e).__name__}: {e}"
        ) from e
    return True


def _listing(items: Sequence[str], sep: str = ", ") -> str:
    """The first items of a list and how many more there are."""
    shown = sep.join(items[:_SHOWN])
    return shown + (f"{sep}... and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def _prefix_hint(missing: Sequence[str], unexpected: Sequence[str]) -> str | None:
    """Says so when the checkpoint's keys are the model's with one leading component added or removed."""
    for longer, shorter, how in ((unexpected, missing, "carry"), (missing, unexpected, "lack")):
        if not longer or not shorter:
            return None
        short = set(shorter)
        heads = set()
        for key in longer:
            head, _, rest = key.partition(".")
            if rest not in short:
                break
            heads.add(head)
        else:
            if len(heads) == 1:
                return f"the checkpoint's keys {how} a prefix {next(iter(heads)) + '.'!r} that the model's do not"
    return None
