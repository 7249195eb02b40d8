"""What every ``preempt`` checkpoint command shares: its exit codes, its failure, its JSON output.

Imported by :mod:`preempt.cli.main` (the parser and the dispatch) and :mod:`preempt.cli.checkpoints` (the commands),
so that neither imports the other's private names. No torch here.
"""

from __future__ import annotations

import json
from typing import Any

EXIT_OK, EXIT_DAMAGED, EXIT_USAGE, EXIT_LOCKED, EXIT_UNREADABLE = 0, 1, 2, 3, 4

EXIT_CODES = """\
exit codes:
  0  ok
  1  a checkpoint is damaged: a file missing, truncated or with another digest, a corrupt manifest or header
  2  bad usage: no such directory, no checkpoint at STEP, --out exists without --force
  3  the save_dir is locked by a running process (prune --yes)
  4  a file could not be read for a reason of the environment (permission denied, out of memory, too many
     open files, an I/O error), and nothing read was damaged: not damage; fix the cause and run again"""


class CommandFailed(Exception):
    """Ends a command with an exit code and a message for stderr."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def emit(doc: Any) -> None:
    """One JSON document on stdout (``--json``)."""
    print(json.dumps(doc, indent=1, allow_nan=True))
