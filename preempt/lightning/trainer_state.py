"""What a checkpoint keeps of Lightning's own state, as a tree of tensors and JSON (no pickle).

Lightning's checkpoint holds the loops' progress counters, each callback's state (ModelCheckpoint's best path
and score, EarlyStopping's wait count), the datamodule's state, the module's hyper-parameters and whatever the
module's and datamodule's ``on_save_checkpoint`` add. :class:`TrainerState` gives the run all of these as one
tracked object, so they go through preempt's codec: tensors in safetensors, the rest in JSON. A value of another
type (a class, a ``Namespace``) is refused by the codec with a message naming its key, never pickled.

The model, optimizers, schedulers and the precision plugin's scaler are the run's own components; Lightning's
``state_dict`` entry and the RNG states are the run's too.

A datamodule of Lightning 2.x has ``state_dict``/``load_state_dict`` but no ``on_save_checkpoint`` hooks (1.x had
them, and a user's class may still define them): each hook is called only where the object has it.

The hyper-parameters are a record, not state: the module that resumes is built by the user's code with its own. So
they never block a run: what JSON can hold is kept as it is, and anything else (a ``torch.nn.Module`` given to
``save_hyperparameters()``, a ``functools.partial`` optimizer factory, a class) is recorded by its type and import
path (:func:`hyper_parameters`), with one warning naming the keys.

On load, the fit loop's counters are loaded through ``fit_loop.load_state_dict``, which marks the loops as
restarting: Lightning then continues the epoch after the last step, exactly as after its own mid-epoch
checkpoint. The hyper-parameters are kept for reading (``preempt inspect``, ``export``), not loaded: the module
that resumes was built with its own.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .. import _log
from ..errors import IncompatibleStateError

if TYPE_CHECKING:
    import lightning.pytorch as pl

# The keys of one Lightning state; the format's version, for a later change of it.
VERSION = 1
_DEPTH = 16  # deeper hyper-parameters are recorded by type (the codec refuses JSON past 64 levels)


def _path(obj: Any) -> str:
    """``torch.nn.modules.linear.Linear`` for a class or an instance of it; a function's qualified name."""
    target = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    module = getattr(target, "__module__", None) or "?"
    return f"{module}.{getattr(target, '__qualname__', type(target).__name__)}"


def _record(value: Any) -> str:
    """What a value JSON cannot hold is recorded as: its kind and import path, never its contents."""
    if isinstance(value, functools.partial):
        return f"<functools.partial of {_path(value.func)}>"
    if isinstance(value, type):
        return f"<class {_path(value)}>"
    if callable(value) and hasattr(value, "__qualname__") and not hasattr(value, "state_dict"):
        return f"<function {_path(value)}>"
    return f"<{_path(value)}>"


def hyper_parameters(hparams: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The hyper-parameters as JSON can hold them, and the keys recorded by type instead (dotted, in order).

    Strings, numbers, booleans, None, lists, tuples and string-keyed dicts of these are kept;
    anything else (modules, partials, classes, tensors, ``Namespace``) becomes a string naming its type and import
    path. Pure: nothing is called on the values.
    """
    recorded: list[str] = []

    def keep(value: Any, key: str, depth: int) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if depth < _DEPTH and isinstance(value, (list, tuple)):
            return [keep(v, f"{key}[{i}]", depth + 1) for i, v in enumerate(value)]
        if depth < _DEPTH and isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return {k: keep(v, f"{key}.{k}", depth + 1) for k, v in value.items()}
        recorded.append(key)
        return _record(value)

    kept = {str(k): keep(v, str(k), 1) for k, v in hparams.items()}
    return kept, recorded


class TrainerState:
    """The trainer's own state as one object with ``state_dict``/``load_state_dict`` (tracked by the run).

    Args:
        trainer: The trainer being fit.
        module: Its LightningModule.
        skip: The callback that owns the run: its own state is the run's, not Lightning's.
    """

    def __init__(self, trainer: pl.Trainer, module: pl.LightningModule, skip: Any) -> None:
        self.trainer = trainer
        self.module = module
        self.skip = skip
        self._told: set[str] = set()  # hyper-parameters already said to be recorded by type

    def _hyper_parameters(self) -> dict[str, Any]:
        kept, recorded = hyper_parameters(self.module.hparams)
        new = [key for key in recorded if key not in self._told]
        if new:
            self._told.update(new)
            _log.log.warning(
                "Lightning hyper-parameters %s are kept in checkpoints by type and import path only (JSON cannot hold"
                " them, and preempt never pickles); resuming does not need them: your code builds the module",
                ", ".join(new),
            )
        return kept

    def _callbacks(self) -> list[Any]:
        return [cb for cb in self.trainer.callbacks if cb is not self.skip]

    def state_dict(self) -> dict[str, Any]:
        import lightning

        trainer = self.trainer
        callbacks = {}
        for cb in self._callbacks():
            s = cb.state_dict()
            if s:
                callbacks[cb.state_key] = s
        datamodule = trainer.datamodule
        extras: dict[str, Any] = {}
        self.module.on_save_checkpoint(extras)  # what the user's module adds to a Lightning checkpoint
        dm_extras: dict[str, Any] = {}
        if datamodule is not None and callable(getattr(datamodule, "on_save_checkpoint", None)):
            datamodule.on_save_checkpoint(dm_extras)  # Lightning 1.x's hook, still defined by some datamodules
        return {
            "version": VERSION,
            "lightning_version": lightning.__version__,
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "fit_loop": trainer.fit_loop.state_dict(),
            "callbacks": callbacks,
            "datamodule": datamodule.state_dict() if datamodule is not None else None,
            "hyper_parameters": self._hyper_parameters(),
            "module_extras": extras,
            "datamodule_extras": dm_extras,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != VERSION:
            found = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise IncompatibleStateError(f"Lightning state: expected version {VERSION}, found {found!r}")
        trainer = self.trainer
        for key in ("fit_loop", "callbacks", "module_extras", "datamodule_extras"):
            if not isinstance(state.get(key), dict):
                raise IncompatibleStateError(
                    f"Lightning state: {key}: expected an object, found {type(state.get(key)).__name__}"
                )
        trainer.fit_loop.load_state_dict(state["fit_loop"])
        saved = state["callbacks"]
        for cb in self._callbacks():
            if cb.state_key in saved:
                cb.load_state_dict(saved[cb.state_key])
        datamodule = trainer.datamodule
        if datamodule is not None and state.get("datamodule"):
            datamodule.load_state_dict(state["datamodule"])
        if state["module_extras"]:
            self.module.on_load_checkpoint(dict(state["module_extras"]))
        if datamodule is not None and state["datamodule_extras"]:
            hook = getattr(datamodule, "on_load_checkpoint", None)
            if not callable(hook):
                raise IncompatibleStateError(
                    f"Lightning state: the checkpoint holds what {type(datamodule).__name__}.on_save_checkpoint added,"
                    " and this datamodule has no on_load_checkpoint to take it"
                )
            hook(dict(state["datamodule_extras"]))
