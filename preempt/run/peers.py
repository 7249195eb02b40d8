"""The processes of one run, and what they agree on: one process is the case of a single peer.

The run has ONE safe-point path and ONE enter path; what differs between a
plain process and the ranks of torchrun is only how decisions are combined
(a checkpoint's files are committed by the writer built for the peers, :mod:`preempt.run.checkpoint_writer`):

* :class:`Alone` -- one process. Agreement is its own decision, a broadcast
  returns what it was given, a barrier does nothing.
* :class:`Ranks` -- under torch.distributed. Rank 0 leads (it holds the lock,
  chooses the checkpoint, writes the replicated state and commits); every rank
  meets the others at every ``sync_every``-th step in one all-reduce
  (:class:`~preempt.cluster.distributed.Coordinator`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from ..cluster import distributed
from ..cluster.nodes import Nodes
from ..errors import PeerLost
from .due import Reason

# How a save's reason crosses the ranks: the agreement is one all-reduce of integers, to which rank 0 alone adds its
# reason's code (0: none). Fixed here, beside the one collective that carries it; the run sees only Reason.
WIRE: dict[Reason, int] = {
    Reason.PREEMPT: 1,
    Reason.INTERVAL: 2,
    Reason.STEPS: 3,
    Reason.PER_EPOCH: 4,
    Reason.MILESTONE: 5,
    Reason.BEST: 6,
    Reason.FINAL: 7,
    Reason.BRANCH: 8,
    Reason.WALLTIME: 9,
    Reason.EMERGENCY: 10,
}
_FROM_WIRE = {code: reason for reason, code in WIRE.items()}


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What every peer does at a safe point."""

    stop: bool  # some peer saw a stop signal (or the leader's walltime keeper says stop)
    save: Reason | None  # the leader's save decision
    signal_rank: int  # the lowest rank that saw a signal, or -1


class Peers(Protocol):
    """What the run asks of its peers, one process or many ranks: every part is given one of these."""

    rank: int
    world_size: int
    leader: bool  # holds the lock, chooses the checkpoint, writes the replicated state and commits
    alone: bool
    every: int  # the ranks meet at every N-th run.step(); 0: when something may be due (one process)
    nodes: Nodes | None  # the ranks' nodes when they share no save_dir (preempt.cluster.nodes), known once started

    def agree(self, stop: bool, save: Reason | None, *, walltime_stop: bool = False) -> Agreement:
        """Every peer's stop request and the leader's save reason combined into one decision."""
        ...

    def broadcast(self, obj: Any) -> Any:
        """The leader's ``obj`` on every peer."""
        ...

    def all(self, flag: bool) -> bool:
        """``flag`` is True on every peer."""
        ...

    def gather(self, obj: Any) -> list[Any] | None:
        """Every peer's ``obj`` in rank order, on the leader (None elsewhere)."""
        ...

    def barrier(self) -> None: ...

    def lost(self, error: BaseException | None) -> PeerLost | None:
        """The :class:`PeerLost` that ``error``, escaping the loop, stands for, if any."""
        ...

    def writers(self) -> Peers:
        """The peers of the background writers (collectives of their own, never interleaved with the loop's)."""
        ...


class Alone:
    """One process: the degenerate case of agreement."""

    rank = 0
    world_size = 1
    leader = True
    alone = True
    every = 0  # run.step() goes through the safe point when something may be due (Ranks: at fixed steps)
    nodes: Nodes | None = None

    def agree(self, stop: bool, save: Reason | None, *, walltime_stop: bool = False) -> Agreement:
        return Agreement(stop or walltime_stop, save, 0 if stop else -1)

    def broadcast(self, obj: Any) -> Any:
        return obj

    def all(self, flag: bool) -> bool:
        """``flag`` is True on every peer."""
        return flag

    def gather(self, obj: Any) -> list[Any] | None:
        return [obj]

    def barrier(self) -> None:
        pass

    def lost(self, error: BaseException | None) -> PeerLost | None:
        """The :class:`PeerLost` that ``error``, escaping the loop, stands for: one process has no peers to lose."""
        return None

    def writers(self) -> Alone:
        """One process's writer needs no group of its own."""
        return self


class Ranks:
    """The ranks of torch.distributed (created collectively, on every rank).

    Most calls forward to :class:`~preempt.cluster.distributed.Coordinator`; the layer stays because the two sit
    on either side of the run's vocabulary: the coordinator (cluster layer) moves integers and objects and knows no
    :class:`Reason`, this class turns a save's reason into the all-reduce's code and back (:data:`WIRE`) and gives the
    ranks the same face as :class:`Alone`, so that the run has one path for one process and for many ranks."""

    alone = False

    def __init__(self, sync_every: int, *, own_group: bool = False) -> None:
        self.coord = distributed.Coordinator(own_group=own_group)
        self.rank, self.world_size = self.coord.rank, self.coord.world_size
        self.leader = self.rank == 0
        self.every = sync_every  # every rank must take the same path: the ranks meet at every N-th step

    @property
    def nodes(self) -> Nodes | None:
        return self.coord.nodes

    @nodes.setter
    def nodes(self, value: Nodes | None) -> None:
        self.coord.nodes = value

    def writers(self) -> Ranks:
        """The ranks' background writers: the same ranks on a gloo group of their own (created now, on every rank),
        so that their collectives never interleave with the loop's."""
        writers = Ranks(self.every, own_group=True)
        writers.coord.nodes = self.coord.nodes  # (known once the run has started: the writers are made after)
        return writers

    def agree(self, stop: bool, save: Reason | None, *, walltime_stop: bool = False) -> Agreement:
        got = self.coord.agree(stop, 0 if save is None else WIRE[save], walltime_stop=walltime_stop)
        return Agreement(got.stop, _FROM_WIRE.get(got.save), got.signal_rank)

    def broadcast(self, obj: Any) -> Any:
        return self.coord.broadcast(obj)

    def all(self, flag: bool) -> bool:
        return self.coord.all(flag)

    def gather(self, obj: Any) -> list[Any] | None:
        return self.coord.gather(obj)

    def barrier(self) -> None:
        self.coord.barrier()

    def lost(self, error: BaseException | None) -> PeerLost | None:
        """A collective outside preempt's (DDP's gradient all-reduce in ``backward()``, the loop's own) failed
        because another rank is gone: the run ends as when one of its own collectives does (exit code 80)."""
        if error is None or not distributed.lost_peer(error):
            return None
        return self.coord.lost("a collective of the training loop (DDP's, or its own)", error)


def join(sync_every: int) -> Peers:
    """The peers of this process: the ranks when torch.distributed has more than one, else the process alone."""
    return Ranks(sync_every) if distributed.active() else Alone()
