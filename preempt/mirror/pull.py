"""A checkpoint of the mirror brought into a save_dir, with the same commit protocol as a local save.

The order (:func:`fetch`), the local half being :mod:`preempt.checkpoint.commit`'s protocol:

1. The step's ``manifest.json`` is read (capped at ``MAX_MANIFEST_BYTES``) and parsed by the strict parser
   (:meth:`Manifest.from_json`: JSON only, never pickle, names inside the checkpoint, sizes bounded); the listing
   must show every file it lists with its size.
2. ``mkdir save_dir/.tmp-step_N-<tag>``.
3. Each data file (up to ``PULL_THREADS`` at once): downloaded into the temporary directory (ranged and parallel
   for large objects, by the client), then its size and xxh3-128 checked against the manifest and ``fdatasync``.
   The client writes the parts of a parallel download out of order, so the digest is taken once the last part is
   in, from the page cache, before the file is made durable. A short, long or different file fails here: the
   temporary directory is discarded and the error names the object (the caller may try the next older checkpoint).
4. ``manifest.json``, the bytes read in 1., written and fdatasynced last.
5. The commit's steps 4-7: fsync the temporary directory, rename it to ``step_N``, fsync save_dir.

A transfer cut off mid-way (the process killed, the network gone) leaves a ``.tmp-`` directory, never a
``step_N``: the next start deletes it (:func:`preempt.checkpoint.commit.recover`) and the pull is redone.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .._log import duration
from ..checkpoint import aside, commit, deleter, files, hashed_io
from ..checkpoint.manifest import MAX_MANIFEST_BYTES, Manifest
from ..checkpoint.names import MANIFEST, checkpoint_name
from ..errors import CorruptCheckpointError, MirrorError, NoCheckpointError, PreemptError
from . import plan
from .store import MirrorStore
from .survey import Survey, Surveyor

log = logging.getLogger("preempt")

PULL_THREADS = 4  # files downloaded at once
ROOM_MARGIN = 256 << 20  # bytes a pull leaves free on the disk


@dataclasses.dataclass(frozen=True)
class Pulled:
    """A checkpoint brought from the mirror: where it is now, its step, the bytes downloaded and the seconds."""

    path: Path
    step: int
    bytes: int
    seconds: float
    failed: tuple[str, ...] = ()  # newer complete steps that did not verify (one message each)


def pull(
    store: MirrorStore,
    save_dir: str | os.PathLike[str],
    step: int | None = None,
    *,
    newer_than: int | None = None,
    replace: bool = False,
) -> Path:
    """Downloads a complete checkpoint of the mirror into ``save_dir``; returns its path there.

    Args:
        store: The mirror.
        save_dir: The local directory (created when missing).
        step: That step; None: the newest complete one, falling back to older ones when one fails verification.
        newer_than: As :func:`pull_newest` (with no ``step``).
        replace: As :func:`pull_newest`.

    Raises:
        NoCheckpointError: The mirror holds no complete checkpoint (of that step), or none verified.
        CorruptCheckpointError: ``step`` was given and an object does not match its manifest.
        MirrorError: The mirror cannot be reached.
    """
    if step is not None:
        surveyed = Surveyor(store).survey(wanted=[step])
        if step not in surveyed.manifests:
            raise NoCheckpointError(f"mirror {store.display}: {_absent(surveyed, step)}")
        return fetch(store, Path(save_dir), step, surveyed, replace=replace).path
    pulled = pull_newest(store, Path(save_dir), newer_than=newer_than, replace=replace)
    if pulled is None:
        raise NoCheckpointError(f"mirror {store.display}: no complete checkpoint")
    return pulled.path


def pull_newest(
    store: MirrorStore,
    save_dir: Path,
    *,
    newer_than: int | None = None,
    replace: bool = False,
    surveyed: Survey | None = None,
    surveyor: Surveyor | None = None,
    clock: Callable[[], float] = time.monotonic,
    check: Callable[[Path], object] | None = None,
) -> Pulled | None:
    """The newest complete checkpoint of the mirror that verifies, newer than ``newer_than``, pulled into
    ``save_dir``; None when the mirror has none newer. Manifests are read newest first, a round at a time, until one
    verifies (:meth:`Surveyor.newest_complete`): older steps, however many, cost nothing but their listing.

    ``surveyed``: a listing already made by ``surveyor`` (one is made when None).

    ``check``: called with each pulled checkpoint's path; a CorruptCheckpointError from it (a file whose digest
    matches its forged manifest but whose format does not hold: a pickle, an absurd tensor, a JSON bomb) moves that
    checkpoint to ``quarantine/`` and the next older one is tried, as for a digest that does not match.

    Raises:
        NoCheckpointError: There were candidates and none verified (each one's reason in ``corrupt``).
        MirrorError: The mirror cannot be reached.
    """
    surveyor = surveyor if surveyor is not None else Surveyor(store)
    surveyed = surveyed if surveyed is not None else surveyor.survey(wanted=())
    failed: list[str] = []
    for step in surveyor.newest_complete(surveyed, newer_than):
        try:
            got = fetch(store, save_dir, step, surveyed, replace=replace, clock=clock)
            if check is not None:
                _checked(save_dir, got.path, check)
        except CorruptCheckpointError as e:
            failed.append(str(e))
            log.warning("%s; trying the next older checkpoint of the mirror", e)
            continue
        return dataclasses.replace(got, failed=tuple(failed))
    if failed:
        raise NoCheckpointError(
            f"mirror {store.display}: no complete checkpoint verified ({len(failed)} tried): {failed[-1]}", failed
        )
    return None


def fetch(
    store: MirrorStore,
    save_dir: Path,
    step: int,
    surveyed: Survey,
    *,
    replace: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> Pulled:
    """One complete mirrored step into ``save_dir`` (the module's protocol).

    Args:
        replace: A ``step_N`` already in ``save_dir`` is moved to ``quarantine/`` (the run pulls only steps newer
            than its newest valid checkpoint: one there is broken). False: it is an error.

    Raises:
        CorruptCheckpointError: The manifest or an object does not match (the message names the object).
        MirrorError: The mirror cannot be reached; FileExistsError: ``step_N`` exists and not ``replace``.
    """
    start = clock()
    name = checkpoint_name(step)
    where = store.where(step, MANIFEST)
    try:
        data = store.read(step, MANIFEST, MAX_MANIFEST_BYTES)
    except MirrorError as e:
        raise CorruptCheckpointError(str(e)) if e.errno == errno.ENOENT else e from None
    try:
        manifest = Manifest.from_json(data, where)
    except ValueError as e:
        raise CorruptCheckpointError(str(e)) from None
    objects = surveyed.listing.get(step, {})
    if manifest.step != step or not plan.is_complete(objects, manifest):
        raise CorruptCheckpointError(f"{where}: changed since it was listed, or lists objects the mirror lacks")
    save_dir.mkdir(parents=True, exist_ok=True)
    final = save_dir / name
    part = _part_here(final, manifest)
    if part is not None:
        pass  # this node's part of that save: its files are taken over, and it is replaced by the whole
    elif final.exists() or final.is_symlink():
        if not replace:
            raise FileExistsError(f"{final} exists; move it away to pull step {step} from {store.display}")
        aside.quarantine(save_dir, final, f"{final}: replaced by the mirror's copy of step {step}")
    _room(save_dir, manifest, where, part)
    tmp = commit.new_tmp_dir(save_dir, name)
    try:
        # the files side by side: one's digest and fdatasync overlap another's transfer (each large one is also
        # fetched in parallel parts by the client); the first failure is raised, the files not started are not
        with ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="preempt-pull") as pool:
            jobs = [pool.submit(_download, store, step, f, e, tmp / f, part) for f, e in sorted(manifest.files.items())]
            try:
                for job in jobs:
                    job.result()
            finally:
                for job in jobs:
                    job.cancel()
        total = sum(e.size for e in manifest.files.values())
        hashed_io.write_file(tmp / MANIFEST, [data])
        path, replaced = commit.commit_dir(save_dir, tmp, name)
    except BaseException:
        files.discard_tmp(tmp)
        raise
    if replaced is not None:  # a step_N that appeared meanwhile; ours is committed
        deleter.remove_tree(replaced)
    seconds = clock() - start
    log.info(
        "pulled step %d from %s: %d files, %s in %s",
        step,
        store.display,
        len(manifest.files),
        _size(total),
        duration(seconds),
    )
    return Pulled(path, step, total, seconds)


def _room(save_dir: Path, manifest: Manifest, where: str, part: Path | None) -> None:
    """The bytes a pull would write fit the disk (with a margin): the manifest declares the sizes, so a forged one
    could otherwise fill the disk the run writes its checkpoints to. CorruptCheckpointError (the next older step is
    tried) naming the need and the room."""
    need = sum(d.size for n, d in manifest.files.items() if part is None or not (part / n).exists())
    free = shutil.disk_usage(save_dir).free
    if need > free - ROOM_MARGIN:
        raise CorruptCheckpointError(
            f"{where}: declares {_size(need)} to download; {save_dir} has {_size(free)} free (keeping"
            f" {_size(ROOM_MARGIN)} spare)"
        )


def _checked(save_dir: Path, path: Path, check: Callable[[Path], object]) -> None:
    """``check(path)``; a pulled checkpoint it refuses is moved to ``quarantine/`` before the error goes on."""
    try:
        check(path)
    except CorruptCheckpointError as e:
        aside.quarantine(save_dir, path, f"{e}; pulled from the mirror")
        raise


def _part_here(final: Path, whole: Manifest) -> Path | None:
    """``final`` when it is this node's part of the save ``whole`` describes (same step and time, its files among the
    whole's with the same digests): the pull takes its files over instead of downloading them."""
    try:
        here = files.read_manifest(final / MANIFEST)
    except (OSError, ValueError, PreemptError):
        return None
    same = here.step == whole.step and here.created == whole.created
    if here.part is None or not same or any(whole.files.get(n) != d for n, d in here.files.items()):
        return None
    return final


def _download(
    store: MirrorStore, step: int, file: str, expected: hashed_io.FileDigest, path: Path, part: Path | None = None
) -> None:
    """Step 3 for one file: downloaded, checked, made durable; CorruptCheckpointError naming the object if not.
    A file of this node's ``part`` of the same save is linked instead when it still has its digest."""
    if part is not None and _reuse(part / file, expected, path):
        return
    got = store.get(step, file, path, expected.size)  # hashed as it was written, where the store streams it
    files.regular_file(path)
    if got is None:
        got = hashed_io.hash_file(path)
    if got.size != expected.size:
        raise CorruptCheckpointError(f"{store.where(step, file)}: size {got.size} bytes, manifest says {expected.size}")
    if got.xxh3_128 != expected.xxh3_128:
        raise CorruptCheckpointError(
            f"{store.where(step, file)}: xxh3 mismatch (manifest {expected.xxh3_128}, object {got.xxh3_128};"
            f" {got.size} bytes)"
        )
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        getattr(os, "fdatasync", os.fsync)(fd)
    finally:
        os.close(fd)


def _reuse(local: Path, expected: hashed_io.FileDigest, path: Path) -> bool:
    """Hard-links ``local`` at ``path`` when it is a regular file with ``expected``'s size and digest."""
    try:
        files.regular_file(local)
        got = hashed_io.hash_file(local)
        if (got.size, got.xxh3_128) != (expected.size, expected.xxh3_128):
            return False
        os.link(local, path)
    except (OSError, CorruptCheckpointError):
        return False
    return True


def _absent(surveyed: Survey, step: int) -> str:
    if step in surveyed.problems:
        return surveyed.problems[step]
    if step in surveyed.listing:
        return f"step {step} is incomplete (an upload that did not finish)"
    have = ", ".join(str(s) for s in surveyed.complete[-5:]) or "none"
    return f"no checkpoint of step {step} (complete: {have})"


def _size(n: int) -> str:
    size = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} bytes"
