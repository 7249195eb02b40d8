"""What a checkpoint keeps of Lightning's own state, as a tree of tensors and JSON (no pickle).

Lightning's checkpoint holds the loops' progress counters, each callback's state (ModelCheckpoint's best path
and score, EarlyStopping's wait count), the datamodule's state, the module's hyper-parameters and whatever the
module's and datamodule's ``on_save_checkpoint`` add. :class:`TrainerState` gives the run all of these as one
tracked object, so they go through preempt's codec: tensors in safetensors, the rest in JSON. A value of another
type (a class, a ``Namespace``) is refused by the codec with a message naming its key, never pickled.

The model, optimizers, schedulers and the precision plugin's scaler are the run's own components; Lightning's
``state_dict`` entry and the RNG states are the run's too.

On load, the fit loop's counters are loaded through ``fit_loop.load_state_dict``, which marks the loops as
restarting: Lightning then continues the epoch after the last step, exactly as after its own mid-epoch
checkpoint. The hyper-parameters are kept for reading (``preempt inspect``, ``export``), not loaded: the module
that resumes was built with its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import IncompatibleStateError

if TYPE_CHECKING:
    import lightning.pytorch as pl

# The keys of one Lightning state; the format's version, for a later change of it.
VERSION = 1


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
        if datamodule is not None:
            datamodule.on_save_checkpoint(dm_extras)
        return {
            "version": VERSION,
            "lightning_version": lightning.__version__,
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "fit_loop": trainer.fit_loop.state_dict(),
            "callbacks": callbacks,
            "datamodule": datamodule.state_dict() if datamodule is not None else None,
            "hyper_parameters": dict(self.module.hparams),
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
            datamodule.on_load_checkpoint(dict(state["datamodule_extras"]))
