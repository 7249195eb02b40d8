"""Recycling: the files of a pruned checkpoint, kept for the next save to write over in place.

Writing a file into disk blocks that were never written is far slower on some
disks than writing over blocks a file already holds (thin-provisioned virtual
disks: ``bench/README.md``), and the stop's checkpoint, written between
SIGTERM and SIGKILL, is the write that must not pay it. So the manager keeps
the files of one pruned checkpoint (or of a write a stop cancelled) as
``save_dir/.recycle-<tag>/`` instead of deleting them, and the next save
renames that directory to its temporary name (step 1 of the commit protocol,
:mod:`preempt.checkpoint.commit`) and writes over the files in place.

Nothing trusts a recycled file's content or kind: :func:`preempt.checkpoint.hashed_io.write_file`
opens each one without following links and writes into it only when it is a
regular file of ours with one link (else it is removed and a new file made),
and truncates it to what was written; :func:`drop_extra` removes what the new
checkpoint does not list before its manifest is written. Only directories of
ours count as pools (a symlink named ``.recycle-x`` could lead a save outside
``save_dir``); anything else with that name is deleted at the start.

Disk use: the space of one checkpoint more between saves, none more at the
peak (the pool is the space a save needs while the oldest kept one still
exists). One pool at a time: the one with the most bytes to write over.

A pool written ahead (:func:`reserve`): a new job has pruned nothing yet, so
its first saves, the stop's among them, would all write into new blocks. When
a run's staging buffers are sized for the whole state and ``save_dir`` has no
pool, its background writer writes one: a file of zeros for each file of the
state, of that file's tensor bytes, at the writer's low priority. Any save
that comes meanwhile cancels it and writes over what it had written.
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from . import cancel, commit, deleter, hashed_io, names

PREFIX = ".recycle-"


def pools(save_dir: Path) -> list[Path]:
    """The ``.recycle-`` directories of ``save_dir`` that a save may write over, the best first.

    Best: the most bytes to write over (a whole pruned checkpoint before the
    part of a cancelled write), then the newest.
    """
    found = []
    try:
        entries = os.listdir(save_dir)
    except OSError:
        return []
    for entry in entries:
        path = save_dir / entry
        if entry.startswith(PREFIX) and own_dir(path):
            try:
                found.append((file_bytes(path), os.stat(path, follow_symlinks=False).st_ctime_ns, entry))
            except OSError:  # taken meanwhile
                continue
    return [save_dir / entry for *_, entry in sorted(found, reverse=True)]


def strays(save_dir: Path) -> list[Path]:
    """Entries named like a pool that are not directories of ours (a symlink, a file): never used, to delete."""
    try:
        entries = os.listdir(save_dir)
    except OSError:
        return []
    return [save_dir / e for e in entries if e.startswith(PREFIX) and not own_dir(save_dir / e)]


def file_bytes(directory: Path) -> int:
    """The bytes of the regular files directly in ``directory`` (links not followed)."""
    with os.scandir(directory) as entries:
        return sum(e.stat(follow_symlinks=False).st_size for e in entries if e.is_file(follow_symlinks=False))


def own_dir(path: Path) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def take(save_dir: Path, tmp: Path) -> bool:
    """Renames the best pool to ``tmp`` (step 1 with recycled files); False when there is none to take."""
    for pool in pools(save_dir):
        try:
            os.rename(pool, tmp)
        except OSError:  # taken by someone else meanwhile, or not renameable: not needed
            continue
        if own_dir(tmp):
            return True
        deleter.remove_tree(tmp)  # swapped for something else between the check and the rename: not written into
    return False


def give(save_dir: Path, path: Path) -> Path:
    """Renames a pruned or cancelled checkpoint directory to a ``.recycle-`` name, for the next save."""
    target = save_dir / f"{PREFIX}{names.tag()}"
    os.rename(path, target)
    return target


def reserve(save_dir: Path, sizes: Mapping[str, int]) -> Path:
    """Writes a pool ahead: ``sizes`` (file name -> bytes) as files of zeros, fdatasynced; returns the pool.

    Cancellable (:func:`preempt.checkpoint.cancel.cancellable`): what was written by then
    becomes the pool, and :class:`~preempt.checkpoint.cancel.WriteCancelled` propagates.
    Any other failure (a full disk) removes what was written. The run calls it through its manager, which checks
    its lock first (:meth:`preempt.checkpoint.manager.CheckpointManager.reserve`).
    """
    tmp = commit.new_tmp_dir(save_dir, "reserve")
    try:
        for name, size in sizes.items():
            hashed_io.write_file(tmp / name, _zeros(size))
    except cancel.WriteCancelled:
        give(save_dir, tmp)
        raise
    except BaseException:
        deleter.remove_tree(tmp)
        raise
    return give(save_dir, tmp)


POOL_CHUNK = 8 << 20
"""Bytes of zeros per write of a pool (the last up to twice that): a save that cancels it waits for one such write at
most (fresh blocks of a thin-provisioned disk are slow to write: ``bench/README.md``, "Recycling the pruned checkpoint's
files")."""


def _zeros(size: int) -> Iterator[memoryview]:
    """``size`` zero bytes, from one page-aligned block: an anonymous mapping, which holds no memory of its own
    while it is only read. Aligned, the pool goes to the disk without the page cache (:mod:`~.direct_io`), so a
    save that cancels it writes over its blocks without the kernel first writing back the zeros still dirty in the
    page cache over the same range (what a direct write over cached pages makes it do)."""
    block = memoryview(mmap.mmap(-1, max(1, min(size, 2 * POOL_CHUNK))))  # closed when collected
    while size > 0:
        n = size if size < 2 * POOL_CHUNK else POOL_CHUNK  # the last chunk whole: a short one would be coalesced
        yield block[:n]  # into a buffer of the writer's, unaligned, through the page cache
        size -= n


def drop_extra(tmp: Path, keep: Iterable[str]) -> None:
    """Removes what a recycled directory still holds beyond the files ``keep`` (before the manifest is written)."""
    wanted = set(keep)
    for entry in os.listdir(tmp):
        if entry not in wanted:
            deleter.remove_tree(tmp / entry)


class Pool:
    """The pool a run writes ahead for its saves to write over: the sizes of its files (as the staging buffers were
    last sized) and whether one is due once the background writer is free."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}  # the state's tensor bytes per file
        self.due = False

    def sized(self, sizes: dict[str, int]) -> None:
        """The state's tensor bytes per file, as the staging buffers are being sized."""
        self.sizes = sizes

    def ready(self, due: bool) -> None:
        """Whether a pool is due once the writer is free (the buffers were sized for the whole state)."""
        self.due = due

    def take(self, save_dir: Path, *, wanted: bool) -> dict[str, int] | None:
        """The sizes to write a pool of now, or None; either way the pool is no longer due. ``wanted``: this run
        recycles and owns ``save_dir``. None when it already has a pool, or nothing to write."""
        if not self.due:
            return None
        self.due = False
        if not wanted or not any(self.sizes.values()) or pools(save_dir):
            return None
        return self.sizes
