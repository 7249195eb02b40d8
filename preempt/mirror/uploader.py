"""The background uploader: committed checkpoints copied to the mirror after they are durable, never blocking the loop.

One named daemon thread. The run's step path only calls :meth:`Uploader.submit` (a lock, a notify). Each pass:

1. Survey the mirror (:mod:`preempt.mirror.survey`) and read the local committed checkpoints' manifests.
2. For each local checkpoint the mirror lacks (:func:`plan.to_upload`), oldest first, the actions of
   :func:`plan.upload_actions`: an older save's manifest of that step deleted first, the data objects (each local
   file's size and xxh3-128 checked against the manifest just before it is uploaded: a file damaged since its commit
   is not uploaded, and neither is that checkpoint's manifest), a file the mirror holds already (carried unchanged)
   copied server-side, and the manifest last, the very bytes whose digests were checked, once the checkpoint is
   still committed locally (a checkpoint pruned meanwhile may have had its files recycled: its manifest is not
   uploaded). An object listing therefore never shows a partial checkpoint as complete.
3. Retention on the mirror (:func:`plan.deletions`), then the run records (train.log, history.jsonl) at the prefix.

The mirror unreachable: one warning, the pass retried after a wait that doubles up to ``max_backoff``
(:func:`preempt.mirror.backoff.delay`); when it answers again, one line says how many checkpoints it was behind and
that it caught up. Events go to ``on_event`` (the run records them in history.jsonl: ``preempt report`` shows how far
behind the mirror was).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from .. import _testing
from .._log import duration
from ..checkpoint import files, hashed_io, safe_io
from ..checkpoint.hashed_io import FileDigest
from ..checkpoint.manifest import MAX_MANIFEST_BYTES, Manifest
from ..checkpoint.names import MANIFEST, checkpoint_name, parse_checkpoint_name
from ..checkpoint.retention import RetentionPolicy
from ..errors import CorruptCheckpointError, MirrorError
from . import backoff, plan
from .store import MirrorStore
from .survey import Survey, Surveyor

log = logging.getLogger("preempt")

# The boundaries of one checkpoint's upload: the fault point "upload" of preempt._testing.
STAGES = ("after_first_object", "before_manifest", "uploaded")
RETENTION_READS = 64  # manifests retention reads in one pass at most (newest first)


def _stage(name: str, step: int) -> None:
    _testing.reach("upload", name, step)


@dataclasses.dataclass
class Counts:
    """What the uploader did, for the log, history.jsonl and the tests."""

    uploaded: int = 0  # checkpoints whose manifest went up
    put_bytes: int = 0  # bytes uploaded
    copied_bytes: int = 0  # bytes copied server-side (carried files)
    max_behind_steps: int = 0  # the most steps the mirror was behind the newest durable checkpoint
    max_behind_s: float = 0.0  # the longest a durable checkpoint waited to be in the mirror


class Uploader:
    """Uploads a save_dir's committed checkpoints to a mirror in the background.

    Args:
        store: The mirror.
        save_dir: The run's directory.
        retention: The run's retention, applied to the mirror's complete checkpoints too.
        records: Files at save_dir's root copied to the mirror's root after each pass (train.log, history.jsonl).
        on_event: Called as ``on_event(kind, **fields)`` with ``mirror`` (a checkpoint uploaded: its step as
            ``uploaded``), ``mirror_down``, ``mirror_up``; from the uploader's thread.
        clock: Monotonic seconds (for tests).
        first_backoff, max_backoff: Seconds between tries while the mirror fails.
        node: The ranks' nodes share no save_dir (:mod:`preempt.cluster.nodes`): this one's number. Node 0
            uploads its part, then the whole checkpoint's manifest once the mirror lists every other node's files
            (looking again after ``wait_parts`` seconds, doubling up to 20 times that), and applies the retention;
            another node uploads only its part of each checkpoint newer than the newest complete one it knows.
    """

    def __init__(
        self,
        store: MirrorStore,
        save_dir: Path,
        retention: RetentionPolicy,
        *,
        records: Iterable[str] = (),
        on_event: Callable[..., None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        first_backoff: float = 1.0,
        max_backoff: float = 30.0,
        node: int | None = None,
        wait_parts: float = 0.2,
    ) -> None:
        self.store = store
        self.save_dir = Path(save_dir)
        self.retention = retention
        self.records = tuple(records)
        self.on_event = on_event
        self.clock = clock
        self.first_backoff, self.max_backoff = first_backoff, max_backoff
        self.surveyor = Surveyor(store)
        self.counts = Counts()
        self.held: set[int] = set()  # the complete steps of the mirror, as last seen
        self._held_saves: dict[int, float] = {}  # step -> its manifest's ``created``: which save of it the mirror holds
        self.error: BaseException | None = None  # an unexpected error that ended the thread (logged)
        self.local_error: Exception | None = None  # the local error of the latest pass, which is retried
        self.failures = 0  # passes failed in a row
        self.down_since: float | None = None
        self._cond = threading.Condition()
        self._wanted: int | None = None  # the newest durable local step submitted
        # submissions counted: a step saved again (the final save replacing a periodic one of its step) is a new one
        self._submitted = 0
        self._done = 0  # the submissions a completed pass has covered
        self._durable_at: dict[int, float] = {}  # step -> when it became durable, until the mirror holds it
        self._damaged: set[tuple[int, float]] = set()  # (step, created) of local checkpoints not to upload
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self.node, self.wait_parts = node, wait_parts
        # parts written before this time (by an earlier process: a timeline the resume left) are never uploaded
        self.since = -math.inf
        self.lacking: dict[int, dict[int, list[str]]] = {}  # node 0: step -> node -> its files the mirror lacks
        self._parts: dict[int, float] = {}  # another node: step -> ``created`` of the save whose part is up
        self._sent: set[tuple[int, str, str]] = set()  # another node: (step, file, xxh3) uploaded or copied
        # The steps whose objects the run knows: this process uploaded them, or pulled and checked them. Only these are
        # copy sources, and the newest of them bounds retention: a shared or forged bucket's claims are not trusted.
        self.verified: set[int] = set()

    # ------------------------------------------------------------------ the run's side

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="preempt-mirror", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        """Checkpoint ``step`` is durable locally: upload it (and any older one the mirror lacks). Never blocks."""
        with self._cond:
            if self._wanted is None or step > self._wanted:
                self._wanted = step
            self._submitted += 1
            self._durable_at.setdefault(step, self.clock())
            held = max(self.held, default=None)
            if held is None or step > held:
                behind = step - (held if held is not None else 0)
                self.counts.max_behind_steps = max(self.counts.max_behind_steps, behind)
            self._cond.notify_all()

    def holds(self) -> int | None:
        """The newest step the mirror holds complete, as last seen."""
        with self._cond:
            return max(self.held, default=None)

    def wait_for(self, step: int, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds until the mirror holds ``step`` complete, the save of it that save_dir
        holds now (not an earlier save of the same step); whether it does."""
        deadline = self.clock() + max(0.0, timeout)
        local = _read_manifest(self.save_dir / checkpoint_name(step))
        created = None if local is None else local[0].created
        part = local is not None and local[0].part is not None

        def held() -> bool:
            if self.node and part:  # another node than 0: its part of that save is up
                return step in self._parts and (created is None or self._parts[step] == created)
            return step in self.held and (created is None or self._held_saves.get(step) == created)

        with self._cond:
            while not held():
                left = deadline - self.clock()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    return held()
                self._cond.wait(min(left, 0.1))
            return True

    def wait_idle(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds until the pass for the newest submitted step has ended (its retention and
        run records done too); whether it has."""
        deadline = self.clock() + max(0.0, timeout)
        with self._cond:
            while self._done != self._submitted:
                left = deadline - self.clock()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    return False
                self._cond.wait(min(left, 0.1))
            return True

    def behind(self) -> tuple[int, float]:
        """Steps and seconds the mirror is behind the newest durable checkpoint submitted, now."""
        with self._cond:
            held = max(self.held, default=-1)
            waiting = [t for s, t in self._durable_at.items() if s > held]
            steps = 0 if self._wanted is None or self._wanted <= held else self._wanted - max(held, 0)
            return steps, (self.clock() - min(waiting)) if waiting else 0.0

    def close(self) -> None:
        """Stops the thread after its current operation, without waiting for it (a stop has a deadline); a
        daemon thread blocked on a dead server does not keep the process."""
        self._closing.set()
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        waits = 0  # passes in a row that found other nodes' files missing
        try:
            while not self._closing.is_set():
                with self._cond:
                    while not self._closing.is_set() and self._done == self._submitted:
                        self._cond.wait()
                    target, submitted = self._wanted, self._submitted
                if self._closing.is_set():
                    return
                if self.run_once(target):
                    if self.lacking:  # node 0: other nodes' parts not in the mirror yet; looked for again soon
                        waits += 1
                        self._closing.wait(backoff.delay(waits, self.wait_parts, 20 * self.wait_parts))
                        continue
                    waits = 0
                    with self._cond:
                        self._done = submitted
                        self._cond.notify_all()
                    continue
                self._closing.wait(backoff.delay(self.failures, self.first_backoff, self.max_backoff))
        except BaseException as e:  # a bug, not the mirror: said once; training goes on without a mirror
            self.error = e
            log.error("the mirror's uploader stopped: %s: %s; the mirror receives no more checkpoints", type(e), e)
        finally:
            with self._cond:
                self._cond.notify_all()

    def run_once(self, target: int | None) -> bool:
        """One pass (the module's steps 1-3) for the checkpoints up to step ``target``; whether it completed.

        A MirrorError makes the pass fail (the first of a series is warned about); so does a local error (a file,
        memory, a bug: said once, with its type), retried like the mirror's.
        """
        start = self.clock()
        try:
            uploaded = self._pass(target)
        except MirrorError as e:
            return self._failed(e, start)
        except Exception as e:  # a local error (a file, memory, a bug): this pass fails, the next one retries
            self.failures += 1
            if self.local_error is None:
                log.warning(
                    "the mirror's uploader met a local error (%s: %s); training goes on, the upload is retried",
                    type(e).__name__,
                    e,
                )
            self.local_error = e
            return False
        self.local_error = None
        return self._succeeded(uploaded)

    def _failed(self, e: MirrorError, start: float) -> bool:
        """A pass the mirror failed: the first of a series is warned about, the others go to the debug log."""
        self.failures += 1
        if self.down_since is None:
            self.down_since = start
            log.warning(
                "%s; training goes on, uploads are retried (every %s at most) and catch up when it answers",
                e,
                duration(self.max_backoff),
            )
            self._event("mirror_down", error=str(e)[:500])
        else:
            log.debug("mirror still failing (%d tries): %s", self.failures, e)
        return False

    def _succeeded(self, uploaded: list[int]) -> bool:
        """A pass that completed: a mirror that was down is said to be back, with how far behind it was."""
        self.failures = 0
        now = self.clock()
        if self.down_since is not None:
            held = self.holds()
            log.info(
                "mirror %s reachable again after %s, %d checkpoint(s) behind, caught up (it holds %s)",
                self.store.display,
                duration(now - self.down_since),
                len(uploaded),
                "no checkpoint" if held is None else f"step {held}",
            )
            self._event("mirror_up", down_s=round(now - self.down_since, 3), behind=len(uploaded), held=held)
            self.down_since = None
        return True

    def _pass(self, target: int | None) -> list[int]:
        local = self._local(target)
        # the manifests a pass needs: the mirror's of the local steps (to upload what it lacks), of the steps it trusts
        # (copy sources), and retention's (below); never those of every step a shared or forged bucket lists
        surveyed = self.surveyor.survey(wanted={*local, *self.verified, *self._parts})
        self._seen(surveyed)
        if self.node:
            return self._pass_part(local, surveyed)
        uploaded = []
        self.lacking = {}
        trusted = {s: m for s, m in surveyed.manifests.items() if s in self.verified}
        newest = max(trusted, default=-1)
        for step in plan.to_upload({s: m.whole for s, (m, _) in local.items()}, surveyed.manifests):
            manifest, data = local[step]
            if (step, manifest.created) in self._damaged:
                continue
            # A part older than the mirror's newest whole checkpoint is not waited for (the other nodes skip it), nor
            # one an earlier process wrote
            if manifest.part and (step < newest or manifest.created < self.since):
                continue
            if self._upload(manifest, data, surveyed, trusted):
                whole = manifest.whole
                uploaded.append(step)
                self.verified.add(step)
                trusted[step] = surveyed.manifests[step] = whole
                sizes = {n: d.size for n, d in whole.files.items()}
                surveyed.listing[step] = {**sizes, MANIFEST: len(whole.to_json() if manifest.part else data)}
                self._seen(surveyed)
        ours = {s for s, m in surveyed.manifests.items() if s in local and local[s][0].whole == m}
        counted = self.verified | ours  # a step it never wrote, pulled or holds is neither counted nor deleted
        # retention's reads, newest first and bounded per pass: a step still undecided after them is kept this pass
        # (an older step's manifest that might be complete and kept is never guessed at, nor read without end)
        self.surveyor.read(
            surveyed, plan.undecided(self.retention, surveyed.manifests, surveyed.unread, counted)[:RETENTION_READS]
        )
        undecided = plan.undecided(self.retention, surveyed.manifests, surveyed.unread, counted)
        doomed = plan.deletions(self.retention, surveyed.listing, surveyed.manifests, busy=undecided, trusted=counted)
        if doomed:
            self.store.delete_steps({s: surveyed.listing[s] for s in doomed})
            log.debug("mirror %s: deleted %d step(s) (retention): %s", self.store.display, len(doomed), doomed[:20])
        self._seen(self.surveyor.survey(wanted=()) if uploaded else surveyed)
        for name in self.records:
            record = _read_record(self.save_dir / name)
            if record is not None:
                self.store.put_text(name, record)
        return uploaded

    def _pass_part(self, local: dict[int, tuple[Manifest, bytes]], surveyed: Survey) -> list[int]:
        """Another node than 0: the files of its part of each checkpoint newer than the mirror's newest complete
        one, uploaded (or copied server-side when a complete step holds the same bytes); never a manifest."""
        # the whole steps this node knows: those it uploaded its part of, and one it pulled
        trusted = {s: m for s, m in surveyed.manifests.items() if s in self.verified or self._parts.get(s) == m.created}
        newest = max(trusted, default=-1)
        done = []
        for step, (manifest, data) in sorted(local.items()):
            if step < newest or manifest.part is None or manifest.created < self.since:
                continue
            whole = surveyed.manifests.get(step)
            if self._parts.get(step) == manifest.created or (whole is not None and whole.created == manifest.created):
                continue
            ckpt = self.save_dir / checkpoint_name(step)
            for name, digest in sorted(manifest.files.items(), key=lambda item: (-item[1].size, item[0])):
                if (step, name, digest.xxh3_128) in self._sent:
                    continue
                source = plan.copy_source(name, digest, step, trusted)
                if source is not None and self._copy(source, name, step, digest.size):
                    self.counts.copied_bytes += digest.size
                elif self._put(ckpt / name, digest, manifest, data):
                    self.counts.put_bytes += digest.size
                else:
                    break
                self._sent.add((step, name, digest.xxh3_128))
            else:
                note = plan.part_note_body(manifest.created, manifest.files)
                self.store.put_bytes(step, plan.part_note(manifest.part.node), json.dumps(note).encode())
                with self._cond:
                    self._parts[step] = manifest.created
                    self._cond.notify_all()
                done.append(step)
                self._event("mirror_part", uploaded=step, node=self.node)
        return done

    def _ready(self, whole: Manifest, here: Iterable[str], part: Any) -> bool:
        """Node 0, before a whole checkpoint's manifest: every other node's files of it are in the mirror (their
        sizes as listed); what is not is kept in :attr:`lacking` (the stop's line names the nodes)."""
        listed = self.store.steps().get(whole.step, {})
        lacking: dict[int, list[str]] = {}
        by_node: dict[int, dict[str, FileDigest]] = {}
        for name, (node, digest) in part.elsewhere.items():
            by_node.setdefault(node, {})[name] = digest
        for node, held in sorted(by_node.items()):
            if all(listed.get(n) == d.size for n, d in held.items()) and self._part_up(whole, node, held, listed):
                continue
            lacking[node] = sorted(n for n, d in held.items() if listed.get(n) != d.size) or [plan.part_note(node)]
        if lacking:
            self.lacking[whole.step] = lacking
        return not lacking

    def _part_up(self, whole: Manifest, node: int, held: dict[str, FileDigest], listed: dict[str, int]) -> bool:
        """Node ``node``'s note says its part of this very save is up (not an earlier save's objects of the step)."""
        name = plan.part_note(node)
        if name not in listed:
            return False
        try:
            note = safe_io.load_json(self.store.read(whole.step, name, MAX_MANIFEST_BYTES), name)
        except (MirrorError, ValueError):
            return False
        return plan.part_is_up(note, whole.created, held)

    def lagging(self, step: int) -> str:
        """Node 0: which nodes' files of ``step`` the mirror lacked when last looked at, in words ("" for none)."""
        lacking = self.lacking.get(step, {})
        return "; ".join(f"node {k} has not uploaded {', '.join(names)}" for k, names in sorted(lacking.items()))

    def _seen(self, surveyed: Survey) -> None:
        """What the mirror holds now: waiters woken, lags measured."""
        now = self.clock()
        with self._cond:
            self.held = set(surveyed.manifests)
            self._held_saves = {s: m.created for s, m in surveyed.manifests.items()}
            newest = max(self.held, default=-1)
            # The mirror was behind since the oldest durable checkpoint it lacked became durable (one superseded
            # meanwhile counts too: the mirror's state was that old).
            caught = [t for s, t in self._durable_at.items() if s <= newest]
            if caught:
                self.counts.max_behind_s = max(self.counts.max_behind_s, now - min(caught))
            self._durable_at = {s: t for s, t in self._durable_at.items() if s > newest}
            self._cond.notify_all()

    def _local(self, target: int | None) -> dict[int, tuple[Manifest, bytes]]:
        """The manifests (parsed, and their bytes) of the committed local checkpoints up to ``target``."""
        out: dict[int, tuple[Manifest, bytes]] = {}
        try:
            names = os.listdir(self.save_dir)
        except OSError:
            return out
        for name in names:
            step = parse_checkpoint_name(name)
            if step is None or (target is not None and step > target):
                continue
            read = _read_manifest(self.save_dir / name)
            # a part another node wrote here (the nodes' roles are the rendezvous's, not the disks'): not this node's
            if read is not None and read[0].step == step and (read[0].part is None or read[0].part.node == self.node):
                out[step] = read
        return out

    def _upload(self, manifest: Manifest, data: bytes, surveyed: Survey, trusted: dict[int, Manifest]) -> bool:
        """One checkpoint, in :func:`plan.upload_actions`'s order; whether its manifest went up. Objects are copied
        server-side only from ``trusted`` steps."""
        step, store = manifest.step, self.store
        ckpt = self.save_dir / checkpoint_name(step)
        first = True
        start, before = self.clock(), dataclasses.replace(self.counts)
        copies: list[plan.Action] = []
        whole = manifest.whole  # node 0's part: the other nodes upload their files, this one the whole's manifest
        body = data if whole is manifest else whole.to_json()
        for action in plan.upload_actions(whole, surveyed.listing.get(step), trusted):
            if action.kind == "delete":
                store.delete(step, action.name)
                continue
            if action.kind == "manifest":
                if _read_manifest(ckpt) != (manifest, data):  # pruned or replaced meanwhile: not this save any more
                    log.debug("%s changed while it was uploaded; its manifest is not uploaded", ckpt)
                    return False
                if manifest.part is not None and not self._ready(whole, manifest.files, manifest.part):
                    return False
                _stage("before_manifest", step)
                store.put_bytes(step, MANIFEST, body)
                self.surveyor.remember(whole, len(body))
                self.counts.uploaded += 1
                _stage("uploaded", step)
                now, c = self.clock(), self.counts
                with self._cond:
                    durable = self._durable_at.get(step)
                self._event(  # (not "step": a history line's step is where the loop stood, for preempt report)
                    "mirror",
                    uploaded=step,
                    put_bytes=c.put_bytes - before.put_bytes,
                    copied_bytes=c.copied_bytes - before.copied_bytes,
                    copied=sorted(a.name for a in copies),
                    seconds=round(now - start, 3),
                    behind_s=None if durable is None else round(now - durable, 3),
                )
                return True
            if action.name not in manifest.files:  # another node's file: that node uploads it
                continue
            expected = manifest.files[action.name]
            sent = (step, action.name, expected.xxh3_128)
            if sent in self._sent:  # up in an earlier pass that waited for the other nodes' files
                continue
            if (
                action.kind == "copy"
                and action.source is not None
                and self._copy(action.source, action.name, step, expected.size)
            ):
                self.counts.copied_bytes += expected.size
                copies.append(action)
            elif not self._put(ckpt / action.name, expected, manifest, data):
                return False
            else:
                self.counts.put_bytes += expected.size
            if manifest.part is not None:
                self._sent.add(sent)
            if first:
                first = False
                _stage("after_first_object", step)
        return False  # (upload_actions always ends with the manifest)

    def _copy(self, source: int, name: str, step: int, size: int) -> bool:
        try:
            self.store.copy(source, name, step, size)
        except MirrorError as e:
            if e.errno != errno.ENOENT:
                raise
            return False  # the source went (retention, another process): upload it instead
        return True

    def _put(self, path: Path, expected: FileDigest, manifest: Manifest, data: bytes) -> bool:
        """The local file checked against the manifest, then uploaded; False when it does not match: said once, as
        damage, unless the checkpoint was replaced or pruned meanwhile (a new save of its step is submitted anew)."""
        try:
            files.regular_file(path)
            got = hashed_io.hash_file(path)
        except FileNotFoundError:
            return False  # pruned meanwhile
        except (OSError, CorruptCheckpointError) as e:
            got, problem = None, str(e)
        else:
            problem = ""
        if got is not None and got != expected:
            problem = (
                f"{path}: size {got.size}, xxh3 {got.xxh3_128}; the manifest says size {expected.size},"
                f" xxh3 {expected.xxh3_128}"
            )
        if problem and _read_manifest(path.parent) != (manifest, data):
            log.debug("%s changed while it was uploaded (replaced or pruned); not uploaded", path.parent)
            return False
        if problem:
            self._damaged.add((manifest.step, manifest.created))
            log.warning(
                "%s: damaged since its commit; checkpoint step %d is not uploaded to the mirror (nor its manifest)",
                problem,
                manifest.step,
            )
            return False
        try:
            self.store.put(path, manifest.step, path.name)
        except FileNotFoundError:  # pruned between its check and its upload: the pass goes on without it
            return False
        except MirrorError:
            if not path.exists():  # the same, noticed by the client mid-upload: not the mirror's failure
                return False
            raise
        return True

    def _event(self, kind: str, **fields: Any) -> None:
        if self.on_event is not None:
            try:
                self.on_event(kind, **fields)
            except Exception as e:  # a record is not worth the uploads
                log.debug("mirror event %s not recorded: %s", kind, e)


def _read_manifest(ckpt: Path) -> tuple[Manifest, bytes] | None:
    """A local checkpoint's manifest, parsed, and its bytes; None when it has none or it is not valid."""
    path = ckpt / MANIFEST
    try:
        files.regular_file(path)
        data = safe_io.read_bytes(path, MAX_MANIFEST_BYTES)
        return Manifest.from_json(data, str(path)), data
    except (OSError, ValueError, CorruptCheckpointError):
        return None


def _read_record(path: Path, limit: int = 256 << 20) -> bytes | None:
    """A run record's bytes (a regular file, capped), or None."""
    try:
        return safe_io.read_bytes(path, limit)
    except (OSError, ValueError):
        return None


def summary(counts: Counts, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The counts as a history record's fields."""
    return {**dataclasses.asdict(counts), **(extra or {})}
