"""Ranks that stop together and commit one checkpoint: the agreement behind ``PreemptibleRun`` under torchrun.

When ``torch.distributed`` is initialised before the run is entered, every
rank enters ``PreemptibleRun`` with the same ``save_dir`` (on a filesystem all
ranks share) and the ranks agree, at every safe point, on what to do:

* **One collective per safe point.** Each rank contributes whether it saw a stop
  signal; rank 0 contributes its save decision (the policy's clock is rank 0's).
  An all-reduce (MAX) of those few integers gives every rank the same answer,
  so all save at the same step and all stop together even when only one rank
  received the signal. The signal handler itself never calls a collective: it
  sets a flag that the next safe point reads. The collective runs on a gloo
  group of its own (a CPU tensor, no device synchronisation), created when
  the run starts; it costs a round trip between the ranks per step
  (``sync_every_steps`` spaces it out).
* **One commit.** Rank 0 creates the temporary directory and names it to the
  others; every rank writes and fsyncs its own files into it and sends rank 0
  their digests (that gather is the barrier: every file is durable before it
  returns); rank 0 writes the manifest listing every rank's files, renames the
  directory into place and tells every rank the outcome. A checkpoint missing
  any rank's file does not verify and is never chosen. Deferred: when rank 0
  saves in the background, the exchange is the same but rank 0 writes none of
  its files in it; its background writer later writes them into the same
  directory and commits (:class:`~preempt.checkpoint.manager.Pending`), with no collective off the main
  thread. Sharded state in the background: the whole exchange runs in every
  rank's writer thread, on a :class:`Coordinator` of its own group
  (``own_group=True``), so the writers' collectives and the loop's never share
  a group.
* **Nodes without a shared save_dir** (``Coordinator.nodes``, :mod:`preempt.cluster.nodes`; a mirror is then
  required): each node's leader makes rank 0's temporary directory, by its name, in its own save_dir, and every
  rank writes into its node's; rank 0 commits node 0's part (a manifest of its node's files that also lists every
  other node's, :class:`~preempt.checkpoint.manifest.Part`), then each other node's leader commits its part, stamped
  with rank 0's time of the save. Each of those two steps is one agreement: a failure on any node fails the save on
  every rank alike (an OSError when it is one, so a periodic save is skipped everywhere).
* **What each rank writes.** The replicated state (DDP: the model, the
  optimizer, scheduler, scaler, tracked objects, ``run.user_state``) is written
  once, by rank 0, with rank 0's random generators. Every other rank writes its
  own random generators (``rank_<r>.safetensors`` and ``rank_<r>.json``). The
  cursor counts global samples, so a resume on another world size continues at
  the right sample.

* **A lost rank.** A rank that dies closes its connections, so the others'
  next collective fails at once; a rank whose node
  vanishes is noticed when the group's timeout passes. Every collective here
  turns that failure into :class:`~preempt.errors.PeerLost`: one ERROR line
  and exit code 80 on each survivor, nothing saved (a checkpoint needs every
  rank), the last checkpoint intact for the rerun of all ranks.

Objects crossing ranks here (directory names, digests, outcomes) travel as
JSON (:mod:`preempt.checkpoint.codec`), never pickled: a rank opens nothing another
process could turn into code.

* **Works destroyed in the main thread.** The latest collectives' work
  objects are kept until the process ends (:func:`_wait`), so that a
  process can end normally (no ``os._exit``). With gloo, a ``barrier()``
  (the usual last line of a script) holds weak references to the works still
  in progress when it starts; a work's destructor runs when its last
  reference goes, and that may be the barrier's, released by a gloo thread
  after the main thread has moved on, even during the interpreter's
  finalization. The destructor releases the work's tensors, which takes the
  GIL (torch keeps the Python object of a tensor that C++ shares); a thread
  that takes the GIL during finalization is made to exit inside a
  ``noexcept`` destructor and the process aborts ("terminate called without
  an active exception", SIGABRT; seen in 4 of at least 112 two-rank runs under load,
  and in 8 of 25 runs of a script that ends with a barrier behind 2,000
  broadcasts, against 0 of 40 when the barrier's work is kept). A work kept
  here is destroyed by the main thread, with the GIL, when the process ends.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import _testing
from .._log import log
from ..checkpoint import codec, hashed_io, names
from ..checkpoint.files import read_manifest
from ..checkpoint.manager import CheckpointInfo, CheckpointManager, Pending, write_payload
from ..checkpoint.manifest import Manifest, Part
from ..checkpoint.names import MANIFEST
from ..checkpoint.state import Payload
from ..errors import CheckpointWriteError, PeerLost
from .nodes import Nodes


def active() -> bool:
    """torch.distributed is initialised with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# How the backends word the loss of a peer in the errors they raise from a collective. gloo: the transport's own
# messages (a connection closed or reset, a read or write error, a timeout) all come from its source tree's
# transport/ folder, whose path starts the message. NCCL: the result codes of a remote peer's failure and the
# watchdog's timeout. Other errors (a shape mismatch, NCCL's invalid usage) are bugs that a rerun would repeat.
_LOST_PEER_WORDS = (
    "gloo/transport/",
    "Connection closed by peer",
    "Connection reset by peer",
    "ncclRemoteError",
    "remote process exited",
    "unexpected exit of a remote peer",
    "Watchdog caught collective operation timeout",
    "NCCL communicator was aborted",
)


def lost_peer(error: BaseException) -> bool:
    """Whether an error raised outside preempt's collectives (DDP's gradient all-reduce in ``backward()``, the
    loop's own collectives) is torch.distributed's report that another rank is gone."""
    if isinstance(error, PeerLost) or not isinstance(error, RuntimeError):
        return False
    if isinstance(error, (dist.DistNetworkError, dist.DistStoreError)):
        return True  # the connection to a peer or to the rendezvous store (rank 0's) is gone
    return any(word in str(error) for word in _LOST_PEER_WORDS)


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What every rank does at a safe point."""

    stop: bool  # some rank saw a stop signal (or rank 0's walltime keeper says stop)
    save: int  # rank 0's save decision: 0 none, else its reason's code (preempt.run.peers.WIRE)
    signal_rank: int  # the lowest rank that saw a signal, or -1


class Coordinator:
    """The collectives of one run: agreement at safe points and the commit's exchanges.

    Every method is a collective: every rank calls it, in the same order.
    """

    def __init__(self, *, own_group: bool = False) -> None:
        """``own_group``: on a gloo group of its own (created now, a collective), for the ranks' background writers."""
        if not active():
            raise RuntimeError("Coordinator: torch.distributed is not initialised with more than one rank")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.backend = str(dist.get_backend())
        # A CPU group for the per-step agreement: with NCCL the default group would need a device tensor
        # and a synchronisation of the stream every step.
        self.group = None if self.backend == "gloo" and not own_group else dist.new_group(backend="gloo")
        self._buf = torch.zeros(3, dtype=torch.int64)
        self.nodes: Nodes | None = None  # set when the ranks' nodes share no save_dir (preempt.cluster.nodes)
        self.rounds = 0  # the exchanges this rank has waited for (a collective, or a send or receive of its own)

    def agree(self, stop: bool, save: int, *, walltime_stop: bool = False) -> Agreement:
        """Combines every rank's stop flag with rank 0's save decision."""
        buf = self._buf
        big = self.world_size + 1
        buf[0] = 1 if stop or walltime_stop else 0
        buf[1] = save if self.rank == 0 else 0
        buf[2] = (big - self.rank) if stop else 0  # MAX picks the lowest signalled rank
        with self._peers("the agreement at a safe point"):
            self._wait(dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        first = int(buf[2])
        return Agreement(bool(buf[0]), int(buf[1]), big - first if first else -1)

    def all(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on every rank."""
        buf = torch.tensor([1 if flag else 0], dtype=torch.int64)
        with self._peers("an agreement on how to save"):
            self._wait(dist.all_reduce(buf, op=dist.ReduceOp.MIN, group=self.group, async_op=True))
        return bool(buf[0])

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (JSON: tuples arrive as lists), on every rank: one exchange when it fits in
        :data:`HEAD` bytes (a directory's name, an outcome), a second for the rest when it does not."""
        with self._peers("a broadcast from rank 0"):
            data = codec.dumps(obj) if self.rank == 0 else b""
            head = _framed(data) if self.rank == 0 else torch.empty(HEAD, dtype=torch.uint8)
            self._wait(dist.broadcast(head, src=0, group=self.group, async_op=True))
            size = _length(head)
            rest = None
            if size > HEAD - _SIZE:  # every rank read that from the head: all take the second exchange
                rest = _tensor_of(data[HEAD - _SIZE :]) if self.rank == 0 else _empty(size - (HEAD - _SIZE))
                self._wait(dist.broadcast(rest, src=0, group=self.group, async_op=True))
        if self.rank == 0:
            return obj
        return codec.loads(_body(head, rest), "a broadcast from rank 0")

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (JSON), in rank order, on rank 0 (None elsewhere): one exchange when each fits in
        :data:`HEAD` bytes (a rank's files and their digests); the rest of one that does not is sent on its own by
        its rank, which alone knows it, and received by rank 0, which reads it from that rank's head (a send names a
        global rank: a coordinator's group holds every rank, in order)."""
        mine = codec.dumps(obj)
        with self._peers("a gather to rank 0"):
            heads = [_empty(HEAD) for _ in range(self.world_size)] if self.rank == 0 else None
            self._wait(dist.gather(_framed(mine), heads, dst=0, group=self.group, async_op=True))
            if self.rank != 0:
                if len(mine) > HEAD - _SIZE:
                    self._wait(dist.isend(_tensor_of(mine[HEAD - _SIZE :]), dst=0, group=self.group))
                return None
            assert heads is not None
            out = []
            for r, head in enumerate(heads):
                size, rest = _length(head), None
                if r != 0 and size > HEAD - _SIZE:
                    rest = _empty(size - (HEAD - _SIZE))
                    self._wait(dist.irecv(rest, src=r, group=self.group))
                out.append(mine if r == 0 else _body(head, rest))
        return [codec.loads(data, f"rank {r}'s part of a gather") for r, data in enumerate(out)]

    def barrier(self) -> None:
        with self._peers("a barrier"):
            self._wait(dist.barrier(group=self.group, async_op=True))

    def _wait(self, work: dist.Work | None) -> None:
        """Waits for an exchange of this coordinator's (:func:`_wait`), counted in :attr:`rounds`."""
        self.rounds += 1
        _wait(work)

    @contextlib.contextmanager
    def _peers(self, during: str) -> Iterator[None]:
        """Turns the failure of a collective (another rank is gone) into :class:`PeerLost`, exit code 80.

        gloo and NCCL report a lost peer as a ``RuntimeError`` (``DistBackendError`` derives from it): a
        closed connection, or the collective's timeout.
        """
        try:
            yield
        except RuntimeError as e:
            raise self.lost(during, e) from e

    def lost(self, during: str, error: BaseException) -> PeerLost:
        """The :class:`PeerLost` of a collective that failed with ``error`` (its ``__cause__``), logged at ERROR."""
        lost = PeerLost(self.rank, self.world_size, during, error)
        lost.__cause__ = error
        log.error("%s", lost)
        return lost


# The work objects of this process's latest collectives (see the docstring). Several: gloo runs works on more than
# one thread, so a barrier may still hold a work issued a few collectives before it.
_KEPT: collections.deque[dist.Work] = collections.deque(maxlen=64)


def _wait(work: dist.Work | None) -> None:
    """Waits for a collective started with ``async_op=True`` and keeps its work until the process ends."""
    assert work is not None
    _KEPT.append(work)
    work.wait()


def settle(work: dist.Work | None) -> None:
    """Waits for a collective of another module started with ``async_op=True``, its work kept as :func:`_wait` keeps
    the ones here."""
    _wait(work)


_CPU_GROUP: list[Any] = []  # the gloo group of cpu_group(), once made


def cpu_group() -> Any:
    """A group of every rank for CPU tensors: the default group when its backend is gloo (None, as torch names it),
    else a gloo group made on the first call. A collective on that first call: every rank calls it at the same point.
    """
    if str(dist.get_backend()) == "gloo":
        return None
    if not _CPU_GROUP:
        _CPU_GROUP.append(dist.new_group(backend="gloo"))
    return _CPU_GROUP[0]


def _describe(error: BaseException, rank: int) -> tuple[int | None, str]:
    """An error as (errno or None, text), to send to the other ranks."""
    if isinstance(error, OSError):
        return error.errno, f"rank {rank}: {error.strerror or error}"
    return None, f"rank {rank}: {type(error).__name__}: {error}"


def _rebuild(described: tuple[int | None, str]) -> Exception:
    number, text = described
    if number is not None:
        return OSError(number, text)
    return CheckpointWriteError(text)


def _tensor_of(data: bytes) -> torch.Tensor:
    """``data`` as a uint8 tensor of its own memory."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# The bytes each rank sends in the first exchange of a broadcast or a gather: its object's size, then as much of the
# object as fits. What the commit exchanges (a directory's name, a rank's files and their digests, an outcome) fits,
# so each of those is one exchange rather than two (the size first, then the bytes).
HEAD = 4096
_SIZE = 8


def _framed(data: bytes) -> torch.Tensor:
    """A head of :data:`HEAD` bytes: the size of ``data``, then as much of it as fits."""
    head = torch.zeros(HEAD, dtype=torch.uint8)
    head[:_SIZE] = _tensor_of(len(data).to_bytes(_SIZE, "little"))
    part = data[: HEAD - _SIZE]
    if part:
        head[_SIZE : _SIZE + len(part)] = _tensor_of(part)
    return head


def _length(head: torch.Tensor) -> int:
    return int.from_bytes(head[:_SIZE].numpy().tobytes(), "little")


def _body(head: torch.Tensor, rest: torch.Tensor | None) -> bytes:
    """The object's bytes: those in its head, then the rest, sent on its own when it did not fit."""
    size = _length(head)
    data = head[_SIZE : _SIZE + min(size, HEAD - _SIZE)].numpy().tobytes()
    return data if rest is None else data + rest.numpy().tobytes()


def _empty(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def save_ranked(
    manager: CheckpointManager,
    coord: Coordinator,
    payload: Payload,
    manifest: Manifest,
    extra: Callable[[Path], list[str]] | None = None,
    *,
    defer: bool = False,
) -> CheckpointInfo | Pending | None:
    """The distributed commit (see the module docstring); every rank calls it with its own payload.

    Args:
        extra: Called on every rank with the temporary directory before its
            payload is written (a collective writer: DCP's pieces of sharded
            state); returns the names of the files this rank wrote there, which
            are hashed and listed like the payload's.
        defer: Rank 0's wish (the other ranks' value is ignored; they learn
            it): rank 0 does not write its payload here; it gets a
            :class:`~preempt.checkpoint.manager.Pending` to finish in the background, once every other
            rank's files are durable.

    Returns:
        The checkpoint's CheckpointInfo, on every rank; when deferred, the
        Pending checkpoint on rank 0 and None on the others.

    Raises:
        OSError: Some rank could not write (disk full, I/O error): on every rank,
            naming that rank; the partial directory is gone.
        CheckpointWriteError: Any other failure of some rank.
    """
    nodes = coord.nodes
    tmp, error = None, None
    if coord.rank == 0:
        try:
            tmp = manager.new_tmp_dir(manifest.step, reuse=extra is None)  # DCP writes its own files
        except OSError as e:
            error = _describe(e, 0)
    where, error, defer = coord.broadcast((None if tmp is None else str(tmp), error, defer))
    if where is None:
        raise _rebuild(error)
    tmp = Path(where)
    if nodes is not None:  # each node's leader makes the directory of that name in its own save_dir
        tmp = _node_tmp(manager, coord, nodes, tmp.name)
    files, error = None, None
    try:
        writes = not (defer and coord.rank == 0)  # a deferred rank 0 writes later (manager.save_into)
        if writes:
            _testing.reach("write", tmp)
        extra_names = extra(tmp) if extra is not None else []
        files = write_payload(tmp, payload) if writes else {}
        for fname in extra_names:
            files[fname] = hashed_io.read_file(tmp / fname)[1]
    except Exception as e:
        error = _describe(e, coord.rank)
    sent = None if files is None else {name: d.to_json() for name, d in files.items()}
    got = coord.gather((sent, error))  # returns on rank 0 once every rank's files are durable
    outcome: Any = None
    result: CheckpointInfo | Pending | None = None
    if coord.rank == 0:
        assert got is not None
        errors = [e for _, e in got if e is not None]
        by_node = _by_node(got, nodes)
        listed, part = by_node.pop(0), None
        if nodes is not None:
            elsewhere = {n: (k, d) for k, held in by_node.items() for n, d in held.items()}
            part = Part(0, nodes.count, elsewhere)
        if errors:
            manager.discard(tmp)
            outcome = ("error", errors[0])
        elif defer:
            result = Pending(tmp, listed, part)
            outcome = ("deferred", str(tmp))
        else:
            try:
                result = manager.commit(tmp, dataclasses.replace(manifest, part=part), listed)
                outcome = ("ok", str(result.path))
            except Exception as e:
                outcome = ("error", _describe(e, 0))
        if outcome[0] != "error":  # each other node's leader commits its part with its ranks' files, as of this save
            parts = {k: {n: d.to_json() for n, d in held.items()} for k, held in by_node.items()}
            outcome = (*outcome, parts, manifest.created)
    outcome = coord.broadcast(outcome)
    if outcome[0] == "error":
        if nodes is not None and coord.rank != 0 and nodes.leads(coord.rank):
            manager.discard(tmp)
        raise _rebuild(outcome[1])
    if nodes is not None:
        return _commit_part(manager, coord, nodes, manifest, tmp, outcome, result)
    if coord.rank == 0 or outcome[0] == "deferred":
        return result
    path = Path(outcome[1])
    info = CheckpointInfo(path, manifest.step, "valid", read_manifest(path / MANIFEST))
    manager.committed(info)  # this rank's files in it are durable: the next checkpoint may carry them
    return info


def _by_node(got: list[Any], nodes: Nodes | None) -> dict[int, dict[str, hashed_io.FileDigest]]:
    """The files every rank wrote (gathered on rank 0), by the node whose save_dir holds them (all: node 0)."""
    count = 1 if nodes is None else nodes.count
    by: dict[int, dict[str, hashed_io.FileDigest]] = {k: {} for k in range(count)}
    for rank, (sent, _) in enumerate(got):
        held = by[0 if nodes is None else nodes.of[rank]]
        held.update({name: hashed_io.FileDigest(**d) for name, d in (sent or {}).items()})
    return by


def _node_tmp(manager: CheckpointManager, coord: Coordinator, nodes: Nodes, name: str) -> Path:
    """Nodes without a shared save_dir: the directory ``name`` (rank 0's) in this rank's own save_dir, made by its
    node's leader before any rank of that node writes into it (one agreement; a failure on any node fails all)."""
    tmp, error = manager.save_dir / name, None
    if coord.rank != 0 and nodes.leads(coord.rank):
        try:
            manager.new_tmp_dir_named(name)
        except OSError as e:
            error = e
    first = _first_error(coord, error)
    if first is not None:
        if error is None and nodes.leads(coord.rank):  # rank 0's, or one another leader made
            manager.discard(tmp)
        raise first
    return tmp


def _first_error(coord: Coordinator, error: BaseException | None) -> Exception | None:
    """The first rank's error among every rank's (None: none failed), the same on every rank: an OSError (a periodic
    save that fails for want of disk is skipped, by every rank alike) or a CheckpointWriteError."""
    got = coord.gather(None if error is None else _describe(error, coord.rank))
    first = coord.broadcast(None if got is None else next((e for e in got if e is not None), None))
    return None if first is None else _rebuild(first)


def _commit_part(
    manager: CheckpointManager,
    coord: Coordinator,
    nodes: Nodes,
    manifest: Manifest,
    tmp: Path,
    outcome: Any,
    result: CheckpointInfo | Pending | None,
) -> CheckpointInfo | Pending | None:
    """Nodes without a shared save_dir, once rank 0 committed (or deferred) node 0's part: every other node's leader
    commits its part, then every rank learns that all parts are durable (one agreement). Returns as
    :func:`save_ranked`: a part's leader gets its part, even when rank 0 finishes its own in the background."""
    node = nodes.of[coord.rank]
    error: Exception | None = None
    part: CheckpointInfo | None = None
    if node != 0 and nodes.leads(coord.rank):
        held = {n: hashed_io.FileDigest(**d) for n, d in outcome[2].get(str(node), {}).items()}
        try:
            # rank 0's time of the save: the parts of one save have one time, which the mirror's manifest has too
            mine = dataclasses.replace(manifest, created=outcome[3], part=Part(node, nodes.count))
            part = manager.commit(tmp, mine, held)
        except Exception as e:
            error = e
    first = _first_error(coord, error)
    if first is not None:
        if isinstance(result, Pending) and result.tmp is not None:
            manager.discard(result.tmp)
        elif isinstance(result, CheckpointInfo):  # node 0's part of a checkpoint that will never be whole
            manager.quarantine(result, f"{result.path}: another node could not commit its part ({first})")
        raise first
    if coord.rank == 0:
        return result
    if part is not None:
        return part
    if node == 0 and outcome[0] == "deferred":
        return None  # rank 0 commits node 0's part in the background
    path = Path(outcome[1]) if node == 0 else manager.save_dir / names.checkpoint_name(manifest.step)
    info = CheckpointInfo(path, manifest.step, "valid", read_manifest(path / MANIFEST))
    manager.committed(info)
    return info
