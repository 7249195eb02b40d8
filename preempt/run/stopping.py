"""Why and how the run stops: signals, the walltime keeper, SLURM's requeue and restart limits.

:class:`Stopper` holds the stop flag (:class:`~preempt.cluster.signals.StopFlag`), the
walltime keeper (:class:`Walltime`) and what SLURM says about
the job (its end time, KillWait, whether ``scontrol`` works). At a stop it
names the cause, requeues the job when the stop is its time limit (the rule is
:func:`preempt.cluster.slurm.decide_requeue`), and raises
:class:`~preempt.errors.Preempted` with the exit code that tells the caller
what happened.

**Walltime.** With a deadline (the SLURM job's end time, or ``time_limit``)
the run also stops by itself, with no signal, early enough for the stop's
checkpoint to be durable before the deadline; the margin comes from the
measured step and save times (:class:`Walltime`). Under
SLURM, a stop at the time limit then requeues the job (rule and limits in
:mod:`preempt.cluster.slurm`); other stops only save and exit.

**Notices and the grace.** With ``notices=`` (or ``PREEMPT_NOTICES``) a thread watches the cloud's metadata
service (:mod:`preempt.cluster.notices`, on the first rank of each node) and a notice raises the stop flag as a
signal would: the stop's cause is the notice, its deadline is in the log and history. The grace, the seconds from a
stop's signal to the kill, comes from ``grace=``, ``PREEMPT_GRACE_S``, torchrun or SLURM
(:mod:`preempt.cluster.grace`). After each checkpoint the stopper compares what a stop costs now (the latest save's
time to durable, a step, the mirror's upload) with the grace and warns once when it does not fit. At a stop it
writes a ``stopping`` marker before the stop's save (a process killed during the save leaves it, and the next one
says why its steps were lost) and gives the stop's time to durable and its margin to the ``stop`` marker.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from .. import _log
from ..cluster import grace as graces
from ..cluster import notices, ray_notice, slurm
from ..cluster.environment import Environment
from ..cluster.signals import StopFlag, signal_name
from ..errors import REQUEUE_FAILED_EXIT_CODE, RESTART_LIMIT_EXIT_CODE, Preempted, RestartLimitReached, SlurmError
from ..health.history import HISTORY_FILE, tail
from .config import StopOptions
from .due import Decision, Reason
from .loop_state import LoopState
from .write_decisions import SaveRecord

log = _log.log


PRIOR_SAVE_BYTES_PER_S = 100e6
"""Write speed assumed for the first checkpoint before one has been timed: a slow shared filesystem."""


class Walltime:
    """When to stop so that the stop's checkpoint is durable before a deadline.

    Pure: the run passes the clock's values in. The run stops at the first
    safe point at or after :meth:`stop_at`, which is the deadline minus a
    margin of ``1.5 * (step + gap + save) + SLACK_S``: from a safe point just
    before ``stop_at`` the loop may run one more step (or an epoch's end and
    the next epoch's start) before it notices, then saves.

    * ``save`` is the longest checkpoint this process has timed; before the
      first one, a prior of 0.5 s plus the state's bytes at
      :data:`PRIOR_SAVE_BYTES_PER_S`.
    * ``step`` is the longest average step time over the windows between the
      run's reviews (saves excluded, epoch-end code included). Reviews are
      scheduled at half the time left before ``stop_at`` (at least
      :attr:`MIN_REVIEW_S` apart), so there are about log2(T / 1 s) of them in
      a job of T seconds and the windows near the end are short.
    * ``gap`` is the longest stretch between safe points that is not a step:
      the code after an epoch's last batch (validation), and the start of an
      epoch's loader up to its first batch (worker start-up). The run times
      both, twice per epoch.

    The per-step cost is nil: the run folds :meth:`review_at` into the clock
    threshold that ``run.step()`` already compares with. A single step much
    longer than the average (an evaluation inside the loop every N steps) is
    not foreseen; move it to an epoch's end, or leave room with a shorter
    ``time_limit``.

    Args:
        deadline: Monotonic time by which the stop's checkpoint must be durable.
        prior_save_s: Estimated seconds of one checkpoint until one is timed.
        now: Monotonic time now (the start of the first window).
        step: The global step now.
    """

    SLACK_S = 2.0
    MIN_REVIEW_S = 1.0

    def __init__(self, deadline: float, prior_save_s: float, now: float, step: int) -> None:
        self.deadline = deadline
        self.save_s = prior_save_s
        self.save_measured = False
        self.step_s = 0.0
        self.gap_s = 0.0
        self._base_time = now
        self._base_step = step

    @staticmethod
    def prior_save_s(state_bytes: int) -> float:
        return 0.5 + state_bytes / PRIOR_SAVE_BYTES_PER_S

    def margin(self) -> float:
        return 1.5 * (self.step_s + self.gap_s + self.save_s) + self.SLACK_S

    def stop_at(self) -> float:
        return self.deadline - self.margin()

    def observe(self, now: float, step: int) -> None:
        """At a safe point: the steps since the window started took ``now - start``."""
        if step > self._base_step:
            self.step_s = max(self.step_s, (now - self._base_time) / (step - self._base_step))
            self._base_time, self._base_step = now, step

    def gap(self, seconds: float) -> None:
        """A stretch between safe points that is not a step (epoch end, loader start) took ``seconds``."""
        self.gap_s = max(self.gap_s, seconds)

    def saved(self, seconds: float, now: float, step: int) -> None:
        """A checkpoint took ``seconds``; the next window starts after it."""
        self.save_s = max(self.save_s, seconds) if self.save_measured else seconds
        self.save_measured = True
        self._base_time, self._base_step = now, step

    def review_at(self, now: float) -> float:
        """When the run should next call :meth:`observe` (never after :meth:`stop_at`)."""
        stop = self.stop_at()
        left = stop - now
        if left <= self.MIN_REVIEW_S:
            return stop
        return now + max(left / 2, self.MIN_REVIEW_S)


class Stopper:
    """The run's stop: when (signal, request, walltime) and what follows it (requeue, exit code)."""

    def __init__(
        self, config: StopOptions, env: Environment, save_dir: Path, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.env = env
        self.save_dir = save_dir
        self.clock = clock
        self.flag = StopFlag(config.signals, clock)
        self.walltime: Walltime | None = None
        self.end_time: float | None = None  # the SLURM job's end time, unix seconds
        self.kill_wait: float | None = None  # SLURM's KillWait, seconds
        self.grace_time: float | None = None  # the SLURM partition's GraceTime for preemptions, seconds
        self._scontrol_missing = False
        self.grace: graces.Grace | None = None  # from a stop's signal to the kill (start())
        self.notice: notices.Notice | None = None  # the cloud's advance notice, once seen
        self.watcher: notices.Watcher | ray_notice.RayWatcher | None = None
        self.cost: graces.StopCost | None = None  # what a stop costs now, from the latest save
        self._grace_warned = False
        self._marker: Callable[..., None] = lambda event, **fields: None  # history.jsonl (start())
        self._step_of: Callable[[], int] = lambda: 0
        self._last_saved: tuple[float, int] | None = None  # (clock, step) of the previous durable save, or the start
        self._upload_s: float | None = None  # the mirror's latest upload of a checkpoint
        self._stopping_at: float | None = None  # when the stop was decided (clock)
        self._start_step: int | None = None  # this process's first step, when an early warning may be held
        self._early_held = False
        self._margin = 0.0  # the walltime keeper's margin when it decided to stop
        self._loader_done: float | None = None  # when the epoch's loader ran out (walltime keeping only)
        # The mirror's wait for the stop's checkpoint (preempt.run.mirroring), after it is durable; its words end the
        # stop's line.

    # ---------------------------------------------------------------- at the start

    def check_restarts(self) -> None:
        """Under SLURM: refuses to train past ``max_restarts``.

        Raises:
            RestartLimitReached: The job's restart count exceeds it (exit code 77).
        """
        count = self.env.slurm_restart_count or 0
        limit = self.config.max_restarts
        if self.env.slurm_job_id and limit is not None and count > limit:
            log.error(
                "SLURM job %s is at restart %d but max_restarts=%d: not training (exit code %d); resubmit the"
                " job to continue from %s",
                self.env.slurm_job_id,
                count,
                limit,
                RESTART_LIMIT_EXIT_CODE,
                self.save_dir,
            )
            raise RestartLimitReached(count, limit)

    def read_slurm_job(self) -> None:
        """Under SLURM: the job's end time (``end_time``, which the run's provenance records), KillWait, and whether
        scontrol is there (one call each)."""
        env = self.env
        end_time: float | None = env.slurm_job_end_time
        if not env.slurm_job_id:
            return
        try:
            job = slurm.show_job(env.slurm_job_id)
        except SlurmError as e:
            self._scontrol_missing = e.missing
            log.warning(
                "SLURM job %s: %s. This job cannot requeue itself: a stop at its time limit will exit with"
                " code %d for a wrapper script to requeue or resubmit it.%s",
                env.slurm_job_id,
                e,
                REQUEUE_FAILED_EXIT_CODE,
                ""
                if end_time
                else " Its end time is unknown too (no SLURM_JOB_END_TIME): walltime keeping needs time_limit=",
            )
        else:
            end_time = end_time or job.end_time
            self.kill_wait = slurm.kill_wait()
            if env.slurm_partition is not None:
                self.grace_time = slurm.grace_time(env.slurm_partition)
            if self.config.requeue and job.requeue is False:
                log.warning(
                    "SLURM job %s has Requeue=0 (--no-requeue): a stop at its time limit cannot requeue it"
                    " and will exit with code %d",
                    env.slurm_job_id,
                    REQUEUE_FAILED_EXIT_CODE,
                )
        self.end_time = end_time

    def arm_walltime(self, state_nbytes: int, step: int, alone: bool = True) -> None:
        """Starts the walltime keeper when there is a deadline: the job's end time or time_limit.

        ``alone``: one process (no peers); only then is an early time-limit warning held (:meth:`pending`)."""
        now, wall = self.clock(), time.time()
        self._start_step = step if alone else None
        limits = []  # (seconds left, what)
        if self.end_time is not None:
            limits.append((self.end_time - wall, f"SLURM job {self.env.slurm_job_id}"))
        if self.config.time_limit_s is not None:
            limits.append((self.config.time_limit_s, f"time_limit={self.config.time_limit_s:g} s"))
        if not limits:
            return
        left, what = min(limits)
        self.walltime = Walltime(now + left, Walltime.prior_save_s(state_nbytes), now, step)
        log.info(
            "walltime: %s ends in %s (at %s); the run stops and saves before then",
            what,
            _log.duration(max(0.0, left)),
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall + left)),
        )

    # ---------------------------------------------------------------- in the loop

    def stop_at(self) -> float:
        return float("inf") if self.walltime is None else self.walltime.stop_at()

    def review_at(self, now: float) -> float:
        if self.flag.held:
            return now  # the next run.step() goes through the safe point, which takes the held stop
        return float("inf") if self.walltime is None else self.walltime.review_at(now)

    def observe(self, step: int) -> None:
        """A safe point: the walltime keeper learns the step time; an early warning is held or taken."""
        if self.walltime is not None:
            self.walltime.observe(self.clock(), step)
        self.pending(step)

    def pending(self, step: int) -> bool:
        """Whether a stop is asked for at ``step``. SLURM's time-limit warning come before this process's first
        step is held until that step is made (:func:`~preempt.cluster.slurm.early_warning`), once."""
        f = self.flag
        if f.held and step != self._start_step:
            f.release()
        elif f.requested and step == self._start_step and not self._early_held and f.received_at is not None:
            wall = time.time()
            signal_time = wall - (self.clock() - f.received_at)
            margin = None if self.walltime is None else self.walltime.margin()
            if slurm.early_warning(
                signal_time=signal_time, end_time=self.end_time, now=wall, progressed=False, margin=margin
            ):
                self._early_held = True
                f.hold()
                assert self.end_time is not None
                log.warning(
                    "%s came %s before SLURM job %s's end time, before this process's first step (SLURM may send"
                    " its --signal warning up to 60 s early): the run makes that step and stops there, so that"
                    " the requeue continues from progress",
                    signal_name(f.signum),
                    _log.duration(self.end_time - signal_time),
                    self.env.slurm_job_id,
                )
        return f.requested

    def decided(self, decision: Decision) -> None:
        if decision.reason is Reason.WALLTIME and self.walltime is not None:
            self._margin = self.walltime.margin()  # for the log line: the save updates the estimate

    def loader_gap(self, seconds: float) -> None:
        """Time outside the steps: a loader's start-up, an epoch's end-of-epoch code."""
        if self.walltime is not None:
            self.walltime.gap(seconds)

    def loader_done(self) -> None:
        if self.walltime is not None:
            self._loader_done = self.clock()

    def epoch_done(self) -> None:
        """The epoch's body returned: the time since its loader ran out was its end-of-epoch code."""
        if self.walltime is not None and self._loader_done is not None:
            self.walltime.gap(self.clock() - self._loader_done)
            self._loader_done = None

    def saved(self, seconds: float, now: float, step: int) -> None:
        """A checkpoint became durable in ``seconds``."""
        if self.walltime is not None:
            self.walltime.saved(seconds, now, step)

    # ---------------------------------------------------------------- notices and the grace

    def start(self, marker: Callable[..., None], step_of: Callable[[], int]) -> None:
        """The run is on: the grace read, the notices' watcher started when asked for. ``marker`` writes a
        history marker, ``step_of`` reads the loop's step (from the watcher's thread)."""
        self._marker, self._step_of = marker, step_of
        self._last_saved = (self.clock(), step_of())  # the first save's steps are timed from here
        cfg, env = self.config, self.env
        torchrun = None
        if env.torchelastic:
            torchrun = graces.from_torchrun(graces.parent_argv(), env.torchrun_shutdown_timeout)
        self.grace = graces.choose(
            option=cfg.grace,
            variable=env.grace_s,
            torchrun=torchrun,
            kill_wait=self.kill_wait,
            grace_time=self.grace_time,
        )
        if self.grace is not None:
            log.debug("grace: %s (%s)", _log.duration(self.grace.seconds), self.grace.source)
        which = cfg.notices or env.notices
        if which is None and ray_notice.in_ray_worker():  # Ray keeps the signals: its drain is the warning
            which = "ray"
        if which is None or (env.local_rank or 0) != 0:  # one watcher per node: the ranks agree on the stop
            return
        platform = notices.Platform(which)
        if platform is notices.Platform.RAY:
            if not ray_notice.in_ray_worker():
                log.warning("notices=ray: this process is not a Ray worker (ray not initialized): no drain is watched")
                return
            self.watcher = ray_notice.RayWatcher(self._noticed, on_trouble=self._notices_down).start()
            log.info("notices: watching %s for a drain of this node", self.watcher.where)
            return
        given = {
            notices.Platform.AWS: env.aws_metadata_endpoint,
            notices.Platform.GCE: env.gce_metadata_host,
            notices.Platform.AZURE: env.azure_metadata_endpoint,
        }[platform]
        address = notices.endpoint(platform, given)
        watcher = notices.Watcher(platform, address, self._noticed, on_trouble=self._notices_down).start()
        self.watcher = watcher
        log.info("notices: watching %s's metadata service at %s for an advance notice", which, watcher.where)

    def _notices_down(self, error: str) -> None:
        """The watcher's thread: its service does not answer (said once)."""
        self._marker("notices_down", error=error[:500])

    def _noticed(self, notice: notices.Notice) -> None:
        """The watcher's thread: the stop flag raised as by a signal; said in the log and the history."""
        self.notice = notice
        self.flag.request(None)
        left = notice.left(time.time())
        when = (
            "its deadline unknown"
            if notice.deadline is None
            else f"the machine goes at {time.strftime('%H:%M:%S', time.localtime(notice.deadline))}, in"
            f" {_log.duration(max(0.0, left or 0.0))}"
        )
        cost = self.cost
        fits = ""
        if cost is not None and left is not None and not cost.fits(left):
            fits = f"; a stop measured {_log.duration(cost.seconds)}: it may not be durable in time"
        log.warning("%s (%s): the run stops and saves at its next step%s", notice.cause, when, fits)
        self._marker("notice", step=self._step_of(), **notice.fields())

    def measuring(self, on_saved: Callable[[SaveRecord, int], None]) -> Callable[[SaveRecord, int], None]:
        """The save scheduler's ``on_saved`` hook: ``on_saved``, then what a stop costs measured against the grace."""

        def saved(record: SaveRecord, nbytes: int) -> None:
            on_saved(record, nbytes)
            self.measured(record, nbytes)

        return saved

    def measured(self, record: SaveRecord, nbytes: int) -> None:
        """A durable checkpoint: what a stop costs now; warned once when that does not fit the grace."""
        if record.write_s is None:
            return
        now, step = self.clock(), record.step
        step_s = self.walltime.step_s if self.walltime is not None else 0.0
        if self._last_saved is not None and step > self._last_saved[1]:
            t0, s0 = self._last_saved
            step_s = max(step_s, (now - t0 - record.stall_s) / (step - s0))
        self._last_saved = (now, step)
        self.cost = graces.StopCost(record.write_s, nbytes, max(0.0, step_s), self._upload_s)
        g = self.grace
        if g is None or self._grace_warned or self.cost.fits(g.seconds):
            return
        self._grace_warned = True
        log.warning("%s", graces.advice(self.cost, g))
        self._marker(
            "grace_short", step=step, grace_s=round(g.seconds, 3), stop_s=round(self.cost.seconds, 3), source=g.source
        )

    def uploaded(self, seconds: float) -> None:
        """The mirror uploaded a checkpoint in ``seconds``: part of a stop's time to durable from now on."""
        self._upload_s = seconds
        if self.cost is not None:
            self.cost = graces.StopCost(self.cost.save_s, self.cost.nbytes, self.cost.step_s, seconds)

    def stopping(self, step: int, peer: int = -1) -> None:
        """The stop is decided, its save comes next: a ``stopping`` marker, left behind if the kill comes first.
        ``peer``: the rank whose stop flag the ranks agreed on (-1: none, or alone)."""
        self._stopping_at = self.clock()
        g = self._grace_now()
        self._marker(
            "stopping",
            step=step,
            cause=self._cause_text(peer),
            grace_s=None if g is None else round(g, 3),
            stop_s=None if self.cost is None else round(self.cost.seconds, 3),
        )

    def _grace_now(self) -> float | None:
        """The grace of the stop under way: a notice's time to its deadline, else the grace known."""
        n = self.notice
        if n is not None and self.flag.signum is None and n.deadline is not None:
            return n.deadline - n.seen_at
        return None if self.grace is None else self.grace.seconds

    def _cause_text(self, peer: int) -> str:
        f = self.flag
        if f.requested and f.signum is not None:
            return signal_name(f.signum)
        if f.requested:
            return "request" if self.notice is None else self.notice.cause
        return f"a stop signal received by rank {peer}" if peer >= 0 else "walltime"

    def close(self) -> BaseException | None:
        """The watcher stopped; the error it kept (a bug, not the service's), returned for the run to raise."""
        w, self.watcher = self.watcher, None
        if w is None:
            return None
        try:
            w.close(timeout=0.5)  # a connect under way cannot be cut off: the daemon thread is left to it
        except Exception as e:
            return e
        return None

    # ---------------------------------------------------------------- the stop

    def stop(
        self,
        loop: LoopState,
        *,
        checkpoint: Path | None,
        peer: int = -1,
        requested: bool | None = None,
        mirror_wait: Callable[[Path | None], str] | None = None,
    ) -> NoReturn:
        """Leaves the run: requeues the job when due, logs why, and raises Preempted.

        ``requested``: whether this process's stop flag was up when the stop was decided (what it told the peers);
        None: read the flag now. A signal that arrives after the decision (the scheduler's SIGTERM for the requeue
        that rank 0's walltime keeper asked for, while another rank is still saving) does not change the cause.
        ``mirror_wait``: waits (bounded) for the stop's checkpoint in the mirror and says so, for the stop's line
        (:meth:`preempt.run.mirroring.Mirroring.at_stop`).
        """
        step, epoch, batch, start_step = loop.global_step, loop.epoch, loop.batch, loop.start_step
        f = self.flag
        now = self.clock()
        if requested is None:
            requested = f.requested
        if not requested and self.walltime is None:
            # Under torch.distributed: another rank received the signal, or rank 0's walltime keeper stopped.
            cause = slurm.Cause.SIGNAL if peer >= 0 else slurm.Cause.WALLTIME
            what = f"a stop signal received by rank {peer}" if peer >= 0 else "rank 0's walltime keeper"
        elif requested and f.signum is None and self.notice is not None:
            cause = slurm.Cause.SIGNAL  # the machine goes as on a signal: SLURM's requeue rule applies unchanged
            left = self.notice.left(time.time())
            what = f"{self.notice.cause} (seen {_log.duration(now - (f.received_at or now))} ago"
            what += ")" if left is None else f", {_log.duration(max(0.0, left))} before its deadline)"
        elif requested:
            cause = slurm.Cause.SIGNAL if f.signum is not None else slurm.Cause.REQUEST
            what = signal_name(f.signum) if f.signum is not None else "request"
            if f.received_at is not None:
                what += f" {_log.duration(now - f.received_at)} after it arrived"
        else:
            cause = slurm.Cause.WALLTIME
            wt = self.walltime
            assert wt is not None
            what = (
                f"walltime ({_log.duration(max(0.0, wt.deadline - now))} before the deadline; margin"
                f" {_log.duration(self._margin)} for steps of {_log.duration(wt.step_s)}, epoch ends of"
                f" {_log.duration(wt.gap_s)} and saves of {_log.duration(wt.save_s)})"
            )
        signal_time = None if f.received_at is None or not requested else time.time() - (now - f.received_at)
        mirrored = mirror_wait(checkpoint) if mirror_wait is not None else ""
        timing = self._timing(requested, cause)
        code, requeued = self._after_stop(cause, signal_time, progressed=step > start_step, step=step)
        log.info(
            "stopping on %s at step %d (epoch %d, batch %d); state in %s%s; exit code %d",
            what,
            step,
            epoch,
            batch,
            checkpoint or "(no checkpoint: nothing had changed)",
            f"; {mirrored}" if mirrored else "",
            code,
        )
        said = signal_name(f.signum) if requested and f.signum is not None else cause.value
        if requested and f.signum is None and self.notice is not None:
            said = self.notice.cause
        path = None if checkpoint is None else str(checkpoint)
        raise Preempted(code, f.signum, path, requeued=requeued, cause=said, timing=timing)

    def _timing(self, requested: bool, cause: slurm.Cause) -> dict[str, float]:
        """The stop's time to durable (from its signal, notice or decision to now: its checkpoint durable, and in the
        mirror when one waits), its grace and margin, for the ``stop`` marker and ``preempt report``."""
        now, f = self.clock(), self.flag
        asked = f.received_at if requested and f.received_at is not None else self._stopping_at
        out: dict[str, float] = {}
        if asked is None:
            return out
        out["durable_s"] = round(now - asked, 3)
        if cause is slurm.Cause.WALLTIME and self.walltime is not None:
            out["margin_s"] = round(self.walltime.deadline - now, 3)
            return out
        g = self._grace_now()
        if g is not None:
            out["grace_s"] = round(g, 3)
            out["margin_s"] = round(g - (now - asked), 3)
        return out

    def _after_stop(
        self, cause: slurm.Cause, signal_time: float | None, *, progressed: bool, step: int
    ) -> tuple[int, bool]:
        """Requeues the SLURM job when the stop is its time limit; returns the exit code and whether it did."""
        env, exit_code = self.env, self.config.exit_code
        if not env.slurm_job_id or not self.config.requeue or (env.rank or 0) != 0:
            return exit_code, False
        job = None
        if cause is slurm.Cause.SIGNAL and not self._scontrol_missing:
            try:
                job = slurm.show_job(env.slurm_job_id, timeout=5.0)
            except SlurmError as e:
                log.warning("SLURM job %s: %s", env.slurm_job_id, e)
        decision = slurm.decide_requeue(
            cause=cause,
            signal_time=signal_time,
            end_time=self.end_time,
            job=job,
            restart_count=env.slurm_restart_count or 0,
            max_restarts=self.config.max_restarts,
            progressed=progressed,
        )
        name = f"SLURM job {env.slurm_job_id}"
        if decision.action is slurm.Action.NONE:
            log.info("%s: not requeued: %s", name, decision.why)
            return exit_code, False
        if decision.action is slurm.Action.REFUSE:
            log.error(
                "%s: not requeued: %s (exit code %d); resubmit the job to continue from %s",
                name,
                decision.why,
                RESTART_LIMIT_EXIT_CODE,
                self.save_dir,
            )
            return RESTART_LIMIT_EXIT_CODE, False
        target = slurm.requeue_target(env.slurm_job_id, env.slurm_array_job_id, env.slurm_array_task_id)
        signals = self.flag.count  # SLURM's SIGTERM for the requeue may come before scontrol returns
        try:
            slurm.requeue(target)
        except SlurmError as e:
            log.error(
                "%s: %s; could not requeue it: %s. The state is saved: requeue or resubmit the job (exit code %d)",
                name,
                decision.why,
                e,
                REQUEUE_FAILED_EXIT_CODE,
            )
            return REQUEUE_FAILED_EXIT_CODE, False
        log.info(
            "%s: %s; requeued it (scontrol requeue %s): restart %d continues from step %d",
            name,
            decision.why,
            target,
            (env.slurm_restart_count or 0) + 1,
            step,
        )
        # SLURM now ends the job with SIGTERM to all its processes. Receive it here, while the handlers are
        # still in place, so that the process exits with the documented code instead of dying of it.
        until = time.monotonic() + 2.0
        while self.flag.count == signals and self.flag.installed and time.monotonic() < until:
            time.sleep(0.01)
        return exit_code, True


def stop_under_way(lines: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``stopping`` marker of the last process in ``lines`` (a history's tail) that has no end after it (no
    ``stop``, ``complete``, ``error`` or ``exit``): that process was killed during its stop. Pure."""
    found = None
    for doc in lines:
        event = doc.get("event")
        if event in ("restoring", "start", "resume", "stop", "complete", "error", "exit"):
            found = None
        elif event == "stopping":
            found = doc
    return found


def killed_stopping(save_dir: Path) -> str | None:
    """When the process before this one was killed during its stop (its ``stopping`` marker is the last word of its
    history): the words for the next process's log, with the stop's grace and measured time; else None."""
    doc = stop_under_way(tail(save_dir / HISTORY_FILE))
    if doc is None:
        return None
    cause = str(doc.get("cause"))[:200]
    grace, cost = doc.get("grace_s"), doc.get("stop_s")
    figures = []
    if isinstance(grace, (int, float)) and not isinstance(grace, bool):
        figures.append(f"its grace {_log.duration(float(grace))}")
    if isinstance(cost, (int, float)) and not isinstance(cost, bool):
        figures.append(f"a stop measured {_log.duration(float(cost))}")
    said = f": {', '.join(figures)}" if figures else ""
    return f"during its stop on {cause} (killed before the stop's checkpoint was durable{said})"
