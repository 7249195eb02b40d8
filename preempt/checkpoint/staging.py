"""Asynchronous checkpoints: a snapshot into reused host buffers, written by a background thread.

The loop pays for a memory copy; the disk write, the hashing and the commit
happen in a named daemon thread with the same protocol as a synchronous save
(:mod:`preempt.checkpoint.commit`). Two parts, each usable alone:

* :class:`Stager` copies a :class:`~preempt.checkpoint.state.Payload`'s tensors into host
  buffers that are allocated once, touched once when allocated (so the first
  checkpoint does not pay a page fault per 4 KiB page), and reused
  by every later snapshot. Tensors on a GPU are copied into pinned memory (its
  pages registered, exactly the arena's size: :mod:`preempt.checkpoint.pinned`)
  with ``non_blocking=True`` and one synchronisation, or, lazily, on a side
  stream (:mod:`preempt.checkpoint.side_stream`). JSON documents are encoded
  at snapshot time, so the loop may go on mutating the objects they came from.
* :class:`BackgroundWriter` runs one job at a time in a thread and keeps its
  outcome. A failure is never lost: the job's future holds its exception,
  which the run takes at its next step.

The extra memory is one copy of what changes. While a write is in flight its
buffers must not change, so at most one snapshot exists: the run waits for
the writer before it stages again (see ``PreemptibleRun(async_save=...)``).
The files named in :attr:`Stager.live` (the frozen base of a fine-tuning run,
``base.safetensors``) get no buffers when their digest at the step is known
(hashed then by :meth:`~preempt.checkpoint.carry.Carrier.mark_carried`, ``payload.at_step``): the writer reads them
where they live, its digest of what it wrote must equal the step's
(:func:`preempt.checkpoint.write.write_payload`), and it checks afterwards that no
tensor it read moved or was changed through autograd (:class:`LiveTensors`);
the tensors of files carried from the previous checkpoint
(:mod:`preempt.checkpoint.carry`), which the writer writes when it cannot link
them, are checked the same way. A fine-tuning run's staging memory is then the size of
its adapters and their optimizer state, not of the model.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from typing import Any

import torch

from .._torch_compat import version_counter
from . import codec, direct_io, pinned, prefault, tensorfile
from .side_stream import SideStreams, StreamedCopies, Verdict
from .state import Payload


def payload_nbytes(payload: Payload, skip: Collection[str] = ()) -> int:
    """Bytes of the tensors of ``payload``, but for those of the files named in ``skip``."""
    return sum(
        t.numel() * t.element_size()
        for name, (ts, _) in payload.tensor_files.items()
        if name not in skip
        for t in ts.values()
    )


class Stager:
    """Host buffers, one per tensor of a payload, reused from one snapshot to the next.

    The buffers of one file are views into one page-aligned arena, laid out as
    the file's data area (:func:`preempt.checkpoint.tensorfile.layout`): the writer sends
    the whole arena to the disk without the page cache (:mod:`preempt.checkpoint.direct_io`).
    A file's arena is (re)allocated only when one of its tensors appears,
    vanishes or changes shape or dtype (the optimizer's moments appear after
    the first step), and dropped when the file is gone.

    Args:
        pin_memory: Pin the buffers (for copies from a GPU). None: pin when
            CUDA is available and some tensor lives on it.
        live: Files that get no buffers: the writer reads their tensors where
            they live (see the module docstring).
    """

    def __init__(self, pin_memory: bool | None = None, live: Collection[str] = ()) -> None:
        self.pin_memory = pin_memory
        self.live = frozenset(live)
        self._files: dict[str, _Arena] = {}
        self.side_streams: SideStreams | None = None  # the GPU copy streams of lazy snapshots, once one was made

    @property
    def nbytes(self) -> int:
        """Bytes held in buffers."""
        return sum(a.data.numel() for a in self._files.values())

    @property
    def pinned(self) -> bool:
        """Some buffer is in pinned (page-locked) host memory: copies from a GPU go straight into it."""
        return any(a.pinned for a in self._files.values())

    @property
    def pinned_exactly(self) -> bool:
        """Every pinned buffer locks exactly its own bytes (:mod:`preempt.checkpoint.pinned`), none a block of
        torch's pinned allocator rounded up to a power of two."""
        return all(a.pinned == "registered" for a in self._files.values() if a.pinned)

    def _buffers(
        self, file: str, tensors: dict[str, torch.Tensor], pin: bool, stop: threading.Event | None = None
    ) -> dict[str, torch.Tensor]:
        signature = _Arena.signature_of(tensors)
        arena = self._files.get(file)
        if arena is not None and arena.pin == pin and arena.signature == signature:
            return arena.views
        if arena is not None:
            self._drop(file)
        arena = self._files[file] = _Arena(tensors, signature, pin, stop)
        return arena.views

    def _drop(self, file: str) -> None:
        """Forgets a file's arena and unpins its pages. No copy into them is in flight: a snapshot is staged only
        once the previous one's copies were waited for (its write ran :meth:`LazyCopy.run`, or it was dropped)."""
        self._files.pop(file).release()

    def prepare(self, payload: Payload, stop: threading.Event | None = None) -> None:
        """Allocates (and touches) the buffers for ``payload`` without copying: done when the run starts. ``stop``,
        once set, leaves the pages not touched yet to the first copy (a stop's save does not wait for them)."""
        pin = self._pin(payload)
        for file, (tensors, _meta) in payload.tensor_files.items():
            if file not in self.live:
                self._buffers(file, tensors, pin, stop)

    def stage(self, payload: Payload, *, loop_waits: bool = False) -> Payload:
        """A snapshot of ``payload`` in the buffers: tensors copied, JSON encoded.

        The returned payload refers to the buffers, to bytes, and to the files of :attr:`live` that are read where
        they live (see :meth:`stage_lazily`). ``loop_waits``: the payload is written before the loop goes on, so
        every file of :attr:`live` is read where it lives, its digest at the step known or not.
        """
        return self.stage_lazily(payload, frozenset(), loop_waits=loop_waits)[0]

    def stage_lazily(
        self, payload: Payload, later: Collection[SourceKey], *, loop_waits: bool = False
    ) -> tuple[Payload, LazyCopy | None]:
        """:meth:`stage`, except for the tensors whose storage is in ``later`` (:func:`source_key`): their copies are
        left to the returned :class:`LazyCopy` (None when there are none), to be made before those tensors change:
        by the writer thread for a state on the CPU, by the GPU's copy engine on a side stream for a state on a GPU
        (:mod:`preempt.checkpoint.side_stream`).

        The files of :attr:`live` (when :meth:`~preempt.checkpoint.carry.Carrier.mark_carried` hashed them at the step,
        ``payload.at_step``, or ``loop_waits``) and the tensors of the carried files are not copied: the returned
        payload refers to them where they live, with the checks its writer makes once it has read them (their digests at
        the step; ``payload.live``: :class:`LiveTensors`)."""
        pin = self._pin(payload)
        # A state on a GPU: its lazy tensors are copied on a side stream (into pinned buffers only: a copy into
        # pageable memory would hold the host), and its CPU tensors (the optimizer's step counts) at the step, so that
        # the optimizer's hook never waits for the writer thread.
        stream = pin and any(device.startswith("cuda") for device, _ in later)
        deferred: list[tuple[str, torch.Tensor, torch.Tensor, int | None]] = []  # the writer thread copies these
        streamed: list[tuple[str, torch.Tensor, torch.Tensor, int | None]] = []  # and the GPU's copy engine these
        files: dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]] = {}
        read_live = [
            (file, key, t.detach()) for file, carry in payload.carried.items() for key, t in carry.tensors.items()
        ]
        copied: set[str] = set()  # the files staged into buffers: the others' buffers are dropped
        on_gpu: set[torch.device] = set()  # GPUs with copies queued on the loop's stream
        with torch.no_grad():
            for file, (tensors, meta) in payload.tensor_files.items():
                if file in self.live and (loop_waits or file in payload.at_step):  # no copy needed
                    files[file] = ({key: t.detach() for key, t in tensors.items()}, dict(meta))
                    read_live += [(file, key, t) for key, t in files[file][0].items()]
                    continue
                staged = self._buffers(file, tensors, pin)
                copied.add(file)
                for key, t in tensors.items():
                    buf = staged[key]
                    src = t.detach()
                    cuda = src.device.type == "cuda"
                    if later and cuda == stream and source_key(src) in later:
                        (streamed if cuda else deferred).append((f"{file}:{key}", src, buf, version_counter(src)))
                        continue
                    if cuda:
                        on_gpu.add(src.device)
                    buf.copy_(src, non_blocking=cuda and pin)
                files[file] = (staged, dict(meta))
        device_copies = None
        if stream:  # nothing waits on the host: the writer waits for the events
            if self.side_streams is None:
                self.side_streams = SideStreams()
            device_copies = StreamedCopies(streamed, self.side_streams, queued=on_gpu)
        elif on_gpu:
            torch.cuda.synchronize()  # one wait for every non-blocking copy
        for gone in self._files.keys() - copied:
            self._drop(gone)
        docs = {name: codec.dumps(doc) for name, doc in payload.json_files.items()}
        live = LiveTensors(read_live) if read_live else None
        at_step = {f: d for f, d in payload.at_step.items() if f in payload.carried or f not in copied}
        copy = Payload(tensor_files=files, json_files=docs, carried=payload.carried, live=live, at_step=at_step)
        lazy = LazyCopy(deferred, device_copies) if deferred or device_copies is not None else None
        return copy, lazy

    def _pin(self, payload: Payload) -> bool:
        if self.pin_memory is not None:
            return self.pin_memory
        if not torch.cuda.is_available():
            return False
        return any(t.device.type == "cuda" for ts, _ in payload.tensor_files.values() for t in ts.values())


SourceKey = tuple[str, int]


def source_key(t: torch.Tensor) -> SourceKey:
    """What names a tensor's storage in a lazy snapshot's ``later``: its device and its address there."""
    return str(t.device), t.untyped_storage().data_ptr()


class _Arena:
    """One file's staging buffers: views into one page-aligned block, each at its place in the file's data area.

    Pinned for copies from a GPU: exactly its bytes are page-locked (:func:`preempt.checkpoint.pinned.lock`), or, where
    CUDA refuses that, the block comes from torch's pinned allocator (rounded up to a power of two).
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        signature: tuple[Any, ...],
        pin: bool,
        stop: threading.Event | None = None,
    ) -> None:
        places = tensorfile.layout(tensors)
        total = places[-1][2] if places else 0
        self.pin = pin  # asked to be pinned
        self.pinned: str | None = None  # how it is: "registered" (exactly these bytes), "allocator" (torch's), None
        self._unlock: Callable[[], None] | None = None
        self.data = self._allocate(total, pin_memory=False, stop=stop)
        if pin and total:
            try:
                self._unlock = pinned.lock(self.data, self)
                self.pinned = "registered"
            except RuntimeError:
                self.data = self._allocate(total, pin_memory=True, stop=stop)
                self.pinned = "allocator"
        self.signature = signature
        self.views = {
            key: self.data[begin:end].view(tensors[key].dtype).view(tensors[key].shape) for key, begin, end in places
        }

    @staticmethod
    def _allocate(total: int, pin_memory: bool, stop: threading.Event | None = None) -> torch.Tensor:
        raw = torch.empty(total + direct_io.BLOCK, dtype=torch.uint8, pin_memory=pin_memory)
        start = -raw.data_ptr() % direct_io.BLOCK
        data = raw[start : start + total]
        prefault.touch(data, stop)  # every page now, not during a checkpoint (unless a stop cannot wait)
        return data

    def release(self) -> None:
        """Unpins registered pages now (once no copy into them is in flight), not when the arena is collected."""
        if self._unlock is not None:
            self._unlock()

    @staticmethod
    def signature_of(tensors: dict[str, torch.Tensor]) -> tuple[Any, ...]:
        """What decides the layout: every tensor's name, shape and dtype."""
        return tuple((key, tuple(t.shape), t.dtype) for key, t in tensors.items())


class TornSnapshot(RuntimeError):
    """A tensor of a lazy snapshot changed before its copy was made: the snapshot would mix two steps."""


class ChangedWhileWritten(TornSnapshot):
    """A tensor the writer read where it lives (not from a copy) moved or was changed before it was done."""


class LiveTensors:
    """The tensors of a snapshot that the writer may read where they live, and what each was when the snapshot was
    taken: where its data lies and its version counter.

    :meth:`check`, once the writer has read them (every tensor file written, before the commit), raises
    :class:`ChangedWhileWritten` naming the first tensor of the files it read that was changed in place or replaced
    meanwhile: the file written from it could mix two steps, so the checkpoint is not committed. A carried file
    that was linked was not read (its bytes are the source's, which the live tensors hashed to at the step) and is
    not checked: the next ``optimizer.step()`` may change its tensors while the write goes on. (A write through
    ``tensor.data`` bumps no counter: the writer's digest against the step's catches it, see
    :mod:`preempt.checkpoint.write`.)
    """

    def __init__(self, tensors: list[tuple[str, str, torch.Tensor]]) -> None:
        self.seen = [(file, key, t, t.data_ptr(), version_counter(t)) for file, key, t in tensors]

    def check(self, read: Collection[str]) -> None:
        """Raises :class:`ChangedWhileWritten` for the first changed tensor of the files in ``read``."""
        for file, key, t, ptr, version in self.seen:
            if file in read and (version_counter(t) != version or t.data_ptr() != ptr):
                raise ChangedWhileWritten(f"{file}:{key} was changed in place while the writer read it")


class LazyCopy:
    """The copies of a snapshot that are made after the loop has moved on (a lazy snapshot).

    Between one ``optimizer.step()`` and the next, the forward and backward
    passes only read the parameters and the optimizer's state, so their copies
    can be made meanwhile: the writer thread calls :meth:`run` and the
    optimizer's pre-step hook calls :meth:`wait`, which returns once every copy
    is made. Anything else that writes into one of these tensors in place
    before its copy is made bumps its version counter; :meth:`run` compares
    each tensor's counter with the one read when the snapshot was taken, after
    every copy, and raises :class:`TornSnapshot` naming the first that moved.
    (A write through ``tensor.data`` bumps no counter and is not seen.)
    """

    def __init__(
        self, pairs: list[tuple[str, torch.Tensor, torch.Tensor, int | None]], streamed: StreamedCopies | None = None
    ) -> None:
        self.pairs = pairs  # (name, source, buffer, the source's version when the snapshot was taken)
        self.streamed = streamed  # the copies from a GPU, queued on a side stream (their pairs: streamed.pairs)
        self.done = threading.Event()
        self.waited = 0.0  # seconds the loop waited for the copies (the optimizer's hook)

    def run(self) -> None:
        """Makes the copies (the writer thread), then checks that no source changed meanwhile; for a GPU's, waits
        for the side stream and takes :class:`~preempt.checkpoint.side_stream.Verdict`'s word."""
        try:
            with torch.no_grad():
                for _name, src, buf, _version in self.pairs:
                    buf.copy_(src)
            moved = Verdict([(name, src, version) for name, src, _buf, version in self.pairs]).decide()
        finally:
            self.done.set()
        if self.streamed is not None:  # waited for even when torn: they write into the buffers the next snapshot reuses
            on_gpu = self.streamed.finish()
            moved = moved or on_gpu
        if moved is not None:
            raise TornSnapshot(f"{moved} was changed in place before its copy was made")

    def drop(self) -> None:
        """The snapshot will not be written: the copies a GPU was given are waited for all the same, since they write
        into the buffers that the next snapshot reuses."""
        if self.streamed is not None:
            self.streamed.finish()

    def wait(self) -> None:
        """Returns once nothing the optimizer changes can reach a copy still to be made: the writer's copies are made,
        and the GPU's stream runs the step after the side stream's copies (the host does not wait for those)."""
        if self.streamed is not None:
            t0 = time.perf_counter()
            self.streamed.order()
            self.waited += time.perf_counter() - t0
        if not self.done.is_set() and self.pairs:
            t0 = time.perf_counter()
            self.done.wait()
            self.waited += time.perf_counter() - t0


def _lower_priority(niceness: int) -> None:
    """Lowers the calling thread's CPU priority by ``niceness`` where the OS allows it per thread (Linux).

    Hashing and copying a checkpoint in the background competes with the
    training loop for the cores; the loop should win. Best effort: elsewhere
    (or when refused) nothing changes.
    """
    if niceness <= 0 or not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + niceness))
    except OSError:
        pass


class BackgroundWriter:
    """Runs one job at a time in a named daemon thread; each job is a :class:`concurrent.futures.Future` that holds
    its result or its exception (never lost: whoever holds the future takes it).

    The thread drops the job (and the tensors its closure holds) before the future is done, and whoever takes the
    outcome joins it (:meth:`join`): no thread of ours outlives the run holding torch objects. One that did could
    free them while the interpreter finalizes, where a thread that needs the GIL is ended with ``pthread_exit``:
    unwinding through torch's C++ aborts the process ("terminate called without an active exception").
    """

    def __init__(self, name: str = "preempt-writer", niceness: int = 10) -> None:
        self.name = name
        self.niceness = niceness  # the thread yields the CPU to the training loop (Linux: per-thread nice)
        self._idle = threading.Event()  # no job runs (read at every run.step() while one does: no lock, unlike done())
        self._idle.set()
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        """A job is running."""
        return not self._idle.is_set()

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        """Starts ``job`` in the thread; returns its future.

        Raises:
            RuntimeError: A job is still running (one at a time).
        """
        if self.busy:
            raise RuntimeError(f"{self.name}: a job is still running; wait for its future before submitting another")
        self.join()
        future: Future[Any] = Future()
        future.set_running_or_notify_cancel()
        self._idle.clear()
        # in a list the thread empties: the Thread's own arguments would hold the job until the thread ends
        self._thread = threading.Thread(target=self._run, args=([job], future), name=self.name, daemon=True)
        self._thread.start()
        return future

    def join(self) -> None:
        """Waits until the thread of the last job has ended (its future is done first)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _run(self, box: list[Callable[[], Any]], future: Future[Any]) -> None:
        _lower_priority(self.niceness)
        job = box.pop()
        error: BaseException | None = None
        result: Any = None
        try:
            result = job()
        except BaseException as e:  # kept for the loop; a thread's exception would otherwise only be printed
            error = e
        del job  # released here, before anyone sees the future done
        self._idle.set()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
