"""The run's save_dir in a Ray Train run's directory, and its newest checkpoint reported to Ray when it ends.

Ray Train restarts a failed or preempted worker group and gives the new workers the last checkpoint a worker
reported (``ray.train.get_checkpoint()``, and ``result.checkpoint`` at the end). preempt resumes from its own
save_dir whatever Ray says, bit for bit; reporting its checkpoint keeps Ray's view the same step. Ray takes a
reported directory where it lies (``CheckpointUploadMode.NO_UPLOAD``: no byte copied) only inside the Ray run's
directory, hence :func:`save_dir`.

When: once, after the run's exit (a stop's checkpoint, or the final one, durable by then), on every rank, since
``ray.train.report`` is a collective of all workers; rank 0 names the checkpoint. A periodic checkpoint is not
reported as it is taken: rank 0 alone knows when its background write becomes durable, and a report from the
training loop would have to meet every rank at the same step. A group that dies without a stop (a SIGKILL) reports
nothing; its restart resumes from preempt's newest durable checkpoint, and the restarted run reports when it ends.

After a stop: rank 0 tells the driver its checkpoint is durable (:func:`preempt.cluster.ray_notice.say_stopped`, for
:func:`preempt.ray.fit`), and, when Ray is draining a node and the stop was not this rank's own signal or the driver's
word, every rank stays until Ray Train's controller ends the group at the drain's deadline (:func:`wait_for_ray`): Ray
2.60 charges a group's end to ``max_preemption_failures`` only then (or when a worker dies with its node), to
``max_failures`` when the workers leave earlier with an error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..cluster import ray_notice
from ..errors import Preempted
from ..run.preemptible import PreemptibleRun
from .signals import held

log = logging.getLogger("preempt")
UNKNOWN_DEADLINE_S = 120.0  # Ray Train's wait for a drain without a deadline (DEFAULT_PREEMPTION_DEADLINE_S, 2.60)
PAST_DEADLINE_S = 60.0  # how long past the deadline a worker waits for Ray Train to end it


def save_dir(name: str = "preempt") -> str:
    """``name`` inside the Ray Train run's directory (``RunConfig(storage_path=..., name=...)``): a path every worker
    sees when the storage is a shared filesystem (a local path of a one-machine cluster, NFS, a mounted bucket).

    Raises:
        RuntimeError: Outside a Ray Train worker, or the run's storage is not a local filesystem (s3://...): give
            the run a local save_dir and ``mirror=`` the bucket instead.
    """
    import pyarrow.fs
    import ray.train

    storage = ray.train.get_context().get_storage()
    if not isinstance(storage.storage_filesystem, pyarrow.fs.LocalFileSystem):
        raise RuntimeError(
            f"preempt.ray.save_dir(): the Ray run's storage {storage.experiment_fs_path!r} is not a local or mounted"
            f" filesystem ({type(storage.storage_filesystem).__name__}); give PreemptibleRun a local save_dir and"
            " mirror= that storage"
        )
    return os.path.join(storage.experiment_fs_path, name)


def report(run: PreemptibleRun, metrics: Mapping[str, Any] | None = None) -> None:
    """Every rank: ``ray.train.report(metrics, checkpoint=...)``, rank 0 naming the run's newest durable checkpoint
    in place (no upload), the others none."""
    import ray.train
    from ray.train import CheckpointUploadMode

    path: Path | None = run.last_checkpoint if run.rank == 0 else None
    checkpoint = None if path is None else ray.train.Checkpoint(str(path))
    metrics = {"step": run.global_step, **(metrics or run.metrics)}
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
    if checkpoint is not None:
        log.info("ray: reported checkpoint %s (step %d) to Ray Train", path, run.global_step)


def drain_ends(now: float) -> float | None:
    """When Ray's drain of this cluster's nodes ends (unix seconds: the latest deadline; a drain without one, Ray
    Train's own wait of :data:`UNKNOWN_DEADLINE_S` from ``now``), or None when no node is draining."""
    draining = ray_notice.draining_nodes()
    if not draining:
        return None
    return max(ms / 1000.0 if ms > 0 else now + UNKNOWN_DEADLINE_S for ms in draining.values())


def wait_for_ray(until: float, clock: Callable[[], float] = time.time) -> None:
    """Stays (the training thread asleep) until ``until`` plus :data:`PAST_DEADLINE_S`: Ray Train's controller ends
    the group at the drain's deadline, counting it as a preemption; a worker still alive then goes on leaving."""
    left = until + PAST_DEADLINE_S - clock()
    log.info("ray: staying until Ray Train ends the group at the drain's deadline (in %.0f s)", max(0.0, left))
    threading.Event().wait(max(0.0, left))
    log.warning("ray: the group was not ended by the drain's deadline; leaving (Ray counts it against max_failures)")


@contextlib.contextmanager
def reporting(
    run: PreemptibleRun, metrics: Mapping[str, Any] | None = None, *, after_drain: str = "stay"
) -> Iterator[PreemptibleRun]:
    """Enters ``run`` and, once it has ended, completed or stopped (``Preempted``), reports its newest checkpoint to
    Ray from every rank (:func:`report`); then a stop goes on leaving (its ``SystemExit``: Ray restarts the group).

    ``with preempt.ray.reporting(PreemptibleRun(save_dir(), model=..., optimizer=...)) as run:``

    While inside, a SIGTERM (SIGUSR1, SIGUSR2) to the worker process stops the run at its next step with a
    checkpoint, as in any other process (:mod:`preempt.ray.signals`: Ray's own handler would end the worker at once).
    After a stop rank 0 tells the driver that its checkpoint is durable (:func:`preempt.ray.fit` waits for it).

    Another way out (an error, another rank lost: ``PeerLost``) leaves without a report: a rank that failed may not
    reach Ray's collective.

    Args:
        run: The run, not yet entered.
        metrics: The metrics reported with the checkpoint (default: ``run.metrics``), ``step`` added.
        after_drain: After a stop while Ray drains a node (the run's notice, or another rank's), ``"stay"``: every
            rank, its checkpoint durable and reported, stays until Ray Train's controller ends the group at the drain's
            deadline, which Ray counts as a preemption (``FailureConfig(max_preemption_failures=...)``, unlimited by
            default); ``"leave"``: the ranks leave at once, and Ray restarts the group sooner but counts it against
            ``max_failures``.
    """
    if after_drain not in ("stay", "leave"):
        raise ValueError(f"after_drain: {after_drain!r}; expected 'stay' or 'leave'")
    with held(run.stopper.flag.request):
        run.__enter__()
        try:
            yield run
        except Preempted as e:
            run.__exit__(type(e), e, e.__traceback__)  # the stop's checkpoint durable, the lock released
            try:
                report(run, metrics)
            finally:
                if run.rank == 0:
                    ray_notice.say_stopped(run.global_step, e.checkpoint)
            own = e.signum is not None or ray_notice.stop_asked() is not None  # a signal, the driver's word
            until = None if own or after_drain == "leave" else drain_ends(time.time())
            if until is not None:
                wait_for_ray(until)
            raise
        except BaseException as e:
            run.__exit__(type(e), e, e.__traceback__)
            raise
        run.__exit__(None, None, None)  # the final checkpoint
        report(run, metrics)
