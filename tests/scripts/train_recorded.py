"""``tests/scripts/train.py`` with the live state of every step recorded: ``python train_recorded.py --live_dir DIR
TRAIN_ARGS...`` runs train.py with TRAIN_ARGS and writes, at each step's ``step`` point (its work done, just before
its ``run.step()``: the state a checkpoint taken at that step holds), the model's and the optimizer's tensors to
``DIR/step_NNNNNNNNN.safetensors`` (``tests/helpers/kept.py``, whose oracle compares every kept checkpoint with
them).

An uninterrupted run's records stand for the live state at each step of any run with the same training arguments
that resumes bit for bit (the checkpoint options change nothing a step computes): the suite's tests of train.py
compare their kept checkpoints with them (``reference.recorded(args)``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "scripts"))
import train  # noqa: E402

# tests/helpers/kept.py alone, by its path: the helpers package imports pytest, and the folder on sys.path would
# shadow top-level modules with its own (cli, distributed, metadata)
_spec = importlib.util.spec_from_file_location("kept", TESTS / "helpers" / "kept.py")
assert _spec is not None and _spec.loader is not None
kept = sys.modules["kept"] = importlib.util.module_from_spec(_spec)  # (its dataclass looks itself up there)
_spec.loader.exec_module(kept)


def main() -> int | None:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--live_dir", required=True)
    ours, rest = p.parse_known_args()

    def record(point: str, n: int) -> None:
        if point == "step":  # the loop's own thread, the step's work done: the run's step is the one about to count
            run = train._runs[0]
            live = run.components
            kept.record_live(ours.live_dir, run.global_step + 1, live.model, live.optimizer)

    train.act(record)
    sys.argv = [train.__file__, *rest]
    return train.main()


if __name__ == "__main__":
    sys.exit(main())
