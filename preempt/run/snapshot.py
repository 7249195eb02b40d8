"""What a checkpoint of the run holds: the payload of every file, and its manifest.

:class:`Snapshot` turns the run's parts into a checkpoint's content: the
components' tensors and JSON (:func:`preempt.checkpoint.state.capture`), the run's own
state (every random generator now and at the epoch's start, where the data
stands, the user's state, the learning-rate scale, the epoch so far), and the manifest with the
cursor, metrics, best, lineage and the run's retention. Under torch.distributed
each rank other than 0 writes only its own random state; sharded (DTensor)
tensors are written by DCP (:mod:`preempt.cluster.sharded`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from .. import _log
from ..checkpoint import codec, state
from ..checkpoint.manifest import Manifest, retention_record
from ..checkpoint.retention import RetentionPolicy
from ..cluster import sharded
from ..data import rng
from .data_cursor import DataCursor
from .due import Reason
from .loop_state import LoopState

log = _log.log


class Snapshot:
    """Builds the content of the run's checkpoints."""

    def __init__(
        self,
        components: state.Components,
        loop: LoopState,
        data: DataCursor,
        *,
        rank: int = 0,
        sharded: bool = False,
        group_frozen: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.components = components
        self.clock = clock  # the run's: the epoch's seconds so far
        self.group_frozen = group_frozen  # the frozen base in a file of its own (preempt.checkpoint.carry)
        self.loop = loop
        self.data = data
        self.rank = rank
        self.sharded = sharded  # the model's state is DTensors: its tensors go through DCP
        self.user_state: dict[str, Any] = {}
        # Each field below has one writer: the learning-rate scale the restore (the checkpoint's) and then the guards,
        # through rescaled(); the lineage the restore (where the timeline starts); the provenance the run, once, at
        # its start (started()).
        self.lr_scale = 1.0  # learning rates relative to the run's own (rollbacks, the supervisor)
        self.lineage: dict[str, Any] = {}  # the timeline: the resume request it follows, its source, its start
        self._provenance: dict[str, Any] = {}  # host, versions, SLURM job

    def started(self, provenance: dict[str, Any]) -> None:
        """The run has started: where and with what it runs (host, versions, SLURM job), in every manifest from now."""
        self._provenance = provenance

    def rescaled(self, lr_scale: float) -> None:
        """The learning rates now run at ``lr_scale`` of the run's own (a rollback, ``preempt supervise --lr``)."""
        self.lr_scale = lr_scale

    def run_state(self) -> dict[str, Any]:
        codec.check_json(self.user_state, "run.user_state")
        epoch_rng, data = self.data.state()
        return {
            "rng": {
                "now": rng.to_tree(rng.capture()),
                "epoch_start": rng.to_tree(epoch_rng) if epoch_rng is not None else None,
            },
            "data": data,
            "user": self.user_state,
            "lr_scale": self.lr_scale,
            "epoch": self.loop.epoch_record(self.clock()),  # the epoch's summary covers every process's part
        }

    def capture(
        self, split: tuple[dict[str, Any], Any] | None = None, *, unready: list[tuple[str, Exception]] | None = None
    ) -> state.Payload:
        """Everything but what DCP writes (the tensors of sharded state), as the files of a checkpoint.

        ``split``: the sharded state already read (:meth:`split`), so that one save reads it once. ``unready``: at
        the start, tracked objects whose state cannot be read yet are named there instead of failing
        (:func:`preempt.checkpoint.state.capture`).
        """
        c = self.components
        if not self.sharded:
            return state.capture(c, self.run_state(), group_frozen=self.group_frozen, unready=unready)
        _, rest = split if split is not None else self.split()
        run_state = {**self.run_state(), "sharded": {"optimizer": rest}}
        tracked_only = state.Components(None, None, c.scheduler, c.scaler, c.tracked)
        return state.capture(tracked_only, run_state, unready=unready)

    def capture_at_start(self) -> state.Payload:
        """What the run's start captures: state that can never be saved fails now, before any training; a tracked
        object whose ``state_dict()`` cannot answer yet (the batch a loop draws first inside the run, named by a
        variable that does not exist yet) is said and read at the first checkpoint, where it must answer."""
        unready: list[tuple[str, Exception]] = []
        payload = self.capture(unready=unready)
        for name, error in unready:
            log.info(
                "tracked %r: its state cannot be read yet (%s: %s); it is read at the first checkpoint",
                name,
                type(error).__name__,
                error,
            )
        return payload

    def tensors(self) -> state.Payload:
        """The components' tensors alone (to size the staging buffers)."""
        return state.capture(self.components, {}, group_frozen=self.group_frozen and not self.sharded)

    def split(self) -> tuple[dict[str, Any], Any]:
        """The live tensors of the sharded model and optimizer as DCP writes them, and the optimizer's other state
        (:func:`sharded.split_state`: FSDP2's ``state_dict()``, read once per save)."""
        c = self.components
        assert c.model is not None  # (sharded: the model holds DTensors)
        return sharded.split_state(state.unwrap_model(c.model), c.optimizer)

    def pieces(self, tensors: dict[str, Any]) -> tuple[dict[str, Any], state.Payload]:
        """Sharded state: (what is left for DCP; this rank's files of pieces, :func:`sharded.pieces_apart`).

        The frozen base's pieces, in a file of their own when carrying is on, are carried by the next checkpoint
        while unchanged, as one process carries ``base.safetensors``.
        """
        c = self.components
        frozen = state.frozen_keys(c.model, c.optimizer) if self.group_frozen and c.model is not None else set()
        left, base, rest = sharded.pieces_apart(tensors, self.rank, frozen)
        names = state.shard_files(self.rank)
        files = {name: f for name, f in zip(names, (base, rest), strict=True) if f is not None}
        return left, state.Payload(tensor_files=files, json_files={})

    def content(self) -> tuple[state.Payload, dict[str, Any] | None]:
        """What this process writes, and the live sharded tensors DCP writes for it (None: the state is not sharded).

        The files: everything on rank 0; under torch.distributed, only its RNG on the others; with sharded state,
        each rank's pieces of the model and optimizer besides (:meth:`pieces`).
        """
        split = self.split() if self.sharded else None
        shards, pieces = None, state.Payload(tensor_files={}, json_files={})
        if split is not None:
            left, pieces = self.pieces(split[0])
            shards = left or None  # DCP writes only what the ranks' files of pieces cannot hold
        if self.rank == 0:
            files = self.capture(split)
        else:
            run_state = self.run_state()
            own = state.capture(state.Components(), {"rng": run_state["rng"], "data": run_state["data"]})
            tensors, meta = own.tensor_files[state.STATE_FILE]
            tensor_file, json_file = state.rank_files(self.rank)
            files = state.Payload(
                tensor_files={tensor_file: (tensors, meta)}, json_files={json_file: own.json_files[state.STATE_JSON]}
            )
        files.tensor_files.update(pieces.tensor_files)
        return files, shards

    def manifest(self, reason: Reason, point: str, retention: RetentionPolicy | None = None) -> Manifest:
        """The manifest of a checkpoint taken now; ``retention``: the run's, recorded for ``preempt prune``."""
        loop = self.loop
        cursor, sampler = self.data.cursor(loop.global_step, loop.epoch, loop.batch)
        return Manifest(
            step=loop.global_step,
            cursor=dataclasses.replace(cursor, point=point),
            reason=reason.value,
            created=time.time(),
            files={},
            sampler=sampler,
            metrics=dict(loop.metrics),
            best=loop.best,
            is_best=loop.holds_best,
            lineage=self.lineage,
            provenance=self._provenance,
            retention=None if retention is None else retention_record(retention),
        )
