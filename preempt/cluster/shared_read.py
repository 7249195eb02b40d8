"""Ranks that restore together: each reads a share of a checkpoint's files past the page cache, and they exchange the
rest, so that the disk reads every byte once, whatever the number of ranks.

Every rank of a DDP run restores the same files (rank 0's model and optimizer, every rank's small random state).
Read by each rank, they cost the disk (or the page cache) once per rank. Here the ranks that see the same save_dir
share the work:

1. **The byte ranges** (:func:`byte_ranges`, pure). The files' bytes, taken in order as one stream, are cut into one
   contiguous share per rank at block boundaries (a read past the page cache reads whole aligned blocks), and each share
   into ranges of at most :data:`LARGEST_RANGE` bytes. The ranges are exchanged round by round: each rank's first range
   in rank order, then each rank's second, so that every rank's reads go on while the others' ranges cross.
2. **Taking part** (a gather, then rank 0's decision broadcast): a rank takes part when it sees the checkpoint rank 0
   offers (:func:`exchange`'s ``take_part``) and has the memory for the files; when one does not, none does, and
   each reads the files itself, as a process alone does.
3. **The exchange.** The ranks of one machine (same boot id and host name) read their ranges ``O_DIRECT`` into memory
   they all map (a ``memfd`` of rank 0's, opened by the others through ``/proc``), two reads in flight, and each then
   maps it privately (copy on write: a rank's changes stay its own); each file is hashed once, by one of them
   (:func:`hashing`), range by range as the ranks read them (:func:`reading_order`). A rank done with its share
   takes the ranges another has not begun, from the back of its share (:func:`claim`: a device that serves one
   process more slowly than another does not hold the others up), and the pages of the files the caller copies out
   (a model's weights) are mapped in each rank's private view as they land, rather than a fault per page when they
   are copied (after every file is verified). Ranks of several machines, or where that memory cannot be shared,
   read their ranges into memory of their own and broadcast each as soon as it is read, on a gloo group (CPU
   tensors, :func:`preempt.cluster.distributed.cpu_group`), and every rank hashes every file.
4. **The verdict.** Every file is hashed whole (xxh3-128, the manifest's digest, over the bytes the ranks will use);
   the ranks' findings are gathered and rank 0 broadcasts the first failure: a file that fails its digest (on any
   rank's share), or a share that could not be read, fails the checkpoint for every rank alike, as
   :class:`~preempt.errors.CorruptCheckpointError` (the caller falls back to the next older checkpoint, as for a
   process alone) or :class:`~preempt.errors.CheckpointUnreadableError` (a resource error: no fallback, nothing moved
   aside).

The cost of sharing on one machine: state that stays in host memory (an optimizer's on the CPU) keeps the shared
pages it was restored from for as long as it lives, besides each rank's own copy of the pages it changes; state moved
to a GPU frees them as it is moved.

Every step is a collective: each rank calls :func:`exchange` with the same files in the same order (rank 0's offer,
broadcast by the caller). A process alone never comes here.
"""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from .. import _log
from ..checkpoint import direct_io, files, hashed_io, readahead, safe_io
from ..checkpoint.hashed_io import FileDigest
from ..errors import CheckpointUnreadableError, CorruptCheckpointError, PeerLost
from . import distributed

log = _log.log

_POLL = 0.002  # seconds between two looks at whether a range a rank hashes is read yet
# bytes per range at most: a direct read of the device's size, and a broadcast that overlaps the next read
LARGEST_RANGE = 32 << 20
BLOCK = direct_io.BLOCK
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; Python names it from 3.14 on

Shared = dict[str, tuple[np.ndarray, FileDigest]]  # a file's name -> its bytes and the digest this rank computed


class Talk(Protocol):
    """The small collectives of the exchange (:class:`preempt.run.peers.Peers` has them): JSON objects."""

    def broadcast(self, obj: Any) -> Any: ...

    def gather(self, obj: Any) -> list[Any] | None: ...


@dataclasses.dataclass(frozen=True)
class ByteRange:
    """``length`` bytes of file number ``file`` from ``offset``, read by rank ``owner`` and broadcast from it."""

    file: int
    offset: int
    length: int
    owner: int


def byte_ranges(
    sizes: Sequence[int], ranks: int, *, largest: int = LARGEST_RANGE, block: int = BLOCK
) -> list[ByteRange]:
    """Which rank reads which bytes of which file, in the order the byte ranges are exchanged. Pure.

    The files' bytes in order are one stream, cut into ``ranks`` contiguous shares of about equal size; a cut falls
    on a multiple of ``block`` within its file (so a share may be up to a block shorter or longer than its part).
    Each share is cut at the files' ends and every ``largest`` bytes. Every offset is a multiple of ``block``, every
    length too unless the range ends its file. The order: round ``k`` holds each rank's ``k``-th range, in rank order.

    Args:
        sizes: The files' sizes in bytes, in the order all ranks list them.
        ranks: How many ranks read (>= 1).
        largest: The largest range, a multiple of ``block``.
        block: The alignment of a read past the page cache.

    Raises:
        ValueError: ``ranks`` < 1, or ``largest`` not a positive multiple of ``block``, or a negative size.
    """
    if ranks < 1:
        raise ValueError(f"ranks: expected >= 1, found {ranks}")
    if largest <= 0 or largest % block:
        raise ValueError(f"largest: expected a positive multiple of {block}, found {largest}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"sizes: expected sizes >= 0, found {min(sizes)}")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    cuts = [0]
    for r in range(1, ranks):
        x = total * r // ranks
        f = next((i for i in range(len(sizes)) if starts[i] <= x < starts[i] + sizes[i]), None)
        at = total if f is None else starts[f] + (x - starts[f]) // block * block
        cuts.append(max(at, cuts[-1]))
    cuts.append(total)
    own: list[list[ByteRange]] = [[] for _ in range(ranks)]
    for r in range(ranks):
        lo, hi = cuts[r], cuts[r + 1]
        for f, (start, size) in enumerate(zip(starts, sizes, strict=True)):
            a, b = max(lo, start) - start, min(hi, start + size) - start
            for offset in range(a, b, largest) if a < b else ():
                own[r].append(ByteRange(f, offset, min(largest, b - offset), r))
    rounds = max((len(p) for p in own), default=0)
    return [own[r][k] for k in range(rounds) for r in range(ranks) if k < len(own[r])]


def exchange(
    talk: Talk,
    where: Path,
    wanted: Sequence[tuple[str, FileDigest]],
    *,
    take_part: bool,
    machine: str | None = None,
    copied: Collection[str] = (),
) -> Shared:
    """The files ``wanted`` of the checkpoint directory ``where``, read together by every rank (the module
    docstring); {} on every rank when one of them does not take part (each then reads them itself).

    A collective: every rank calls it with the same ``wanted``, in the same order. ``machine`` tells this rank's
    machine from the others' (None: its boot's id and its name): the ranks of one machine share memory, the others
    broadcast. ``copied``: the files whose bytes the caller copies out once they are verified (a model's weights,
    copied into the live model): where the ranks share memory, this rank's view of them is mapped ahead, as each
    range lands, so that the copy does not fault in every page (the others' bytes it keeps as they are).

    Raises:
        CorruptCheckpointError: On every rank alike: a file is missing, not a regular file, of another size or of
            another digest (the message names the file and both digests).
        CheckpointUnreadableError: On every rank alike: a share could not be read for a reason of the environment.
        PeerLost: Another rank is gone.
    """
    rank = dist.get_rank()
    room = sum(_whole(d.size) for _, d in wanted)
    available = readahead.host_memory_available()
    if take_part and available is not None and not hashed_io.keeps_in_memory(room, available):
        log.debug(
            "rank %d: no memory to restore %s with the other ranks (%d of %d bytes)", rank, where, room, available
        )
        take_part = False
    views = talk.gather([take_part, _machine() if machine is None else machine])
    memfd, decided = -1, None
    if views is not None:  # rank 0: every rank on this machine shares memory; else they broadcast
        if all(v[0] for v in views) and all(v[1] == views[0][1] for v in views):
            memfd = _memfd(room, byte_ranges([d.size for _, d in wanted], len(views)), len(views))
        decided = [all(v[0] for v in views), None if memfd < 0 else [os.getpid(), memfd]]
    go, at = talk.broadcast(decided)
    try:
        if go and at is not None:
            fd = memfd if rank == 0 else _open_memfd(*at)
            got = _through_memory(talk, where, wanted, room, fd, copied)
            if got is not None:
                return got
        return _by_broadcast(talk, where, wanted) if go else {}
    finally:
        if memfd >= 0:
            os.close(memfd)


def _through_memory(
    talk: Talk, where: Path, wanted: Sequence[tuple[str, FileDigest]], room: int, fd: int, copied: Collection[str]
) -> Shared | None:
    """The ranks of one machine: each reads its ranges into memory they all map (rank 0's ``memfd``, ``fd`` here; -1
    where it could not be opened), then maps it privately (copy on write: a rank's changes stay its own). None on
    every rank when one could not open or map it (they broadcast instead)."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    start = time.monotonic()
    sizes = [d.size for _, d in wanted]
    ranges = byte_ranges(sizes, ranks)
    together = own = None
    locks: list[int] = []  # a descriptor of the memory for each reading thread: the claims' lock (flock) is per open
    try:
        if fd >= 0:
            size = room + _Claims.size(ranks, len(ranges))
            together = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            # this rank's own view: not a mapping of a file of the checkpoint (hashed_io.is_mapping), so the
            # optimizer's tensors keep it as it is; nobody else writes or truncates it
            own = hashed_io._Memory(fd, room, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            locks = [os.open(f"/proc/self/fd/{fd}", os.O_RDWR | getattr(os, "O_CLOEXEC", 0)) for _ in range(2)]
    except OSError as e:  # no room for the mappings: every rank broadcasts instead
        log.debug("rank %d: cannot map the memory of the ranks' restore (%s)", rank, e)
        own = None
    finally:
        if fd >= 0 and rank != 0:
            os.close(fd)
    mapped = talk.gather(own is not None)
    if not talk.broadcast(None if mapped is None else all(mapped)) or together is None or own is None:
        for m in (together, own):
            if m is not None:
                m.close()
        for lock in locks:
            os.close(lock)
        return None
    starts = [sum(_whole(d.size) for _, d in wanted[:f]) for f in range(len(wanted))]
    failures: list[tuple[int, str, str]] = []
    kept, view = {f for f, (name, _) in enumerate(wanted) if name in copied}, own
    mine: list[ByteRange] = []  # the ranges this rank read

    def ahead(ps: Sequence[ByteRange]) -> None:  # this rank's view of the ranges of the files copied out, mapped
        for p in ps:
            if p.file in kept:
                _map_ahead(view, starts[p.file] + p.offset, p.length)

    # One hash of each file for all: the ranks map the same memory. Each file hashed through the shared mapping by
    # one rank (hashing), range by range as the ranks read them, whichever reads each.
    hashers = hashing(sizes, ranks)
    found: dict[int, FileDigest] = {}
    stop = threading.Event()

    with memoryview(together) as whole:
        rooms = [whole[a : a + _whole(d.size)] for a, (_, d) in zip(starts, wanted, strict=True)]
        claims = _Claims(whole[room:], ranges, rank, ranks)

        def read(ps: Sequence[ByteRange]) -> None:
            mine.extend(ps)
            claims.read(ps)
            ahead(ps)
            for p in ps:  # this rank's pages of the shared view, let go while the device reads (the hasher's: hashed)
                if hashers[p.file] != rank:
                    _let_go(together, starts[p.file] + p.offset, p.length)

        def hashed(p: ByteRange) -> None:
            _let_go(together, starts[p.file] + p.offset, p.length)

        hasher = threading.Thread(
            target=claims.hash,
            args=(rooms, [f for f in range(len(wanted)) if hashers[f] == rank], sizes, found, stop, hashed),
            name="preempt-shared-hash",
            daemon=True,
        )
        # two reads in flight (the device serves several at once), each thread its own descriptors
        second = threading.Thread(
            target=_read_share,
            args=(where, wanted, rooms, claims.ranges(locks[1]), {}, failures, read),
            name="preempt-shared-read",
            daemon=True,
        )
        try:
            hasher.start()
            second.start()
            try:
                _read_share(where, wanted, rooms, claims.ranges(locks[0]), {}, failures, read)
            finally:
                second.join()
                for lock in locks:
                    os.close(lock)
            talk.gather(None)  # every rank's ranges are in the memory: a barrier
            talk.broadcast(None)
            exchanged = time.monotonic()
            # the others' ranges of the files copied out, mapped while the last ranges are hashed
            done = set(mine)
            others = threading.Thread(
                target=ahead, args=([p for p in ranges if p not in done],), name="preempt-map-ahead", daemon=True
            )
            others.start()
            hasher.join()
            others.join()
        finally:
            stop.set()  # another rank lost: nothing more to wait for
            if hasher.is_alive():
                hasher.join()
            claims.release()
            for r in rooms:
                r.release()
    together.close()  # its pages let go of already, so the unmapping is short: this rank's own view stays
    mine_found = found
    bufs = [
        np.frombuffer(own, dtype=np.uint8, count=d.size, offset=a) for a, (_, d) in zip(starts, wanted, strict=True)
    ]
    return _verdict(talk, where, wanted, bufs, failures, mine_found, sum(p.length for p in mine), exchanged - start)


def claim(rank: int, left: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """Which range ``rank`` reads next where the ranks of one machine share the work: ``(r, i)``, the ``i``-th range of
    rank ``r``'s share (:func:`byte_ranges`), or None: nothing left. ``left[r]`` is ``(next, end)``: rank ``r``'s
    share's ranges ``next`` to ``end`` (exclusive) are not claimed yet. Pure.

    A rank reads its own share from the front; once it is done, it takes the last range of the share with the most
    ranges left (the lowest rank among equals), so that a rank the device serves more slowly does not hold the
    others up, but never a share's first range: every rank with a share reads a part of it.
    """
    first, end = left[rank]
    if first < end:
        return rank, first
    spare = [end - max(first, 1) for first, end in left]  # what may be taken from each share's back
    most = max(range(len(left)), key=lambda r: (spare[r], -r))
    return (most, left[most][1] - 1) if spare[most] > 0 else None


def reading_order(ranges: Sequence[ByteRange], ranks: int) -> list[list[ByteRange]]:
    """Each rank's share of ``ranges`` (:func:`byte_ranges`) in the order it reads them: by their offset in their files,
    so that the ranks that hash the files (:func:`hashing`) find each file's beginning read early, whichever ranks read
    it. Pure."""
    return [sorted((p for p in ranges if p.owner == r), key=lambda p: (p.offset, p.file)) for r in range(ranks)]


class _Claims:
    """The ranges the ranks of one machine claim (:func:`claim`), in the blocks after the memory they share: each
    rank's ``(next, end)``, read and changed under a lock (``flock`` of a descriptor of that memory: a thread's own),
    then one flag per range, set once it is read (or failed: the verdict fails the checkpoint)."""

    def __init__(self, blocks: memoryview, ranges: Sequence[ByteRange], rank: int, ranks: int) -> None:
        self.left = np.frombuffer(blocks, dtype=np.int64, count=2 * ranks).reshape(ranks, 2)
        self.flags = np.frombuffer(blocks, dtype=np.int64, count=len(ranges), offset=16 * ranks)
        self.index = {p: i for i, p in enumerate(ranges)}
        self.shares = reading_order(ranges, ranks)
        self.rank = rank

    @staticmethod
    def size(ranks: int, ranges: int) -> int:
        """The bytes of the blocks: ``(next, end)`` for each rank, a flag for each range."""
        return _whole(8 * (2 * ranks + ranges))

    def read(self, ranges: Sequence[ByteRange]) -> None:
        for p in ranges:
            self.flags[self.index[p]] = 1

    def hash(
        self,
        rooms: Sequence[memoryview],
        files: Sequence[int],
        sizes: Sequence[int],
        found: dict[int, FileDigest],
        stop: threading.Event,
        hashed: Callable[[ByteRange], None],
    ) -> None:
        """The digests of ``files`` into ``found``, each range hashed once a rank has read it, in order (``hashed``
        told of each); back when ``stop`` is set."""
        by_file: dict[int, list[tuple[int, ByteRange]]] = {f: [] for f in files}
        for p in self.index:
            if p.file in by_file:
                by_file[p.file].append((p.offset, p))
        for f in files:
            digest = xxhash.xxh3_128()
            for _, p in sorted(by_file[f]):
                while not self.flags[self.index[p]]:
                    if stop.wait(_POLL):
                        return
                hashed_io.update(digest, rooms[f][p.offset : p.offset + p.length])
                hashed(p)
            found[f] = FileDigest(sizes[f], digest.hexdigest())

    def ranges(self, lock: int) -> Iterator[ByteRange]:
        """The ranges this thread reads, each claimed as the one before is read."""
        while True:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                got = claim(self.rank, [(int(a), int(b)) for a, b in self.left])
                if got is None:
                    return
                r, i = got
                if r == self.rank:
                    self.left[r, 0] = i + 1  # from the front of its own share
                else:
                    self.left[r, 1] = i  # from the back of another's
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
            yield self.shares[r][i]

    def release(self) -> None:
        del self.left, self.flags  # the views of the shared memory, before it is unmapped


def hashing(sizes: Sequence[int], ranks: int) -> list[int]:
    """Which rank hashes each file of ``sizes`` when the ranks map the same memory: the largest file first, each to
    the rank with the fewest bytes to hash so far (the lowest rank among equals). Pure."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for f in sorted(range(len(sizes)), key=lambda f: (-sizes[f], f)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[f] = r
        load[r] += sizes[f]
    return owner


def _by_broadcast(talk: Talk, where: Path, wanted: Sequence[tuple[str, FileDigest]]) -> Shared:
    """The ranks of several machines: each reads its ranges into memory of its own, and broadcasts each as soon as
    it is read, on a gloo group. {} on every rank when one has not the memory."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        bufs = [_memory(d.size)[: d.size] for _, d in wanted]  # each in memory that holds its last block whole
    except MemoryError as e:
        log.debug("rank %d: no memory to restore %s with the other ranks (%s)", rank, where, e)
        bufs = []
    made = talk.gather(bool(bufs) or not wanted)
    if not talk.broadcast(None if made is None else all(made)):
        return {}
    ranges = byte_ranges([d.size for _, d in wanted], world)
    mine = [p for p in ranges if p.owner == rank]
    ready = {p: threading.Event() for p in mine}
    failures: list[tuple[int, str, str]] = []  # (file, kind, message) of this rank's reads
    rooms = [(b.base if isinstance(b.base, np.ndarray) else b).data.cast("B") for b in bufs]
    reader = threading.Thread(
        target=_read_share,
        args=(where, wanted, rooms, mine, ready, failures),
        name="preempt-shared-read",
        daemon=True,
    )
    start = time.monotonic()
    reader.start()
    try:
        group = distributed.cpu_group()
        works = []
        for p in ranges:
            if p.owner == rank:
                ready[p].wait()
            view = torch.from_numpy(bufs[p.file][p.offset : p.offset + p.length])
            works.append(dist.broadcast(view, src=p.owner, group=group, async_op=True))
        for work in works:
            distributed.settle(work)
    except RuntimeError as e:
        lost = PeerLost(rank, world, "the exchange of a restore's files", e)
        log.error("%s", lost)
        raise lost from e
    finally:
        reader.join()
    took = time.monotonic() - start
    found = dict(enumerate(hashed_io.digests_of(bufs)))
    return _verdict(talk, where, wanted, bufs, failures, found, sum(p.length for p in mine), took)


def _verdict(
    talk: Talk,
    where: Path,
    wanted: Sequence[tuple[str, FileDigest]],
    bufs: list[np.ndarray],
    failures: list[tuple[int, str, str]],
    found: dict[int, FileDigest],
    read: int,
    took: float,
) -> Shared:
    """The first failure of any rank's (its reads, the digests it found: ``found``, by file number) raised on every
    rank alike; else every file's bytes with its digest as found (by this rank, or by the rank that hashed the
    memory they all map)."""
    rank = dist.get_rank()
    problems = [[f, kind, message] for f, kind, message in failures]
    for f, got in found.items():
        try:
            files.compare(where / wanted[f][0], wanted[f][1], got)
        except CorruptCheckpointError:
            # Hashed as its ranges landed, each once its flag said it was read. A processor that may reorder loads
            # (ARM) could have read bytes older than the flag: hashed again now, after the ranks' barrier, before the
            # checkpoint is failed (a damaged file fails both).
            again = hashed_io.digest_of(bufs[f])
            try:
                files.compare(where / wanted[f][0], wanted[f][1], again)
                found[f] = again
            except CorruptCheckpointError as e:
                problems.append([f, "digest", str(e)])
    said = talk.gather(sorted(problems))
    verdict = talk.broadcast(None if said is None else _first(said))
    if verdict is not None:
        kind, message = verdict
        raise (CheckpointUnreadableError if kind == "unreadable" else CorruptCheckpointError)(message)
    log.debug(
        "rank %d: read %d of the %d bytes of %s, the other ranks the rest, in %.2f s; hashed %d of them",
        rank,
        read,
        sum(b.nbytes for b in bufs),
        where,
        took,
        sum(d.size for d in found.values()),
    )
    return {name: (buf, found.get(f, d)) for f, ((name, d), buf) in enumerate(zip(wanted, bufs, strict=True))}


def _machine() -> str:
    """What tells this machine from another: its boot's id where Linux gives one, and its name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()} {boot}"


def _memfd(size: int, ranges: Sequence[ByteRange], ranks: int) -> int:
    """Rank 0: anonymous memory of ``size`` bytes that the other ranks of this machine open
    (``/proc/<pid>/fd/<fd>``), and after it the blocks where they claim the ``ranges`` and say which are read
    (:class:`_Claims`), each rank its own share to begin with; gone when the last rank unmaps it, whatever happens.
    -1 where there is none."""
    try:
        fd = os.memfd_create("preempt-restore", getattr(os, "MFD_CLOEXEC", 0))
    except (AttributeError, OSError):
        return -1
    try:
        os.ftruncate(fd, size + _Claims.size(ranks, len(ranges)))
        shares = [sum(p.owner == r for p in ranges) for r in range(ranks)]
        os.pwrite(fd, np.array([[0, n] for n in shares], dtype=np.int64).tobytes(), size)
    except OSError:
        os.close(fd)
        return -1
    return fd


def _open_memfd(pid: int, fd: int) -> int:
    """A rank other than 0: rank 0's memory (:func:`_memfd`), or -1 where it cannot be opened."""
    try:
        return os.open(f"/proc/{int(pid)}/fd/{int(fd)}", os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return -1


def _whole(size: int) -> int:
    """The memory of a file of ``size`` bytes in whole blocks (a direct read reads the last block whole)."""
    return max(BLOCK, -(-size // BLOCK) * BLOCK)


def _first(said: list[list[list[Any]]]) -> list[str] | None:
    """Rank 0: the failure every rank raises: the first file's (in the files' order) read failure before its digest
    failure (a share not read fails its digest too, and the read's error says why), else None."""
    problems = sorted((f, kind == "digest", kind, message) for got in said for f, kind, message in got)
    return None if not problems else [problems[0][2], problems[0][3]]


def _memory(size: int) -> np.ndarray:
    """Memory of this process's own for a file of ``size`` bytes, page-aligned, in whole blocks (a direct read reads
    the last block whole). Not a mapping of a file: the tensors may keep it as it is."""
    available = readahead.host_memory_available()
    if available is not None and not hashed_io.keeps_in_memory(size, available):
        raise MemoryError(f"{size} bytes: more than {hashed_io.KEEP_FRACTION:.0%} of the {available} available")
    # the device and the broadcasts write every page: nothing to fault in beforehand
    return hashed_io._fresh(_whole(size), populate=False)


def _read_share(
    where: Path,
    wanted: Sequence[tuple[str, FileDigest]],
    rooms: list[memoryview],
    mine: Iterable[ByteRange],
    ready: Mapping[ByteRange, threading.Event],
    failures: list[tuple[int, str, str]],
    read: Callable[[Sequence[ByteRange]], None] | None = None,
) -> None:
    """This rank's ranges (as claimed), read in order into ``rooms`` (each file's memory, in whole blocks); each
    range's event in ``ready`` set once read (or failed: the failure is in ``failures``, and the range holds what it
    holds; the verdict fails the checkpoint); ``read`` told of each range once done with (read, or failed)."""
    fds: dict[int, int] = {}
    failed: set[int] = set()
    try:
        for p in mine:
            if p.file not in failed:
                path = where / wanted[p.file][0]
                try:
                    if p.file not in fds:
                        fds[p.file] = _open(path, wanted[p.file][1].size)
                    for _ in direct_io.read_range(fds[p.file], rooms[p.file], p.offset, p.length):
                        pass  # a refused direct read goes on through the page cache
                except (OSError, MemoryError, CorruptCheckpointError) as e:
                    failed.add(p.file)
                    error = e if isinstance(e, CorruptCheckpointError) else files.read_error(path, e)
                    kind = "unreadable" if isinstance(error, CheckpointUnreadableError) else "corrupt"
                    failures.append((p.file, kind, str(error)))
            if read is not None:
                read([p])
            if p in ready:
                ready[p].set()
    finally:
        for event in ready.values():
            event.set()
        for fd in fds.values():
            os.close(fd)


def _open(path: Path, size: int) -> int:
    """A descriptor of the regular file ``path`` of ``size`` bytes, read past the page cache where the filesystem
    lets it (:func:`direct_io.set_direct`; a file shorter than a block through the page cache).

    Raises:
        CorruptCheckpointError: Missing, not a regular file, or of another size.
        OSError: It cannot be opened.
    """
    try:
        files.regular_file(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: missing") from None
    fd = safe_io.open_fd(path)
    try:
        found = os.fstat(fd).st_size
        if found != size:
            raise CorruptCheckpointError(f"{path}: size {found} bytes, manifest says {size}")
        if size >= BLOCK:
            direct_io.set_direct(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map_ahead(memory: mmap.mmap, start: int, length: int) -> None:
    """The pages of ``length`` bytes of ``memory`` from ``start`` (a multiple of the page size) mapped for reading
    now (``MADV_POPULATE_READ``: one call, rather than a fault per page when they are copied); where the system has
    no such advice, they are mapped as they are first read, as before."""
    try:
        memory.madvise(_MADV_POPULATE_READ, start, -(-length // mmap.PAGESIZE) * mmap.PAGESIZE)
    except (OSError, ValueError):
        pass


def _let_go(memory: mmap.mmap, start: int, length: int) -> None:
    """This process's mapping of ``length`` bytes of the shared ``memory`` from ``start`` undone (``MADV_DONTNEED``:
    the bytes stay in the memory, read again on the next access), so that unmapping it all at the end, which takes
    the process's memory map for as long, has little left to do."""
    try:
        memory.madvise(mmap.MADV_DONTNEED, start, length // mmap.PAGESIZE * mmap.PAGESIZE)
    except (OSError, ValueError):
        pass
