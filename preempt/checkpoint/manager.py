"""CheckpointManager: write, find, verify, load and prune checkpoints in one directory.

Usable on its own, without :class:`preempt.PreemptibleRun`::

    manager = CheckpointManager("runs/exp1", keep_last=3)
    info = manager.save_state(step=100, model=model, optimizer=opt)
    info, loaded = manager.load("latest")

The commit protocol is in :mod:`preempt.checkpoint.commit`; the file layout of one
checkpoint in :mod:`preempt.checkpoint.state`. Deleting is slow (``bench/README.md``,
"Figures once kept in docstrings"), so pruned and replaced checkpoints are first renamed out of
sight (fast, atomic) and then deleted by a background thread.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .. import _testing
from ..errors import CheckpointError, CheckpointUnreadableError, CorruptCheckpointError, NoCheckpointError
from . import aside, cancel, commit, deleter, hashed_io, names, recycle
from . import completion as marker
from .carry import Carrier, CarryOptions
from .files import FileCheck, check_file, discard_tmp, parse_tensors, present, read_all, read_manifest
from .hashed_io import FileDigest
from .manifest import Cursor, Manifest, Part
from .names import COMPLETE, MANIFEST, SUPERSEDED
from .retention import BestRanking, Kept, RetentionPolicy, rank_best, select_kept  # noqa: F401  (rank_best: here too)
from .write import write_payload, written

if TYPE_CHECKING:  # torch: imported by the methods that read or write tensors, not by ls or verify
    import torch

    from . import state
    from .lock import DirLock

SHARDED_INDEX = "dcp_metadata.json"  # preempt.cluster.sharded.METADATA: the checkpoint holds DCP-written sharded state

log = logging.getLogger("preempt")

Status = Literal["valid", "corrupt", "incomplete", "unreadable"]
Selector = Literal["latest", "best"] | int


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory as discovery sees it.

    ``status`` is ``"valid"`` when the manifest parses and passes its own
    checksum; the data files are only hashed by :meth:`CheckpointManager.verify`
    and on load. ``"unreadable"``: the manifest could not be read for a reason of the environment (permission,
    memory, I/O), not damage; such a checkpoint may be valid: never moved aside, and a resume stops at it.
    """

    path: Path
    step: int
    status: Status
    manifest: Manifest | None = None
    problem: str | None = None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def valid(self) -> Manifest:
        """The manifest of a checkpoint that discovery found valid.

        Raises:
            CorruptCheckpointError: The checkpoint was not found valid (no manifest to read).
        """
        if self.status != "valid" or self.manifest is None:
            raise CorruptCheckpointError(f"{self.path}: {self.problem or 'not a valid checkpoint'}")
        return self.manifest


@dataclasses.dataclass(frozen=True)
class Pending:
    """A checkpoint taken but not yet written: this process's own files are written from a staged copy later, by
    the background writer (:meth:`CheckpointManager.finish`).

    ``tmp``: the temporary directory the other ranks' files are already durable in (``files``, name -> digest), None
    for a process alone; ``part``: with nodes that share no save_dir, node 0's part (the other nodes' files listed).
    """

    tmp: Path | None = None
    files: Mapping[str, FileDigest] = dataclasses.field(default_factory=dict)
    part: Part | None = None


class CheckpointManager:
    """Writes, discovers, verifies, loads and prunes the checkpoints of one ``save_dir``.

    Args:
        save_dir: The directory; created if missing.
        keep_last: Keep the newest N valid checkpoints (None keeps all).
        keep_best: Also keep the N best by ``best_metric``.
        keep_every_steps: Also keep every checkpoint at a multiple of this step.
        best_metric: The metric that ranks "best" checkpoints.
        best_mode: ``"min"`` or ``"max"``.
        owner: When True (a run that owns ``save_dir``), broken checkpoints are
            moved to ``quarantine/`` as they are found; when False (tools that
            only look), nothing on disk is changed.
        retention: The keep_* and best_* options as one RetentionPolicy
            (a run passes its own); given, it replaces them.
        recycle_files: Keep the files of one pruned checkpoint as
            ``.recycle-*`` for the next save to write over in place (on many
            disks far faster than writing into new blocks; see
            :mod:`preempt.checkpoint.commit`), instead of deleting them.
        carry_unchanged: A checkpoint hard-links the tensor files that have not changed since the previous
            one instead of writing them (True, or :class:`~preempt.checkpoint.carry.CarryOptions`); the
            model's frozen parameters go to a file of their own (:mod:`preempt.checkpoint.carry`). Applies to
            :meth:`save_state` and to payloads passed through :meth:`mark_carried`; False writes every file.
        lock: The run's lock of ``save_dir`` (:class:`~preempt.checkpoint.lock.DirLock`): before each write into
            the save_dir the manager checks that the directory and its lock file are still the ones locked, so
            that a run never writes into a save_dir replaced under it. None (a manager used alone): nothing checked.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        *,
        keep_last: int | None = 2,
        keep_best: int = 0,
        keep_every_steps: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        owner: bool = True,
        retention: RetentionPolicy | None = None,
        recycle_files: bool = True,
        carry_unchanged: bool | CarryOptions = True,
        lock: DirLock | None = None,
    ) -> None:
        self.save_dir = Path(save_dir)
        self.lock = lock
        self.carrier = Carrier(CarryOptions.of(carry_unchanged))
        self.retention = retention or RetentionPolicy(
            keep_last=keep_last,
            keep_best=keep_best,
            keep_every_steps=keep_every_steps,
            metric=best_metric,
            mode=best_mode,
            recycle=recycle_files,
        )
        self._owner = owner
        self.completion_problem: str | None = None  # why complete.json was ignored, by the last completion()
        self._deleter = deleter.Deleter()
        self._index: dict[int, Kept] = {}
        self._indexed = False

    @property
    def owner(self) -> bool:
        """This manager may change the save_dir (quarantine, prune, recycle): opened as its owner, or holding its
        lock (a node's leader that took the lock of its own save_dir, when the ranks' nodes share none)."""
        return self._owner or (self.lock is not None and self.lock.held)

    # ----------------------------------------------------------------- start

    def prepare(self) -> None:
        """:meth:`check_dir`, then :meth:`recover`."""
        self.check_dir()
        self.recover()

    def check_dir(self) -> None:
        """Creates ``save_dir`` when missing and proves that it is a writable directory.

        Raises:
            CheckpointError: ``save_dir`` is not a writable directory (said now,
                not at the first checkpoint hours later).
        """
        d = self.save_dir
        if d.exists() and not d.is_dir():
            raise CheckpointError(f"save_dir {d}: expected a directory, found a file")
        try:
            d.mkdir(parents=True, exist_ok=True)
            probe = commit.new_tmp_dir(d, "probe")
            probe.rmdir()
        except OSError as e:
            raise CheckpointError(f"save_dir {d}: not a writable directory ({e.strerror or e})") from e

    def recover(self) -> None:
        """Cleans the leftovers of interrupted writes (only while no other process writes here)."""
        d = self.save_dir
        found = commit.recover(d)
        for name in found.restored:
            log.warning("%s: restored %s from an interrupted replacement", d, name)
        # A pool to delete is renamed out of reach first: a save must never take a directory being deleted.
        pools = recycle.pools(d)
        extra = pools[1:] if self.retention.recycle else pools
        self._deleter.submit(found.to_delete + recycle.strays(d) + [commit.trash(d, p) for p in extra])
        self._indexed = False

    # ------------------------------------------------------------- discovery

    def list(self) -> list[CheckpointInfo]:
        """Every ``step_*`` directory, newest first, with its manifest parsed (not its data hashed)."""
        if not self.save_dir.is_dir():
            return []
        found = []
        for entry in os.listdir(self.save_dir):
            step = names.parse_checkpoint_name(entry)
            if step is not None:
                found.append(self._inspect(self.save_dir / entry, step))
        found.sort(key=lambda c: c.step, reverse=True)
        if self.owner:
            self._index = {c.step: _kept(c.manifest) for c in found if c.status == "valid" and c.manifest}
            self._indexed = True
        return found

    def _inspect(self, path: Path, step: int) -> CheckpointInfo:
        if path.is_symlink() or not path.is_dir():
            return CheckpointInfo(path, step, "corrupt", problem=f"{path}: not a directory (or a symlink)")
        mpath = path / MANIFEST
        try:
            manifest = read_manifest(mpath)
        except FileNotFoundError:
            return CheckpointInfo(path, step, "incomplete", problem=f"{mpath}: missing")
        except CorruptCheckpointError as e:
            return CheckpointInfo(path, step, "corrupt", problem=str(e))
        except CheckpointUnreadableError as e:
            return CheckpointInfo(path, step, "unreadable", problem=str(e))
        if manifest.step != step:
            return CheckpointInfo(
                path, step, "corrupt", manifest, f"{mpath}: records step {manifest.step}, directory says {step}"
            )
        return CheckpointInfo(path, step, "valid", manifest)

    def check_files(self, info: CheckpointInfo, files: Iterable[str] | None = None) -> builtins.list[FileCheck]:
        """Re-hashes and parses the checkpoint's files: one :class:`FileCheck` per file the manifest lists.

        Each file is hashed in its memory mapping (:func:`preempt.checkpoint.hashed_io.read_file`):
        no copy into fresh memory, unlike ``readinto`` a buffer (``python bench/bench_verify.py``). The same
        mapping is then parsed, so a re-signed file of another kind (a pickle)
        is reported even though its digest matches.

        Args:
            info: The checkpoint, as :meth:`list` found it (with a manifest).
            files: Only these file names (default: every file the manifest lists).
        """
        if info.manifest is None:
            raise CorruptCheckpointError(info.problem or f"{info.path}: no manifest")
        wanted = None if files is None else set(files)
        return [
            check_file(info.path / name, expected)
            for name, expected in info.manifest.files.items()
            if wanted is None or name in wanted
        ]

    def verify(self, info: CheckpointInfo, files: Iterable[str] | None = None) -> builtins.list[str]:
        """Re-hashes (and parses) the checkpoint's files; one message per problem (empty: all good).

        Each message names the file's path, then what the manifest promises and
        what the file holds: both full digests, both sizes, or "missing".
        """
        if info.manifest is None:
            return [info.problem or f"{info.path}: no manifest"]
        return [c.message for c in self.check_files(info, files) if c.message is not None]

    def quarantine(self, info: CheckpointInfo, problem: str) -> Path | None:
        """Moves a broken checkpoint to ``quarantine/``, or sets it aside in place (owner only; :mod:`.aside`)."""
        self._index.pop(info.step, None)
        if not self.owner or not info.path.exists():
            return None
        dest = aside.quarantine(self.save_dir, info.path, problem)
        if dest is not None:
            log.warning("%s; moved to %s", problem, dest)
        return dest

    def supersede(self, infos: Iterable[CheckpointInfo]) -> builtins.list[Path]:
        """Moves checkpoints of an abandoned timeline to ``superseded/`` (nothing is deleted)."""
        moved = []
        for info in infos:
            self._index.pop(info.step, None)
            if info.path.exists():
                moved.append(aside.move_aside(self.save_dir, info.path, SUPERSEDED))
        return moved

    # ------------------------------------------------------------------ load

    def candidates(
        self, selector: Selector, infos: builtins.list[CheckpointInfo] | None = None
    ) -> builtins.list[CheckpointInfo]:
        """Valid checkpoints in the order to try for ``selector`` (best first, see :func:`rank_best`).

        Raises:
            NoCheckpointError: For "best", when the newest manifest's ``best.mode`` is neither min nor max.
        """
        infos = self.list() if infos is None else infos
        valid = [c for c in infos if c.status == "valid" and (c.manifest is None or c.manifest.part is None)]
        if selector == "latest":
            return valid
        if selector == "best":
            best = rank_best(valid, self.retention.mode)
            if best.problem:
                raise NoCheckpointError(f"{self.save_dir}: no 'best' checkpoint ({best.problem})", [best.problem])
            return best.ranked
        if isinstance(selector, int) and not isinstance(selector, bool):
            return [c for c in valid if c.step == selector]
        raise ValueError(f"resume: expected 'latest', 'best' or a step number, got {selector!r}")

    def load(
        self,
        selector: Selector = "latest",
        *,
        weights_only: bool = False,
        rank: int = 0,
        check: Callable[[CheckpointInfo, state.Loaded], object] | None = None,
        direct: bool = True,
    ) -> tuple[CheckpointInfo, state.Loaded]:
        """Loads the first checkpoint for ``selector`` whose files all verify (and that ``check`` accepts).

        ``direct``: large files not in the page cache are read past it (:meth:`read`); False where other processes
        of this machine read the same checkpoint next (the other ranks), which the page cache then serves.

        A corrupt candidate is reported (file and both digests), moved aside
        when this manager owns the directory, and the next one is tried. So is
        one whose content ``check`` refuses with CorruptCheckpointError: a
        re-signed checkpoint passes every digest (preempt.run.restore.check_restored).
        One that cannot be read (an environment's error, not damage) stops it.

        Raises:
            NoCheckpointError: None matches, or every match is corrupt.
            CheckpointUnreadableError: A checkpoint that comes before the one loaded (for "latest": a newer one;
                for "best": any; for a step: that one) cannot be read; nothing was moved aside.
        """
        infos = self.list()
        if self.owner:
            for c in infos:
                if c.status in ("corrupt", "incomplete"):
                    self.quarantine(c, c.problem or f"{c.path}: broken")
        # Checkpoints whose manifest is broken could have been the one asked for: say what is wrong with them.
        tried = [
            c.problem or f"{c.path}: {c.status}"
            for c in infos
            if c.status in ("corrupt", "incomplete") and (selector == "latest" or c.step == selector)
        ]
        blocking = [c for c in infos if c.status == "unreadable" and selector in ("latest", "best", c.step)]
        for info in self.candidates(selector, infos):
            if any(c.step > info.step or selector != "latest" for c in blocking):
                break
            try:
                loaded = self.read(info, weights_only=weights_only, rank=rank, direct=direct)
                if check is not None:
                    check(info, loaded)
                return info, loaded
            except CorruptCheckpointError as e:
                tried.append(str(e))
                if self.owner:
                    self.quarantine(info, f"{e}; falling back to an older checkpoint")
                else:
                    log.warning("%s; trying an older checkpoint", e)
        if blocking:
            first = blocking[0]
            raise CheckpointUnreadableError(
                f"{first.problem or first.path}. Not resumed from an older checkpoint instead: {first.name} may be"
                " valid (to go on without it, move it out of the save_dir)"
            )
        missing = {"latest": "no valid checkpoint", "best": "no valid 'best' checkpoint"}
        what = missing[selector] if isinstance(selector, str) else f"no valid checkpoint at step {selector}"
        detail = f" ({len(tried)} corrupt: {'; '.join(tried)})" if tried else ""
        raise NoCheckpointError(f"{self.save_dir}: {what}{detail}", corrupt=tried)

    def read(
        self, info: CheckpointInfo, *, weights_only: bool = False, rank: int = 0, direct: bool = True
    ) -> state.Loaded:
        """Reads and verifies one checkpoint's files into memory (no pickle), several at once
        (:func:`preempt.checkpoint.files.read_all`).

        ``direct``: a large file not in the page cache is read ``O_DIRECT`` into the memory its tensors keep, faster
        cold than mapped (``bench/README.md``, "A restart's restore"). False reads through the page cache (for the
        next process to find it there).

        A checkpoint written by several ranks lists each rank's own files:
        every one of them must verify, and ``rank``'s random generators (when
        the checkpoint has that rank) replace rank 0's in the returned tree.

        Raises:
            CorruptCheckpointError: A file is missing, has the wrong size or
                digest, or is malformed; the message names it.
        """
        from . import codec, state

        manifest = info.manifest
        if manifest is None:
            raise CorruptCheckpointError(info.problem or f"{info.path}: no manifest")
        for name, expected in manifest.files.items():  # valid = every listed file there, as listed (as verify)
            problem = present(info.path / name, expected)
            if problem is not None:
                raise CorruptCheckpointError(problem)
        sharded = SHARDED_INDEX in manifest.files or any(state.is_shard_file(f) for f in manifest.files)
        if sharded and weights_only:
            raise CorruptCheckpointError(
                f"{info.path}: holds sharded state (FSDP/DTensor); weights_only loading of it is not supported"
            )
        wanted = [state.MODEL_FILE] if weights_only else [state.MODEL_FILE, state.STATE_FILE, state.STATE_JSON]
        if sharded:  # the model and optimizer tensors are the ranks' pieces
            wanted = [state.STATE_FILE, state.STATE_JSON]
        for name in wanted:
            if name not in manifest.files:
                raise CorruptCheckpointError(f"{info.path / MANIFEST}: lists no {name}")
        if state.BASE_FILE in manifest.files and not sharded:  # the frozen base, apart (preempt.checkpoint.carry)
            wanted.append(state.BASE_FILE)
        if sharded:
            wanted += sorted(f for f in manifest.files if state.is_shard_file(f))
        if not weights_only:
            wanted += sorted(f for f in manifest.files if f.startswith("rank_"))  # small: each rank's RNG
        # DCP's files are only checked here (DCP reads them itself afterwards): every one verifies before any is read
        checked = sorted(f for f in manifest.files if sharded and (f == SHARDED_INDEX or f.endswith(".distcp")))
        bufs = read_all(info.path, manifest.files, wanted, checked, direct=direct)
        model = {} if sharded else parse_tensors(bufs[state.MODEL_FILE], info.path / state.MODEL_FILE)[0]
        pieces = []
        for fname in sorted(f for f in manifest.files if sharded and state.is_shard_file(f)):
            pieces.append((str(info.path / fname), *parse_tensors(bufs[fname], info.path / fname)))
        if state.BASE_FILE in bufs:
            base = parse_tensors(bufs[state.BASE_FILE], info.path / state.BASE_FILE)[0]
            twice = sorted(model.keys() & base.keys())
            if twice:
                where = info.path / state.BASE_FILE
                raise CorruptCheckpointError(f"{where}: holds {twice[0]!r}, as {state.MODEL_FILE} does")
            model.update(base)
        tree: dict[str, Any] = {}
        if not weights_only:
            tensors, _ = parse_tensors(bufs[state.STATE_FILE], info.path / state.STATE_FILE)
            json_where = str(info.path / state.STATE_JSON)
            try:
                tree = codec.decode(codec.loads(bufs[state.STATE_JSON], json_where), tensors, json_where)
            except ValueError as e:
                raise CorruptCheckpointError(str(e)) from None
            if not isinstance(tree, dict):
                raise CorruptCheckpointError(f"{json_where}: expected a JSON object")
            tree = state.own_small_state(tree)
            own = state.rank_files(rank)
            if rank:
                tree.pop("data", None)  # rank 0's loader position is not this rank's; its own file has its own
            if rank and own[1] in manifest.files:
                fname = own[1]
                if own[0] not in bufs:
                    raise CorruptCheckpointError(f"{info.path / MANIFEST}: lists {fname} but no {own[0]}")
                rank_tensors, _ = parse_tensors(bufs[own[0]], info.path / own[0])
                try:
                    rank_tree = codec.decode(codec.loads(bufs[fname], str(info.path / fname)), rank_tensors, fname)
                    own_tree = state.own_small_state(rank_tree)
                    tree["rng"] = own_tree["rng"]
                    tree["data"] = own_tree.get("data")  # its own loader's position, not rank 0's
                except (ValueError, KeyError, TypeError) as e:
                    raise CorruptCheckpointError(f"{info.path / fname}: not a rank's state ({e})") from None
        # The tensors view the files' bytes, read O_DIRECT into memory of this process's own or mapped: the model's
        # weights are copied into the model; the optimizer's tensors become its state as they are, but those that
        # view a mapping, which state.apply gives memory of their own unless loading moved them (to a GPU).
        mapped = tuple((b.ctypes.data, b.nbytes) for b in bufs.values() if b.nbytes and hashed_io.is_mapping(b))
        return state.Loaded(str(info.path), model, tree, mapped, sharded, tuple(pieces))

    # ------------------------------------------------------------------ save

    def save(self, payload: state.Payload, manifest: Manifest) -> CheckpointInfo:
        """Writes a checkpoint with the commit protocol, then prunes.

        ``manifest.files`` is filled in here. On any failure the partial
        directory is removed and the previous checkpoints are untouched.
        """
        if not self.save_dir.is_dir():  # "created if missing", also without a run (save_state)
            self.check_dir()
        return self.save_into(self.new_tmp_dir(manifest.step), payload, manifest)

    def _check_lock(self) -> None:
        """Raises :class:`~preempt.errors.LockLostError` when the save_dir or its lock file is not the one locked
        (nothing is checked without a lock, or before it is taken)."""
        if self.lock is not None:
            self.lock.check()

    def finish(self, pending: Pending, payload: state.Payload, manifest: Manifest) -> CheckpointInfo:
        """Writes a :class:`Pending` checkpoint's own files from ``payload`` (a staged copy) and commits it."""
        if pending.tmp is None:
            return self.save(payload, manifest)
        return self.save_into(pending.tmp, payload, dataclasses.replace(manifest, part=pending.part), pending.files)

    def reserve(self, sizes: Mapping[str, int]) -> Path:
        """Writes a pool of files ahead for the saves to write over (:func:`preempt.checkpoint.recycle.reserve`)."""
        self._check_lock()  # never into a save_dir replaced under the run
        return recycle.reserve(self.save_dir, sizes)

    def new_tmp_dir(self, step: int, *, reuse: bool = True) -> Path:
        """Step 1 of the commit protocol for a checkpoint of ``step``: recycled files when there are some.

        ``reuse=False`` for a directory that others' code writes into (DCP's
        shards): only :func:`hashed_io.write_file` knows how to write over a recycled file.
        """
        self._check_lock()  # nothing written into a save_dir replaced under the run holding it
        tmp = commit.tmp_dir_path(self.save_dir, names.checkpoint_name(step))
        if reuse and self.owner and self.retention.recycle and recycle.take(self.save_dir, tmp):
            return tmp
        tmp.mkdir()
        return tmp

    def new_tmp_dir_named(self, name: str) -> Path:
        """Step 1 under a name another process chose (rank 0, for the part of a node with a save_dir of its own)."""
        self._check_lock()
        if not name.startswith(names.TMP_PREFIX) or "/" in name:
            raise ValueError(f"{name!r} is not the name of a checkpoint's temporary directory")
        tmp = self.save_dir / name
        tmp.mkdir()
        return tmp

    def discard(self, tmp: Path, *, cancelled: bool = False) -> None:
        """Drops a failed or cancelled write.

        A cancelled write's files (a stop cancelled a periodic write) are kept
        for the next save, the stop's, to write over when recycling. A failed
        write's are removed at once: after a full disk or an I/O error the
        space goes back to everyone.
        """
        if cancelled and self.owner and self.retention.recycle:
            commit.stage("discard")
            with contextlib.suppress(OSError):  # not renamed: removed below
                recycle.give(self.save_dir, tmp)
                # One pool at a time: the one with the most to write over stays (a whole pruned checkpoint, not a part).
                self._deleter.submit([commit.trash(self.save_dir, p) for p in recycle.pools(self.save_dir)[1:]])
                return
        discard_tmp(tmp)

    def save_into(
        self, tmp: Path, payload: state.Payload, manifest: Manifest, files: Mapping[str, FileDigest] | None = None
    ) -> CheckpointInfo:
        """Writes ``payload`` into ``tmp``, then commits it with ``files`` (already durable there) and its own.

        On any failure ``tmp`` is removed.
        """
        try:
            _testing.reach("write", tmp)
            own = write_payload(tmp, payload, durable=False)  # synced with the manifest, all at once
        except BaseException as e:
            self.discard(tmp, cancelled=isinstance(e, cancel.WriteCancelled))
            raise
        return self.commit(tmp, manifest, {**(files or {}), **own}, unsynced=written(own))

    def commit(
        self, tmp: Path, manifest: Manifest, files: Mapping[str, FileDigest], *, unsynced: Iterable[str] = ()
    ) -> CheckpointInfo:
        """Writes the manifest of ``files`` (already durable in ``tmp``, but for those named ``unsynced``, which are
        synced with it), renames ``tmp`` into place, prunes.

        On failure before the rename ``tmp`` is removed; a checkpoint that was
        renamed into place stays (its files are all durable).
        """
        name = names.checkpoint_name(manifest.step)
        if not self._indexed:
            self.list()
        ours = manifest.step in self._index  # any other step_N there is quarantined below, never deleted
        try:
            commit.stage("before_manifest")
            manifest = dataclasses.replace(manifest, files=dict(files))
            recycle.drop_extra(tmp, [*files, MANIFEST])  # a recycled directory's files the new one does not list
            hashed_io.write_file(tmp / MANIFEST, [manifest.to_json()], recycle=True, sync=False)
            self._check_lock()  # the save_dir moved or replaced under the run holding it: no rename
            final, replaced = commit.commit_dir(self.save_dir, tmp, name, [tmp / f for f in (*unsynced, MANIFEST)])
        except BaseException as e:
            self.discard(tmp, cancelled=isinstance(e, cancel.WriteCancelled))
            raise
        self.carrier.durable(final, manifest.step, manifest.files)
        if replaced is not None and ours:
            # out of recovery's sight before the slow delete: a start that meets a ``.replaced-`` copy whose
            # step_N has since gone (pruned) would rename the half-deleted copy back
            self._deleter.submit([commit.trash(self.save_dir, replaced)])
        elif replaced is not None:
            problem = f"{final}: replaced a checkpoint of that step that was not valid"
            log.warning("%s; moved to %s", problem, aside.quarantine(self.save_dir, replaced, problem, name) or "-")
        self._index[manifest.step] = _kept(manifest)
        self.prune()
        return CheckpointInfo(final, manifest.step, "valid", manifest)

    def save_state(
        self,
        *,
        step: int,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: state.Stateful | None = None,
        scaler: state.Stateful | None = None,
        tracked: Mapping[str, state.Stateful] | None = None,
        user_state: Mapping[str, Any] | None = None,
        reason: str = "manual",
    ) -> CheckpointInfo:
        """Saves objects directly (no RNG, no cursor): the manager used without a run."""
        from . import codec, state

        components = state.Components(model, optimizer, scheduler, scaler, dict(tracked or {}))
        run_state = {"user": dict(user_state or {})}
        codec.check_json(run_state["user"], "user_state")
        manifest = Manifest(step=step, cursor=Cursor(), reason=reason, created=time.time(), files={})
        payload = state.capture(components, run_state, group_frozen=self.carrier.enabled)
        return self.save(self.mark_carried(payload, step), manifest)

    def committed(self, info: CheckpointInfo) -> None:
        """Another process (rank 0) committed ``info``, which holds files this one wrote: the next checkpoint may
        carry them (:meth:`Carrier.durable`)."""
        if info.manifest is not None:
            self.carrier.durable(info.path, info.step, info.manifest.files)

    def mark_carried(self, payload: state.Payload, step: int, *, read_later: Collection[str] = ()) -> state.Payload:
        """``payload`` at the step, before any staging copy: its frozen base carried when its live bytes are those of
        the last durable copy, and hashed at the step when a writer will read it after the step (``read_later``)
        (:meth:`Carrier.mark_carried`); the checkpoint of ``step`` then records what it was made from when committed."""
        return self.carrier.mark_carried(payload, step, read_later=read_later)

    def loaded(self, info: CheckpointInfo, live: state.Payload) -> builtins.list[str]:
        """After a resume from ``info``: its tensor files that the live tensors (``live``, captured right after the
        load) match become what the next checkpoint may carry. Only checkpoints of this save_dir (a hard link into
        another run's directory would tie the two together). Returns the file names."""
        if info.manifest is None or info.path.parent.resolve() != self.save_dir.resolve():
            self.carrier.loaded(info.path, {}, live, info.step)
            return []
        return self.carrier.loaded(info.path, info.manifest.files, live, info.step)

    # ----------------------------------------------------------------- prune

    def prune(self) -> builtins.list[int]:
        """Applies the retention policy to valid checkpoints; returns the pruned steps.

        Victims are renamed out of sight at once and deleted in the background.
        """
        if not self.owner:
            raise CheckpointError("prune: this manager was opened read-only (owner=False)")
        self._check_lock()
        if not self._indexed:
            self.list()
        keep = select_kept(self.retention, self._index.values())
        victims = sorted(s for s in self._index if s not in keep)
        doomed = []
        recycled = not self.retention.recycle
        for s in sorted(victims, reverse=True):  # the newest victim is the likeliest to match the next save's files
            path = self.save_dir / names.checkpoint_name(s)
            del self._index[s]
            if not path.is_dir():
                continue
            if not recycled:
                # One pool at a time: an unused older one goes (renamed first: a save must never take it mid-delete).
                doomed += [commit.trash(self.save_dir, p) for p in recycle.pools(self.save_dir)]
                recycle.give(self.save_dir, path)
                recycled = True
            else:
                doomed.append(commit.trash(self.save_dir, path))
        self._deleter.submit(doomed)
        return victims

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for background deletions; False when ``timeout`` passed first."""
        return self._deleter.wait(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Finishes background deletions (up to ``timeout``) and stops the deleting thread."""
        return self._deleter.close(timeout)

    # ------------------------------------------------------------- complete

    def mark_complete(self, info: CheckpointInfo) -> None:
        """Records that the run finished with checkpoint ``info``."""
        self._check_lock()
        doc = marker.record(info, time.time())
        commit.write_atomic(self.save_dir / COMPLETE, [json.dumps(doc, indent=1).encode() + b"\n"])

    def completion(self) -> dict[str, Any] | None:
        """The content of ``complete.json`` when it is believed (:func:`~preempt.checkpoint.completion.read`), or
        None: a marker that is not ours, or that does not name a valid checkpoint of this save_dir as the run wrote
        it, is logged and ignored (``completion_problem`` says why); the run's own replaces it."""
        doc, self.completion_problem = marker.read(self.save_dir / COMPLETE, self.list)
        if self.completion_problem is not None:
            log.warning("%s", self.completion_problem)
        return doc

    def clear_complete(self) -> None:
        """Removes the completion marker (training goes on past it)."""
        path = self.save_dir / COMPLETE
        if path.exists():
            path.unlink()
            hashed_io.fsync_dir(self.save_dir)


def _kept(manifest: Manifest) -> Kept:
    return Kept(manifest.step, manifest.best_value, manifest.origins())


def newest_files(save_dir: str | os.PathLike[str]) -> tuple[Path, list[Path]] | None:
    """The newest valid checkpoint of ``save_dir`` (the one a run resumes from) and its files as its manifest lists
    them; None when there is none or the directory cannot be read. Reads manifests only (``preempt prefetch``)."""
    try:
        infos = CheckpointManager(save_dir, owner=False).list()
    except OSError:
        return None
    for info in infos:
        if info.status == "valid" and info.manifest is not None:
            return info.path, [info.path / name for name in info.manifest.files]
    return None
