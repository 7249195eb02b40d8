"""What a background save needs: the staging buffers, the writer thread, and lazy copies.

:class:`Background` holds the staging buffers (:class:`~preempt.checkpoint.staging.Stager`) and the background
writer (:class:`~preempt.checkpoint.staging.BackgroundWriter`) once a run may save in the background, when the
buffers are to be sized for the optimizer's state, how long sizing them took, and whether snapshots are lazy (the
copies made by the writer while the loop runs on, the optimizer's pre-step hook waiting for them). It copies a
payload into the buffers, falling back to synchronous saves where host memory refuses. The scheduler
(:mod:`preempt.run.save_scheduler`) decides what runs on the writer and when.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from .. import _log
from ..checkpoint import state
from ..checkpoint.readahead import host_memory_available
from ..checkpoint.staging import BackgroundWriter, LazyCopy, SourceKey, Stager, payload_nbytes, source_key

log = _log.log
MEMORY_FRACTION = 0.5  # staging buffers may take at most this fraction of the host's available memory


class Writer(Protocol):
    """What the scheduler asks of its background writer (:class:`~preempt.checkpoint.staging.BackgroundWriter`).

    A Protocol for one implementation because the scheduler's unit tests inject another (``writer=``): a writer that
    runs each job only when the test says, so that every interleaving of a job and the loop is reached without threads
    or sleeps.
    """

    @property
    def busy(self) -> bool: ...

    def submit(self, job: Callable[[], Any]) -> Future[Any]: ...

    def join(self) -> None: ...


class Background:
    """The staging buffers and the writer of background saves (None until :meth:`open`, the buffers None again once
    host memory refused them: saves are synchronous from then on).

    Args:
        writer: Makes the background writer (a seam for tests: :class:`Writer`).
        stager: Makes staging buffers.
    """

    def __init__(self, writer: Callable[[], Writer] = BackgroundWriter, stager: Callable[[], Stager] = Stager) -> None:
        self.new_writer, self.new_stager = writer, stager
        self.stager: Stager | None = None  # while background saves are possible
        self.writer: Writer | None = None
        self.lazy = False  # snapshots are lazy: see SaveScheduler.start()
        self.hook: Any = None  # the optimizer's pre-step hook that waits for a lazy snapshot's copies
        self.prepare_at: int | None = None  # the step after which the buffers are sized for the optimizer
        self.prepare_s: float | None = None  # seconds spent allocating the staging buffers (background)

    def open(self, live: frozenset[str] = frozenset()) -> None:
        """Background saves from now: the buffers and the writer are made. ``live``: the files read where their
        tensors live, never copied (the frozen base)."""
        self.stager, self.writer = self.new_stager(), self.new_writer()
        self.stager.live = live

    def lazily(self, hook: Any) -> None:
        """Snapshots are lazy from now; ``hook``: the optimizer's pre-step hook that waits for their copies."""
        self.lazy, self.hook = True, hook

    def prepare_after(self, step: int | None) -> None:
        """The buffers are to be sized for the whole state at the first safe point from ``step`` (None: not)."""
        self.prepare_at = step

    def prepared(self, seconds: float) -> None:
        """The buffers were sized in ``seconds`` (counted over every sizing)."""
        self.prepare_s = (self.prepare_s or 0.0) + seconds

    def refused(self) -> None:
        """Host memory refused the buffers: every save is synchronous from now."""
        self.stager = None

    def copy_at_step(self) -> None:
        """A lazy snapshot was torn: the copies are made at the step from now."""
        self.lazy = False

    def copy_frozen_base(self) -> None:
        """A tensor read where it lives changed: the frozen base is copied at the step from now."""
        if self.stager is not None:
            self.stager.live = frozenset()

    @property
    def pinned(self) -> bool:
        """The staging buffers are in pinned (page-locked) host memory."""
        return self.stager is not None and self.stager.pinned

    @property
    def nbytes(self) -> int:
        return 0 if self.stager is None else self.stager.nbytes

    def staging(self) -> Stager:
        assert self.stager is not None  # (asked only while background saves are possible)
        return self.stager

    def running(self) -> Writer:
        assert self.writer is not None  # (asked only after open())
        return self.writer

    def sizing(
        self, payload: state.Payload, shards: state.Payload | None, shard_stager: Any, stop: threading.Event
    ) -> Callable[[], float] | None:
        """The writer's job that sizes the buffers for ``payload`` (and this rank's ``shards`` of sharded state:
        allocated and touched once), returning the seconds it took; None when a copy would take more than
        :data:`MEMORY_FRACTION` of the host memory available: checkpoints are written synchronously from now on.
        ``stop`` set: the job ends at its next step, the pages not touched yet left to the first copy."""
        stager = self.staging()
        nbytes = payload_nbytes(payload, stager.live) + (0 if shards is None else payload_nbytes(shards))
        available = host_memory_available()
        if available is not None and nbytes - stager.nbytes > available * MEMORY_FRACTION:
            log.warning(
                "async_save: a copy of the state (%s) would take more than %d%% of the host memory available (%s);"
                " checkpoints are written synchronously",
                _log.size(nbytes),
                int(MEMORY_FRACTION * 100),
                _log.size(available),
            )
            self.stager = None
            return None

        def job() -> float:
            t0 = time.perf_counter()
            stager.prepare(payload, stop)
            if shards is not None:
                shard_stager.prepare(shards, stop)
            return time.perf_counter() - t0

        return job

    def copy(self, payload: state.Payload, optimizer: Any) -> tuple[state.Payload | None, LazyCopy | None]:
        """The state copied into the staging buffers, and the copies still to make when lazy (those of the
        storages that only ``optimizer.step()`` changes); (None, None): save synchronously (from now on)."""
        stager = self.staging()
        try:
            if self.lazy:
                return stager.stage_lazily(payload, _lazy_sources(optimizer))
            return stager.stage(payload), None
        except (MemoryError, RuntimeError) as e:  # e.g. pinned memory refused
            log.warning("async_save: could not stage the state in host memory (%s); saving synchronously from now", e)
            self.stager = None
            return None, None

    def staged_now(self, payload: state.Payload) -> state.Payload:
        """For a synchronous save: ``payload`` copied into the staging buffers, whose files are then written without
        the page cache (see :data:`~preempt.run.write_decisions.STAGE_SYNCHRONOUS`); the live payload where that
        fails."""
        try:
            return self.staging().stage(payload, loop_waits=True)
        except (MemoryError, RuntimeError) as e:
            log.warning("could not copy the state into the staging buffers (%s); writing it from the tensors", e)
            return payload

    def unhook(self) -> None:
        """The optimizer's pre-step hook removed (the run's end)."""
        if self.hook is not None:
            self.hook.remove()
            self.hook = None


def _lazy_sources(optimizer: Any) -> set[SourceKey]:
    """The storages of the tensors that only ``optimizer.step()`` changes: the parameters and its state."""
    assert optimizer is not None  # (lazy copies are asked for with an optimizer only)
    found: set[SourceKey] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            found.add(source_key(p))
    for per_param in optimizer.state.values():
        for v in per_param.values():
            if isinstance(v, torch.Tensor):
                found.add(source_key(v))
    return found
