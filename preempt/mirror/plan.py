"""Pure decisions of the mirror: what is complete there, what to upload and in which order, what to pull, what to
delete, how long a stop waits. No clock, no network, no disk: the uploader, the pull and the run gather the facts (a
listing, the manifests read from it) and ask these functions; the unit tests call them with made-up listings.

Complete, in the mirror: ``manifest.json`` is there AND every file the manifest lists is there with its size. A
listing cannot show a digest, so a complete step may still hold a damaged object: the pull checks every byte against
the manifest and falls back to the next older complete step (:func:`pull_candidates`).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Mapping

from ..checkpoint.hashed_io import FileDigest
from ..checkpoint.manifest import Manifest
from ..checkpoint.names import MANIFEST
from ..checkpoint.retention import Kept, RetentionPolicy, select_kept

PART_SUFFIX = ".part.json"  # node K's note that its part of a step's save is up: ``node_0000K.part.json``


def part_note(node: int) -> str:
    """The object name of node ``node``'s note in a step's directory (nodes without a shared save_dir)."""
    return f"node_{node:05d}{PART_SUFFIX}"


def part_note_body(created: float, files: Mapping[str, FileDigest]) -> dict[str, object]:
    """What a node's note says: the save (its time) whose part is up, and the digest of each of its files."""
    return {"created": created, "files": {n: d.xxh3_128 for n, d in sorted(files.items())}}


def part_is_up(note: object, created: float, files: Mapping[str, FileDigest]) -> bool:
    """Whether a node's note (parsed JSON) says that its part of the save made at ``created`` is up, with these
    files: the sizes in a listing cannot tell one save's objects from another's of the same step."""
    return note == part_note_body(created, files)


DEFAULT_DEADLINE = 60.0  # seconds a stop waits for its checkpoint's upload (a spot VM's warning is 2 minutes)
TIME_LEFT_SHARE = 0.5  # at most this part of the time left before the kill (SLURM's end, the walltime keeper's)


def is_complete(objects: Mapping[str, int], manifest: Manifest | None) -> bool:
    """Whether one mirrored step is complete: its manifest (parsed; None: absent or not valid) and every file it
    lists, with the listed size."""
    if manifest is None or MANIFEST not in objects:
        return False
    return all(objects.get(name) == d.size for name, d in manifest.files.items())


def to_upload(local: Mapping[int, Manifest], mirrored: Mapping[int, Manifest]) -> list[int]:
    """The local committed checkpoints the mirror lacks or holds incomplete or holds another save of, oldest first.

    Args:
        local: Each committed local checkpoint's manifest, by step.
        mirrored: The manifest of each complete step in the mirror.
    """
    return sorted(s for s, m in local.items() if mirrored.get(s) != m)


@dataclasses.dataclass(frozen=True)
class Action:
    """One operation of a checkpoint's upload.

    ``kind``: ``"delete"`` (an object of an older save of this step), ``"put"`` (upload the local file), ``"copy"``
    (server-side, from the same object of step ``source``: identical bytes by the manifests), ``"manifest"`` (last).
    """

    kind: str
    name: str
    source: int | None = None


def upload_actions(
    manifest: Manifest, present: Mapping[str, int] | None, mirrored: Mapping[int, Manifest]
) -> list[Action]:
    """The order of one checkpoint's upload: the old manifest deleted first (a replaced step never shows an old
    manifest over new data), stale objects deleted, data objects (largest first: the long transfers start early),
    the manifest last.

    A file is copied server-side, not uploaded, when a complete mirrored step lists the same name with the same size
    and digest: the step it was carried from (:mod:`preempt.checkpoint.carry`) when it is there, else the newest.

    Args:
        manifest: The local checkpoint's manifest.
        present: The objects the mirror already holds at this step (name: size), or None.
        mirrored: The manifest of each complete step in the mirror.
    """
    actions: list[Action] = []
    present = present or {}
    if MANIFEST in present:
        actions.append(Action("delete", MANIFEST))
    stale = [n for n in sorted(present) if n != MANIFEST and n not in manifest.files and not n.endswith(PART_SUFFIX)]
    actions += [Action("delete", n) for n in stale]
    for name, digest in sorted(manifest.files.items(), key=lambda item: (-item[1].size, item[0])):
        source = copy_source(name, digest, manifest.step, mirrored)
        actions.append(Action("put", name) if source is None else Action("copy", name, source))
    actions.append(Action("manifest", MANIFEST))
    return actions


def copy_source(name: str, digest: FileDigest, step: int, mirrored: Mapping[int, Manifest]) -> int | None:
    """A complete mirrored step (not ``step``) holding ``name`` with these bytes, or None."""
    same = [s for s, m in mirrored.items() if s != step and m.files.get(name) == digest]
    if not same:
        return None
    return digest.carried_from if digest.carried_from in same else max(same)


def pull_candidates(mirrored: Iterable[int], local_newest: int | None) -> list[int]:
    """The mirror's complete steps a run should pull, newest first: those newer than the newest valid local
    checkpoint (all of them when there is none). The first that verifies is used; empty: resume from save_dir."""
    return sorted((s for s in mirrored if local_newest is None or s > local_newest), reverse=True)


def deletions(
    policy: RetentionPolicy,
    listing: Mapping[int, Mapping[str, int]],
    mirrored: Mapping[int, Manifest],
    *,
    pull_pending: bool = False,
    busy: Iterable[int] = (),
    trusted: Iterable[int] | None = None,
) -> list[int]:
    """The steps to delete from the mirror: the run's retention applied to the mirror's complete checkpoints as
    to save_dir (never the newest complete one), and debris (an incomplete step older than the newest complete: an
    upload that died). Nothing while a pull decision is pending; never a step in ``busy`` (being uploaded).

    A bucket may be shared or forged: only the steps up to the newest one the run trusts (it wrote it, or holds the
    same save locally) are counted and deleted; a step newer than that, which the run never verified, is neither
    kept in its place nor deleted.

    Args:
        policy: The run's retention.
        listing: Every step in the mirror (objects and sizes).
        mirrored: The manifest of each complete step.
        trusted: The steps the run trusts (None: all of them).
    """
    if trusted is not None:
        trusted = [s for s in trusted if s in mirrored]
        newest_trusted = max(trusted, default=None)
        if newest_trusted is None:
            return []
        mirrored = {s: m for s, m in mirrored.items() if s <= newest_trusted}
        listing = {s: o for s, o in listing.items() if s <= newest_trusted}
    if pull_pending or not mirrored:
        return []
    kept = select_kept(policy, (Kept(s, m.best_value) for s, m in mirrored.items()))
    kept.add(max(mirrored))
    newest = max(mirrored)
    skip = set(busy)
    doomed = {s for s in mirrored if s not in kept}
    doomed |= {s for s in listing if s not in mirrored and s < newest}
    return sorted(doomed - skip)


def undecided(
    policy: RetentionPolicy,
    mirrored: Mapping[int, Manifest],
    unread: Iterable[int],
    trusted: Iterable[int],
) -> list[int]:
    """The steps whose manifest :func:`deletions` needs read, newest first: those not read yet (``unread``) whose fate
    retention cannot tell without it. Up to the newest trusted step only (retention counts no newer one); a policy
    that keeps all, or ranks by a metric, needs every one; ``keep_last=K`` (and milestones at ``keep_every_steps``)
    only the unread steps with fewer than K complete steps known above them: below those, a step is deleted whether
    it is complete (not among the K newest) or not (debris). Given these as ``busy`` (kept for now),
    :func:`deletions` of what was read deletes nothing that reading every manifest would keep: a complete step it
    has not read can only push a known one further out of what is kept.

    Args:
        policy: The run's retention.
        mirrored: The manifest of each complete step read so far.
        unread: The steps whose listing shows a manifest not read yet.
        trusted: The steps the run trusts (:func:`deletions`).
    """
    top = max((s for s in trusted if s in mirrored), default=None)
    if top is None:
        return []
    steps = sorted((s for s in unread if s <= top), reverse=True)
    if policy.keep_last is None or policy.keep_best:
        return steps
    known = sorted(s for s in mirrored if s <= top)
    out = []
    for step in steps:
        above = len(known) - bisect.bisect_right(known, step)
        every = policy.keep_every_steps
        if above < policy.keep_last or (every and step % every == 0):
            out.append(step)
    return out


def stop_deadline(deadline: float, time_left: float | None) -> float:
    """Seconds a stop waits for its checkpoint's upload: ``mirror_deadline``, capped by a part of the time left
    before the process is killed (None: unknown, as under a plain SIGTERM)."""
    if time_left is None:
        return max(0.0, deadline)
    return max(0.0, min(deadline, TIME_LEFT_SHARE * time_left))
