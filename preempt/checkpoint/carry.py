"""Carrying unchanged files: a checkpoint hard-links what has not changed since the previous one.

Fine-tuning trains a few tensors beside a large frozen model. :func:`preempt.checkpoint.state.capture` puts the
model's frozen parameters that no optimizer holds in a file of their own (``base.safetensors``), so that a file is
either wholly unchanged or rewritten; this module decides, per tensor file, whether it changed since the copy
this process last made durable, and the commit (:func:`preempt.checkpoint.hashed_io.link_file`) then makes the new
checkpoint's file a hard link to that copy: not copied, not hashed again, not written. Every checkpoint directory
stays complete (its manifest lists every file, with size and digest); ``ls``, ``verify``, load and ``export``
follow no reference.

**What is seen.** Each tensor's fingerprint, :func:`fingerprint`: where its data lies (``data_ptr``,
``storage_offset``), its version counter (``_version``: every in-place operation through autograd's view of a
tensor bumps it, views share their base's), shape, stride, dtype and device. A file is carried when every tensor
fingerprints as it did when that file was last made durable by this process (written, carried, or loaded at
resume: the fingerprints taken right after the load) and that durable file still exists (:func:`decide`). The
recorded tensors are held, so their memory cannot be freed and handed to a new tensor at the same address with
a fresh version counter (a buffer reassigned every step would otherwise look unchanged).

**Optimizers that write behind the counters.** A fused optimizer kernel (``torch.optim.AdamW(fused=True)`` on the
CPU, the Hugging Face Trainer's default optimizer) updates the parameters and its moments without bumping their
version counters: its files would look unchanged after every step and be carried stale.
:func:`preempt.run.loop_state.follow_steps` hooks every optimizer of a run: after a step that left a parameter's
counter as it was, it bumps the counters of all the optimizer's parameters and state (no data is touched), so that
the step is seen.

**What is not seen**, and guarded: a write through ``tensor.data`` (a tensor with a version counter of its own),
through a NumPy view (``tensor.numpy()``), DLPack, or a raw pointer (a custom kernel, ``ctypes``) changes the
bytes without a trace. So at the first carried checkpoint of each process, and then at every
``check_every``-th carried checkpoint, each file about to be carried is serialised from the live tensors into the
xxh3 hasher (nothing written) and compared with the digest of the copy on disk; on a mismatch the file is
written and a warning names it and the likely cause (:func:`confirm`). The writer does it, in the background for
a checkpoint written there, so the loop does not wait for it; a stop's save never does it (it races the grace
period: hashing a 14 GiB base would cost seconds of it), and the check falls to the next carried checkpoint.
Between two checks such a change is missed: do not change a frozen tensor behind autograd's back, or turn
carrying off (``carry_unchanged=False``).

**Damage.** Checkpoints that carry a file share one inode: a bit flipped in it damages all of them. So a file
shared by ``carry_limit`` checkpoints is written afresh at the next one (a new inode), and retention keeps one
checkpoint that shares no file with the newest (:func:`preempt.checkpoint.retention.select_kept`), so that a
damaged shared file always leaves an older valid checkpoint to fall back to.

**Many ranks.** Under DDP rank 0 writes the replicated state and carries as a single process does; the other ranks'
files (their random state) change at every checkpoint anyway. Under FSDP2 (DTensor state) each rank puts its own
pieces of the frozen base in a file of its own (``base_0000R.safetensors``,
:func:`preempt.cluster.sharded.pieces_apart`) and carries it as one process carries ``base.safetensors``: each rank
decides for its own file, so the ranks need no agreement on it; rank 0's commit tells the others that their files
are durable (:meth:`preempt.checkpoint.manager.CheckpointManager.committed`).

No disk here but :func:`exists`; the pure decisions (:func:`fingerprint`, :func:`decide`, :func:`check_due`) are
unit-tested with made-up facts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import xxhash

from .. import _log
from .._torch_compat import version_counter
from .hashed_io import FileDigest

if TYPE_CHECKING:
    import torch

    from .state import Payload

log = logging.getLogger("preempt")

Fingerprint = tuple[Any, ...]
Action = Literal["write", "carry"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CarryOptions:
    """How unchanged files are carried from one checkpoint to the next.

    Args:
        enabled: Carry unchanged files (hard links); False writes every file of every checkpoint and keeps the
            model's tensors in one file, as before carrying existed.
        check_every: The live tensors of a file about to be carried are hashed and compared with the copy on disk
            before the first carried checkpoint of each process and then at every N-th carried checkpoint (what
            the version counters cannot see: writes through ``.data``, NumPy views, raw pointers).
        carry_limit: A file shared by this many checkpoints is written afresh at the next one (a new inode), so
            that one damaged file cannot take every checkpoint with it. 10: the frozen base is written once per ten
            checkpoints (a tenth of its size per checkpoint on average), and retention keeps one checkpoint that
            shares nothing with the newest (with the default ``keep_last=2``, the newest two often share the base).
    """

    enabled: bool = True
    check_every: int = 10
    carry_limit: int = 10

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"carry_unchanged: expected True, False or CarryOptions, got enabled={self.enabled!r}")
        for name in ("check_every", "carry_limit"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"carry_unchanged: {name}: expected an integer >= 1, got {value!r}")

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


def unchanged(tensors: Mapping[str, torch.Tensor], recorded: Mapping[str, Fingerprint]) -> bool:
    """Whether ``tensors`` fingerprint as ``recorded``: fingerprinted one by one, up to the first that does not."""
    if len(tensors) != len(recorded):
        return False
    for key, t in tensors.items():
        was = recorded.get(key)
        if was is None or fingerprint(t) != was:
            return False
    return True


def decide(
    now: Mapping[str, Fingerprint] | None,
    recorded: Mapping[str, Fingerprint] | None,
    *,
    source_present: bool,
    shared: int,
    carry_limit: int,
) -> tuple[Action, str]:
    """Whether a tensor file is carried (linked) or written, and why.

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


def check_due(carried: int, check_every: int) -> bool:
    """Whether the ``carried``-th carried checkpoint of this process (counted from 0) re-hashes what it carries."""
    return carried % check_every == 0


def digest_of(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str]) -> FileDigest:
    """Size and xxh3 of the file these tensors would be written as, computed without writing it."""
    from . import tensorfile

    digest, size = xxhash.xxh3_128(), 0
    for piece in tensorfile.pieces(tensors, meta):
        view = memoryview(piece).cast("B")
        digest.update(view)
        size += view.nbytes
    return FileDigest(size, digest.hexdigest())


def exists(path: Path) -> bool:
    try:
        return os.path.isfile(path) and not os.path.islink(path)
    except OSError:
        return False


@dataclasses.dataclass
class Carry:
    """A file of a checkpoint to be linked from ``source`` (``digest`` as its manifest lists it, ``carried_from``
    set); ``tensors`` and ``meta`` write it instead when the link cannot be made, or when ``check`` (the guard) finds
    that their content differs from the source's (:func:`confirm`)."""

    source: Path
    digest: FileDigest
    tensors: dict[str, torch.Tensor]
    meta: dict[str, str]
    check: bool = False
    versions: list[int | None] = dataclasses.field(default_factory=list)  # the tensors' version counters at the step


def confirm(name: str, carry: Carry) -> bool:
    """The guard: whether the live tensors of a file about to be carried still serialise to its source's bytes.

    Hashes them (nothing written); False, with a warning naming the file and the likely cause, when they do not.
    True as well when a tensor's version counter moved since the step (the loop's next steps changed them: the writer
    runs beside it), before or while they were hashed: that hash says nothing, and the counters, unchanged at the
    step, carry the file.
    """
    got = digest_of(carry.tensors, carry.meta)
    if got.xxh3_128 == carry.digest.xxh3_128 and got.size == carry.digest.size:
        return True
    if carry.versions and [version_counter(t) for t in carry.tensors.values()] != carry.versions:
        log.debug("%s: changed by the loop while the guard hashed it; carried by its version counters", name)
        return True
    log.warning(
        "%s: unchanged by its tensors' version counters, but its content differs from %s (xxh3 %s, expected %s):"
        " something changed it behind autograd (a write through .data, a .numpy() view or a custom kernel);"
        " written, not carried",
        name,
        carry.source,
        got.xxh3_128,
        carry.digest.xxh3_128,
    )
    return False


@dataclasses.dataclass
class Source:
    """A tensor file this process made durable: where, its digest, the fingerprints (and tensors) it was made from."""

    path: Path
    digest: FileDigest  # carried_from: the step whose save wrote the bytes
    prints: dict[str, Fingerprint]
    tensors: dict[str, torch.Tensor]  # held: their memory cannot be reused by a new tensor at the same address
    shared: int  # checkpoints holding this inode so far


class Carrier:
    """One process's memory of its durable tensor files, and the plan of each checkpoint (see the module docstring).

    :meth:`plan` at the step, on the live payload (before any staging copy); :meth:`durable` once that checkpoint
    is committed (any thread: the background writer's); :meth:`loaded` after a resume.
    """

    def __init__(self, options: CarryOptions | None = None) -> None:
        self.options = options or CarryOptions()
        self.sources: dict[str, Source] = {}
        self.carried = 0  # checkpoints of this process that carried a file (the guard's cadence)
        self._pending: tuple[int, dict[str, tuple[dict[str, Fingerprint], dict[str, Any]]]] | None = None

    @property
    def enabled(self) -> bool:
        return self.options.enabled

    def plan(self, payload: Payload, step: int, *, urgent: bool = False) -> Payload:
        """``payload`` with each unchanged tensor file moved from ``tensor_files`` to ``carried``.

        Fingerprints are taken now, for :meth:`durable` to record once the checkpoint of ``step`` is committed.
        When the guard is due, the carried files are marked for it (``Carry.check``): the writer hashes them
        (:func:`confirm`), in the background for a checkpoint written there. ``urgent`` (a stop's save, racing a
        grace period) never waits for the guard: it falls to the next checkpoint. Nor does it fingerprint a file
        past its first changed tensor (a LoRA run's adapters and moments: hundreds of tensors, milliseconds): that
        file is written, and nothing is recorded of it for a later checkpoint (the run ends with its stop; should
        the stop's save fail and the run go on, the next checkpoint writes it again).
        """
        if not self.enabled:
            return payload
        opts = self.options
        pending: dict[str, tuple[dict[str, Fingerprint], dict[str, Any]]] = {}
        carried: dict[str, Carry] = {}
        for name, (tensors, meta) in payload.tensor_files.items():
            src = self.sources.get(name)
            if urgent and (src is None or not unchanged(tensors, src.prints)):
                continue  # written (left in tensor_files), unrecorded
            now = src.prints if urgent and src is not None else fingerprints(tensors)
            if now is not None:
                pending[name] = (now, dict(tensors))
            action, why = decide(
                now,
                None if src is None else src.prints,
                source_present=src is not None and exists(src.path),
                shared=0 if src is None else src.shared,
                carry_limit=opts.carry_limit,
            )
            if action == "carry":
                assert src is not None
                versions = [version_counter(t) for t in tensors.values()]
                carried[name] = Carry(src.path, src.digest, dict(tensors), dict(meta), versions=versions)
            elif src is not None:
                log.debug("%s: written (%s)", name, why)
        if carried and not urgent:
            if check_due(self.carried, opts.check_every):
                for c in carried.values():
                    c.check = True
            self.carried += 1
        self._pending = (step, pending)
        files = {n: v for n, v in payload.tensor_files.items() if n not in carried}
        return dataclasses.replace(payload, tensor_files=files, carried=carried)

    def durable(self, directory: Path, step: int, files: Mapping[str, FileDigest]) -> None:
        """The checkpoint of ``step`` planned last is committed in ``directory``, with ``files`` as listed."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != step:
            return  # not the save planned last (a save without a plan): nothing known of its tensors
        sources = {}
        for name, (prints, tensors) in pending[1].items():
            digest = files.get(name)
            if digest is None:
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
        """After a resume from ``directory``: its tensor files that the live tensors match become the sources.

        ``payload``: the live state captured right after the load. A file counts only when its header lists
        exactly those tensors, with their dtypes, shapes and metadata (a load that cast or skipped a tensor does
        not match); the guard (:meth:`plan`) hashes the content before the first file is carried.
        Returns the names recorded.
        """
        from . import tensorfile

        self._pending = None
        self.sources = {}
        if not self.enabled:
            return []
        for name, (tensors, meta) in payload.tensor_files.items():
            digest = files.get(name)
            prints = fingerprints(tensors)
            if digest is None or prints is None:
                continue
            path = directory / name
            try:
                header = tensorfile.read_header(path)
                shared = os.stat(path).st_nlink
            except (OSError, ValueError):
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
