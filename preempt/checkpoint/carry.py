"""Carrying unchanged files: a checkpoint hard-links the frozen base when its bytes are what the previous one holds.

Fine-tuning trains a few tensors beside a large frozen model. :func:`preempt.checkpoint.state.capture` puts the
model's frozen parameters that no optimizer holds in a file of their own (``base.safetensors``; under FSDP2 each
rank's pieces of it in ``base_0000R.safetensors``), so that a file is either wholly unchanged or rewritten; this module
decides, at the step, whether that file is carried (the commit, :func:`preempt.checkpoint.hashed_io.link_file`, makes
the new checkpoint's file a hard link to the copy this process last made durable: not copied, not written) or
written. Every checkpoint directory stays complete (its manifest lists every file, with size and digest); ``ls``,
``verify``, load and ``export`` follow no reference.

**The contract: a checkpoint holds the state at its step.** A proxy for "unchanged" may say "changed" cheaply; it is
never the only proof of "unchanged", since a loop can write a tensor behind autograd (``p.data.add_``, a momentum
teacher updated through ``.data``, a NumPy view, a custom kernel) and move no version counter. So:

* Only base files are candidates (:func:`carriable`). ``model.safetensors`` (every trainable parameter, every
  parameter an optimizer holds, every buffer) and ``state.safetensors`` are written at every checkpoint; a model
  given without an optimizer has no base (:func:`preempt.checkpoint.state.frozen_keys`): every parameter may be
  trained by hand.
* A base file is carried only when its tensors fingerprint as they did when its durable copy was made (address,
  offset, version counter, shape, stride, dtype, device: :func:`fingerprint`, :func:`decide`) **and** the live
  tensors, serialised into the xxh3 hasher at the step (nothing written, :func:`digest_of`), give that copy's digest.
  The hash costs a read of the base at memory speed, a small part of writing it; it is made at the step, on the
  loop's thread, for every checkpoint that would carry, a stop's and the final one included.
* A save written after the step (``async_save``) reads a base file where it lives, without a copy, only when the file's
  digest at the step is known (hashed then, :attr:`~preempt.checkpoint.state.Payload.at_step`); the writer's own
  digest of what it wrote must equal it, or the checkpoint is not committed
  (:class:`~preempt.checkpoint.staging.ChangedWhileWritten`).
* A base file found changed behind autograd (hash and fingerprints disagree, or the writer's digest differs from the
  step's) is never carried, hashed or read live again: it is written, from a copy made at the step, at every
  checkpoint. The file says so itself (its safetensors metadata ``preempt.carry: never``), so a process that resumes
  from it trusts it no more (:meth:`Carrier.loaded`). A warning names the file and the cause once.

**Optimizers that write behind the counters.** A fused optimizer kernel (``torch.optim.AdamW(fused=True)`` on the
CPU) updates its parameters without bumping their version counters; those parameters are in ``model.safetensors``,
which is always written, and :func:`preempt.run.loop_state.follow_steps` bumps their counters after each step so that
the staging and lazy-snapshot checks see the step.

The recorded tensors are held, so their memory cannot be freed and handed to a new tensor at the same address with
a fresh version counter.

**Damage.** Checkpoints that carry a file share one inode: a bit flipped in it damages all of them. So a file
shared by ``carry_limit`` checkpoints is written afresh at the next one (a new inode), and retention keeps one
checkpoint that shares no file with the newest (:func:`preempt.checkpoint.retention.select_kept`), so that a
damaged shared file always leaves an older valid checkpoint to fall back to.

**Many ranks.** Under DDP rank 0 writes the replicated state and carries as a single process does. Under FSDP2
(DTensor state) each rank carries its own ``base_0000R.safetensors`` as one process carries ``base.safetensors``:
each rank decides for its own file, so the ranks need no agreement on it; rank 0's commit tells the others that their
files are durable (:meth:`preempt.checkpoint.manager.CheckpointManager.committed`).

No disk here but :func:`exists`; the pure decisions (:func:`carriable`, :func:`fingerprint`, :func:`decide`) are
unit-tested with made-up facts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import xxhash

from .. import _log
from .._torch_compat import version_counter
from .hashed_io import FileDigest
from .names import BASE_FILE, SHARD_BASE

if TYPE_CHECKING:
    import torch

    from .state import Payload

log = logging.getLogger("preempt")

Fingerprint = tuple[Any, ...]
Action = Literal["write", "carry"]

NEVER_META = ("preempt.carry", "never")
"""The metadata entry of a tensor file whose tensors were found written behind autograd: never carried again."""
_SHARD_BASE_RE = re.compile(SHARD_BASE.replace("{rank:05d}", r"\d{5,}").replace(".", r"\."))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CarryOptions:
    """How the frozen base is carried from one checkpoint to the next.

    Args:
        enabled: Carry an unchanged frozen base (hard links), its bytes checked at each checkpoint; False writes every
            file of every checkpoint and keeps the model's tensors in one file, as before carrying existed.
        carry_limit: A file shared by this many checkpoints is written afresh at the next one (a new inode), so
            that one damaged file cannot take every checkpoint with it. 10: the frozen base is written once per ten
            checkpoints (a tenth of its size per checkpoint on average), and retention keeps one checkpoint that
            shares nothing with the newest (with the default ``keep_last=2``, the newest two often share the base).
    """

    enabled: bool = True
    carry_limit: int = 10

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"carry_unchanged: expected True, False or CarryOptions, got enabled={self.enabled!r}")
        value = self.carry_limit
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"carry_unchanged: carry_limit: expected an integer >= 1, got {value!r}")

    @classmethod
    def of(cls, value: bool | CarryOptions) -> CarryOptions:
        """``carry_unchanged=`` as given: a bool or the options themselves.

        Raises:
            ValueError: Anything else, naming the value.
        """
        if isinstance(value, CarryOptions):
            return value
        if isinstance(value, bool):
            return cls(enabled=value)
        raise ValueError(f"carry_unchanged: expected True, False or CarryOptions, got {value!r}")


def summary(manifest: Any) -> str:
    """What a checkpoint (its manifest) carried rather than wrote: ``" (12.0 MiB written, 1.2 GiB carried from
    step 40)"``, or "" (nothing carried, or no manifest)."""
    files: Mapping[str, FileDigest] = manifest.files if manifest is not None else {}
    carried = {n: d for n, d in files.items() if d.carried_from is not None}
    if not carried:
        return ""
    nbytes = sum(d.size for d in carried.values())
    steps = ", ".join(str(s) for s in sorted({d.carried_from for d in carried.values() if d.carried_from is not None}))
    written = sum(d.size for d in files.values()) - nbytes
    return f" ({_log.size(written)} written, {_log.size(nbytes)} carried from step {steps})"


def fingerprint(t: torch.Tensor) -> Fingerprint | None:
    """What says a tensor is unchanged: address, offset, version counter, shape, stride, dtype, device.

    None for a tensor without a version counter (created under ``torch.inference_mode``): it is never carried.
    """
    version = version_counter(t)
    if version is None:
        return None
    return (t.data_ptr(), t.storage_offset(), version, tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device))


def fingerprints(tensors: Mapping[str, torch.Tensor]) -> dict[str, Fingerprint] | None:
    """Every tensor's :func:`fingerprint`; None when one has none."""
    out = {}
    for key, t in tensors.items():
        fp = fingerprint(t)
        if fp is None:
            return None
        out[key] = fp
    return out


class WrittenBehindAutograd(RuntimeError):
    """A file written from its live tensors after the step came out other than they were at the step: something
    wrote them behind autograd meanwhile, and the checkpoint cannot hold that step's state. ``file``: its name."""

    def __init__(self, file: str, message: str) -> None:
        super().__init__(message)
        self.file = file


def carriable(name: str) -> bool:
    """Whether a tensor file may be carried at all: only a frozen base (``base.safetensors``, a rank's
    ``base_0000R.safetensors``); the trained tensors' and the optimizer's files are written at every checkpoint."""
    return name == BASE_FILE or _SHARD_BASE_RE.fullmatch(name) is not None


def marked_never(meta: Mapping[str, str]) -> bool:
    """Whether a tensor file's metadata says its tensors were found written behind autograd."""
    return meta.get(NEVER_META[0]) == NEVER_META[1]


def decide(
    now: Mapping[str, Fingerprint] | None,
    recorded: Mapping[str, Fingerprint] | None,
    *,
    source_present: bool,
    shared: int,
    carry_limit: int,
) -> tuple[Action, str]:
    """Whether a base file is worth hashing to be carried, or written, and why: the proxies' say, which may only
    refuse (the hash at the step, :meth:`Carrier.mark_carried`, has the last word on "carry").

    Args:
        now: The file's tensors' fingerprints now (None: some tensor has none).
        recorded: Those taken when its durable copy was made (None: this process made none).
        source_present: That copy still exists.
        shared: How many checkpoints hold that copy's inode so far.
        carry_limit: :attr:`CarryOptions.carry_limit`.
    """
    if now is None:
        return "write", "a tensor keeps no version counter"
    if recorded is None:
        return "write", "no durable copy of it from this process"
    if dict(now) != dict(recorded):
        return "write", "changed"
    if not source_present:
        return "write", "its durable copy is gone"
    if shared >= carry_limit:
        return "write", f"a fresh copy: {shared} checkpoints share the last one"
    return "carry", "unchanged"


def digest_of(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str]) -> FileDigest:
    """Size and xxh3 of the file these tensors would be written as, computed without writing it."""
    from . import tensorfile

    digest, size = xxhash.xxh3_128(), 0
    for chunk in tensorfile.chunks(tensors, meta):
        view = memoryview(chunk).cast("B")
        digest.update(view)
        size += view.nbytes
    return FileDigest(size, digest.hexdigest())


def same_bytes(a: FileDigest, b: FileDigest) -> bool:
    """Two digests of one file's content agree (size and xxh3; where the bytes came from does not count)."""
    return a.size == b.size and a.xxh3_128 == b.xxh3_128


def exists(path: Path) -> bool:
    try:
        return os.path.isfile(path) and not os.path.islink(path)
    except OSError:
        return False


@dataclasses.dataclass
class Carry:
    """A file of a checkpoint to be linked from ``source`` (``digest`` as its manifest lists it, ``carried_from``
    set: the live tensors hashed to it at the step); ``tensors`` and ``meta`` write it instead when the link cannot
    be made."""

    source: Path
    digest: FileDigest
    tensors: dict[str, torch.Tensor]
    meta: dict[str, str]


@dataclasses.dataclass
class Source:
    """A tensor file this process made durable: where, its digest, the fingerprints (and tensors) it was made from."""

    path: Path
    digest: FileDigest  # carried_from: the step whose save wrote the bytes
    prints: dict[str, Fingerprint]
    tensors: dict[str, torch.Tensor]  # held: their memory cannot be reused by a new tensor at the same address
    shared: int  # checkpoints holding this inode so far


class Carrier:
    """One process's memory of its durable base files, and which files each checkpoint carries (see the module
    docstring).

    :meth:`mark_carried` at the step, on the live payload (before any staging copy); :meth:`durable` once that
    checkpoint is committed (any thread: the background writer's); :meth:`loaded` after a resume; :meth:`distrust`
    when a writer found a file's bytes changed behind autograd.
    """

    def __init__(self, options: CarryOptions | None = None) -> None:
        self.options = options or CarryOptions()
        self.sources: dict[str, Source] = {}
        self.never: set[str] = set()  # files found written behind autograd: written from a copy at every checkpoint
        self._pending: tuple[int, dict[str, tuple[dict[str, Fingerprint], dict[str, Any]]]] | None = None

    @property
    def enabled(self) -> bool:
        return self.options.enabled

    def mark_carried(self, payload: Payload, step: int, *, read_later: Collection[str] = ()) -> Payload:
        """``payload`` at the step: each base file whose bytes are those of its durable copy moved from
        ``tensor_files`` to ``carried``, and ``at_step`` the digests, hashed now, of the files a writer may read where
        they live after the step.

        Args:
            payload: The live payload.
            step: The checkpoint's step, for :meth:`durable` to record what it was made from.
            read_later: The files that a save written after the step would read without a copy (a staged save's
                frozen base); empty for a save written while the loop waits.
        """
        if not self.enabled:
            return payload
        opts = self.options
        pending: dict[str, tuple[dict[str, Fingerprint], dict[str, Any]]] = {}
        carried: dict[str, Carry] = {}
        at_step: dict[str, FileDigest] = {}
        files = dict(payload.tensor_files)
        for name, (tensors, meta) in payload.tensor_files.items():
            if not carriable(name):
                continue
            if name in self.never:
                files[name] = (tensors, {**meta, NEVER_META[0]: NEVER_META[1]})
                continue
            src = self.sources.get(name)
            now = fingerprints(tensors)
            action, why = decide(
                now,
                None if src is None else src.prints,
                source_present=src is not None and exists(src.path),
                shared=0 if src is None else src.shared,
                carry_limit=opts.carry_limit,
            )
            if action == "carry":
                assert src is not None
                got = digest_of(tensors, meta)
                if same_bytes(got, src.digest):
                    carried[name] = Carry(src.path, src.digest, dict(tensors), dict(meta))
                    at_step[name] = src.digest
                    pending[name] = (src.prints, dict(tensors))
                    del files[name]
                    continue
                self.distrust(
                    name,
                    f"its content differs from {src.path} (xxh3 {got.xxh3_128}, expected"
                    f" {src.digest.xxh3_128}) though its version counters did not move",
                )
                files[name] = (tensors, {**meta, NEVER_META[0]: NEVER_META[1]})
                continue
            if src is not None:
                log.debug("%s: written (%s)", name, why)
            if now is None:
                continue
            if name in read_later:
                at_step[name] = digest_of(tensors, meta)
            pending[name] = (now, dict(tensors))
        self._pending = (step, pending)
        return dataclasses.replace(payload, tensor_files=files, carried=carried, at_step=at_step)

    def distrust(self, name: str, why: str) -> None:
        """``name``'s tensors were found changed behind autograd (``why``): never carried or read live again, and
        marked so in every file of it written from now on, for a process that resumes to know."""
        if name in self.never:
            return
        self.never.add(name)
        self.sources.pop(name, None)
        log.warning(
            "%s: %s: something writes these tensors behind autograd (a write through .data, a .numpy() view or a"
            " custom kernel); it is written from a copy at every checkpoint from now on, never carried",
            name,
            why,
        )

    def durable(self, directory: Path, step: int, files: Mapping[str, FileDigest]) -> None:
        """The checkpoint of ``step`` marked last (:meth:`mark_carried`) is committed in ``directory``, with ``files``
        as listed."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != step:
            return  # not the save marked last (a save not marked): nothing known of its tensors
        sources = {}
        for name, (prints, tensors) in pending[1].items():
            digest = files.get(name)
            if digest is None or name in self.never:
                continue
            before = self.sources.get(name)
            if digest.carried_from is not None:  # linked: one more checkpoint holds that inode
                shared = (1 if before is None else before.shared) + 1
            else:
                digest = dataclasses.replace(digest, carried_from=step)  # its bytes: written by this save
                shared = 1
            sources[name] = Source(directory / name, digest, prints, tensors, shared)
        self.sources = sources

    def loaded(self, directory: Path, files: Mapping[str, FileDigest], payload: Payload, step: int) -> list[str]:
        """After a resume from ``directory``: its base files that the live tensors match become the sources.

        ``payload``: the live state captured right after the load. A file counts only when its header lists
        exactly those tensors, with their dtypes, shapes and metadata (a load that cast or skipped a tensor does
        not match); the next checkpoint hashes the live tensors before it carries one. A file marked as written
        behind autograd (:data:`NEVER_META`) is never carried by this process either. Returns the names recorded.
        """
        from . import tensorfile

        self._pending = None
        self.sources = {}
        if not self.enabled:
            return []
        for name, (tensors, meta) in payload.tensor_files.items():
            digest = files.get(name)
            if digest is None or not carriable(name):
                continue
            path = directory / name
            try:
                header = tensorfile.read_header(path)
                shared = os.stat(path).st_nlink
            except (OSError, ValueError):
                continue
            if marked_never(header.metadata):
                self.never.add(name)
                continue
            prints = fingerprints(tensors)
            if prints is None:
                continue
            want = {k: (tensorfile.dtype_name(t.dtype), tuple(t.shape)) for k, t in tensors.items()}
            have = {e.name: (e.dtype, e.shape) for e in header.entries}
            if want != have or header.metadata != {str(k): str(v) for k, v in meta.items()}:
                continue
            origin = step if digest.carried_from is None else digest.carried_from
            self.sources[name] = Source(
                path, dataclasses.replace(digest, carried_from=origin), prints, dict(tensors), shared
            )
        return sorted(self.sources)
