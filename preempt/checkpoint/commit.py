"""The atomic commit of a checkpoint directory: the layout of ``save_dir``, the protocol's stages, the rename and
what a start concludes from a leftover.

Every checkpoint directory is made by the protocol below; the other files of a
``save_dir`` (the lock, the completion marker, quarantined and recycled checkpoints)
are written by their own modules with the same primitives. It knows nothing of torch
or of signals: it moves directory entries. The bytes and their digests are
:mod:`preempt.checkpoint.hashed_io`'s, the names :mod:`preempt.checkpoint.names`', a write's cancellation
:mod:`preempt.checkpoint.cancel`'s, and the deletion of what is left :mod:`preempt.checkpoint.deleter`'s.

Layout of ``save_dir``::

    step_000000120/               a committed checkpoint; manifest.json inside
    .tmp-step_000000120-<tag>/    a checkpoint being written
    .replaced-step_000000120-<tag>/  the previous checkpoint of the same step,
                                  while a newer save of that step replaces it
    .trash-<tag>/                 a pruned checkpoint being deleted
    .recycle-<tag>/               the files of a pruned checkpoint, kept for the next save
                                  to write over in place (see "Recycling" below)
    quarantine/                   corrupt or incomplete checkpoints, moved aside
    quarantined-step_000000120-<tag>/  the same, set aside in place where quarantine/ cannot be used
    superseded/                   checkpoints of an abandoned timeline, moved aside
    complete.json                 the run finished

The commit protocol, in this exact order (:meth:`preempt.checkpoint.manager.CheckpointManager.save`):

1. ``mkdir save_dir/.tmp-step_N-<tag>``, or rename a ``.recycle-`` directory to that name
   (:mod:`preempt.checkpoint.recycle`).
2. Each data file: write, hash with xxh3-128 while writing
   (a recycled file of the same name is written over, then truncated to its new size);
   or, for a file carried unchanged from the previous checkpoint (:mod:`preempt.checkpoint.carry`),
   ``link`` the previous checkpoint's durable file under the new name
   (:func:`~preempt.checkpoint.hashed_io.link_file`): its bytes are durable already, the new entry becomes
   durable with step 4. A recycled file with another name (``st_nlink > 1``: a carried file of a kept
   checkpoint) is never written into.
3. ``manifest.json`` (sizes and digests of every data file, and a checksum of
   itself): write. The manifest is always the last file written.
4. ``fdatasync`` every file written in steps 2-3 and ``fsync`` the temporary directory, all at
   once (:func:`~preempt.checkpoint.hashed_io.sync_together`): the device gets one flush for them rather than one
   each in a row.
   Nothing is renamed before every one of them has returned. (Files that other ranks wrote into
   the directory are made durable by them before the commit.)
5. If ``step_N`` already exists (a later save at the same global step, e.g. the
   final save right after a periodic one), rename it to
   ``.replaced-step_N-<tag>``.
6. Rename the temporary directory to ``step_N``.
7. ``fsync(save_dir)``. From here on the checkpoint is durable; only now may
   anything older be deleted (pruning runs after this, off the loop's path).

What a reader concludes from each leftover (:func:`recover`, run at start):

* ``.tmp-*``: a write that never reached step 6; its content is not trusted.
  Deleted.
* ``.replaced-step_N-*`` and ``step_N`` present: the replacement committed.
  The old copy is deleted.
* ``.replaced-step_N-*`` and ``step_N`` absent: the process died between
  steps 5 and 6. The old copy is renamed back to ``step_N``: it was valid.
* ``.trash-*``: pruning was interrupted. Deleted.
* ``.recycle-*``: files kept for the next save (:mod:`preempt.checkpoint.recycle`); never
  read; tidied by the manager.
* ``step_N`` without ``manifest.json``, or whose files do not match the
  manifest: not made by a completed commit (or damaged since). The manager
  moves it to ``quarantine/`` when it meets it (never deletes it), so that a
  later save of the same step does not collide with it.

Rename within one filesystem is atomic on POSIX; a crash leaves either the old
name or the new one, never a mix.

Recycling (``.recycle-*``, step 1 with a recycled directory, writing over a
file in place) is :mod:`preempt.checkpoint.recycle`.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .. import _testing
from . import hashed_io
from .cancel import cancel_event, check_cancelled
from .hashed_io import FileDigest
from .names import REPLACED, TMP_PREFIX, TRASH, parse_checkpoint_name, tag

# The boundaries of the commit protocol, in order, where a fault can be injected.
STAGES = (
    "before_tensor_files",  # step 2 begins: nothing of the payload read or written yet
    "after_tensor_files",  # step 2: the tensor files are durable, the JSON files not written yet
    "before_manifest",  # step 2 done: every data file durable, no manifest yet
    "before_tmp_fsync",  # step 3 done: the manifest is written, the temporary directory not fsynced
    "before_rename",  # step 4 done: ready to rename
    "after_replace",  # step 5: an older step_N was moved aside, the new one not renamed yet
    "before_dir_fsync",  # step 6 done: renamed, save_dir not fsynced
    "committed",  # step 7 done: durable; nothing older deleted yet
)


def stage(name: str) -> None:
    """Marks a protocol boundary (see :data:`STAGES`), a fault point of :mod:`preempt._testing`.

    Before the rename, a write running under :func:`~preempt.checkpoint.cancel.cancellable` whose event is set
    stops here.
    """
    if name in _CANCEL_POINTS:
        check_cancelled()
    _testing.reach("commit", name, cancel_event())


_CANCEL_POINTS = frozenset({"after_tensor_files", "before_manifest", "before_tmp_fsync", "before_rename"})


def tmp_dir_path(save_dir: Path, name: str) -> Path:
    """The name of step 1's hidden directory for checkpoint ``name`` (unique to this process and call)."""
    return save_dir / f"{TMP_PREFIX}{name}-{tag()}"


def new_tmp_dir(save_dir: Path, name: str) -> Path:
    """Step 1 of the protocol: a fresh hidden directory inside ``save_dir``."""
    tmp = tmp_dir_path(save_dir, name)
    tmp.mkdir()
    return tmp


def commit_dir(
    save_dir: Path, tmp: Path, name: str, unsynced: Iterable[str | os.PathLike[str]] = ()
) -> tuple[Path, Path | None]:
    """Steps 4-7: makes ``tmp`` the durable checkpoint ``name``.

    ``unsynced``: files of ``tmp`` written but not yet durable (the manifest, and the data files of a checkpoint
    written by this process): they are synced together with ``tmp``'s entries (:func:`sync_together`), before
    the rename.

    Returns:
        The final path, and the path of the replaced checkpoint of the same
        name (to be deleted by the caller, off the critical path) or None.
    """
    stage("before_tmp_fsync")
    hashed_io.sync_together(unsynced, [tmp])
    stage("before_rename")
    final = save_dir / name
    replaced = None
    if final.exists():
        replaced = save_dir / f"{REPLACED}{name}-{tag()}"
        os.rename(final, replaced)
    try:
        if replaced is not None:
            stage("after_replace")
        os.rename(tmp, final)
    except BaseException:
        if replaced is not None:  # put the valid older copy back rather than leave the name empty
            os.rename(replaced, final)
        raise
    stage("before_dir_fsync")
    hashed_io.fsync_dir(save_dir)
    stage("committed")
    return final, replaced


def write_atomic(path: Path, chunks: Iterable[Any], *, replace: bool = True) -> FileDigest:
    """Writes a file atomically: a temporary file beside it, fdatasync, rename, fsync(dir).

    Args:
        path: The file.
        chunks: Its content (bytes-like chunks, as for :func:`write_file`).
        replace: False never replaces an existing file, not even one created
            meanwhile: the last step is ``link``, which fails when ``path`` exists.

    Raises:
        FileExistsError: ``replace`` is False and ``path`` exists.
    """
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{tag()}")
    try:
        digest = hashed_io.write_file(tmp, chunks)
        if replace:
            os.rename(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:  # a filesystem without hard links: check, then rename
                if path.exists():
                    raise FileExistsError(errno.EEXIST, "exists", str(path)) from None
                os.rename(tmp, path)
        hashed_io.fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)  # gone after a rename; after a link, the second name
    return digest


def trash(save_dir: Path, path: Path) -> Path:
    """Renames a directory to a ``.trash-`` name (invisible to discovery) for later deletion."""
    target = save_dir / f"{TRASH}{path.name}-{tag()}"
    os.rename(path, target)
    return target


@dataclasses.dataclass
class Recovery:
    """What :func:`recover` found: restored names and paths left to delete."""

    restored: list[str] = dataclasses.field(default_factory=list)
    to_delete: list[Path] = dataclasses.field(default_factory=list)


def recover(save_dir: Path) -> Recovery:
    """Interprets the leftovers of interrupted writes (see the module docstring).

    Renames happen here; the deletions are returned so that the caller can do
    them in the background (deleting a large tree is slow).
    """
    out = Recovery()
    if not save_dir.is_dir():
        return out
    entries = sorted(os.listdir(save_dir))

    def renamed_at(entry: str) -> int | None:
        try:
            return os.stat(save_dir / entry, follow_symlinks=False).st_ctime_ns
        except FileNotFoundError:  # gone since the listing: a deletion of the last run still finishing
            return None

    replaced = [(at, e) for e in entries if e.startswith(REPLACED) and (at := renamed_at(e)) is not None]
    # Newest replaced copy first: if a replacement is interrupted twice, the later copy is the one to restore.
    for _, entry in sorted(replaced, reverse=True):
        name = entry[len(REPLACED) :].split("-", 1)[0]
        if parse_checkpoint_name(name) is not None and not (save_dir / name).exists():
            os.rename(save_dir / entry, save_dir / name)
            out.restored.append(name)
        else:
            out.to_delete.append(save_dir / entry)
    if out.restored:
        hashed_io.fsync_dir(save_dir)
    for entry in entries:
        if entry.startswith((TMP_PREFIX, TRASH)):
            out.to_delete.append(save_dir / entry)
    return out
