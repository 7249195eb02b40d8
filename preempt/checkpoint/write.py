"""Step 2 of the commit protocol for a payload: its files into a checkpoint's temporary directory.

Each tensor file is written (:func:`preempt.checkpoint.hashed_io.write_file`, hashed on the way, fdatasynced), or,
when carried (:mod:`preempt.checkpoint.carry`: its live tensors hashed to the source's digest at the step), hard-linked
from the previous checkpoint (:func:`preempt.checkpoint.hashed_io.link_file`): its manifest entry is the source's size
and digest with ``carried_from``. A link that cannot be made (another filesystem, no hard links, too many links, the
source pruned meanwhile) is written from the tensors :meth:`~preempt.checkpoint.carry.Carrier.mark_carried` kept. A file
written from tensors read where they live whose digest at the step is known (``payload.at_step``) must come out with
that digest, or :class:`~preempt.checkpoint.carry.WrittenBehindAutograd` is raised and nothing is committed; the tensors
of a staged payload that were read where they live are then checked for moved version counters (``payload.live``:
:class:`preempt.checkpoint.staging.LiveTensors`) before the JSON files. No torch at
import (the checkpoint commands import the manager, which imports this).
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from . import cancel, commit, hashed_io
from .carry import WrittenBehindAutograd, same_bytes
from .hashed_io import FileDigest

if TYPE_CHECKING:
    from .state import Payload

log = logging.getLogger("preempt")


def write_payload(directory: Path, payload: Payload, *, durable: bool = True) -> dict[str, FileDigest]:
    """Writes (or links) a payload's files into ``directory``; returns their manifest entries.

    ``durable``: the files written are synced together before this returns (:func:`hashed_io.sync_together`);
    without it the caller syncs them with the manifest (:func:`commit.commit_dir`). A linked file is durable
    already."""
    from . import codec, tensorfile

    files: dict[str, FileDigest] = {}
    commit.stage("before_tensor_files")
    read = set(payload.tensor_files)  # the files written from tensors (a staged file's are copies, never checked)
    for fname, carry in payload.carried.items():
        try:
            hashed_io.link_file(carry.source, directory / fname, carry.digest.size)
            files[fname] = carry.digest
            continue
        except cancel.WriteCancelled:
            raise
        except OSError as e:
            code = errno.errorcode.get(e.errno or 0, "")
            log.debug("%s: cannot link %s (%s %s); writing it", directory / fname, carry.source, code, e.strerror)
        read.add(fname)
        chunks = tensorfile.chunks(carry.tensors, carry.meta)
        files[fname] = hashed_io.write_file(directory / fname, chunks, recycle=True, sync=False)
    for fname, (tensors, meta) in payload.tensor_files.items():
        files[fname] = hashed_io.write_file(
            directory / fname, tensorfile.chunks(tensors, meta), recycle=True, sync=False
        )
    for fname, expected in payload.at_step.items():
        if fname in read and not same_bytes(files[fname], expected):
            raise WrittenBehindAutograd(
                fname,
                f"{directory / fname}: written from its live tensors after the step, its content differs from theirs"
                f" at the step (xxh3 {files[fname].xxh3_128}, at the step {expected.xxh3_128})",
            )
    commit.stage("after_tensor_files")
    if payload.live is not None:
        payload.live.check(read)  # the tensors read where they live are as when the snapshot was taken
    for fname, doc in payload.json_files.items():
        data = doc if isinstance(doc, bytes) else codec.dumps(doc)  # a staged snapshot is encoded already
        files[fname] = hashed_io.write_file(directory / fname, [data], recycle=True, sync=False)
    if durable:
        hashed_io.sync_together(directory / fname for fname in written(files))
    return files


def written(files: dict[str, FileDigest]) -> list[str]:
    """The names of ``files`` that were written, not linked (a linked file's entry says where it was carried from)."""
    return [fname for fname, digest in files.items() if digest.carried_from is None]
