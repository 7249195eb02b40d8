"""The manifest: the last file of every checkpoint, and its only index.

``manifest.json`` holds the format version, where the run stood (global step,
epoch, batch and sample cursor, the sampler's state), why the checkpoint was
written, the size and xxh3-128 digest of every other file, and provenance
(library versions, the code's git commit, the SLURM job), and the run's
retention (which checkpoints it keeps, so that ``preempt prune`` keeps them
too). It carries a checksum of itself, so a flipped byte in the manifest is
detected like one in a tensor file.

Fields added after format version 1 was first written are optional: a
file entry's ``carried_from`` (the step whose save wrote a file this checkpoint
hard-links, :mod:`preempt.checkpoint.carry`) is absent for a written file; a
manifest without ``retention`` (written by an older preempt, or by
:meth:`~preempt.checkpoint.manager.CheckpointManager.save_state`) loads, its retention
unknown; an older preempt ignores the field (the checksum covers every key).

Parsing is strict: a manifest from an untrusted source cannot name files
outside its directory, claim absurd sizes, or smuggle in anything but JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import TYPE_CHECKING, Any, TypeGuard

import xxhash

from . import safe_io
from .hashed_io import FileDigest, dumps_json
from .names import MANIFEST, MAX_STEP

if TYPE_CHECKING:
    from .retention import RetentionPolicy

FORMAT = "preempt-checkpoint"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20
MAX_FILES = 1 << 16  # files a manifest may list: every rank's and every DCP shard's, with room to spare
# values a manifest's JSON may hold, checked before it is parsed: ~6 per listed file, with room for the rest (a
# compact document of empty objects costs many times its text in memory to parse)
MAX_VALUES = 1 << 20
MAX_FILE_BYTES = 1 << 50  # 1 PiB: larger claims are corruption, not data
_FILE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", re.ASCII)  # used with fullmatch
_HEX32_RE = re.compile(r"[0-9a-f]{32}", re.ASCII)
MAX_CREATED = 1e11  # seconds since 1970: the year 5138; the largest time ``datetime`` can show is below 2.6e11
POINTS = ("step", "epoch")
MODES = ("min", "max")


@dataclasses.dataclass(frozen=True)
class Cursor:
    """Where the loop stood when the checkpoint was taken.

    Attributes:
        epoch: The epoch the loop is in.
        batch: Batches of that epoch consumed by completed steps.
        sample: Samples of that epoch consumed (counted across all ranks),
            or -1 when the loader's batch size is unknown.
        point: ``"step"``: taken in ``run.step()``, inside the batch loop;
            ``"epoch"``: taken at an epoch boundary, before the epoch's first batch.
        batches_per_epoch: len(loader) when known, else -1.
    """

    epoch: int = 0
    batch: int = 0
    sample: int = 0
    point: str = "epoch"
    batches_per_epoch: int = -1


@dataclasses.dataclass(frozen=True)
class Part:
    """A node's part of a checkpoint whose ranks share no save_dir (nodes with disks of their own, joined by a mirror).

    Each node's save_dir holds the files its ranks wrote, under a manifest listing just those (so that every local
    check holds as for a whole checkpoint). Node 0's also lists, in ``elsewhere``, every other node's files with the
    node that holds them: its :meth:`Manifest.whole` is the manifest uploaded to the mirror once every node's files
    are there. A part is never loaded by itself; a resume pulls the whole checkpoint from the mirror.
    """

    node: int
    nodes: int
    elsewhere: dict[str, tuple[int, FileDigest]] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "nodes": self.nodes,
            "elsewhere": {n: {**d.to_json(), "node": k} for n, (k, d) in sorted(self.elsewhere.items())},
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    """The parsed content of ``manifest.json``."""

    step: int
    cursor: Cursor
    reason: str
    created: float  # unix seconds
    files: dict[str, FileDigest]
    sampler: dict[str, Any] | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    best: dict[str, Any] | None = None  # the run's best so far: metric, mode, value, step
    is_best: bool = False  # this checkpoint holds the state that set ``best``
    lineage: dict[str, Any] = dataclasses.field(default_factory=dict)
    provenance: dict[str, Any] = dataclasses.field(default_factory=dict)
    # What the writing run keeps (:func:`retention_record`); None: unknown (an older manifest, or no run).
    retention: dict[str, Any] | None = None
    part: Part | None = None  # this save_dir holds one node's part of the checkpoint (:class:`Part`)
    format_version: int = FORMAT_VERSION

    @property
    def whole(self) -> Manifest:
        """The manifest of the whole checkpoint: this one when it is not a part; node 0's part with the other nodes'
        files listed (what the mirror holds). A part of another node has no whole (ValueError)."""
        if self.part is None:
            return self
        if self.part.node != 0:
            raise ValueError(f"step {self.step}: node {self.part.node}'s part does not list the other nodes' files")
        more = {n: d for n, (_, d) in self.part.elsewhere.items()}
        return dataclasses.replace(self, files={**self.files, **more}, part=None)

    def origins(self) -> frozenset[tuple[str, int]]:
        """``(file, step that wrote its bytes)`` for every file: two checkpoints share an inode when they share a pair
        (a carried file is a hard link to the bytes its ``carried_from`` step wrote)."""
        return frozenset((n, self.step if d.carried_from is None else d.carried_from) for n, d in self.files.items())

    @property
    def carried(self) -> dict[str, FileDigest]:
        """The files this checkpoint carried unchanged (hard links) rather than wrote."""
        return {n: d for n, d in self.files.items() if d.carried_from is not None}

    @property
    def best_value(self) -> float | None:
        """The metric value when this checkpoint is a "best" one, else None."""
        if self.is_best and self.best is not None:
            return float(self.best["value"])
        return None

    def to_dict(self) -> dict[str, Any]:
        body = {
            "format": FORMAT,
            "format_version": self.format_version,
            "step": self.step,
            "cursor": dataclasses.asdict(self.cursor),
            "reason": self.reason,
            "created": self.created,
            "files": {name: d.to_json() for name, d in sorted(self.files.items())},
            "sampler": self.sampler,
            "metrics": self.metrics,
            "best": self.best,
            "is_best": self.is_best,
            "lineage": self.lineage,
            "provenance": self.provenance,
        }
        if self.retention is not None:  # absent rather than null: a manifest without it reads as before
            body["retention"] = self.retention
        if self.part is not None:  # the same: a whole checkpoint's manifest has no "part"
            body["part"] = self.part.to_json()
        body["checksum"] = xxhash.xxh3_128_hexdigest(dumps_json(body))
        return body

    def to_json(self) -> bytes:
        """Pretty JSON for people, with a checksum over the canonical form."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True, allow_nan=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parses and validates a manifest.

        Args:
            data: The bytes of ``manifest.json``.
            where: The manifest's path, for messages.

        Raises:
            ValueError: Anything off, with a message naming ``where``, what
                was expected and what was found.
        """
        if len(data) > MAX_MANIFEST_BYTES:
            raise ValueError(f"{where}: {len(data)} bytes; a manifest is at most {MAX_MANIFEST_BYTES}")
        # Nesting is checked before parsing (a deep document would break the checksum's re-encoding too).
        raw = safe_io.load_json(data, where, max_values=MAX_VALUES)
        if raw.get("format") != FORMAT:
            raise ValueError(f"{where}: expected format {FORMAT!r}, found {_short(raw.get('format'))}")
        version = raw.get("format_version")
        if type(version) is not int or version != FORMAT_VERSION:
            newer = isinstance(version, int) and version > FORMAT_VERSION
            hint = " (written by a newer preempt; upgrade to read it)" if newer else ""
            raise ValueError(
                f"{where}: format_version {_short(version)} is not supported, expected {FORMAT_VERSION}{hint}"
            )
        checksum = raw.pop("checksum", None)
        actual = xxhash.xxh3_128_hexdigest(dumps_json(raw))
        if checksum != actual:
            raise ValueError(f"{where}: manifest checksum mismatch (recorded {checksum}, computed {actual})")
        r = _Reader(raw, where)
        listed = r.mapping("files")
        if len(listed) > MAX_FILES:
            raise ValueError(f"{where}: lists {len(listed)} files; a checkpoint holds at most {MAX_FILES}")
        files = {name: _file_entry(name, entry, f"{where}: files") for name, entry in listed.items()}
        part = _check_part(r.mapping("part"), files, where) if "part" in raw else None
        c = _Reader(r.mapping("cursor"), f"{where}: cursor")
        point = c.text("point")
        if point not in POINTS:
            raise ValueError(f"{where}: cursor.point: expected one of {POINTS}, found {_short(point)}")
        cursor = Cursor(
            epoch=c.integer("epoch"),
            batch=c.integer("batch"),
            sample=c.integer("sample", lo=-1),
            point=point,
            batches_per_epoch=c.integer("batches_per_epoch", lo=-1),
        )
        best = r.optional_dict("best")
        if best is not None:
            b = _Reader(best, f"{where}: best")
            b.text("metric")
            b.float("value")
        created = r.float("created", lo=0.0, hi=MAX_CREATED, finite=True)
        metrics = r.mapping("metrics")
        m = _Reader(metrics, f"{where}: metrics")
        for key in metrics:
            m.float(key)  # NaN and infinities are legitimate metric values (and an infinite "best")
        sampler = r.optional_dict("sampler")
        _check_cursor_in_epoch(cursor, sampler, where)
        retention = _check_retention(r.optional_dict("retention"), where) if "retention" in raw else None
        return cls(
            step=r.integer("step", hi=MAX_STEP),
            cursor=cursor,
            reason=r.text("reason"),
            created=created,
            files=files,
            sampler=sampler,
            metrics=metrics,
            best=best,
            is_best=r.boolean("is_best"),
            lineage=r.mapping("lineage"),
            provenance=r.mapping("provenance"),
            retention=retention,
            part=part,
            format_version=version,
        )


def _file_entry(name: Any, entry: Any, where: str) -> FileDigest:
    """One listed file: a plain name inside the checkpoint, a bounded size, a digest."""
    if not isinstance(name, str) or not _FILE_NAME_RE.fullmatch(name) or name == MANIFEST or ".." in name:
        raise ValueError(f"{where}: file name {_short(name)} is not a plain file name inside the checkpoint")
    e = _Reader(entry, f"{where}[{name!r}]")
    size = e.integer("size", hi=MAX_FILE_BYTES)
    digest = e.text("xxh3_128")
    if not _HEX32_RE.fullmatch(digest):
        raise ValueError(f"{where}[{name!r}].xxh3_128: expected 32 hex digits, found {_short(digest)}")
    origin = e.optional_int("carried_from", hi=MAX_STEP) if "carried_from" in entry else None
    return FileDigest(size, digest, origin)


def _check_part(raw: dict[str, Any], files: dict[str, FileDigest], where: str) -> Part:
    """The ``part`` object: node numbers in range, the other nodes' files named as plain files apart from these."""
    r = _Reader(raw, f"{where}: part")
    nodes = r.integer("nodes", lo=2, hi=MAX_FILES)
    node = r.integer("node", hi=nodes - 1)
    listed = r.mapping("elsewhere")
    if node != 0 and listed:
        raise ValueError(f"{where}: part.elsewhere: only node 0's part lists other nodes' files, found node {node}")
    if len(files) + len(listed) > MAX_FILES:
        raise ValueError(f"{where}: lists {len(files) + len(listed)} files; a checkpoint holds at most {MAX_FILES}")
    elsewhere = {}
    for name, entry in listed.items():
        digest = _file_entry(name, entry, f"{where}: part.elsewhere")
        held = _Reader(entry, f"{where}: part.elsewhere[{name!r}]").integer("node", lo=1, hi=nodes - 1)
        if name in files:
            raise ValueError(f"{where}: part.elsewhere[{name!r}]: also listed among this node's files")
        elsewhere[name] = (held, digest)
    return Part(node, nodes, elsewhere)


class _Reader:
    """Typed field access with messages that name the field."""

    def __init__(self, raw: Any, where: str):
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: expected a JSON object, found {type(raw).__name__}")
        self.raw = raw
        self.where = where

    def _get(self, key: str) -> Any:
        if key not in self.raw:
            raise ValueError(f"{self.where}: missing field {key!r}")
        return self.raw[key]

    def integer(self, key: str, lo: int = 0, hi: int = 1 << 62) -> int:
        v = self._get(key)
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise ValueError(f"{self.where}: field {key!r}: expected an integer in [{lo}, {hi}], found {_short(v)}")
        return v

    def float(self, key: str, lo: float = -math.inf, hi: float = math.inf, finite: bool = False) -> float:
        v = self._get(key)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        try:
            f = float(v) if ok else math.nan
        except OverflowError:  # an integer beyond the float range
            ok, f = False, math.nan
        if not ok or (finite and not math.isfinite(f)) or (math.isfinite(f) and not lo <= f <= hi):
            if lo > -math.inf or hi < math.inf:
                want = f"a number in [{lo:g}, {hi:g}]"
            else:
                want = "a finite number" if finite else "a number"
            raise ValueError(f"{self.where}: field {key!r}: expected {want}, found {_short(v)}")
        return f

    def text(self, key: str) -> str:
        v = self._get(key)
        if not isinstance(v, str):
            raise ValueError(f"{self.where}: field {key!r}: expected a string, found {_short(v)}")
        return v

    def boolean(self, key: str) -> bool:
        v = self._get(key)
        if not isinstance(v, bool):
            raise ValueError(f"{self.where}: field {key!r}: expected true or false, found {_short(v)}")
        return v

    def mapping(self, key: str) -> dict[str, Any]:
        v = self._get(key)
        if not isinstance(v, dict):
            raise ValueError(f"{self.where}: field {key!r}: expected an object, found {type(v).__name__}")
        return v

    def optional_dict(self, key: str) -> dict[str, Any] | None:
        return None if self._get(key) is None else self.mapping(key)

    def optional_int(self, key: str, lo: int = 0, hi: int = 1 << 62) -> int | None:
        return None if self._get(key) is None else self.integer(key, lo, hi)

    def optional_str(self, key: str) -> str | None:
        return None if self._get(key) is None else self.text(key)


def retention_record(policy: RetentionPolicy) -> dict[str, Any]:
    """What a run records of its retention in each manifest: what ``preempt prune`` keeps by default.

    ``recycle`` is left out: it says how the run deletes, not what it keeps.
    """
    return {
        "keep_last": policy.keep_last,
        "keep_best": policy.keep_best,
        "keep_every_steps": policy.keep_every_steps,
        "metric": policy.metric,
        "mode": policy.mode,
    }


def _check_retention(raw: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """The ``retention`` object, each field type- and range-checked; unknown keys are left out (a newer writer's)."""
    if raw is None:
        return None
    r = _Reader(raw, f"{where}: retention")
    keep_best = r.integer("keep_best")
    metric = r.optional_str("metric")
    mode = r.text("mode")
    if mode not in MODES:
        raise ValueError(f"{where}: retention.mode: expected one of {MODES}, found {_short(mode)}")
    if metric == "":
        raise ValueError(f"{where}: retention.metric: expected a metric name or null, found ''")
    if keep_best and metric is None:
        raise ValueError(f"{where}: retention.keep_best: {keep_best} needs a metric to rank by, found metric null")
    return {
        "keep_last": r.optional_int("keep_last", lo=1),
        "keep_best": keep_best,
        "keep_every_steps": r.optional_int("keep_every_steps", lo=1),
        "metric": metric,
        "mode": mode,
    }


def _check_cursor_in_epoch(cursor: Cursor, sampler: dict[str, Any] | None, where: str) -> None:
    """A cursor past the end of its epoch would make a resume skip the rest of that epoch silently.

    The sampler's state (:meth:`preempt.data.sampler.ResumableSampler.state_dict`)
    says how many global positions an epoch has; a manifest without one, or
    with one of another shape, is not checked here.
    """
    if sampler is None or cursor.sample <= 0:
        return
    n, w, drop = sampler.get("dataset_len"), sampler.get("num_replicas", 1), sampler.get("drop_last", False)
    if not (_is_int(n) and n >= 0 and _is_int(w) and w >= 1 and isinstance(drop, bool)):
        return
    total = (n // w) * w if drop else -(-n // w) * w
    if cursor.sample > total:
        raise ValueError(
            f"{where}: cursor.sample {cursor.sample} is past the end of the epoch"
            f" ({total} samples: dataset_len {n}, num_replicas {w}, drop_last {drop})"
        )


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(v: Any) -> str:
    """``repr(v)`` cut to 200 characters: a hostile manifest can hold a 60 MB string."""
    text = repr(v)
    return text if len(text) <= 200 else f"{text[:160]}... ({len(text)} characters)"
