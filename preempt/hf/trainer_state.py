"""What a checkpoint keeps of the Trainer's own state, as JSON and one tensor: where training is, and what it counts.

The Trainer writes its ``TrainerState`` as ``trainer_state.json``; here the same JSON goes into preempt's checkpoint
as a tracked object. On load, the fields that say how far training went are set on the Trainer's fresh state; those
the Trainer derives from its arguments at each start (``max_steps``, ``logging_steps``, ``eval_steps``,
``save_steps``, ``num_train_epochs``, ``train_batch_size``) keep the values of this start.

Beside it, what the Trainer counts in the process and would start again from zero in a resumed one (its own
checkpoints lose it too), so that what a user reads at the end equals an uninterrupted run's:

- the loss summed since the last log (``_tr_loss``, a tensor kept as it is), the sum of the logged ones
  (``_total_loss_scalar``), the step of the last log and the step the run first started at: the first ``loss`` logged
  after a resume, ``train_loss`` and ``TrainOutput.training_loss`` are over the whole run;
- the floating-point operations not yet added to ``state.total_flos`` (``current_flos``);
- the seconds trained by the processes before, so that ``train_runtime`` and the rates are over the whole run too;
- each exportable callback's attributes (``EarlyStoppingCallback``'s patience counter), set back on the callbacks
  the script built (the Trainer's own resume makes new ones);
- what trl's trainers count by themselves (``SFTTrainer``'s tokens seen, ``num_tokens``, and the metrics gathered
  since the last log).

The Trainer sets its counters back to zero after the checkpoint is loaded (in ``_inner_training_loop``, before
``on_train_begin``): they are kept on load and put in place by :meth:`TrainerProgress.continue_counters` then.
Under torchrun the checkpoint holds rank 0's counters, which every rank gets back: the loss summed since the last
log (each rank's own, averaged across ranks when logged) is exact only for a stop at a logging step.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from ..errors import IncompatibleStateError

# Derived from the arguments at every start (TrainerState.init_training_references, compute_steps): not loaded.
_OF_THIS_START = frozenset(
    {"max_steps", "logging_steps", "eval_steps", "save_steps", "num_train_epochs", "train_batch_size"}
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Counters:
    """What the Trainer counts in the process, at a checkpoint (see the module's docstring)."""

    loss_since_log: torch.Tensor
    logged_loss_sum: float
    last_logged_step: int
    first_step: int
    flos: float
    seconds: float


class TrainerProgress:
    """``trainer.state`` and the Trainer's counters as one object with ``state_dict``/``load_state_dict``.

    Args:
        trainer: The Trainer.
        clock: Wall-clock seconds, as the Trainer times its training (``time.time``).
    """

    def __init__(self, trainer: Any, clock: Callable[[], float] = time.time) -> None:
        self.trainer = trainer
        self.clock = clock
        self.seconds_before = 0.0  # trained by the processes before this one, up to the checkpoint resumed from
        self._began: float | None = None  # when this process's training began (continue_counters)
        self._loaded: Counters | None = None
        self._loaded_trl: dict[str, Any] | None = None

    # ------------------------------------------------------------------ saving

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        # as TrainerState.save_to_json writes it: a JSON round trip leaves only JSON's types
        out: dict[str, Any] = {"trainer_state": json.loads(json.dumps(dataclasses.asdict(trainer.state)))}
        loss = getattr(trainer, "_tr_loss", None)
        if self._began is not None and isinstance(loss, torch.Tensor):  # inside train(): the counters exist
            out["counters"] = {
                "loss_since_log": loss.detach().to("cpu", copy=True),
                "logged_loss_sum": float(trainer._total_loss_scalar),
                "last_logged_step": int(trainer._globalstep_last_logged),
                # transformers 5.19 added it (train()'s loss and throughput count this call's steps only); before,
                # nothing reads it, and 0 is what those versions divide by instead
                "first_step": int(getattr(trainer, "_initial_global_step", 0)),
                "flos": float(trainer.current_flos),
                "seconds": self.seconds_before + (self.clock() - self._began),
            }
        out["callbacks"] = json.loads(json.dumps(_callback_states(trainer)))
        trl = _trl_counts(trainer)
        if trl is not None:
            out["trl"] = trl
        return out

    # ------------------------------------------------------------------ loading

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("trainer_state") if isinstance(state, dict) else None
        if not isinstance(saved, dict) or not isinstance(saved.get("global_step"), int):
            raise IncompatibleStateError(
                f"Trainer state: expected an object with an integer global_step, found {type(saved).__name__}"
            )
        current = self.trainer.state
        for key, value in saved.items():
            if key not in _OF_THIS_START and hasattr(current, key):
                setattr(current, key, value)
        counters = state.get("counters")
        if counters is not None:  # absent from checkpoints of earlier versions: the counters start at zero
            self._loaded = _counters(counters)
            self.seconds_before = self._loaded.seconds
        _set_callback_states(self.trainer, state.get("callbacks") or {})
        self._loaded_trl = state.get("trl")

    def continue_counters(self) -> None:
        """At ``on_train_begin``, after the Trainer zeroed its counters: the loaded ones put back; this process's
        training seconds counted from now."""
        trainer, loaded = self.trainer, self._loaded
        self._began = self.clock()
        if loaded is not None:
            trainer._tr_loss = loaded.loss_since_log.to(trainer._tr_loss.device, copy=True)
            trainer._total_loss_scalar = loaded.logged_loss_sum
            trainer._globalstep_last_logged = loaded.last_logged_step
            trainer._initial_global_step = loaded.first_step
            trainer.current_flos = loaded.flos
        if self._loaded_trl is not None:
            _set_trl_counts(trainer, self._loaded_trl)
        self._loaded, self._loaded_trl = None, None


def _counters(saved: Any) -> Counters:
    """The saved counters, each checked: a checkpoint written by another program is not trusted."""
    expected: dict[str, type | tuple[type, ...]] = {
        "loss_since_log": torch.Tensor,
        "logged_loss_sum": float,
        "last_logged_step": int,
        "first_step": int,
        "flos": (int, float),
        "seconds": (int, float),
    }
    if not isinstance(saved, dict):
        raise IncompatibleStateError(f"Trainer counters: expected an object, found {type(saved).__name__}")
    for key, kind in expected.items():
        value = saved.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise IncompatibleStateError(f"Trainer counters: {key}: expected {kind}, found {type(value).__name__}")
    shape = tuple(saved["loss_since_log"].shape)
    if shape:
        raise IncompatibleStateError(f"Trainer counters: loss_since_log: expected a 0-d tensor, found shape {shape}")
    return Counters(
        loss_since_log=saved["loss_since_log"],
        logged_loss_sum=float(saved["logged_loss_sum"]),
        last_logged_step=saved["last_logged_step"],
        first_step=saved["first_step"],
        flos=float(saved["flos"]),
        seconds=float(saved["seconds"]),
    )


def _exportable(trainer: Any) -> list[Any]:
    """The callbacks whose state the Trainer's own checkpoints keep (``ExportableState``), in the handler's order.
    (``TrainerControl`` is left out: the Trainer resets it at ``on_train_begin``.)"""
    from transformers.trainer_callback import ExportableState

    return [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ExportableState)]


def _callback_states(trainer: Any) -> dict[str, list[dict[str, Any]]]:
    states: dict[str, list[dict[str, Any]]] = {}
    for cb in _exportable(trainer):
        states.setdefault(type(cb).__name__, []).append(dict(cb.state().get("attributes", {})))
    return states


def _set_callback_states(trainer: Any, saved: Any) -> None:
    """Each saved callback's attributes set on the script's callback of that class, in order (the objects the script
    holds stay the ones the Trainer calls)."""
    if not isinstance(saved, dict):
        raise IncompatibleStateError(f"Trainer callbacks: expected an object, found {type(saved).__name__}")
    by_name: dict[str, list[Any]] = {}
    for cb in _exportable(trainer):
        by_name.setdefault(type(cb).__name__, []).append(cb)
    for name, attributes in saved.items():
        if not isinstance(attributes, list) or not all(isinstance(a, dict) for a in attributes):
            raise IncompatibleStateError(f"Trainer callbacks: {name}: expected a list of objects")
        for cb, values in zip(by_name.get(name, []), attributes, strict=False):
            for key, value in values.items():
                setattr(cb, key, value)


def _trl_counts(trainer: Any) -> dict[str, Any] | None:
    """trl's counts kept on its trainers: the tokens seen (``_total_train_tokens``, logged as ``num_tokens``) and
    the metrics gathered since the last log (``_metrics``, averaged when logged); None for another Trainer."""
    tokens, metrics = getattr(trainer, "_total_train_tokens", None), getattr(trainer, "_metrics", None)
    if not isinstance(tokens, int) or not isinstance(metrics, dict):
        return None
    gathered = {mode: {k: list(v) for k, v in values.items()} for mode, values in metrics.items()}
    return {"total_train_tokens": tokens, "metrics": json.loads(json.dumps(gathered))}


def _set_trl_counts(trainer: Any, saved: Any) -> None:
    if not isinstance(saved, dict) or not isinstance(saved.get("total_train_tokens"), int):
        raise IncompatibleStateError("trl counts: expected an object with an integer total_train_tokens")
    if not hasattr(trainer, "_total_train_tokens") or not isinstance(getattr(trainer, "_metrics", None), dict):
        raise IncompatibleStateError(
            f"trl counts: the checkpoint holds trl's token count, but this {type(trainer).__name__} keeps none"
        )
    trainer._total_train_tokens = saved["total_train_tokens"]
    for mode, values in (saved.get("metrics") or {}).items():
        kept = trainer._metrics.get(mode)
        if kept is None or not isinstance(values, dict):
            continue
        kept.clear()  # (a defaultdict(list): keep the object, the trainer appends to it)
        kept.update({k: list(v) for k, v in values.items()})
