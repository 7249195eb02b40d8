"""Every command of the ``preempt`` command line, then a resume, on one save_dir; prints what each did as JSON.

Run by ``tests/faults/test_hostile_files.py`` in a real process, as root and with privileges dropped. Each command
goes through ``preempt.cli.main.main`` (and ``preempt supervise``) in this process with its output captured; an
exception that escapes a command is recorded with its traceback, for the test to fail on. The resume enters a
``PreemptibleRun`` on the save_dir with the model of ``tests/faults/test_bad_input.py`` (alone: an optimizer would
import torch._dynamo, seconds on a busy machine, and the reading, checking and quarantining are the same) and leaves
at once: preempt's documented errors (a ``PreemptError``) are recorded by class and message, anything else as a
traceback. The JSON document is the last line of stdout.

Usage: ``every_command.py SAVE_DIR OUT_DIR [--no-resume]``; OUT_DIR (outside SAVE_DIR) receives what
``export`` and ``report --plot`` write.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback
from pathlib import Path
from typing import Any


def command(argv: list[str]) -> dict[str, Any]:
    from preempt.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    doc: dict[str, Any] = {"argv": argv}
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            doc["rc"] = main(argv)
        except SystemExit as e:  # argparse's usage errors
            doc["rc"] = e.code
        except BaseException:
            doc["traceback"] = traceback.format_exc()
    return {**doc, "out": out.getvalue(), "err": err.getvalue()}


def resume(save_dir: str) -> dict[str, Any]:
    import torch

    from preempt import PreemptibleRun
    from preempt.errors import PreemptError

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))  # test_bad_input's
    try:
        with PreemptibleRun(save_dir, model=model, checkpoint_interval=None) as run:
            pass
    except PreemptError as e:
        return {"error": type(e).__name__, "message": str(e)}
    except BaseException:
        return {"traceback": traceback.format_exc()}
    return {"resumed_from": None if run.resumed_from is None else str(run.resumed_from), "step": run.global_step}


def main() -> None:
    save_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    runs = [
        ["ls", save_dir],
        ["ls", save_dir, "--json"],
        ["verify", save_dir],
        ["verify", save_dir, "--json"],
        ["inspect", save_dir],
        ["inspect", save_dir, "--json"],
        ["prune", save_dir, "--keep-last", "1"],
        ["prune", save_dir, "--keep-last", "2", "--yes"],
        ["export", save_dir, "--out", str(out_dir / "weights.safetensors")],
        ["report", save_dir],
        ["supervise", "--save-dir", save_dir, "--max-retries", "0", "--", "true"],
    ]
    doc: dict[str, Any] = {"commands": []}
    for argv in runs:
        print(f"running preempt {' '.join(argv)}", file=sys.stderr, flush=True)  # a hang shows where
        doc["commands"].append(command(argv))
    if "--no-resume" not in sys.argv:
        print("resuming", file=sys.stderr, flush=True)
        doc["resume"] = resume(save_dir)
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
