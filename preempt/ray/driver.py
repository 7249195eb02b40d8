"""The driver of a Ray Train job stopped by a signal: the workers stop at their next step and save before it leaves.

A cluster manager stops a job by signalling its processes (SIGTERM, then SIGKILL after a grace): the driver, and on
some (SLURM's ``scancel``, a container's process group) the workers too. Left to Ray, the driver exits at once
(``ray.init`` makes SIGTERM a ``sys.exit``) and the job's actors die with it, mid-step. :func:`fit` runs
``trainer.fit()`` in a thread and keeps the driver's main thread for the signals; on one it:

1. asks this job's runs to stop (:func:`preempt.cluster.ray_notice.ask_stop`: a key in Ray's internal KV store that
   each node's watcher reads, so workers the signal did not reach stop too);
2. waits until rank 0 says the stop's checkpoint is durable (:func:`~preempt.cluster.ray_notice.stopped`), at most
   ``stop_timeout_s``, or until the fit ends by itself;
3. leaves with ``SystemExit(75)`` (:data:`~preempt.errors.PREEMPTED_EXIT_CODE`): the job's actors go with the driver,
   before Ray Train can restart the group. The driver run again resumes from that checkpoint.

A second SIGINT while waiting raises ``KeyboardInterrupt`` (:class:`~preempt.cluster.signals.StopFlag`): out at once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..cluster import ray_notice
from ..cluster.signals import StopFlag, signal_name
from ..errors import PREEMPTED_EXIT_CODE

log = logging.getLogger("preempt")
POLL_S = 0.1  # how soon the driver's main thread looks at its stop flag and at rank 0's answer


def fit(trainer: Any, *, stop_timeout_s: float = 300.0) -> Any:
    """``trainer.fit()`` (a ``TorchTrainer`` or any Ray Train trainer), its result; a stop signal to the driver
    stops the workers at their next step with a checkpoint, then the driver exits 75.

    Args:
        trainer: The Ray Train trainer.
        stop_timeout_s: How long the driver waits, after its signal, for rank 0 to say its checkpoint is durable; the
            driver leaves then all the same (the workers' newest durable checkpoint is still resumed from).

    Raises:
        SystemExit: Code 75, after a stop signal (the workers' checkpoint durable, or ``stop_timeout_s`` passed).
    """
    import ray

    if threading.current_thread() is not threading.main_thread():
        return trainer.fit()  # no signal can be caught here: the caller's thread keeps them
    if not ray.is_initialized():
        ray.init()  # before the handlers: ray.init installs its own SIGTERM handler
    flag = StopFlag()
    flag.install()
    done = threading.Event()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as e:  # raised again by the driver's main thread
            outcome["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="preempt-ray-fit", daemon=True).start()
    try:
        while not done.wait(POLL_S):  # the main thread runs the handlers between these waits
            if flag.requested:
                _stop(flag, done, stop_timeout_s)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]
    finally:
        flag.restore()


def _stop(flag: StopFlag, done: threading.Event, timeout_s: float) -> None:
    """Asks the workers to stop, waits for rank 0's word or the fit's end, and leaves (75) unless the fit ended."""
    why = signal_name(flag.signum)
    ray_notice.ask_stop(why)
    log.warning(
        "ray driver: %s: the workers stop at their next step and save; waiting for their checkpoint (at most %s s)",
        why,
        f"{timeout_s:g}",
    )
    deadline = time.monotonic() + timeout_s
    said = None
    while said is None and not done.is_set() and time.monotonic() < deadline:
        said = ray_notice.stopped()
        if said is None:
            done.wait(POLL_S)
    if said is None and done.is_set():
        return  # the fit ended first (completed, or failed): its outcome is the driver's
    if said is None:
        log.warning("ray driver: no word from rank 0 within %s s; leaving all the same", f"{timeout_s:g}")
    else:
        log.warning("ray driver: the workers stopped at step %s (%s); exiting", said["step"], said["checkpoint"])
    raise SystemExit(PREEMPTED_EXIT_CODE)
