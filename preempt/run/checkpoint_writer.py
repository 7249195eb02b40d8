"""The run's checkpoint writer, built once: one process's save, or the ranks' distributed commit.

A save is one downward call, as in torch.distributed.checkpoint's ``save()`` (a planner, a storage writer, a
distributed wrapper): the scheduler (:mod:`preempt.run.save_scheduler`) plans and takes the payload and the manifest,
then calls :meth:`CheckpointWriter.write`; the writer calls the manager it was built with, which writes the files and
commits (:mod:`preempt.checkpoint.commit`). Nothing comes back up but the return value: a
:class:`~preempt.checkpoint.manager.CheckpointInfo` (durable), a :class:`~preempt.checkpoint.manager.Pending`
checkpoint (deferred: the background writer finishes it with the staged copy, :meth:`CheckpointWriter.finish`), or
None (a rank other than 0 whose files are durable while rank 0 commits in the background).

One writer for one process and for the ranks; the difference is data, the coordinator it was built with: None for one
process (:meth:`CheckpointManager.save`, or a Pending checkpoint with nothing written), or the ranks' coordinator
(:func:`preempt.cluster.distributed.save_ranked`: every rank's files, one commit by rank 0, on the collectives of
the peers it was built with: the loop's, or the background writers' own group for sharded state).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..checkpoint.manager import CheckpointInfo, CheckpointManager, Pending
from ..checkpoint.manifest import Manifest
from ..checkpoint.state import Payload
from ..cluster import distributed
from .peers import Peers, Ranks

ExtraFiles = Callable[[Path], list[str]]  # a collective writer of more files into the checkpoint (DCP's shards)


class CheckpointWriter:
    """Writes and commits the run's checkpoints into the save_dir of ``manager``.

    Args:
        manager: The save_dir's manager, which writes the files and commits.
        coord: The ranks' coordinator (the distributed commit); None for one process.
    """

    def __init__(self, manager: CheckpointManager, coord: distributed.Coordinator | None = None) -> None:
        self._manager = manager
        self._coord = coord

    def write(
        self, payload: Payload, manifest: Manifest, *, extra: ExtraFiles | None = None, defer: bool = False
    ) -> CheckpointInfo | Pending | None:
        """Commits a checkpoint of ``payload``; when ``defer``, returns the :class:`Pending` checkpoint that
        :meth:`finish` writes later from the staged copy (None on a rank whose part is already durable).

        ``extra``: the ranks' collective writer of more files (DCP's); one process writes only its payload.

        Raises:
            OSError: A file could not be written (on every rank alike); the partial directory is gone.
        """
        if self._coord is not None:
            return distributed.save_ranked(self._manager, self._coord, payload, manifest, extra, defer=defer)
        return Pending() if defer else self._manager.save(payload, manifest)

    def finish(self, pending: Pending, staged: Payload, manifest: Manifest) -> CheckpointInfo:
        """The background writer's thread: a :class:`Pending` checkpoint's own files written from ``staged``, then
        committed."""
        return self._manager.finish(pending, staged, manifest)


def writer_for(manager: CheckpointManager, peers: Peers) -> CheckpointWriter:
    """The checkpoint writer of ``peers`` into ``manager``'s save_dir: the ranks' commit, or one process's save."""
    return CheckpointWriter(manager, peers.coord if isinstance(peers, Ranks) else None)
