"""How the checkpoint commands choose and show checkpoints: the STEP selector, times, sizes, tables.

Shared by :mod:`preempt.cli.checkpoints` (ls, verify, prune, export) and :mod:`preempt.cli.inspection`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ..checkpoint.files import present
from ..checkpoint.manager import CheckpointInfo, CheckpointManager, rank_best
from ..checkpoint.names import QUARANTINE, QUARANTINED, SUPERSEDED
from ..checkpoint.recycle import file_bytes, pools
from ..errors import CheckpointUnreadableError, CorruptCheckpointError
from .output import EXIT_DAMAGED, EXIT_UNREADABLE, EXIT_USAGE, CommandFailed


def fmt_when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def fmt_utc(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat(timespec="seconds")


def fmt_table(rows: list[list[str]], right: Collection[int] = ()) -> list[str]:
    """Rows of cells as aligned lines; the columns in ``right`` are right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
    return out


def checkpoint_size(info: CheckpointInfo) -> int:
    """The bytes its manifest lists; without one, of the regular files in it (0 where it cannot be listed)."""
    if info.manifest is None:
        try:
            if not info.path.is_dir() or info.path.is_symlink():
                return 0
            with os.scandir(info.path) as entries:
                return sum(e.stat(follow_symlinks=False).st_size for e in entries if e.is_file(follow_symlinks=False))
        except OSError:
            return 0
    return sum(d.size for d in info.manifest.files.values())


def sizes_checked(info: CheckpointInfo) -> CheckpointInfo:
    """``info`` after a stat of each file its manifest lists (no hashing): a valid checkpoint with a file missing,
    not a regular file, or of another size than listed is corrupt, as a resume would find it; one whose file cannot
    be stat'ed for a reason of the environment is unreadable. What this cannot see, a changed byte, ``verify`` does."""
    if info.status != "valid" or info.manifest is None:
        return info
    for name, expected in sorted(info.manifest.files.items()):
        try:
            problem = present(info.path / name, expected)
        except CheckpointUnreadableError as e:
            return dataclasses.replace(info, status="unreadable", problem=str(e))
        if problem is not None:
            return dataclasses.replace(info, status="corrupt", problem=problem)
    return info


def carried_bytes(info: CheckpointInfo) -> tuple[int, list[int]]:
    """The bytes a checkpoint carried (hard links to files an earlier save wrote) and the steps that wrote them."""
    if info.manifest is None:
        return 0, []
    carried = info.manifest.carried
    steps = {d.carried_from for d in carried.values() if d.carried_from is not None}
    return sum(d.size for d in carried.values()), sorted(steps)


def resolve(save_dir: Path | str, infos: list[CheckpointInfo], selector: int | str) -> CheckpointInfo:
    """The checkpoint STEP names: a step (whatever its status), the newest valid one, or the best one.

    Raises:
        CommandFailed: EXIT_USAGE when there is none, saying what there is.
    """
    if isinstance(selector, int):
        for c in infos:
            if c.step == selector:
                return c
        have = ", ".join(str(c.step) for c in infos[:20]) + (", ..." if len(infos) > 20 else "")
        raise CommandFailed(EXIT_USAGE, f"{save_dir}: no checkpoint at step {selector} (steps here: {have or 'none'})")
    # A newer checkpoint that could not be read (permission, memory, I/O) may be the latest: never passed over.
    unreadable = [c for c in infos if c.status == "unreadable"]
    if selector == "latest":
        valid = [c for c in infos if c.status == "valid"]
        newer = [c for c in unreadable if not valid or c.step > valid[0].step]
        if newer:
            raise CommandFailed(
                EXIT_UNREADABLE, f"{newer[0].problem}; give STEP to choose an older checkpoint than {newer[0].name}"
            )
        if valid:
            return valid[0]
        broken = f" ({len(infos)} checkpoint(s), none with a valid manifest)" if infos else ""
        raise CommandFailed(EXIT_USAGE, f"{save_dir}: no valid checkpoint{broken}")
    if unreadable:
        raise CommandFailed(EXIT_UNREADABLE, f"{unreadable[0].problem}; it may be the best: give STEP to choose one")
    best = rank_best(infos)
    if best.problem:
        raise CommandFailed(EXIT_DAMAGED, best.problem)
    if not best.ranked:
        raise CommandFailed(
            EXIT_USAGE,
            f"{save_dir}: no valid checkpoint is marked best (a run marks one when its best_metric improves)",
        )
    return best.ranked[0]


def completion(manager: CheckpointManager) -> dict[str, Any] | None:
    try:
        return manager.completion()
    except CorruptCheckpointError as e:
        raise CommandFailed(EXIT_DAMAGED, f"{e}; expected the JSON written when the run completed") from None


def moved_aside(save_dir: Path) -> dict[str, int]:
    """How many checkpoints are in ``quarantine/`` (with those set aside in place as ``quarantined-*``) and in
    ``superseded/``; what cannot be listed counts 0."""
    out = {}
    for where in (QUARANTINE, SUPERSEDED):
        d = save_dir / where
        try:
            out[where] = sum(1 for _ in d.iterdir()) if d.is_dir() and not d.is_symlink() else 0
        except OSError:
            out[where] = 0
    try:
        out[QUARANTINE] += sum(1 for e in os.listdir(save_dir) if e.startswith(QUARANTINED))
    except OSError:
        pass
    return out


def recycled(save_dir: Path) -> list[dict[str, Any]]:
    """The ``.recycle-`` directories (a pruned checkpoint's files, for the next save to write over), with sizes."""
    out = []
    for d in pools(save_dir):
        try:
            out.append({"name": d.name, "path": str(d), "bytes": file_bytes(d)})
        except OSError:  # taken by a save meanwhile
            continue
    return out
