"""The driver of a Ray Train job stopped by a signal: the workers stop at their next step and save before it leaves.

A cluster manager stops a job by signalling its processes (SIGTERM, then SIGKILL after a grace): the driver, and on
some (SLURM's ``scancel``, a container's process group) the workers too. Left to Ray, the driver exits at once
(``ray.init`` makes SIGTERM a ``sys.exit``) and the job's actors die with it, mid-step. :func:`fit` runs
``trainer.fit()`` in the driver's main thread with a handler of its own for SIGTERM, SIGUSR1 and SIGUSR2 that only
records; a named daemon thread (``preempt-ray-driver``) then:

1. asks this job's runs to stop (:func:`preempt.cluster.ray_notice.ask_stop`: a key in Ray's internal KV store that
   each node's watcher reads, so workers the signal did not reach stop too);
2. waits until rank 0 says the stop's checkpoint is durable (:func:`~preempt.cluster.ray_notice.stopped`), at most
   ``stop_timeout_s``, or until the fit ends by itself;
3. has the main thread leave: the handler, run again on the main thread (``_thread.interrupt_main``), raises
   ``SystemExit(75)`` (:data:`~preempt.errors.PREEMPTED_EXIT_CODE`) out of the fit's wait. The job's actors go with the
   driver, before Ray Train can restart the group; the driver run again resumes from that checkpoint.

The fit stays in the main thread, and no thread of this module touches Ray once the main thread leaves: a thread still
inside Ray when the driver calls ``ray.shutdown()`` makes Ray end the process with code 1. SIGINT stays Ray Train's
(``fit()`` installs its own handler, which aborts the run).
"""

from __future__ import annotations

import _thread
import logging
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..cluster import ray_notice
from ..cluster.signals import signal_name
from ..errors import PREEMPTED_EXIT_CODE

log = logging.getLogger("preempt")
SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
POLL_S = 0.1  # how soon the driver's thread sees the signal and rank 0's answer


class _Leave:
    """The driver's handler: records the first stop signal; once :attr:`leaving`, raises ``SystemExit(75)``."""

    def __init__(self, signums: Sequence[int]) -> None:
        self.signums = tuple(signums)
        self.signum: int | None = None
        self.leaving = False
        self.finished = False  # the fit returned or raised: nothing to interrupt
        self.lock = threading.Lock()
        self._previous: dict[int, Any] = {}

    def __call__(self, signum: int, frame: Any) -> None:
        if self.leaving:
            raise SystemExit(PREEMPTED_EXIT_CODE)
        if self.signum is None:
            self.signum = signum

    def install(self) -> None:
        for sig in self.signums:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()


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
    leave = _Leave(SIGNALS)
    leave.install()
    watching = threading.Thread(target=_watch, args=(leave, stop_timeout_s), name="preempt-ray-driver", daemon=True)
    watching.start()
    try:
        return trainer.fit()
    except BaseException:
        if leave.leaving:  # Ray's wait turns the handler's SystemExit(75) into SystemExit(1)
            raise SystemExit(PREEMPTED_EXIT_CODE) from None
        raise
    finally:
        with leave.lock:
            leave.finished = True
        leave.restore()


def _watch(leave: _Leave, timeout_s: float) -> None:
    """The driver's thread: after a stop signal, asks the workers to stop, waits for rank 0's word, and has the main
    thread leave (75) unless the fit ended first."""
    while leave.signum is None:
        if leave.finished:
            return
        time.sleep(POLL_S)
    why = signal_name(leave.signum)
    ray_notice.ask_stop(why)
    log.warning(
        "ray driver: %s: the workers stop at their next step and save; waiting for their checkpoint (at most %s s)",
        why,
        f"{timeout_s:g}",
    )
    deadline = time.monotonic() + timeout_s
    said = None
    while said is None and not leave.finished and time.monotonic() < deadline:
        said = ray_notice.stopped()
        if said is None:
            time.sleep(POLL_S)
    if said is None and not leave.finished:
        log.warning("ray driver: no word from rank 0 within %s s; leaving all the same", f"{timeout_s:g}")
    elif said is not None:
        log.warning("ray driver: the workers stopped at step %s (%s); exiting", said["step"], said["checkpoint"])
    with leave.lock:
        if not leave.finished:  # the fit still waits on Ray: the handler, run on the main thread, raises there
            leave.leaving = True
            _thread.interrupt_main(signal.Signals(leave.signum))
