"""Ranks whose nodes share no save_dir: which node each rank writes to, decided from what each rank sees.

Every rank names a ``save_dir`` by the same path. On a filesystem all nodes share it is one directory, and rank 0's
lock file is seen by every rank. On nodes with disks of their own (cloud machines, Kubernetes pods, SLURM without a
shared filesystem) each node has a directory of its own by that path, and the ranks of another node do not see
rank 0's lock file. Such a run is supported with a mirror (``mirror=``), which is then the only place a whole
checkpoint exists: every node writes its ranks' files into its own save_dir as its part of each checkpoint
(:class:`preempt.checkpoint.manifest.Part`) and uploads them, and a resume pulls the whole checkpoint.

The decisions here are pure (what each rank saw in, the grouping out), unit-tested without processes:

* :func:`split_by_node` -- from each rank's view (rank 0's lock file seen or not, and whether it is its node's first
  local rank), whether the save_dir is shared, refused, or split by node, and which ranks lead the other nodes (each
  takes its own directory's lock);
* :func:`assign` -- from the lock identities the leaders hold and the one each other rank sees, each rank's node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class View:
    """What one rank saw of the save_dir at the start: rank 0's lock file or not, and whether it is the first local
    rank of its node (``LOCAL_RANK`` 0: the one that takes its node's lock when the save_dir is not shared)."""

    same: bool
    first_local: bool
    found: str = ""  # what it saw instead of rank 0's lock file, in words


@dataclasses.dataclass(frozen=True)
class NodeSplit:
    """How the ranks share the save_dir: ``shared`` (one directory), ``refused`` (``problem`` says why), or
    ``apart`` (each node its own; ``leaders``: the rank that takes each node's lock, rank 0 first)."""

    kind: str
    leaders: tuple[int, ...] = (0,)
    problem: str = ""


def split_by_node(views: Sequence[View], *, mirror: bool) -> NodeSplit:
    """The sharing of the save_dir from every rank's view (rank 0's first, its own lock: always ``same``)."""
    other = [r for r, v in enumerate(views) if not v.same]
    if not other:
        return NodeSplit("shared")
    r = other[0]
    if not mirror:
        return NodeSplit(
            "refused",
            problem=f"rank {r} does not see the save_dir as rank 0 does ({views[r].found}). Nodes that do not share"
            " it need a mirror (mirror=...): each node then writes its part of every checkpoint and a resume pulls"
            " the whole checkpoint from the mirror",
        )
    leaders = tuple(r for r in other if views[r].first_local)
    if not leaders:
        return NodeSplit(
            "refused",
            problem=f"rank {r} does not see rank 0's save_dir, and no rank that does not see it has LOCAL_RANK 0 to"
            " hold its node's save_dir (start one torchrun per node)",
        )
    return NodeSplit("apart", (0, *leaders))


@dataclasses.dataclass(frozen=True)
class Nodes:
    """Which node's save_dir each rank writes to (node 0: rank 0's), and the rank that holds each node's lock."""

    of: tuple[int, ...]
    leaders: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.leaders)

    def ranks(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.of) if n == node]

    def leads(self, rank: int) -> bool:
        return rank in self.leaders


def assign(
    leaders: Sequence[int], identities: Sequence[Mapping[str, Any]], seen: Sequence[Mapping[str, Any] | None]
) -> Nodes | str:
    """Each rank's node: its own when it leads one, else the node whose leader's lock identity it sees.

    Args:
        leaders: The rank that leads each node (:attr:`NodeSplit.leaders`).
        identities: The lock identity each leader holds, in the same order.
        seen: Per rank, the identity its save_dir's lock file shows (a leader's entry is not read).

    Returns:
        The :class:`Nodes`, or why the ranks cannot be grouped (a rank that sees no leader's lock file).
    """
    of = []
    for rank, view in enumerate(seen):
        if rank in leaders:
            of.append(leaders.index(rank))
            continue
        node = next((n for n, i in enumerate(identities) if i and view and dict(i) == dict(view)), None)
        if node is None:
            return f"rank {rank} sees none of the node leaders' lock files in its save_dir (ranks {list(leaders)})"
        of.append(node)
    return Nodes(tuple(of), tuple(leaders))
