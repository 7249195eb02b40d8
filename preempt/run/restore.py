"""Starting a run: following the start plan (:mod:`preempt.run.resume_plan`) and restoring a checkpoint.

:class:`Starter` runs on every rank. The leader (the process alone, or rank 0)
plans the start from the save_dir, loads, and tells the other ranks which
checkpoint to load (:meth:`Starter.tell_choice`); a follower loads what it is told. Under
torch.distributed the ranks read each checkpoint the leader tries together
(:mod:`preempt.cluster.shared_read`: a share each, the rest exchanged, a damaged
file failing on every rank alike), so a follower holds the chosen one when it is
named, and the leader names it before it applies it. Restoring
puts a verified checkpoint's state into the components and into the run's
parts: the loop's counters, the data cursor's resume point, the snapshot's
lineage and user state, the scheduler's newest checkpoint.

Nothing read is used before :func:`check_restored` (the one boundary between
a checkpoint's content and the process) has checked it: the manager calls it
on each candidate and falls back past one it refuses, as past a damaged one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import _log
from ..checkpoint import files, hyperparams, lock, state
from ..checkpoint.hashed_io import FileDigest
from ..checkpoint.manager import CheckpointInfo, CheckpointManager
from ..checkpoint.names import parse_checkpoint_name
from ..cluster import distributed, nodes, sharded, shared_read
from ..cluster.environment import Environment
from ..cluster.shared_read import Shared
from ..data import rng
from ..errors import (
    CheckpointUnreadableError,
    CorruptCheckpointError,
    IncompatibleStateError,
    NoCheckpointError,
    PreemptError,
    RunComplete,
)
from .config import RunConfig
from .data_cursor import SEED_MASK, DataCursor, Resume
from .due import Reason
from .loop_state import LoopState, epoch_so_far
from .peers import Peers
from .resume_plan import NO_CHECKPOINT, is_new_request, plan_start, request_of, request_source
from .save_scheduler import SaveScheduler
from .snapshot import Snapshot

if TYPE_CHECKING:
    from .mirroring import Mirroring

log = _log.log

Checked = tuple[rng.RngState, rng.RngState | None]  # a checked checkpoint's RNG states: now, its epoch's start
COPIED = (state.MODEL_FILE, state.BASE_FILE)  # the files whose tensors applying copies into the live model


SHARED_SAVE_DIR = (
    "every rank writes its files into the checkpoint rank 0 commits, so all ranks need one save_dir on a filesystem"
    " they all see, or, on nodes without a shared filesystem, a mirror (mirror=...)"
)


@dataclasses.dataclass(frozen=True)
class PredecessorDied:
    """The previous holder of the save_dir's lock died holding it: the step it had reached (its beacon; None:
    unknown) and, when the kill came during its stop, how (:func:`preempt.run.stopping.killed_stopping`; None: not
    during a stop)."""

    reached_step: int | None
    killed_stopping: str | None


class Starter:
    """Chooses and loads the starting state of one run (see the module docstring)."""

    def __init__(
        self,
        config: RunConfig,
        manager: CheckpointManager,
        components: state.Components,
        parts: tuple[LoopState, DataCursor, Snapshot, SaveScheduler],
        peers: Peers,
        env: Environment,
        *,
        own_lock: lock.DirLock | None = None,
        mirroring: Mirroring | None = None,
    ) -> None:
        self.config = config
        self.manager = manager
        self.save_dir = manager.save_dir
        self.components = components
        self.loop, self.data, self.snapshot, self.saves = parts
        self.peers = peers
        self.env = env
        self.resumed_from: Path | None = None
        self.resume_line: str | None = None  # what was loaded, in words: the start line says it (preempt.run.reporting)
        self.saved_tracked: dict[str, Any] = {}  # a restored checkpoint's tracked objects, for run.track() later
        self._died: PredecessorDied | None = None  # the lock's previous holder died holding it (the leader only)
        self._told = False
        self._branching = False
        self._holder: dict[str, Any] = {}  # what rank 0 wrote in the lock file, sent with the start
        self._branch: tuple[dict[str, Any], CheckpointInfo, bool] | None = None  # the leader's new timeline
        self._branch_due = False  # a new timeline needs its first checkpoint
        # Nodes without a shared save_dir (preempt.cluster.nodes): a node's leader takes its save_dir with this lock
        # (rank 0 took its own before the start) and brings rank 0's chosen checkpoint from the mirror.
        self.own_lock = own_lock
        self.mirroring = mirroring

    # ---------------------------------------------------------------- the leader

    def _latest_request(self) -> Any:
        latest = next((c for c in self.manager.list() if c.status == "valid"), None)
        return NO_CHECKPOINT if latest is None else latest.valid.lineage.get("request")

    def _request(self) -> dict[str, Any] | None:
        return request_of(self.config.resume, self.config.weights_only)

    def new_request(self) -> bool:
        """A resume request (other than "latest") that the newest checkpoint does not record yet."""
        if self.config.starts_fresh:
            return False
        return is_new_request(self._request(), self._latest_request())

    def choose_and_load(self, holder: dict[str, Any], died: PredecessorDied | None = None) -> None:
        """Chooses the starting state, loads it, and tells the other ranks (which then load it too); ``holder``:
        what this process wrote in the lock file (``DirLock.identity``), which the others must see too; ``died``:
        the previous holder died holding the lock (said once the starting step is known)."""
        self._holder, self._died = holder, died
        cfg = self.config
        p = plan_start(
            fresh=cfg.starts_fresh,
            request=None if cfg.starts_fresh else self._request(),
            latest_request=NO_CHECKPOINT if cfg.starts_fresh else self._latest_request(),
        )
        if p.kind == "fresh":
            self._start_fresh({"request": None}, supersede=True)
        elif p.kind == "latest" and self._continue(p.request):
            pass
        else:
            assert p.request is not None  # a branch is a request's
            self._start_branch(p.request)
        if not self._told:
            self.tell_choice(None if self.resumed_from is None else str(self.resumed_from))

    def completed(self, done: dict[str, Any]) -> bool:
        """Whether the run ends at once as complete: complete.json (``done``, believed by its manifest) is heeded
        (``exit_if_complete``, no new start or request) and the checkpoint it names loads and passes
        :meth:`check` (node 0's part of it, on nodes without a shared save_dir: its files verify); one that does not
        is quarantined like any damaged checkpoint and the run goes on."""
        cfg = self.config
        if not cfg.exit_if_complete or cfg.starts_fresh or self.new_request():
            return False
        part = next((c for c in self.manager.list() if c.step == done["step"] and c.status == "valid"), None)
        if part is not None and part.valid.part is not None:
            # nodes without a shared save_dir: node 0's part of the final checkpoint, whose files are all here to check
            problems = self.manager.verify(part)
            if problems:
                log.warning("%s/complete.json is not believed: %s; the run goes on", self.save_dir, problems[0])
            return not problems
        try:
            self.manager.load(done["step"], check=self.check, direct=self.peers.alone)
        except NoCheckpointError as e:
            log.warning("%s/complete.json is not believed: %s; the run goes on", self.save_dir, e)
            return False
        return True

    def _continue(self, request: dict[str, Any] | None) -> bool:
        """Loads the newest valid checkpoint; False when the request's timeline must be branched after all."""
        try:
            # alone, large files are read past the page cache; the ranks read shares of them past it and exchange them
            with self._together():
                info, loaded = self.manager.load("latest", check=self.check, direct=self.peers.alone)
        except NoCheckpointError as e:
            if e.corrupt:
                log.warning("%s; starting fresh (the broken checkpoints are in %s/quarantine)", e, self.save_dir)
            if request is None:
                self._start_fresh({"request": None}, supersede=False)
                return True
            return False
        if request is not None and info.valid.lineage.get("request") != request:
            return False
        if not self.peers.alone:
            # The others load the chosen checkpoint (read with this rank already) while this rank applies it, rather
            # than after. Should applying it fail here (a model of another shape), they fail alike on the same state
            # or lose this rank at their first collective (PeerLost); a checkpoint that fails a check was passed by.
            self.tell_choice(str(info.path))
        self.restore(info, loaded)
        return True

    def tell_choice(self, path: str | None) -> None:
        """Rank 0 tells the others which checkpoint to load, and whether a resume request is being applied, with
        what its lock file says: every rank must see that same file (one save_dir for all, :meth:`load_leaders_choice`).

        Raises:
            PreemptError: Another rank does not see this save_dir as rank 0 does.
        """
        self.peers.broadcast(("start", path, self._branching, self._holder))
        self._told = True
        self._agree_on_save_dirs({})
        if path is not None and self.peers.nodes is not None:
            self._bring(Path(path))

    def tell_failure(self, error: BaseException) -> None:
        """The leader could not start: the other ranks learn it instead of waiting."""
        if not self._told:
            kind = "complete" if isinstance(error, RunComplete) else "fail"
            self.peers.broadcast((kind, repr(error), False, None))

    def _start_branch(self, request: dict[str, Any]) -> None:
        """Applies a resume request once: loads its checkpoint and starts a new timeline from it."""
        source_dir, selector = request_source(self.config.resume, self.save_dir)
        own = source_dir == self.save_dir.resolve()
        if own and not any(c.status == "valid" for c in self.manager.list()):
            log.info("%s has no checkpoint yet; starting fresh", self.save_dir)
            self._start_fresh({"request": request}, supersede=False)
            return
        source = self.manager if own else CheckpointManager(source_dir, owner=False)
        self._branching = True
        weights_only = self.config.weights_only
        info, loaded = source.load(selector, weights_only=weights_only, check=None if weights_only else self.check)
        if weights_only:
            if self.components.model is not None:
                state.load_model(self.components.model, loaded, strict=self.config.strict)
            self.resumed_from = info.path
            self.resume_line = (
                f"loaded the weights of {info.path} (step {info.step}); optimizer, scheduler and counters start fresh"
            )
        else:
            self.restore(info, loaded)
        self._branch = (request, info, own)
        self._branch_due = True

    def supersede_and_save_branch(self) -> None:
        """The new timeline of a resume request: the old one moved aside, and a first checkpoint at once.

        Under torch.distributed, after every rank has loaded the source (a barrier); the save is a collective.
        """
        if not self._branch_due:
            return
        self.peers.barrier()
        if self._branch is not None:
            request, info, own = self._branch
            # Checkpoints that would shadow the new timeline are moved aside, not deleted.
            shadowing = [
                c
                for c in self.manager.list()
                if c.status == "valid" and (self.config.weights_only or not own or c.step > info.step)
            ]
            moved = self.manager.supersede(shadowing)
            if moved:
                log.warning(
                    "moved %d checkpoint(s) of the previous timeline to %s/superseded", len(moved), self.save_dir
                )
            self.snapshot.lineage = {"request": request, "source": str(info.path), "started": time.time()}
        self._branch, self._branch_due = None, False
        # The new timeline gets its first checkpoint at once, so that a rerun continues it.
        self.loop.changed()
        r = self.data.resume
        self.saves.save(Reason.BRANCH, "epoch" if r is None else r.cursor.point)

    def _start_fresh(self, lineage: dict[str, Any], *, supersede: bool) -> None:
        self._say_predecessor_died(0)
        existing = [c for c in self.manager.list() if c.status == "valid"]
        if existing and supersede:
            moved = self.manager.supersede(existing)
            log.warning(
                "starting fresh (auto_resume=False or resume=None): moved %d existing checkpoint(s) to %s/superseded",
                len(moved),
                self.save_dir,
            )
        self.snapshot.lineage = {**lineage, "started": time.time()}

    # ---------------------------------------------------------------- a follower

    def load_leaders_choice(self) -> None:
        """A rank other than 0: loads the checkpoint rank 0 chose (in this save_dir or, for a request, another).

        Each checkpoint rank 0 tries is read by the ranks together (:meth:`_read_with_leader`): the one it chooses is
        then loaded from what this rank holds already."""
        ahead = None
        said = self.peers.broadcast(None)
        while said[0] == "share":
            ahead = self._read_with_leader(said[1])
            said = self.peers.broadcast(None)
        kind, detail, branch, holder = said
        if kind == "complete":
            raise RunComplete(str(self.save_dir))
        if kind == "fail":
            raise PreemptError(f"rank 0 could not start the run in {self.save_dir}: {detail}")
        self._agree_on_save_dirs(holder)
        if detail is None:
            self.snapshot.lineage = {"request": None, "started": time.time()}
        else:
            chosen = Path(detail) if self.peers.nodes is None else self._bring(Path(detail))
            self._load_chosen(chosen, weights_only=branch and self.config.weights_only, ahead=ahead)
        self._branch_due = bool(branch)  # rank 0 moves the old timeline aside

    # ---------------------------------------------------------------- how the ranks share the save_dir

    def _agree_on_save_dirs(self, holder: dict[str, Any]) -> None:
        """Every rank, once rank 0 has told its choice (:meth:`tell_choice`): whether the ranks share the save_dir (each
        sees rank 0's lock file, ``holder``), and when they do not and a mirror is given, each node's leader takes its
        own save_dir and every rank learns its node (:mod:`preempt.cluster.nodes`). Several collectives, at the start
        only.

        Raises:
            PreemptError: The save_dir is not shared and cannot be split by node (no mirror, no leader), on every rank.
        """
        peers, rank = self.peers, self.peers.rank
        if peers.alone:
            return
        seen = {} if peers.leader else lock.holder(self.save_dir)  # (only rank 0 holds a lock yet)
        found = "its lock file is missing" if not seen else f"its lock file says {lock.describe(seen)}"
        local = self.env.local_rank or 0  # torchrun's LOCAL_RANK, else srun's SLURM_LOCALID (read once, from_env)
        view = nodes.View(peers.leader or seen == holder, local == 0, found)
        views = peers.gather(dataclasses.astuple(view))
        split = None if views is None else nodes.split_by_node([nodes.View(*v) for v in views], mirror=self._mirror)
        kind, leaders, problem = peers.broadcast(None if split is None else dataclasses.astuple(split))
        if kind == "refused":
            raise PreemptError(f"{self.save_dir}: {problem}: {SHARED_SAVE_DIR}")
        if kind == "shared":
            return
        identity, error = (self._holder, "") if peers.leader else ({}, "")
        if rank in leaders[1:]:
            try:
                identity = self._take_own_dir()
            except Exception as e:
                error = f"rank {rank} could not take {self.save_dir} for its node: {type(e).__name__}: {e}"
        got = peers.gather((identity, error))
        ids = peers.broadcast(None if got is None else [got[r][0] for r in leaders] + [e for _, e in got if e][:1])
        if len(ids) > len(leaders):
            raise PreemptError(ids[-1])
        sees = None if rank in leaders else lock.holder(self.save_dir)  # now that each node's leader holds its own
        views = peers.gather(sees)
        grouped = None if views is None else nodes.assign(leaders, ids, views)
        decided = peers.broadcast(None if grouped is None else grouped if isinstance(grouped, str) else grouped.of)
        if isinstance(decided, str):
            raise PreemptError(f"{self.save_dir}: {decided}: {SHARED_SAVE_DIR}")
        peers.nodes = nodes.Nodes(tuple(decided), tuple(leaders))
        if rank == 0:
            log.info(
                "the ranks' nodes do not share %s: %d nodes, each writes its part of every checkpoint and uploads it"
                " to the mirror; a resume pulls the whole checkpoint from it",
                self.save_dir,
                peers.nodes.count,
            )

    def _take_own_dir(self) -> dict[str, Any]:
        """A node's leader, when the ranks' nodes share no save_dir: takes its own as rank 0 takes its (the lock,
        the recovery of leftovers); the lock's identity, for the node's other ranks to recognise."""
        assert self.own_lock is not None  # (given by the run)
        self.manager.check_dir()
        self.own_lock.acquire()  # the manager cleans, quarantines and prunes its node's save_dir from now on
        self.manager.recover()
        return self.own_lock.identity

    @property
    def _mirror(self) -> bool:
        return self.config.mirror is not None

    def _bring(self, path: Path) -> Path:
        """Nodes without a shared save_dir: each node's leader brings rank 0's chosen checkpoint of rank 0's save_dir
        (from the mirror, unless its save_dir holds the same save whole); returns where this rank loads it from: its
        own save_dir's copy (the nodes' save_dirs may have other paths), or, for a checkpoint of another run's
        directory that a resume request names, that path as it is."""
        peers = self.peers
        assert peers.nodes is not None
        created = None
        if peers.leader and path.parent.resolve() == self.save_dir.resolve():
            info = next(c for c in self.manager.list() if c.path.name == path.name)
            created = info.valid.created
        created = peers.broadcast(created)
        if created is None:
            return path
        error = ""
        if peers.rank != 0 and peers.nodes.leads(peers.rank):
            assert self.mirroring is not None  # (given by the run)
            try:
                step = parse_checkpoint_name(path.name)
                assert step is not None  # (rank 0's own checkpoint)
                self.mirroring.bring(step, created)
            except Exception as e:
                error = f"rank {peers.rank}: {type(e).__name__}: {e}"
        errors = peers.gather(error)
        said = peers.broadcast(None if errors is None else next((e for e in errors if e), ""))
        if said:
            raise PreemptError(f"a node could not bring {path.name} from the mirror: {said}")
        return self.save_dir / path.name

    # ---------------------------------------------------------------- the ranks' restore together

    def _together(self) -> contextlib.AbstractContextManager[None]:
        """Rank 0's reads of its save_dir's checkpoints, shared with the other ranks (:meth:`_read_with_others`);
        alone, as they are."""
        return contextlib.nullcontext() if self.peers.alone else files.reading_from(self._read_with_others)

    def _read_with_others(
        self, where: Path, listed: Mapping[str, FileDigest], names: Sequence[str]
    ) -> Mapping[str, tuple[Any, FileDigest]]:
        """Rank 0, about to read the files ``names`` of the checkpoint ``where``: offers the other ranks to read
        them together (:mod:`preempt.cluster.shared_read`); what they read together, {} when a rank does not take
        part (rank 0 then reads them alone, as before, the others once it has chosen).

        Raises:
            CorruptCheckpointError: A file fails its digest, on every rank alike: the manager falls back to an older
                checkpoint, and rank 0 offers that one.
            CheckpointUnreadableError: A share could not be read, on every rank alike.
        """
        if not names or where.parent.resolve() != self.save_dir.resolve():
            return {}
        offer = {"path": str(where), "files": [[n, listed[n].size, listed[n].xxh3_128] for n in names]}
        self.peers.broadcast(("share", {**offer, "holder": self._holder}, False, None))
        return shared_read.exchange(self.peers, where, _wanted(offer), take_part=True, copied=COPIED)

    def _read_with_leader(self, offer: dict[str, Any]) -> tuple[CheckpointInfo, state.Loaded] | None:
        """A rank other than 0: reads rank 0's offered checkpoint with it (:meth:`_read_with_others`), then the rest
        of it (its own random state) as :meth:`_load_chosen` would; what was read, or None (a file failed, on every
        rank; this rank did not take part; the rest failed here: rank 0 decides and names the checkpoint it chooses).

        This rank takes part when it sees what rank 0 sees: its lock file (one save_dir for all) and the offered
        checkpoint, with the same digests of those files."""
        rank, path, wanted = self.peers.rank, Path(offer["path"]), _wanted(offer)
        info = None
        if path.parent.resolve() == self.save_dir.resolve() and lock.holder(self.save_dir) == offer["holder"]:
            info = next((c for c in self.manager.list() if c.path.resolve() == path.resolve()), None)
            if info is not None and (info.status != "valid" or any(info.valid.files.get(n) != d for n, d in wanted)):
                info = None
        try:
            got = shared_read.exchange(self.peers, path, wanted, take_part=info is not None, copied=COPIED)
        except (CorruptCheckpointError, CheckpointUnreadableError) as e:
            log.debug("rank %d: %s (rank 0 falls back or stops)", rank, e)
            return None
        if not got or info is None:
            return None
        here = info.path.resolve()

        def shared(where: Path, listed: Mapping[str, FileDigest], names: Sequence[str]) -> Shared:
            return {n: got[n] for n in names if n in got} if where.resolve() == here else {}

        try:
            with files.reading_from(shared):
                return info, self.manager.read(info, rank=rank, direct=False)
        except Exception as e:  # damaged or unreadable here: rank 0 decides, and this rank reads what it names
            log.debug("rank %d: %s read with rank 0, but not loaded (%s: %s)", rank, path, type(e).__name__, e)
            return None

    def _load_chosen(
        self, path: Path, *, weights_only: bool, ahead: tuple[CheckpointInfo, state.Loaded] | None = None
    ) -> None:
        here = path.parent.resolve() == self.save_dir.resolve()
        source = self.manager if here else CheckpointManager(path.parent, owner=False)
        info = next((c for c in source.list() if c.path.resolve() == path.resolve()), None)
        rank = self.peers.rank
        if info is None or info.status != "valid":
            raise NoCheckpointError(f"rank {rank}: {path}, chosen by rank 0, is not a valid checkpoint")
        if weights_only:
            if self.components.model is not None:
                loaded = source.read(info, weights_only=True, direct=self.peers.alone)
                state.load_model(self.components.model, loaded, strict=self.config.strict)
            self.resumed_from = info.path
            return
        if state.rank_files(rank)[1] not in info.valid.files:
            log.warning(
                "rank %d: %s was written by fewer ranks; this rank starts from rank 0's random state", rank, path
            )
        if ahead is not None and _same_save(ahead[0], info):
            log.debug("rank %d: %s was read while rank 0 chose it", rank, path)
            self.restore(info, ahead[1])
            return
        self.restore(info, source.read(info, rank=rank, direct=self.peers.alone))

    def load_tracked(self, name: str, obj: state.Stateful) -> None:
        """``run.track()`` inside the run: the restored checkpoint's state of ``name``, loaded into ``obj`` at once."""
        if not state.load_tracked(name, obj, self.saved_tracked, str(self.resumed_from)):
            if self.resumed_from is not None:
                log.warning("tracked object %r has no state in %s; left as it is", name, self.resumed_from)

    # ---------------------------------------------------------------- restoring

    def check(self, info: CheckpointInfo, loaded: state.Loaded) -> Checked:
        """:func:`check_restored` for this run's objects: what the manager calls before it accepts a checkpoint."""
        c = self.components
        return check_restored(
            loaded.tree,
            f"{info.path}/{state.STATE_JSON}",
            {
                name: _class_name(obj)
                for name, obj in (("optimizer", c.optimizer), ("scheduler", c.scheduler), ("scaler", c.scaler))
            },
        )

    def restore(self, info: CheckpointInfo, loaded: state.Loaded) -> None:
        """Puts a verified checkpoint's state into the components and the run's parts, once :meth:`check` passed."""
        m = info.manifest
        assert m is not None
        tree = loaded.tree
        rng_now, rng_epoch = self.check(info, loaded)  # again for a follower's or a branch's load; microseconds
        data = tree.get("data") or {}  # absent in checkpoints of earlier versions
        seed = data.get("seed")
        if isinstance(seed, int) and not isinstance(seed, bool):
            self.data.seed = seed & SEED_MASK
        self._apply(info, loaded)
        self.saved_tracked = tree.get("tracked", {})
        snap = self.snapshot
        snap.user_state = dict(tree.get("user") or {})
        snap.lr_scale = float(tree.get("lr_scale", 1.0))
        snap.lineage = dict(m.lineage)
        rng.restore(rng_now)
        c = m.cursor
        self.loop.restored(m.step, c, m.metrics, m.best, epoch_so_far(tree.get("epoch"), str(info.path)))
        self.data.resume = Resume(info, c, rng_now, rng_epoch, m.sampler, data.get("loader"))
        self.saves.loaded(info)
        # the files the live tensors now match may be carried by the next checkpoint
        self.manager.loaded(info, snap.pieces(snap.split()[0])[1] if snap.sharded else snap.tensors())
        self.resumed_from = info.path
        age = _log.duration(max(0.0, time.time() - m.created))
        of = f"/{c.batches_per_epoch}" if c.batches_per_epoch >= 0 else ""
        env, job = self.env, ""
        if env.slurm_job_id:
            array = f" (array {env.slurm_array_job_id}_{env.slurm_array_task_id})" if env.slurm_array_job_id else ""
            job = f"restart {env.slurm_restart_count or 0} of job {env.slurm_job_id}{array}: "
        where = f"step {m.step}, epoch {c.epoch}, batch {c.batch}{of}"
        self.resume_line = f"{job}resumed from {info.path}: {where}, saved {age} ago"
        self._say_predecessor_died(m.step)

    def _apply(self, info: CheckpointInfo, loaded: state.Loaded) -> None:
        """The components' state; sharded tensors through DCP (a collective the other ranks are told of first)."""
        c, strict = self.components, self.config.strict
        if not loaded.sharded:
            state.apply(c, loaded, strict=strict)
            return
        state.apply(state.Components(None, None, c.scheduler, c.scaler, c.tracked), loaded, strict=strict)
        if self.peers.leader and not self.peers.alone and not self._told:
            self.tell_choice(str(info.path))  # loading sharded state is a collective: the others must learn it first
        if c.model is None:
            raise IncompatibleStateError(f"{info.path}: holds a sharded model but the run has no model")
        try:
            rest = (loaded.tree.get("sharded") or {}).get("optimizer")
            sharded.load_into(
                info.path,
                state.unwrap_model(c.model),
                c.optimizer,
                rest,
                f"{info.path}/{state.STATE_JSON}",
                loaded.pieces,
            )
        except (ValueError, KeyError, RuntimeError) as e:
            raise IncompatibleStateError(f"{info.path}: sharded state does not load: {e}") from e

    def _say_predecessor_died(self, resumed_step: int) -> None:
        """After a crash (no clean stop), how far the dead process got and what is recomputed."""
        died, self._died = self._died, None
        if died is None:
            return
        what = "without stopping (killed: SIGKILL, out of memory, or its node failed)"
        if died.killed_stopping is not None:
            what = died.killed_stopping
        if died.reached_step is None or died.reached_step < resumed_step:
            log.warning("the previous process died %s; how far it got is not known", what)
            return
        log.warning(
            "the previous process died %s at step %d: the %d step(s) since step %d will be recomputed",
            what,
            died.reached_step,
            died.reached_step - resumed_step,
            resumed_step,
        )


# ---------------------------------------------------------------- the boundary


def _wanted(offer: dict[str, Any]) -> list[tuple[str, FileDigest]]:
    """The files of rank 0's offer (:meth:`Starter._read_with_others`), in its order, with their manifest's sizes
    and digests."""
    return [(str(n), FileDigest(int(size), str(digest))) for n, size, digest in offer["files"]]


def _same_save(a: CheckpointInfo, b: CheckpointInfo) -> bool:
    """Whether two listings name the same save: one path, one manifest (its time and its files' digests)."""
    if a.path.resolve() != b.path.resolve() or a.manifest is None or b.manifest is None:
        return False
    return a.manifest.created == b.manifest.created and a.manifest.files == b.manifest.files


def check_sharded(config: RunConfig, model: Any) -> bool:
    """Whether the model's state is sharded (DTensor/FSDP); PreemptError where a run cannot start with it."""
    is_sharded = sharded.is_sharded(model)
    if is_sharded and not distributed.active():
        raise PreemptError("the model's state is sharded (DTensor/FSDP) but torch.distributed has one rank")
    if is_sharded and config.weights_only and not config.starts_fresh:
        raise PreemptError(
            f"resume={config.resume!r}, weights_only=True: loading only the weights into a sharded model is not"
            " supported yet; load them before entering the run, or resume the whole state"
        )
    return is_sharded


def check_restored(tree: dict[str, Any], where: str, classes: Mapping[str, str | None]) -> Checked:
    """Every value of a read checkpoint that the run uses, checked before any is used: the one boundary.

    A re-signed checkpoint passes every digest, so its content is checked for what the objects that take
    it accept: the random generators (:func:`preempt.data.rng.from_tree`), the optimizer's, scheduler's and
    scaler's numbers (:mod:`preempt.checkpoint.hyperparams`, for torch's own classes), the run's own values.
    Pure: nothing is changed; the live objects are known by their class names alone. What depends on the
    live objects' shapes (a changed model) is checked when they load (:func:`preempt.checkpoint.state.apply`)
    and raises IncompatibleStateError without a fallback: every checkpoint of the run would fail the same way.

    Args:
        tree: The decoded ``state.json`` of a checkpoint.
        where: Its path, for messages.
        classes: ``"optimizer"``, ``"scheduler"``, ``"scaler"``: the dotted class name of the live object
            that will load that state, or None when the run has none.

    Returns:
        The checkpoint's RNG states: at the checkpoint, and at the start of its epoch (None: not saved).

    Raises:
        CorruptCheckpointError: A value no run could have saved (the manager reports the checkpoint as
            damaged and falls back to an older one); the message names the field, what was expected and
            what was found.
        IncompatibleStateError: The checkpoint holds no RNG state: it was not written by a PreemptibleRun.
    """
    rngs = tree.get("rng")
    if rngs is None:
        raise IncompatibleStateError(f"{where}: no RNG state; was it written by PreemptibleRun?")
    if not isinstance(rngs, dict):
        raise CorruptCheckpointError(f"{where}: rng: expected an object, found {type(rngs).__name__}")
    rng_now = rng.from_tree(rngs.get("now"), where, "rng.now")
    epoch = rngs.get("epoch_start")
    rng_epoch = None if epoch is None else rng.from_tree(epoch, where, "rng.epoch_start")
    for name in ("user", "data"):  # data is absent in checkpoints of earlier versions, and None in some
        value = tree.get(name)
        if value is not None and not isinstance(value, dict):
            raise CorruptCheckpointError(f"{where}: {name}: expected an object, found {type(value).__name__}")
    scale = tree.get("lr_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
        raise CorruptCheckpointError(f"{where}: lr_scale: expected a finite number > 0, found {scale!r}")
    hyperparams.check_optimizer(tree.get("optimizer"), where, classes.get("optimizer"))
    hyperparams.check_scheduler(tree.get("scheduler"), where, classes.get("scheduler"))
    hyperparams.check_scaler(tree.get("scaler"), where, classes.get("scaler"))
    epoch_so_far(tree.get("epoch"), where)
    return rng_now, rng_epoch


def _class_name(obj: Any) -> str | None:
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"
