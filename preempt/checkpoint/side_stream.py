"""A lazy snapshot of GPU tensors: copied by the GPU's copy engine on a stream of their own, the host never waiting.

At the step, the copies of the parameters and the optimizer's state into the
pinned staging buffers are queued on a side stream, after the work the loop has
queued so far (so they copy the state as the step left it), and ``run.step()``
returns without waiting for them. The next forward and backward only read those
tensors and run beside the copies. The optimizer's pre-step hook
(:meth:`StreamedCopies.order`) makes the loop's stream wait for the copies on the
GPU, not on the host: the host goes on queueing, and the GPU runs
``optimizer.step()`` only once nothing it changes is still to be copied. The
writer thread waits on the host for the copies (:meth:`StreamedCopies.finish`)
before it reads the buffers.

Something other than ``optimizer.step()`` that changes one of these tensors in
place between the step and the copies (a user's own ``mul_`` on a parameter)
might be copied half-done. Its version counter shows it (:class:`Verdict`): the
counters are compared with the snapshot's once, by whichever comes first, the
optimizer's hook (before the step changes them) or the writer once the copies
are done (anything queued after that runs after the copies). A torn snapshot is
not written (:class:`preempt.checkpoint.staging.TornSnapshot`).
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any

import torch

from .._torch_compat import version_counter

# (name, source, buffer, the source's version at the snapshot)
Pair = tuple[str, torch.Tensor, torch.Tensor, int | None]


class Verdict:
    """Whether a source of the copies was changed before they were safe from it; decided once, by the first to ask.

    Pure: no stream or event is involved, so the unit tests decide it with CPU tensors.
    """

    def __init__(self, sources: list[tuple[str, torch.Tensor, int | None]]) -> None:
        self.sources = sources  # (name, tensor, its version counter when the snapshot was taken)
        self._lock = threading.Lock()
        self._decided = False
        self._moved: str | None = None

    def decide(self) -> str | None:
        """The name of the first source whose counter moved (None: none did), as it was at the first call."""
        with self._lock:
            if not self._decided:
                self._decided = True
                self._moved = next((name for name, t, version in self.sources if version_counter(t) != version), None)
            return self._moved


class SideStreams:
    """One copy stream per GPU, created at its first snapshot and kept for the next ones."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def get(self, device: torch.device) -> Any:
        """The side stream of ``device`` (a ``torch.cuda.Stream``)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream


class StreamedCopies:
    """The GPU copies of one snapshot, queued when it is made (see the module docstring).

    Args:
        pairs: The copies to queue on the side streams: (name, source on a GPU, pinned buffer, version).
        streams: The side streams.
        queued: The GPUs on which copies into pinned buffers were queued on the loop's own stream (the tensors
            that are not lazy): the writer waits for those too.
    """

    def __init__(self, pairs: list[Pair], streams: SideStreams, queued: Collection[torch.device] = ()) -> None:
        self.pairs = pairs
        self.events: list[Any] = []  # everything the writer waits for before it reads the buffers
        for device in queued:
            self.events.append(torch.cuda.current_stream(device).record_event())
        self.copied: dict[torch.device, Any] = {}  # per GPU: the event that ends the side stream's copies
        by_device: dict[torch.device, list[Pair]] = {}
        for pair in pairs:
            by_device.setdefault(pair[1].device, []).append(pair)
        with torch.no_grad():
            for device, group in by_device.items():
                side = streams.get(device)
                side.wait_stream(torch.cuda.current_stream(device))  # after the step's work
                with torch.cuda.stream(side):
                    for _name, src, buf, _version in group:
                        buf.copy_(src, non_blocking=True)
                        src.record_stream(side)  # its memory is not reused before the copy is made
                done = side.record_event()
                self.copied[device] = done
                self.events.append(done)
        self.verdict = Verdict([(name, src, version) for name, src, _buf, version in pairs])

    def order(self) -> None:
        """The optimizer's pre-step hook: the loop's streams wait for the copies on the GPU (the host does not),
        and the sources' counters are compared now, before the step changes them."""
        for device, done in self.copied.items():
            torch.cuda.current_stream(device).wait_event(done)
        self.verdict.decide()

    def finish(self) -> str | None:
        """The writer: waits on the host for every copy; returns the name of a source changed before its copy was
        safe (the snapshot is torn), None when the buffers hold the step."""
        for event in self.events:
            event.synchronize()
        return self.verdict.decide()
