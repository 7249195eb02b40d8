"""Checkpoints moved out of discovery's sight and never deleted: ``quarantine/`` (broken) and ``superseded/``
(an abandoned timeline).

A broken checkpoint is evidence, and a superseded one someone's work: neither is deleted by the library. They are
renamed into ``save_dir/<where>/`` (one rename, atomic, then ``fsync(save_dir)``); a name already taken there gets a
``.1``, ``.2``, ... suffix. Where ``quarantine/`` cannot be used (a file or a symlink of that name), a broken
checkpoint is renamed in place to ``quarantined-<name>-<tag>`` instead: that name is neither discovered
(``step_*``) nor tidied at the start (``.tmp-``, ``.trash-``, ``.replaced-``, ``.recycle-``), so a later save of the
same step cannot replace it and delete it as a replaced copy. No torch here.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from .. import _testing
from . import hashed_io, names
from .names import QUARANTINE, QUARANTINED

log = logging.getLogger("preempt")


def move_aside(save_dir: Path, path: Path, where: str, name: str | None = None) -> Path:
    """Moves a checkpoint directory into ``save_dir/<where>/`` (as ``name``, default its own); returns where.

    Raises:
        OSError: ``where`` is a symlink (moving into it would write outside save_dir) or cannot be made or
            renamed into.
    """
    dest_dir = save_dir / where
    if dest_dir.is_symlink():
        raise OSError(errno.ELOOP, f"{dest_dir} is a symlink; expected a directory inside {save_dir}")
    dest_dir.mkdir(exist_ok=True)
    name = name or path.name
    dest = dest_dir / name
    n = 1
    while dest.exists():
        dest = dest_dir / f"{name}.{n}"
        n += 1
    os.rename(path, dest)
    hashed_io.fsync_dir(save_dir)
    return dest


def quarantine(save_dir: Path, path: Path, problem: str, name: str | None = None) -> Path | None:
    """A broken checkpoint moved to ``quarantine/`` (as ``name``), else renamed in place to ``quarantined-*``;
    where it went, or None (logged, with ``problem``) when neither rename works (then nothing can be written
    in save_dir either)."""
    name = name or path.name
    try:
        dest = move_aside(save_dir, path, QUARANTINE, name)
        _testing.emit("quarantined", name=path.name, to=str(dest), problem=problem)
        return dest
    except OSError as e:
        first = e
    dest = save_dir / f"{QUARANTINED}{name}-{names.tag()}"
    try:
        os.rename(path, dest)
        hashed_io.fsync_dir(save_dir)
    except OSError as e:
        log.warning("%s; left in place: cannot move it aside (%s; %s)", problem, first, e)
        return None
    log.warning("%s cannot be used (%s): %s is set aside in place", save_dir / QUARANTINE, first, name)
    _testing.emit("quarantined", name=path.name, to=str(dest), problem=problem)
    return dest
