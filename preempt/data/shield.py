"""Stop signals kept away from DataLoader workers: of every loader iterated while a run is active, and of any asked for.

``timeout``, Ctrl+C and SLURM without ``B:`` signal the whole process group, so DataLoader workers get the SIGTERM
too. torch installs a handler in each worker that ends it on a SIGTERM from anyone but its parent, and the main
process then raises ``DataLoader worker (pid(s) ...) exited unexpectedly`` at its next batch: an evaluation loop
between two ``run.step()`` calls would fail where the run stops cleanly at its next safe point.

**In a worker** (:class:`ShieldedWorkerInit`, the loader's ``worker_init_fn``, which runs after torch's handlers are
in place) the stop signals are ignored (``SIG_IGN``). A worker of the spawn or forkserver start methods ignores them
already while it unpickles its arguments, before torch's worker loop starts, and torch's handler, installed next, is
replaced at once. A worker leaves when the main process shuts it down (torch's own protocol: an event and a ``None``
on its queue), or when the main process dies (torch's workers watch their parent). At interpreter exit,
multiprocessing ends its daemon children with SIGTERM and then waits for them: a shielded worker would ignore that, so
a finalizer that runs first (:func:`release_workers`) shuts down, by torch's protocol, every shielded worker still
alive (every iterator the guard below made, and the persistent iterator of every loader :func:`shield_workers`
shielded): a loader still held at exit (made at module level, kept by a traceback) does not hang the exit.

**In the main process, while a run is active** (:class:`LoaderGuard`): ``DataLoader.__iter__`` is wrapped, so every
loader with workers is shielded when it is iterated, whoever iterates it (``run.batches()``, an evaluation loop, a
callback) and whenever it was made. While its iterator starts the workers the stop signals are blocked in the calling
thread, so that a forked worker is born with them blocked and none reaches it before its ``worker_init_fn`` (a
signal meanwhile waits, a few milliseconds, for the main process's handler). A spawned worker starts with no signal
blocked: one that comes during its interpreter's start-up, before it unpickles its arguments, still ends it. The first
iterator of a loader with ``persistent_workers=True`` is made with torch's generator kept as it was: it draws the
workers' seed from it once per process, which a resumed process does at another point of the run. Persistent workers
started without the shield (the loader was iterated before the run) are restarted with it.

:func:`shield_workers` (``run.protect(loader)``) shields one loader for good, outside the run's window too. Uses
torch's private iterator and worker start-up, through :mod:`preempt._torch_compat` (absent: nothing is restarted or
released).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import signal
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import _log, _torch_compat
from .loaders import shutdown_workers

log = _log.log


def ignore(signals: Iterable[int]) -> None:
    """Ignores ``signals`` in this process, and unblocks them: one pending since the worker's birth is dropped."""
    sigs = {signal.Signals(s) for s in signals}
    for s in sigs:
        signal.signal(s, signal.SIG_IGN)
    if sigs and hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)


class ShieldedWorkerInit:
    """A ``worker_init_fn`` that makes the worker ignore the stop signals, then calls the user's own.

    A module-level class so that it pickles for the spawn and forkserver start methods.
    """

    def __init__(self, signals: Iterable[int], inner: Callable[[int], Any] | None) -> None:
        self.signals = tuple(int(s) for s in signals)
        self.inner = inner

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if not getattr(multiprocessing.current_process(), "_inheriting", False):
            return  # a copy, not a new worker unpickling its arguments
        # A spawn or forkserver worker, before torch's worker loop: ignore the signals now, and again right after
        # torch installs its own handlers (the first thing its worker loop does).
        ignore(self.signals)
        _torch_compat.wrap_worker_signal_handlers(lambda install: _ThenIgnore(install, self.signals), _ThenIgnore)

    def __call__(self, worker_id: int) -> None:
        ignore(self.signals)
        if self.inner is not None:
            self.inner(worker_id)


class _ThenIgnore:
    """torch's worker handlers installed, then the stop signals ignored (in a spawned worker only)."""

    def __init__(self, install: Callable[[], Any], signals: tuple[int, ...]) -> None:
        self.install, self.signals = install, signals

    def __call__(self) -> None:
        self.install()
        ignore(self.signals)


_ITERATORS: weakref.WeakSet[Any] = weakref.WeakSet()  # made by the guard: their workers are shielded
_LOADERS: weakref.WeakSet[Any] = weakref.WeakSet()  # shielded by shield_workers: their persistent iterators are
_RELEASE: list[Any] = []  # the exit finalizer, once registered in this process


def _release_at_exit() -> None:
    if not _RELEASE:
        # exitpriority >= 0: run by multiprocessing's exit function before it terminates and joins its children (and,
        # being higher than the queues' own 10, before their feeder threads are told to quit)
        _RELEASE.append(multiprocessing.util.Finalize(None, release_workers, exitpriority=100))


def release_workers() -> int:
    """Asks the shielded workers of every iterator still alive to leave, as torch's shutdown does; returns how many
    iterators were asked.

    torch's own ``_shutdown_workers`` does nothing once the interpreter is exiting, so this sets the iterator's
    ``_workers_done_event`` and puts ``None`` on each of its ``_index_queues`` itself: each worker leaves its loop
    when it reads it, and multiprocessing's join that follows returns.
    """
    iterators = set(_ITERATORS) | {_torch_compat.loader_iterator(loader) for loader in _LOADERS}
    return sum(_torch_compat.workers_running(it) and _torch_compat.release_workers(it) for it in iterators)


def _live_unshielded(loader: Any) -> bool:
    """The loader keeps persistent workers that were started without the shield."""
    it = _torch_compat.loader_iterator(loader)
    return _torch_compat.workers_running(it) and not isinstance(_torch_compat.worker_init_of(it), ShieldedWorkerInit)


def shield_workers(loader: Any, signals: Iterable[int]) -> Any:
    """Makes the loader's workers ignore ``signals`` from now on, wherever it is iterated; returns the loader.

    Takes effect for workers started afterwards: persistent workers it already keeps unshielded are stopped, and its
    next iteration starts shielded ones (call it between two iterations, not during one). Idempotent.
    """
    if not getattr(loader, "num_workers", 0):
        return loader
    if not isinstance(loader.worker_init_fn, ShieldedWorkerInit):
        loader.worker_init_fn = ShieldedWorkerInit(signals, loader.worker_init_fn)
    _release_at_exit()
    _LOADERS.add(loader)
    if _live_unshielded(loader):
        shutdown_workers(loader)
        log.info(
            "the persistent workers of a DataLoader over %s, started before it was protected from stop signals,"
            " were stopped; its next iteration starts protected ones",
            type(loader.dataset).__name__,
        )
    return loader


class LoaderGuard:
    """While started, every DataLoader iterated in this process is shielded (see the module docstring).

    One per run; nested or successive runs stack, and ``DataLoader.__iter__`` is itself again once the last stops.
    """

    _active: list[LoaderGuard] = []
    _plain: Any = None  # DataLoader.__iter__ as it was when the first guard started

    def __init__(self, signals: Iterable[int]) -> None:
        self.signals = tuple(signals)

    def start(self) -> None:
        active = LoaderGuard._active
        if self in active:
            return
        if not active:
            LoaderGuard._plain = _torch_compat.set_dataloader_iter(_guarded_iter)
        active.append(self)

    def stop(self) -> None:
        active = LoaderGuard._active
        if self not in active:
            return
        active.remove(self)
        if not active and _torch_compat.dataloader_iter() is _guarded_iter:  # left alone if patched after us
            _torch_compat.set_dataloader_iter(LoaderGuard._plain)

    @property
    def started(self) -> bool:
        return self in LoaderGuard._active


def _guarded_iter(loader: Any) -> Any:
    """``DataLoader.__iter__`` while a run is active: shielded workers, born with the signals blocked (see above)."""
    plain = LoaderGuard._plain
    active = LoaderGuard._active
    if not active or not loader.num_workers:
        return plain(loader)
    signals = active[-1].signals
    shield_workers(loader, signals)
    first_persistent = loader.persistent_workers and _torch_compat.loader_iterator(loader) is None
    kept = torch.get_rng_state() if first_persistent else None
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signals) if hasattr(signal, "pthread_sigmask") else None
    try:
        it = plain(loader)
        _ITERATORS.add(it)
        return it
    finally:
        if blocked is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if kept is not None:
            torch.set_rng_state(kept)
