"""``tests/scripts/train.py`` with the faults a chaos campaign aims from inside (``tests/helpers/chaos.py``).

``python chaos_train.py [--chaos_io_error STAGE:N] [--chaos_stop_save STAGE:KILL|EIO] TRAIN_ARGS...`` runs train.py
with TRAIN_ARGS, and:

- ``--chaos_io_error STAGE:N``: the N-th time this process's commit reaches STAGE (``preempt.checkpoint.commit.STAGES``,
  before the rename), the write fails there with ``OSError(EIO)``, as a disk that fails a write;
- ``--chaos_stop_save STAGE:KILL|EIO``: the first time a commit reaches STAGE after the run has been asked to stop
  (the stop's own save, or a background write still in flight when the stop came), the process SIGKILLs itself there
  (KILL: the grace ran out during the stop) or the write fails with ``OSError(EIO)``;
- SIGQUIT dumps every thread's stack to stderr (``faulthandler``): what the campaign sends a process that hangs,
  before it kills it.

Each fault, when it fires, emits the event ``chaos`` (``what``, ``stage``, ``n``) first. The faults go through the
script's own fault points (``train.act``): nothing outside can aim a commit stage.
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import os
import signal
import sys
from pathlib import Path

HELPERS = Path(__file__).resolve().parent
SCRIPTS = HELPERS.parent / "scripts"
# run as a script, this folder is sys.path[0]: its modules (cli, distributed, metadata) would shadow top-level ones
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HELPERS]
sys.path.insert(0, str(SCRIPTS))
import train  # noqa: E402

from preempt import _testing  # noqa: E402
from preempt.checkpoint import commit  # noqa: E402


def _stage(option: str, spec: str) -> tuple[str, str]:
    stage, _, rest = spec.partition(":")
    if stage not in commit.STAGES or not rest:
        raise SystemExit(f"{option}: expected STAGE:... with STAGE in {commit.STAGES}, got {spec!r}")
    return stage, rest


def io_error(spec: str) -> None:
    stage, n = _stage("--chaos_io_error", spec)

    def action(point: str, count: int) -> None:
        if (point, count) == (stage, int(n)):
            _testing.emit("chaos", what="io_error", stage=stage, n=count)
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    train.act(action)


def stop_save(spec: str) -> None:
    stage, how = _stage("--chaos_stop_save", spec)
    if how not in ("KILL", "EIO"):
        raise SystemExit(f"--chaos_stop_save: expected STAGE:KILL or STAGE:EIO, got {spec!r}")
    fired = []

    def action(point: str, count: int) -> None:
        if point != stage or fired or not train._runs or not train._runs[0].stop_requested:
            return
        fired.append(point)
        _testing.emit("chaos", what=f"stop_save_{how.lower()}", stage=stage, n=count)
        if how == "KILL":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    train.act(action)


def main() -> int | None:
    faulthandler.register(signal.SIGQUIT, all_threads=True, chain=False)
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--chaos_io_error", default=None)
    p.add_argument("--chaos_stop_save", default=None)
    ours, rest = p.parse_known_args()
    if ours.chaos_io_error:
        io_error(ours.chaos_io_error)
    if ours.chaos_stop_save:
        stop_save(ours.chaos_stop_save)
    sys.argv = [train.__file__, *rest]
    return train.main()


if __name__ == "__main__":
    sys.exit(main())
