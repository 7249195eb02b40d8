"""The run's checkpoint writer, built once: one process's, or the ranks' distributed commit.

A save is one downward call, as in torch.distributed.checkpoint's ``save()`` (a planner, a storage writer, a
distributed wrapper): the scheduler (:mod:`preempt.run.save_scheduler`) plans and takes the payload and the manifest,
then calls :meth:`CheckpointWriter.write`; the writer calls the manager it was built with, which writes the files and
commits (:mod:`preempt.checkpoint.commit`). Nothing comes back up but the return value: a
:class:`~preempt.checkpoint.manager.CheckpointInfo` (durable), a :class:`~preempt.checkpoint.manager.Pending`
checkpoint (deferred: the background writer finishes it with the staged copy, :meth:`CheckpointWriter.finish`), or
None (a rank other than 0 whose files are durable while rank 0 commits in the background).

* :class:`ProcessWriter` -- one process: :meth:`CheckpointManager.save`, or a Pending checkpoint with nothing written.
* :class:`RankWriter` -- the ranks of torch.distributed: :func:`preempt.cluster.distributed.save_ranked` (every
  rank's files, one commit by rank 0), on the collectives of the peers it was built with (the loop's, or the
  background writers' own group for sharded state).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ..checkpoint.manager import CheckpointInfo, CheckpointManager, Pending
from ..checkpoint.manifest import Manifest
from ..checkpoint.state import Payload
from ..cluster import distributed
from .peers import Peers, Ranks

ExtraFiles = Callable[[Path], list[str]]  # a collective writer of more files into the checkpoint (DCP's shards)


class CheckpointWriter(Protocol):
    """Writes and commits the run's checkpoints into the save_dir of the manager it was built with."""

    def write(
        self, payload: Payload, manifest: Manifest, *, extra: ExtraFiles | None = None, defer: bool = False
    ) -> CheckpointInfo | Pending | None:
        """Commits a checkpoint of ``payload``; when ``defer``, returns the :class:`Pending` checkpoint that
        :meth:`finish` writes later from the staged copy (None on a rank whose part is already durable).

        Raises:
            OSError: A file could not be written (on every rank alike); the partial directory is gone.
        """
        ...

    def finish(self, pending: Pending, staged: Payload, manifest: Manifest) -> CheckpointInfo:
        """The background writer's thread: a :class:`Pending` checkpoint's own files written from ``staged``, then
        committed."""
        ...


class ProcessWriter:
    """One process's checkpoints: the manager's save."""

    def __init__(self, manager: CheckpointManager) -> None:
        self._manager = manager

    def write(
        self, payload: Payload, manifest: Manifest, *, extra: ExtraFiles | None = None, defer: bool = False
    ) -> CheckpointInfo | Pending:
        # (extra: the ranks' collective writer of DCP's files; one process writes only its payload)
        return Pending() if defer else self._manager.save(payload, manifest)

    def finish(self, pending: Pending, staged: Payload, manifest: Manifest) -> CheckpointInfo:
        return self._manager.finish(pending, staged, manifest)


class RankWriter:
    """The ranks' checkpoints: one distributed commit (:func:`~preempt.cluster.distributed.save_ranked`)."""

    def __init__(self, manager: CheckpointManager, ranks: Ranks) -> None:
        self._manager = manager
        self._coord = ranks.coord

    def write(
        self, payload: Payload, manifest: Manifest, *, extra: ExtraFiles | None = None, defer: bool = False
    ) -> CheckpointInfo | Pending | None:
        return distributed.save_ranked(self._manager, self._coord, payload, manifest, extra, defer=defer)

    def finish(self, pending: Pending, staged: Payload, manifest: Manifest) -> CheckpointInfo:
        return self._manager.finish(pending, staged, manifest)


def writer_for(manager: CheckpointManager, peers: Peers) -> CheckpointWriter:
    """The checkpoint writer of ``peers`` into ``manager``'s save_dir: the ranks' commit, or one process's save."""
    return RankWriter(manager, peers) if isinstance(peers, Ranks) else ProcessWriter(manager)
