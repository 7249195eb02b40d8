"""What every ``preempt`` checkpoint command shares: its exit codes, its failure, its JSON output.

Imported by :mod:`preempt.cli.main` (the parser and the dispatch) and :mod:`preempt.cli.checkpoints` (the commands),
so that neither imports the other's private names. No torch here.
"""

from __future__ import annotations

import json
import math
from typing import Any

EXIT_OK, EXIT_DAMAGED, EXIT_USAGE, EXIT_LOCKED, EXIT_UNREADABLE = 0, 1, 2, 3, 4

EXIT_CODES = """\
exit codes:
  0  ok
  1  a checkpoint is damaged: a file missing, truncated or with another digest, a corrupt manifest or header
  2  bad usage: no such directory, no checkpoint at STEP, --out exists without --force; a mirror's URL: no
     such bucket, no client for its scheme (pip install 'preempt-torch[mirror]')
  3  the save_dir is locked by a running process (prune --yes, pull)
  4  a file could not be read for a reason of the environment (permission denied, out of memory, too many
     open files, an I/O error; a mirror unreachable or refusing access), and nothing read was damaged: not
     damage; fix the cause and run again"""


class CommandFailed(Exception):
    """Ends a command with an exit code and a message for stderr."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def emit(doc: Any) -> None:
    """One JSON document on stdout (``--json``), strict JSON (RFC 8259): a non-finite number (a NaN metric in a
    manifest or a history) is written as the string ``"nan"``, ``"inf"`` or ``"-inf"``, as history.jsonl writes it,
    since the bare ``NaN`` and ``Infinity`` tokens that Python's json allows are refused by most other readers."""
    print(json.dumps(_strict(doc), indent=1, allow_nan=False))


def _strict(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x
