"""Exceptions and the process exit codes of preempt.

Every error preempt raises on purpose derives from :class:`PreemptError`, an
ordinary ``Exception``, so ``except Exception`` sees it. Leaving a run because
of a signal is different: it is not an error but the end of this process's
part of the work, so it is a :class:`SystemExit` (:class:`Preempted`) whose
code tells the caller what happened.

Exit codes (documented in README.md too):

* ``0``   the run completed, or a rerun found it already complete.
* ``75``  :data:`PREEMPTED_EXIT_CODE`: a signal (or the walltime keeper)
  asked the run to stop; the state was checkpointed (or nothing had changed
  since the last checkpoint) and running the same command again continues
  exactly there. Under SLURM a stop at the time limit has also requeued the
  job. 75 is ``EX_TEMPFAIL`` from ``sysexits.h``: "temporary failure, retry
  later".
* ``74``  :data:`SAVE_FAILED_EXIT_CODE`: a signal asked the run to stop, but
  the checkpoint of the stop could not be written (disk full, I/O error). The
  previous checkpoints are intact; a rerun continues from the last good one,
  and the steps after it are lost. 74 is ``EX_IOERR``.
* ``76``  :data:`REQUEUE_FAILED_EXIT_CODE`: the run stopped at its SLURM time
  limit with the state saved, but the job could not requeue itself
  (``scontrol`` missing, or SLURM refused: ``--no-requeue``, an interactive
  job); requeue or resubmit it to continue (see :mod:`preempt.cluster.slurm`).
* ``77``  :data:`RESTART_LIMIT_EXIT_CODE`: ``SLURM_RESTART_COUNT`` passed
  ``max_restarts`` (the run refuses to start; nothing changed), or a stop at
  the time limit found the limit reached or no step made since the restart
  (the state is saved and the job is not requeued), so that a job that cannot
  progress stops coming back.
* ``78``  :data:`NONFINITE_EXIT_CODE`: the loss was NaN or infinite too many
  steps in a row; rerun with a lower learning rate. ``preempt supervise``
  does that (divides ``--lr`` by ``--factor``).
* ``79``  :data:`OOM_EXIT_CODE`: too many steps in a row ran out of device
  memory; rerun with a smaller batch. ``preempt supervise`` does that
  (``--batch-size`` becomes ``int(batch_size / factor)``).
* ``80``  :data:`PEER_LOST_EXIT_CODE`: under torch.distributed, a collective
  of the run, or one of the loop's own (DDP's gradient all-reduce), failed
  because another rank went away (it died, or its node did). Nothing is
  saved then (a checkpoint needs every rank's files); the last checkpoint
  stands and a rerun of all ranks continues from it.
* ``81``  :data:`CHECK_ENDED_EXIT_CODE`: inside ``preempt check`` only, the
  run reached the check's last step: its checkpoint is written and the run
  is not marked complete (:mod:`preempt.cli.check`).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

PREEMPTED_EXIT_CODE = 75
SAVE_FAILED_EXIT_CODE = 74
REQUEUE_FAILED_EXIT_CODE = 76
RESTART_LIMIT_EXIT_CODE = 77
# The runtime guards' codes: the process can run again, but only with other hyperparameters.
# 78 is EX_CONFIG ("configuration error") from sysexits.h, the last code defined there; 79 follows it.
NONFINITE_EXIT_CODE = 78
OOM_EXIT_CODE = 79
# A rank lost its peers: rerun every rank (the job, not this process alone).
PEER_LOST_EXIT_CODE = 80
# Inside `preempt check`: the run reached the check's last step (its state is saved for the comparison).
CHECK_ENDED_EXIT_CODE = 81


class PreemptError(Exception):
    """Base class of the errors preempt raises."""


class CheckpointError(PreemptError):
    """A checkpoint on disk cannot be used."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's bytes differ from what its manifest promises.

    Raised for a digest or size mismatch, a missing file, a manifest that does
    not parse or fails its own checksum, and tensor files that are malformed;
    and, when a run resumes, for a value no run could have saved (a random
    generator's state that its generator refuses, a learning rate that is not
    a finite number): a re-signed checkpoint matches every digest, so its
    content is checked too (``preempt.run.restore.check_restored``).
    """


class CheckpointUnreadableError(CheckpointError):
    """A checkpoint cannot be read for a reason of the environment, not of its bytes.

    Permission denied, out of memory, too many open files, an I/O error, a
    network filesystem that went away: the checkpoint may be valid, and the
    same read may succeed once the cause is gone. It is never moved to
    ``quarantine/`` or deleted, and a resume stops with this error rather
    than fall back past it to an older checkpoint. The message names the path
    and the cause (see :func:`preempt.checkpoint.safe_io.resource_error`).
    Uncaught, it ends the process with that message on one line of stderr,
    as :class:`LockedError` does: the message is the whole story.
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        shown_plainly()


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (disk full, I/O error, a read-only disk).

    The partial files were removed and every earlier checkpoint is intact.

    Attributes:
        last_good: The newest checkpoint that is known good, or None.
    """

    def __init__(self, message: str, last_good: str | None = None):
        super().__init__(message)
        self.last_good = last_good


class NoCheckpointError(CheckpointError):
    """No valid checkpoint matches the request.

    Attributes:
        corrupt: One message per matching checkpoint that was found corrupt.
    """

    def __init__(self, message: str, corrupt: list[str] | None = None):
        super().__init__(message)
        self.corrupt = list(corrupt or [])


class MirrorError(PreemptError, OSError):
    """The checkpoint mirror (object storage, :mod:`preempt.mirror`) refused or could not be reached.

    The message names the mirror's URL (without credentials) and the operation; ``errno`` is ``ENOENT`` when the
    object or the bucket does not exist. It is an ``OSError`` too: a failed transfer is an I/O error.
    """


class IncompatibleStateError(PreemptError):
    """A valid checkpoint does not fit the objects it is loaded into.

    Examples: model keys or shapes differ, the optimizer has another number
    of parameter groups, the dataset length changed.
    """


class LockedError(PreemptError):
    """Another process (or another run in this process) holds the save_dir.

    Uncaught, it ends the process with its message on one line of stderr and
    exit status 1, without a traceback (:func:`shown_plainly`): the message
    says everything a traceback would, and who holds the directory.

    Attributes:
        holder: What the lock file says about the holder (pid, host, since,
            purpose); empty when it could not be read.
    """

    def __init__(self, message: str, holder: dict[str, Any] | None = None):
        super().__init__(message)
        self.holder = dict(holder or {})
        shown_plainly()


class LockLostError(LockedError):
    """The save_dir, or its lock file, is no longer the one this run locked.

    The directory was deleted and made again, moved away and replaced, or its
    lock file removed, while the run held it: another process may lock and
    write the directory now, so this run writes nothing more there (no
    checkpoint, no pruning, no completion marker). Raised before any write
    (:meth:`preempt.checkpoint.lock.DirLock.check`, called by the manager the lock is handed to).

    Attributes:
        holder: What the lock file at the path says now (a new run's details), or empty.
        expected: ``{"lock": [st_dev, st_ino], "dir": [st_dev, st_ino]}`` of what the run locked.
        found: The same of what the paths name now (None for a path that names nothing).
    """

    def __init__(
        self,
        message: str,
        holder: dict[str, Any] | None = None,
        *,
        expected: dict[str, Any] | None = None,
        found: dict[str, Any] | None = None,
    ):
        super().__init__(message, holder)
        self.expected = dict(expected or {})
        self.found = dict(found or {})


class SlurmError(PreemptError):
    """``scontrol`` is missing, did not answer, or refused.

    Attributes:
        missing: scontrol is not on PATH (as inside some containers).
    """

    def __init__(self, message: str, *, missing: bool = False):
        super().__init__(message)
        self.missing = missing


class UnsupportedStateError(PreemptError):
    """State that can be saved neither as a tensor nor as JSON.

    preempt never pickles, so a checkpoint can be opened safely from an
    untrusted source; the message names the key that holds the value.
    """


def _rebuilt(cls: type[SystemExit], args: tuple[Any, ...], state: dict[str, Any]) -> SystemExit:
    e = cls.__new__(cls, *args)
    SystemExit.__init__(e, *args)
    e.__dict__.update(state)
    return e


def _reduce_whole(self: SystemExit) -> tuple[Any, ...]:
    """A leaving exception pickled with its attributes, not rebuilt through its ``__init__`` from ``args`` (the
    default, which these signatures refuse): Ray Train sends a worker's exception to its controller pickled."""
    return (_rebuilt, (type(self), self.args, dict(self.__dict__)))


class PeerLost(SystemExit):
    """A collective of the run failed on this rank: another rank is gone. Exit code 80 (``PEER_LOST_EXIT_CODE``).

    A rank that dies closes its connections, so the others notice at their
    next collective (DDP's all-reduce in ``backward()`` or their next
    ``run.step()``, within a second here); a rank
    whose node vanishes without closing them is noticed when the collective
    times out (``timeout=`` of ``init_process_group``). Raised from the
    error of the collective (``__cause__``); ``str()`` is the message.

    Attributes:
        rank: This process's rank.
        world_size: The number of ranks.
        during: The collective that failed, in words (``"the agreement at a safe point"``).
    """

    __reduce__ = _reduce_whole

    def __init__(self, rank: int, world_size: int, during: str, error: BaseException) -> None:
        super().__init__(PEER_LOST_EXIT_CODE)
        self.rank = rank
        self.world_size = world_size
        self.during = during
        lines = str(error).strip().splitlines()
        first = lines[0] if lines else ""
        self.message = (
            f"rank {rank} of {world_size} lost the other ranks during {during} ({type(error).__name__}: "
            f"{first[:300]}): a rank died or its node went away. Nothing is saved now (a checkpoint needs every "
            f"rank); the last checkpoint stands and a rerun of all ranks continues from it (exit code "
            f"{PEER_LOST_EXIT_CODE})"
        )

    def __str__(self) -> str:
        return self.message


class Preempted(SystemExit):
    """Raised at a step boundary after a stop signal; leaves the run.

    The state is durable on disk when this is raised. The process exits with
    :data:`PREEMPTED_EXIT_CODE` unless the run was configured otherwise.

    Under SLURM, a stop at the job's time limit requeues the job first; the
    code is then still 75, or :data:`REQUEUE_FAILED_EXIT_CODE` when the
    requeue was impossible, or :data:`RESTART_LIMIT_EXIT_CODE` when it was
    refused.

    Attributes:
        signum: The signal that asked for the stop (None: the walltime keeper or request_stop()).
        checkpoint: The directory of the checkpoint that holds the state.
        requeued: This process requeued its SLURM job.
        cause: What asked for the stop, for people and ``preempt report``:
            a signal's name (``"SIGTERM"``), ``"walltime"``, ``"request"`` or a cloud's notice
            (``"aws notice: spot instance-action: terminate"``).
        timing: The stop's seconds, where known: ``durable_s`` (from its signal or notice to its checkpoint
            durable), ``grace_s`` (to the kill), ``margin_s`` (grace minus durable; to the deadline for walltime).
    """

    def __init__(
        self,
        code: int,
        signum: int | None,
        checkpoint: str | None,
        *,
        requeued: bool = False,
        cause: str = "",
        timing: dict[str, float] | None = None,
    ):
        super().__init__(code)
        self.signum = signum
        self.checkpoint = checkpoint
        self.requeued = requeued
        self.cause = cause
        self.timing = dict(timing or {})

    __reduce__ = _reduce_whole


class SaveFailed(SystemExit):
    """Raised when the checkpoint a stop signal asked for cannot be written.

    The process exits with :data:`SAVE_FAILED_EXIT_CODE` (not 75: the state at
    the stop is not on disk). The log says which checkpoint a rerun will use.

    Attributes:
        signum: The signal that asked for the stop.
        last_good: The newest good checkpoint, or None.
        error: The error that made the write fail.
    """

    __reduce__ = _reduce_whole

    def __init__(self, code: int, signum: int | None, last_good: str | None, error: BaseException):
        super().__init__(code)
        self.signum = signum
        self.last_good = last_good
        self.error = error


class RestartLimitReached(SystemExit):
    """Raised on entering a run whose SLURM restart count exceeds ``max_restarts``; exit code 77.

    Nothing was loaded or changed. Resubmit the job (a new job starts its count at 0) or raise the limit.

    Attributes:
        restart_count: ``SLURM_RESTART_COUNT``.
        max_restarts: The limit.
    """

    __reduce__ = _reduce_whole

    def __init__(self, restart_count: int, max_restarts: int):
        super().__init__(RESTART_LIMIT_EXIT_CODE)
        self.restart_count = restart_count
        self.max_restarts = max_restarts


class RunComplete(SystemExit):
    """Raised on entering a run whose save_dir is marked complete; exit code 0."""

    __reduce__ = _reduce_whole

    def __init__(self, save_dir: str):
        super().__init__(0)
        self.save_dir = save_dir


# ---------------------------------------------------------------- how an uncaught error ends the process

_PLAIN = (LockedError, CheckpointUnreadableError)  # errors whose message is the whole story: one line, no traceback
_previous_hook: Any = None


def shown_plainly() -> None:
    """Makes an uncaught :class:`LockedError` or :class:`CheckpointUnreadableError` end the process with one line on
    stderr (exit status 1).

    Installs a ``sys.excepthook`` once, chained to the one it replaces, which
    handles every other exception as before. Python exits with status 1 after
    any uncaught exception; the hook only changes what is printed:
    ``[preempt] error: <message>`` instead of a traceback. With the ``preempt``
    logger at DEBUG (``PREEMPT_LOG_LEVEL=DEBUG``) the traceback is printed as
    well. Called when such an error is made, so a process that never meets one
    keeps its hook untouched.
    """
    global _previous_hook
    if sys.excepthook is _plain_hook:
        return
    _previous_hook = sys.excepthook
    sys.excepthook = _plain_hook


def _plain_hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    previous = _previous_hook if _previous_hook is not None else sys.__excepthook__
    if not isinstance(value, _PLAIN) or logging.getLogger("preempt").isEnabledFor(logging.DEBUG):
        previous(kind, value, tb)
        if not isinstance(value, _PLAIN):
            return
    message = " ".join(str(value).split())  # one line, whatever the message holds
    try:
        sys.stderr.write(f"[preempt] error: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed: the exit status still says it
        pass
