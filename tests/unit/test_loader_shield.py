"""preempt/data/shield.py: the workers of every DataLoader iterated while a run is active, and of any loader given
to run.protect(), ignore the stop signals (run.protect() outside the run, and the exit with a loader still held:
tests/process/test_eval_loaders.py).

The signals are real (``os.kill`` of the worker processes) and sent once the state is reached: after the first batch
has come back, or, for a worker still starting, while its signals are blocked since its birth.
"""

from __future__ import annotations

import copy
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils.data import DataLoader

from preempt.data.loaders import shutdown_workers
from preempt.data.shield import LoaderGuard, ShieldedWorkerInit, release_workers, shield_workers

STOP = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


@contextmanager
def guarded() -> Iterator[LoaderGuard]:
    guard = LoaderGuard(STOP)
    guard.start()
    try:
        yield guard
    finally:
        guard.stop()


def loader(**options) -> DataLoader:
    return DataLoader(torch.arange(64), batch_size=4, num_workers=2, **options)


def sigterm_each_worker(it) -> list[int]:
    pids = [w.pid for w in it._workers]
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    return pids


def test_the_guard_wraps_dataloader_iteration_only_while_a_run_is_active():
    plain = DataLoader.__dict__["__iter__"]
    outer, inner = LoaderGuard(STOP), LoaderGuard(STOP)
    outer.start()
    inner.start()
    wrapped = DataLoader.__dict__["__iter__"]
    assert wrapped is not plain and outer.started and inner.started
    inner.stop()
    assert DataLoader.__dict__["__iter__"] is wrapped  # another run is still active
    outer.stop()
    assert DataLoader.__dict__["__iter__"] is plain and not outer.started


def test_workers_of_any_loader_iterated_under_the_guard_survive_sigterm():
    """An evaluation-style loader the run never saw: SIGTERM to each worker after the first batch, all 16 come."""
    data = loader()
    with guarded():
        it = iter(data)
        batches = [next(it)]
        assert isinstance(it._worker_init_fn, ShieldedWorkerInit)
        sigterm_each_worker(it)
        batches += list(it)
    assert torch.equal(torch.cat(batches), torch.arange(64))
    unguarded = iter(loader())  # after the run: torch's workers as they always were
    assert not isinstance(unguarded._worker_init_fn, ShieldedWorkerInit)
    del unguarded


def test_persistent_workers_started_before_the_run_are_restarted_shielded():
    data = loader(persistent_workers=True)
    assert torch.equal(torch.cat(list(data)), torch.arange(64))
    before = [w.pid for w in data._iterator._workers]
    with guarded():
        it = iter(data)
        first = next(it)
        assert [w.pid for w in it._workers] != before and isinstance(it._worker_init_fn, ShieldedWorkerInit)
        sigterm_each_worker(it)
        assert torch.equal(torch.cat([first, *it]), torch.arange(64))
        assert torch.equal(torch.cat(list(data)), torch.arange(64))  # the next epoch, same (shielded) workers
    shutdown_workers(data)


def test_the_first_iterator_of_persistent_workers_leaves_torchs_generator_alone():
    """It draws the workers' seed once per process: a resumed process would draw it at another step."""
    with guarded():
        torch.manual_seed(3)
        state = torch.get_rng_state()
        persistent = loader(persistent_workers=True)
        list(persistent)
        assert torch.equal(torch.get_rng_state(), state)
        list(loader())  # a new iterator per epoch draws every time, in every process alike: as torch does
        assert not torch.equal(torch.get_rng_state(), state)
    shutdown_workers(persistent)


def test_a_copy_of_the_worker_init_does_not_shield_the_main_process():
    before = signal.getsignal(signal.SIGTERM)
    copy.deepcopy(ShieldedWorkerInit(STOP, None))
    pickled = ShieldedWorkerInit(STOP, None)
    pickled.__setstate__(dict(vars(pickled)))
    assert signal.getsignal(signal.SIGTERM) is before


def test_shield_workers_is_idempotent_and_leaves_a_loader_without_workers_alone():
    data = loader()
    user = data.worker_init_fn = print
    shield_workers(data, STOP)
    init = data.worker_init_fn
    assert isinstance(init, ShieldedWorkerInit) and init.inner is user
    assert shield_workers(data, STOP) is data and data.worker_init_fn is init
    single = DataLoader(torch.arange(4))
    assert shield_workers(single, STOP).worker_init_fn is None
    assert release_workers() == 0  # nothing alive to release
