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
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import Preempted
from ..run.preemptible import PreemptibleRun

log = logging.getLogger("preempt")


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


@contextlib.contextmanager
def reporting(run: PreemptibleRun, metrics: Mapping[str, Any] | None = None) -> Iterator[PreemptibleRun]:
    """Enters ``run`` and, once it has ended, completed or stopped (``Preempted``), reports its newest checkpoint to
    Ray from every rank (:func:`report`); then a stop goes on leaving (its ``SystemExit``: Ray restarts the group).

    ``with preempt.ray.reporting(PreemptibleRun(save_dir(), model=..., optimizer=...)) as run:``

    Another way out (an error, another rank lost: ``PeerLost``) leaves without a report: a rank that failed may not
    reach Ray's collective.
    """
    run.__enter__()
    try:
        yield run
    except Preempted as e:
        run.__exit__(type(e), e, e.__traceback__)  # the stop's checkpoint durable, the lock released
        report(run, metrics)
        raise
    except BaseException as e:
        run.__exit__(type(e), e, e.__traceback__)
        raise
    run.__exit__(None, None, None)  # the final checkpoint
    report(run, metrics)
