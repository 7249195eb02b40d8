"""The run's mirror (``PreemptibleRun(mirror="s3://...")``): pull on a new machine, upload after each durable
checkpoint, wait for the stop's checkpoint up to a deadline.

:class:`Mirroring` is inert without ``mirror=``. With it, on the leader (the process alone, or rank 0: the rank
that commits uploads, and pulls before the ranks agree where to start; the others wait at the existing meeting):

* :meth:`enter`, after the lock and the recovery, before the start plan: the mirror is opened; when save_dir has
  no valid checkpoint as new as the mirror's newest complete one, that one is pulled (:mod:`preempt.mirror.pull`:
  the local commit protocol, every byte checked; an older complete one when it fails), and the start plan resumes
  from it as from any local checkpoint;
* :meth:`begin`: the uploader's thread (:mod:`preempt.mirror.uploader`) starts, told of the newest local
  checkpoint (the mirror may lack it); after each durable checkpoint :meth:`durable` tells it of the new one;
* :meth:`at_stop`: a stop waits for its checkpoint's upload up to :func:`preempt.mirror.plan.stop_deadline`, and
  the stop's line says which step the mirror holds; :meth:`close` does the same for the final checkpoint.

fsspec is imported (by :mod:`preempt.mirror.store`) only here, only with ``mirror=``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import _log
from ..checkpoint.files import read_manifest
from ..checkpoint.manager import CheckpointManager
from ..checkpoint.names import MANIFEST, parse_checkpoint_name
from ..errors import CorruptCheckpointError, MirrorError, NoCheckpointError, PreemptError
from ..health.history import HISTORY_FILE, LOG_FILE
from .config import MirrorOptions

if TYPE_CHECKING:
    from ..cluster.nodes import Nodes
    from ..mirror.uploader import Uploader
    from .reporting import Reporter
    from .stopping import Stopper

log = _log.log


class Mirroring:
    """The mirror's part of a run (see the module docstring)."""

    def __init__(
        self,
        config: MirrorOptions,
        manager: CheckpointManager,
        reporter: Reporter,
        stopper: Stopper,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.manager = manager
        self.reporter = reporter
        self.stopper = stopper
        self.clock = clock
        self.uploader: Uploader | None = None
        self.pulled: dict[str, Any] | None = None  # the pull at enter, for history.jsonl once it is open
        self._ended = False  # the mirror_end marker is written (at the stop, or at the end)
        self._brought: set[int] = set()  # another node's leader: the step it pulled (bring)
        if config.mirror is not None:
            from ..mirror.store import hold_secrets

            hold_secrets(config.mirror, config.mirror_options)  # before provenance, logs and records are written

    @property
    def on(self) -> bool:
        return self.config.mirror is not None

    def enter(self, starts_fresh: bool) -> None:
        """The leader, before the start plan: open the mirror, pull its newest checkpoint when save_dir lacks it."""
        if not self.on:
            return
        from ..mirror import pull, survey

        mirror = self._store()
        valid = [i.step for i in self.manager.list() if i.status == "valid" and i.valid.part is None]
        local = max(valid, default=None)
        surveyor = survey.Surveyor(mirror)
        try:
            mirror.check()
            surveyed = surveyor.survey(wanted=())  # the listing: manifests are read as the pull needs them
        except MirrorError as e:
            if local is None:
                raise MirrorError(
                    f"{e}; save_dir {self.manager.save_dir} holds no checkpoint either: not starting (a fresh start"
                    " would set the mirror's checkpoints aside). Run again when the mirror answers"
                ) from None
            log.warning("%s; resuming from save_dir, uploads are retried", e)
            surveyed = None
        if surveyed is not None and starts_fresh and surveyed.listing:
            raise PreemptError(
                f"mirror {mirror.display} holds checkpoints (up to step {max(surveyed.listing)}) and this run starts"
                " fresh (auto_resume=False or resume=None): give it another mirror prefix, or delete those"
            )
        if surveyed is not None and not starts_fresh and local is not None:
            local = self._newest_whole(max((s for s, o in surveyed.listing.items() if MANIFEST in o), default=None))
        if surveyed is not None and not starts_fresh:
            try:
                got = pull.pull_newest(
                    mirror,
                    self.manager.save_dir,
                    newer_than=local,
                    replace=True,
                    surveyed=surveyed,
                    surveyor=surveyor,
                    check=self._read,
                )
            except NoCheckpointError as e:
                if local is None:
                    raise
                log.warning("%s; resuming from save_dir's step %d", e, local)
                got = None
            if got is not None:
                log.info(
                    "save_dir %s had %s; resuming from the mirror's step %d (%d bytes in %s)",
                    self.manager.save_dir,
                    "no checkpoint" if local is None else f"step {local}, older",
                    got.step,
                    got.bytes,
                    _log.duration(got.seconds),
                )
                self.pulled = {"step": got.step, "bytes": got.bytes, "seconds": round(got.seconds, 3)}
                self.pulled["failed"] = len(got.failed)
        from ..mirror.uploader import Uploader

        self.uploader = Uploader(
            mirror,
            self.manager.save_dir,
            self.manager.retention,
            records=(LOG_FILE, HISTORY_FILE),
            on_event=self._event,
            clock=self.clock,
        )
        if self.pulled is not None:  # its objects were checked as they came: a copy source, counted by retention
            self.uploader.verified.add(self.pulled["step"])

    def _newest_whole(self, mirrored: int | None) -> int | None:
        """The newest local checkpoint to weigh against the mirror's: those at or past the mirror's newest step
        (``mirrored``) are verified first, newest first, and a damaged one is quarantined here, while the mirror
        can still stand in for it (the load would only fall back to an older local one, or start fresh). Costs one
        read of the checkpoint resumed from when the mirror holds nothing newer, the page cache's for the load."""
        for info in self.manager.candidates("latest"):
            if mirrored is None or info.step < mirrored:
                return info.step
            problems = self.manager.verify(info)
            if not problems:
                return info.step
            self.manager.quarantine(info, f"{problems[0]}; the mirror may hold a whole copy")
        return None

    def _event(self, kind: str, **fields: Any) -> None:
        """The uploader's events (its thread): into history.jsonl; an upload's seconds to the stopper too, part of
        what a stop costs when it waits for the mirror."""
        self.reporter.marker(kind, **fields)
        seconds = fields.get("seconds")
        if kind == "mirror" and isinstance(seconds, (int, float)):
            self.stopper.uploaded(float(seconds))

    def nodes(self, rank: int, nodes: Nodes) -> None:
        """The ranks' nodes share no save_dir (:mod:`preempt.cluster.nodes`): rank 0's uploader waits for the other
        nodes' files before each whole checkpoint's manifest; each other node's leader uploads its node's part."""
        if not self.on:
            return
        node = nodes.of[rank]
        if rank == 0:
            assert self.uploader is not None  # (made at enter)
            self.uploader.node = 0
        elif nodes.leads(rank):
            from ..mirror.uploader import Uploader

            self.uploader = Uploader(
                self._store(), self.manager.save_dir, self.manager.retention, clock=self.clock, node=node
            )
            self.uploader.verified |= self._brought
        if self.uploader is not None:
            # A part an earlier process wrote and the mirror never completed belongs to a timeline this run left (it
            # resumed from the mirror's newest whole checkpoint): uploading it could mix with this run's save of it.
            self.uploader.since = time.time()

    def bring(self, step: int, created: float) -> None:
        """Another node's leader, when the ranks' nodes share no save_dir: rank 0's chosen checkpoint (step, and the
        time of its save) made whole in this node's save_dir: kept when it is there, else pulled from the mirror (the
        files of this node's part of that save taken over, not downloaded).

        Raises:
            NoCheckpointError: The mirror does not hold that save whole; MirrorError: it cannot be reached.
        """
        from ..mirror import pull, survey

        here = next((i for i in self.manager.list() if i.step == step and i.status == "valid"), None)
        if here is not None and here.valid.part is None and here.valid.created == created:
            return
        store = self._store()
        surveyed = survey.Surveyor(store).survey(wanted=[step])
        held = surveyed.manifests.get(step)
        if held is None or held.created != created:
            found = "no whole checkpoint of that step" if held is None else "another save of that step"
            raise NoCheckpointError(
                f"mirror {store.display}: rank 0 resumes from step {step}; the mirror holds {found}"
            )
        got = pull.fetch(store, self.manager.save_dir, step, surveyed, replace=True)
        self._brought.add(step)
        log.info(
            "pulled step %d from %s for this node (%d bytes in %s)",
            step,
            store.display,
            got.bytes,
            _log.duration(got.seconds),
        )

    def _store(self) -> Any:
        from ..mirror import store

        assert self.config.mirror is not None  # (on)
        return store.MirrorStore(self.config.mirror, self.config.mirror_options)

    def _read(self, path: Path) -> None:
        """A pulled checkpoint read and checked as a local one is before it is resumed from (its files' format, not
        only their digests): CorruptCheckpointError when it does not hold."""
        info = next((i for i in self.manager.list() if i.path == path), None)
        if info is None or info.status != "valid":
            raise CorruptCheckpointError(f"{path}: {'gone' if info is None else info.problem}")
        self.manager.read(info, direct=False)  # through the page cache: the restore reads it again from there

    def begin(self, newest: Any) -> None:
        """The run is on: the uploader starts, with the newest local checkpoint (``CheckpointInfo`` or None)."""
        if self.uploader is None:
            return
        if self.pulled is not None:
            self.reporter.marker("mirror_pull", **self.pulled)
        self.uploader.start()
        steps = [i.step for i in self.manager.list() if i.status == "valid"]
        if newest is not None or steps:
            self.uploader.submit(max([*steps, *([newest.step] if newest is not None else [])]))

    def chain(self, on_durable: Callable[[float, float, int], None]) -> Callable[[float, float, int], None]:
        """The save scheduler's ``on_durable`` hook: the stopper's, then the uploader told (never blocks)."""

        def durable(seconds: float, now: float, step: int) -> None:
            on_durable(seconds, now, step)
            if self.uploader is not None:
                self.uploader.submit(step)

        return durable

    def deadline(self) -> float:
        """Seconds to wait for a stop's upload: ``mirror_deadline``, capped by a part of the time left."""
        from ..mirror.plan import stop_deadline

        left = []
        if self.stopper.end_time is not None:
            left.append(self.stopper.end_time - time.time())
        if self.stopper.walltime is not None:
            left.append(self.stopper.walltime.deadline - self.stopper.clock())
        return stop_deadline(self.config.mirror_deadline, min(left) if left else None)

    def at_stop(self, checkpoint: Path | None) -> str:
        """Waits for the stop's checkpoint in the mirror (bounded); the words for the stop's line."""
        up = self.uploader
        step = None if checkpoint is None else parse_checkpoint_name(checkpoint.name)
        if up is None or step is None:
            return ""
        limit = self.deadline()
        t0 = self.clock()
        if up.wait_for(step, limit):
            what = (
                f"node {up.node}'s part of step {step}"
                if up.node and checkpoint is not None and _is_part(checkpoint)
                else f"step {step}"
            )
            said = f"mirror holds {what} (the stop's checkpoint), uploaded {_log.duration(self.clock() - t0)}"
            said += " after it was durable"
        else:
            held = up.holds()
            which = "no checkpoint" if held is None else f"step {held}"
            said = f"mirror holds {which}, not the stop's step {step}: {_unfinished(up, limit, step)}"
        self._end(step)
        return said

    def close(self, completed: bool, final: Any) -> None:
        """The run's end: the final checkpoint waited for (bounded) when the run completed; the thread let go."""
        up = self.uploader
        if up is None:
            return
        step = None if final is None else final.step
        if completed and step is not None:
            limit, t0 = self.deadline(), self.clock()
            if up.wait_for(step, limit):
                what = f"node {up.node}'s part of step {step}" if up.node and final.manifest.part else f"step {step}"
                log.info("mirror holds %s (the final checkpoint)", what)
                up.wait_idle(limit - (self.clock() - t0))  # its retention and the run records too
            else:
                held = up.holds()
                which = "no checkpoint" if held is None else f"step {held}"
                log.warning("mirror holds %s, not the final step %d: %s", which, step, _unfinished(up, limit, step))
            self._end(step)
        up.close()
        self.uploader = None

    def _end(self, step: int) -> None:
        """A ``mirror_end`` marker: where the mirror stands at the end of this process, and the worst lag."""
        up = self.uploader
        if up is None or self._ended:
            return
        self._ended = True
        steps, seconds = up.behind()
        c = up.counts
        self.reporter.marker(
            "mirror_end",
            step=step,
            held=up.holds(),
            behind_steps=steps,
            behind_s=round(seconds, 3),
            max_behind_steps=c.max_behind_steps,
            max_behind_s=round(c.max_behind_s, 3),
            put_bytes=c.put_bytes,
            copied_bytes=c.copied_bytes,
        )


def _is_part(checkpoint: Path) -> bool:
    """Whether the checkpoint at ``checkpoint`` is a node's part (nodes without a shared save_dir)."""
    try:
        return read_manifest(checkpoint / MANIFEST).part is not None
    except (OSError, PreemptError):
        return False


def _unfinished(up: Uploader, limit: float, step: int) -> str:
    """Why a checkpoint waited for is not in the mirror: its uploader ended (the error was logged) or the deadline
    (and, on nodes that share no save_dir, which nodes' files were missing)."""
    if up.error is not None:
        return f"the uploader stopped ({type(up.error).__name__}: {up.error})"
    if up.local_error is not None:
        return f"its uploads fail here ({type(up.local_error).__name__}: {up.local_error}), retried until the deadline"
    lagging = up.lagging(step)
    return f"upload not finished in {_log.duration(limit)} (mirror_deadline){f': {lagging}' if lagging else ''}"
