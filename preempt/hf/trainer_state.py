"""What a checkpoint keeps of the Trainer's own state (``trainer.state``: steps, epoch, logs, best metric), as JSON.

The Trainer writes its ``TrainerState`` as ``trainer_state.json``; here the same JSON goes into preempt's checkpoint
as a tracked object. On load, the fields that say how far training went are set on the Trainer's fresh state; those
the Trainer derives from its arguments at each start (``max_steps``, ``logging_steps``, ``eval_steps``,
``save_steps``, ``num_train_epochs``, ``train_batch_size``) keep the values of this start.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..errors import IncompatibleStateError

# Derived from the arguments at every start (TrainerState.init_training_references, compute_steps): not loaded.
_OF_THIS_START = frozenset(
    {"max_steps", "logging_steps", "eval_steps", "save_steps", "num_train_epochs", "train_batch_size"}
)


class TrainerProgress:
    """``trainer.state`` as one object with ``state_dict``/``load_state_dict`` (tracked by the run)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        # as TrainerState.save_to_json writes it: a JSON round trip leaves only JSON's types
        return {"trainer_state": json.loads(json.dumps(dataclasses.asdict(self.trainer.state)))}

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
