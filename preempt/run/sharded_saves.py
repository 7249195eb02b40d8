"""Sharded state saved in the background under torch.distributed: the ranks' writers and the buffers of the pieces.

Every rank copies its files and its pieces of the sharded state (FSDP, DTensor) into buffers of its own; then its
writer thread runs the whole distributed commit (:class:`preempt.run.checkpoint_writer.CheckpointWriter`; DCP
writing the staged DTensors that no file of pieces holds, if any) with the other ranks' writers, on a gloo group of
the writers' own, so that their collectives never interleave with the loop's. Not cancellable: a rank that left the
commit's collectives alone would leave the others waiting; a stop waits for it instead.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checkpoint import state
from ..checkpoint.manager import CheckpointInfo, CheckpointManager
from ..checkpoint.manifest import Manifest
from ..cluster import sharded
from .checkpoint_writer import writer_for
from .peers import Peers


class ShardedSaves:
    """The ranks' writers (:meth:`Peers.writers`, made on every rank at once: a collective) and this rank's buffers
    for its pieces; built by the scheduler when a run of sharded state starts saving in the background."""

    def __init__(self, manager: CheckpointManager, peers: Peers, stager: Any) -> None:
        self.writers: Any = peers.writers()  # a collective: every rank creates the writers' group now
        self.writer = writer_for(manager, self.writers)  # the distributed commit, on the writers' group
        self.stager = stager  # the buffers of this rank's pieces of sharded state
        self._views: dict[str, Any] = {}  # the DTensors around those buffers (sharded.staged)

    @staticmethod
    def pieces(live: Any) -> state.Payload | None:
        """This rank's own pieces of the sharded state (not the components' DTensors), to size the buffers for."""
        return None if live is None else sharded.local_payload(live)

    def extra(self, live: Any) -> Callable[[Path], list[str]] | None:
        """This rank's pieces copied into its buffers now; the writer of their files into the checkpoint's temporary
        directory (called by the distributed commit on the writer's thread). None without pieces."""
        if live is None:
            return None
        shards = sharded.staged(live, self.stager.stage(sharded.local_payload(live)), self._views)
        rank, group = self.writers.rank, self.writers.coord.group

        def extra(tmp: Path) -> list[str]:
            return sharded.save(tmp, shards, rank, group)

        return extra

    def write(
        self, staged: state.Payload, manifest: Manifest, extra: Callable[[Path], list[str]] | None
    ) -> CheckpointInfo:
        """The writer's thread: the distributed commit of a staged snapshot, with the other ranks' writers."""
        got = self.writer.write(staged, manifest, extra=extra)
        assert isinstance(got, CheckpointInfo)  # not deferred: every rank learns the commit's outcome
        return got
