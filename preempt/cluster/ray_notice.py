"""Ray's warning that this node goes (its node draining), read as an advance notice.

When a Ray node is drained for preemption (``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds N``, or the autoscaler's drain of a spot node), Ray's GCS lists the node among the
draining ones with the deadline in unix milliseconds (0: none given). :class:`RayWatcher` polls that list from a named
daemon thread and calls ``on_notice`` once, with a :class:`~preempt.cluster.notices.Notice` of platform ``ray`` whose
deadline is the drain's, the first time it names this process's node; the run then stops at its next step as on any
cloud notice (:mod:`preempt.run.stopping`), the other ranks with it (they agree on a stop at each step).

Where it is read: ``ray._private.state.state.get_draining_nodes()``, the GCS call Ray Train's own
``PreemptionWatcher`` makes (ray 2.60). ``ray.train.get_preemption_info()`` says the same but is a collective every
worker must call the same number of times from its training thread, so a watcher thread cannot use it. The private
call is behind one function, :func:`draining_nodes`, tested against the installed ray; if a later ray moves it, the
watcher says so once (as a metadata service that does not answer) and the run goes on without notices.

Signals in a Ray worker: Ray runs the training function of a ``TorchTrainer`` in a thread of the worker actor and
keeps the main thread with its own SIGTERM handler (it ends the actor), so the run catches no signal there by itself
(``preempt.ray.reporting`` installs one on that thread); the drain is the warning a Ray worker gets
(:func:`in_ray_worker`: the run watches it without being asked).

The driver's word: a driver stopped by a signal (``preempt.ray.fit``) writes a key of this job in Ray's internal KV
store (:func:`ask_stop`); the watcher reads it at each poll beside the draining nodes and stops the run as on a drain,
without a deadline. Rank 0 answers once the stop's checkpoint is durable (:func:`say_stopped`), which the driver waits
for before it leaves (the job's actors die with their driver). The keys are per Ray job, so a rerun of the driver never
reads an old one.

Imports ray only inside the functions that read it: ``import preempt`` never imports ray; :func:`in_ray_worker`
looks at ``sys.modules`` only (a process that has not imported ray is not a Ray worker).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from .notices import Notice, Platform

log = logging.getLogger("preempt")


def _nothing() -> None:
    return None


def in_ray_worker() -> bool:
    """Whether this process is a Ray actor (a Ray Train worker is one), without importing ray."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        return bool(ray.is_initialized()) and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # a ray too old or too new for these calls: not one we know how to watch
        return False


def this_node() -> str:
    """The hex id of the Ray node this process runs on."""
    import ray

    return str(ray.get_runtime_context().get_node_id())


def draining_nodes() -> dict[str, int]:
    """``{node id (hex): deadline in unix ms, 0 when none}`` of the nodes Ray is draining now, from the GCS."""
    from ray._private import state

    return dict(state.state.get_draining_nodes() or {})


KV_NAMESPACE = "preempt"


def _job() -> str:
    import ray

    return str(ray.get_runtime_context().get_job_id())


def _kv_get(key: str) -> str | None:
    from ray.experimental import internal_kv

    value = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
    return None if value is None else bytes(value).decode()


def _kv_put(key: str, value: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value, overwrite=True, namespace=KV_NAMESPACE)


def ask_stop(why: str) -> None:
    """The driver: asks this job's runs to stop at their next step (``why``: what stopped the driver)."""
    _kv_put(f"stop/{_job()}", why)


def stop_asked() -> str | None:
    """What the driver of this job said when it asked the runs to stop (:func:`ask_stop`), or None."""
    return _kv_get(f"stop/{_job()}")


def say_stopped(step: int, checkpoint: str | None) -> None:
    """Rank 0, after a stop: its checkpoint is durable (the driver may leave)."""
    _kv_put(f"stopped/{_job()}", json.dumps({"step": step, "checkpoint": checkpoint}))


def stopped() -> dict[str, Any] | None:
    """What rank 0 said of this job's stop (:func:`say_stopped`): ``{"step", "checkpoint"}``, or None."""
    said = _kv_get(f"stopped/{_job()}")
    return None if said is None else dict(json.loads(said))


def parse_ray(draining: Mapping[str, int], node_id: str, now: float) -> Notice | None:
    """The notice for ``node_id`` when the GCS lists it as draining (its deadline, unix ms; 0: none), else None."""
    if node_id not in draining:
        return None
    deadline_ms = draining[node_id]
    deadline = deadline_ms / 1000.0 if deadline_ms and deadline_ms > 0 else None
    return Notice(Platform.RAY, f"node {node_id[:12]} draining", deadline, now)


class RayWatcher:
    """Polls Ray's draining nodes until this node is among them, or until :meth:`close`.

    Args:
        on_notice: Called once, from the thread, with the first notice.
        node_id: The node watched (None: this process's, read when the thread starts).
        every_s: Seconds between polls (a GCS call of about a millisecond).
        clock: Wall-clock seconds (the drain's deadline is in unix time).
        on_trouble: Called once, from the thread, with the first failure to read the list (after its warning).
        read: The list's reader (:func:`draining_nodes`).
        read_stop: The driver's word's reader (:func:`stop_asked`; by default read only where ``read`` is Ray's own).
    """

    platform = Platform.RAY
    retry_s = 5.0

    def __init__(
        self,
        on_notice: Callable[[Notice], None],
        *,
        node_id: str | None = None,
        every_s: float = 0.5,
        clock: Callable[[], float] = time.time,
        on_trouble: Callable[[str], None] | None = None,
        read: Callable[[], Mapping[str, int]] = draining_nodes,
        read_stop: Callable[[], str | None] | None = None,
    ) -> None:
        self.on_notice, self.on_trouble = on_notice, on_trouble
        self.node_id = node_id
        self.every_s, self.clock, self.read = every_s, clock, read
        self.read_stop = read_stop or (stop_asked if read is draining_nodes else _nothing)
        self.notice: Notice | None = None
        self.requests = 0
        self.error: BaseException | None = None  # not Ray's: raised again by close()
        self.trouble: str | None = None
        self._said = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="preempt-notices-ray", daemon=True)

    @property
    def where(self) -> str:
        return f"Ray's GCS (draining nodes; this node {self.node_id or '?'})"

    def start(self) -> RayWatcher:
        if self.node_id is None:
            self.node_id = this_node()
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stops the thread and raises the error it kept, if any."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _run(self) -> None:
        assert self.node_id is not None
        try:
            while not self._stop.is_set():
                try:
                    self.requests += 1
                    draining = self.read()
                    asked = self.read_stop()
                except Exception as e:  # the GCS unreachable, or a ray whose call moved: said once, retried
                    if self._stop.is_set():
                        return
                    self._failed(e)
                    self._stop.wait(self.retry_s)
                    continue
                if self.trouble is not None:
                    log.info("notices=ray: Ray's draining nodes read again")
                    self.trouble = None
                now = self.clock()
                notice = parse_ray(draining, self.node_id, now)
                if notice is None and asked is not None:
                    notice = Notice(Platform.RAY, f"the driver was stopped ({asked})", None, now)
                if notice is not None:
                    self.notice = notice
                    self.on_notice(notice)
                    return
                self._stop.wait(self.every_s)
        except BaseException as e:  # a bug, not Ray's: kept for close()
            self.error = e

    def _failed(self, e: BaseException) -> None:
        self.trouble = f"{type(e).__name__}: {e}"
        if not self._said:
            self._said = True
            log.warning(
                "notices=ray: Ray's draining nodes cannot be read (%s): no drain can stop this run until they can"
                " (retried every %s)",
                self.trouble,
                f"{self.retry_s:g} s",
            )
            if self.on_trouble is not None:
                self.on_trouble(self.trouble)
