"""PreemptibleRun(async_save=True): snapshots written by the background writer, in one process.

The writer is held or made to fail at a chosen stage of the commit through
the fault point ``commit`` of ``preempt._testing``, from inside the writer thread, so each test knows
exactly which save is in flight while the loop goes on.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import model_and_optimizer_tensors, read_into
from torch.utils.data import DataLoader, TensorDataset

from preempt import CheckpointManager, CheckpointWriteError, Preempted, PreemptibleRun, _testing
from preempt.checkpoint.staging import Stager

WRITER = "preempt-writer"


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    return model, opt, data


def train_step(model, opt, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


snapshot = model_and_optimizer_tensors


def loaded(path: Path) -> dict[str, torch.Tensor]:
    """The model and optimizer tensors of a checkpoint, read back through a fresh model and optimizer."""
    model, opt, _ = build()
    return read_into(path, model, opt)


class Gate:
    """Holds the background writer at a stage of the commit until released, or makes it fail there."""

    def __init__(self, stage: str = "before_manifest", error: BaseException | None = None, times: int = 1):
        self.stage, self.error, self.times = stage, error, times
        self.reached = threading.Event()
        self.release = threading.Event()
        self.hits = 0

    def __call__(self, stage: str, cancel: object = None) -> None:
        if stage != self.stage or threading.current_thread().name != WRITER or self.hits >= self.times:
            return
        self.hits += 1
        self.reached.set()
        if self.error is not None:
            raise self.error
        assert self.release.wait(30), "test never released the writer"


@contextlib.contextmanager
def gated(gate: Gate) -> Iterator[Gate]:
    _testing.install("commit", gate)
    try:
        yield gate
    finally:
        gate.release.set()
        _testing.install("commit", None)


def stepper(run, model, opt, data):
    """This epoch's batches; each call of the returned function trains and counts ``n`` steps."""
    it = iter(run.batches(DataLoader(data, batch_size=4, sampler=run.sampler(data, seed=0))))

    def step(n: int = 1, metrics=None) -> None:
        for _ in range(n):
            train_step(model, opt, *next(it))
            run.step(metrics)

    return step


def steps(run, model, opt, data, n: int, *, on_step=None):
    """Runs n optimizer steps inside one epoch; on_step(run) is called before each run.step()."""
    loader = DataLoader(data, batch_size=4, sampler=run.sampler(data, seed=0))
    done = 0
    for x, y in run.batches(loader):
        train_step(model, opt, x, y)
        if on_step is not None:
            on_step(run)
        run.step()
        done += 1
        if done == n:
            return


def test_snapshot_is_the_state_of_its_step_while_the_loop_goes_on(tmp_path):
    model, opt, data = build()
    with gated(Gate()) as gate, PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_every_steps=3) as run:
        next(run.epochs(1))
        want: dict[str, torch.Tensor] = {}

        def at_step(run):
            if run.global_step + 1 == 3:
                want.update(snapshot(model, opt))

        steps(run, model, opt, data, 6, on_step=at_step)  # step 3 is staged; steps 4-6 change every tensor
        assert gate.reached.wait(10)
        rec = run.last_save
        assert rec is not None and rec.step == 3 and rec.background and not rec.durable and rec.write_s is None
        assert run.last_checkpoint is None  # not durable until the writer is done
        gate.release.set()
        path = run.wait_for_checkpoint(timeout=30)
        assert path == tmp_path / "step_000000003"
        rec = run.last_save
        assert rec.durable and rec.path == path and rec.write_s >= rec.stall_s >= 0
        run.request_stop()
        with pytest.raises(Preempted):
            run.step()
    got = loaded(tmp_path / "step_000000003")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    assert not torch.equal(got["model.0.weight"], model.state_dict()["0.weight"])  # the loop did move on


def test_the_buffers_sized_after_the_first_step_are_the_ones_the_first_checkpoint_uses(tmp_path):
    """The buffers are sized for what a save stages, the random generators' states included, so the first checkpoint
    neither allocates nor (on a GPU) pins its arenas again during the step."""
    model, opt, data = build()
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_every_steps=2, keep_last=None) as run:
        next(run.epochs(1))
        step = stepper(run, model, opt, data)
        # The buffers sized at the start (no moments yet) are ready: step 1's run.step() then sizes them again for
        # the whole state at once (with the start's sizing still in flight, it would at step 2, before the save).
        run.wait_for_checkpoint()
        step()  # step 1: the moments exist; the buffers are sized for them in the background
        run.wait_for_checkpoint()
        sized = dict(run.saves.stager._files)
        step()  # step 2: the first checkpoint
        assert run.last_save.step == 2
        assert sized and run.saves.stager._files == sized  # the same arenas, none made anew
        assert run.wait_for_checkpoint() == tmp_path / "step_000000002"


@pytest.mark.parametrize("slow_prepare", [False, True])
def test_a_periodic_save_due_during_a_write_is_postponed_not_waited_for(tmp_path, caplog, monkeypatch, slow_prepare):
    """slow_prepare: the buffers' first sizing still runs at step 2 (a loaded machine); the re-sizing for the
    optimizer must then not take the writer before the postponed save (it once did: the save was skipped)."""
    if slow_prepare:
        prepare = Stager.prepare

        def slow(self, payload, stop=None):
            threading.Event().wait(0.3)
            prepare(self, payload, stop)

        monkeypatch.setattr(Stager, "prepare", slow)
    model, opt, data = build()
    caplog.set_level(logging.DEBUG, logger="preempt")
    with gated(Gate()) as gate, PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_every_steps=2) as run:
        next(run.epochs(1))
        step = stepper(run, model, opt, data)
        step(4)  # step 2 is staged and held; step 4 comes due while it is in flight
        assert gate.reached.wait(10) and run.last_save.step == 2 and not run.last_save.durable
        assert "a steps checkpoint is due while a write is in flight: postponed" in caplog.text
        gate.release.set()
        assert run.wait_for_checkpoint(timeout=30) == tmp_path / "step_000000002"
        step()  # step 5: the postponed save is taken now
        assert run.last_save.step == 5 and run.last_save.reason == "steps"
        assert run.wait_for_checkpoint(timeout=30) == tmp_path / "step_000000005"


def test_a_best_checkpoint_waits_for_the_write_in_flight(tmp_path):
    model, opt, data = build()
    gate = Gate()
    kw = dict(checkpoint_every_steps=2, best_metric="loss", keep_best=1)
    with gated(gate), PreemptibleRun(tmp_path, model=model, optimizer=opt, **kw) as run:
        next(run.epochs(1))
        step = stepper(run, model, opt, data)
        step(2)
        assert gate.reached.wait(10)
        threading.Timer(0.3, gate.release.set).start()
        step(metrics={"loss": 0.5})  # step 3 is the best so far: it must be that step's state, so it waits
        assert run.last_save.step == 3 and run.last_save.reason == "best"
        assert run.last_checkpoint == tmp_path / "step_000000002"  # the held write was finished first
        assert run.wait_for_checkpoint(timeout=30) == tmp_path / "step_000000003"


def test_stop_while_a_periodic_write_is_in_flight_cancels_it_and_saves_the_current_state_once(tmp_path, caplog):
    """The stop does not wait for a stale write: it is cancelled before its rename; the stop's save writes
    over its files (recycling)."""
    model, opt, data = build()
    caplog.set_level(logging.DEBUG, logger="preempt")  # a routine background write would say "written" at DEBUG
    gate = Gate()
    with gated(gate), pytest.raises(Preempted) as stop:
        with PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_every_steps=2) as run:
            next(run.epochs(1))

            def at_step(run):
                if run.global_step + 1 == 3:
                    assert gate.reached.wait(10)  # step 2's write is held before its manifest
                    threading.Timer(0.3, gate.release.set).start()
                    run.request_stop()

            steps(run, model, opt, data, 10, on_step=at_step)
    assert stop.value.code == 75 and stop.value.checkpoint == str(tmp_path / "step_000000003")
    text = caplog.text
    assert "the background write of step 2 (steps) was cancelled" in text
    assert "step_000000002 (steps) written" not in text and "step_000000003 (preempt) written" in text
    manager = CheckpointManager(tmp_path, owner=False)
    assert [c.step for c in manager.list()] == [3] and not manager.verify(manager.list()[0])
    assert not list(tmp_path.glob(".tmp-*")), "the cancelled write left its partial files"
    assert not list(tmp_path.glob(".recycle-*")), "the stop's save did not take the cancelled write's files"
    assert torch.equal(loaded(tmp_path / "step_000000003")["model.0.weight"], model[0].weight.detach())


def test_stop_while_a_best_write_is_in_flight_waits_for_it(tmp_path, caplog):
    """A best checkpoint is kept for its own sake: the stop lets it become durable, then saves its own state."""
    model, opt, data = build()
    caplog.set_level(logging.INFO, logger="preempt")
    gate = Gate()
    with gated(gate), pytest.raises(Preempted) as stop:
        with PreemptibleRun(
            tmp_path, model=model, optimizer=opt, checkpoint_interval=None, best_metric="loss", keep_best=1
        ) as run:
            next(run.epochs(1))
            step = stepper(run, model, opt, data)
            step(1, metrics={"loss": 1.0})  # step 1: a best checkpoint, held by the gate
            assert gate.reached.wait(10)
            threading.Timer(0.3, gate.release.set).start()
            run.request_stop()
            step(1, metrics={"loss": 2.0})
    assert stop.value.checkpoint == str(tmp_path / "step_000000002")
    assert caplog.text.index("step_000000001 (best) written") < caplog.text.index("step_000000002 (preempt) written")
    assert [c.step for c in CheckpointManager(tmp_path, owner=False).list()] == [2, 1]


def test_a_writer_out_of_disk_is_logged_at_the_next_step_and_training_goes_on(tmp_path, caplog):
    model, opt, data = build()
    full = OSError(errno.ENOSPC, "No space left on device")
    with gated(Gate(error=full)) as gate:
        with PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_every_steps=2) as run:
            next(run.epochs(1))
            steps(run, model, opt, data, 2)  # step 2 staged; its write fails
            assert gate.reached.wait(10)
            assert run.saves.wait_idle(10)  # ended; its outcome is taken by the next step
            assert run.failed_saves == 0  # not seen yet: the loop learns it at its next step
            steps_more = DataLoader(data, batch_size=4)
            x, y = next(iter(steps_more))
            train_step(model, opt, x, y)
            run.step()  # step 3
            assert run.failed_saves == 1
            assert "could not write checkpoint step_000000002 (steps)" in caplog.text
            assert "ENOSPC" in caplog.text and "training goes on" in caplog.text
            assert run.last_checkpoint is None
            for _ in range(3):
                train_step(model, opt, x, y)
                run.step()
            assert run.wait_for_checkpoint(timeout=30) is not None
            run.request_stop()
            with pytest.raises(Preempted):
                run.step()
    assert not list(tmp_path.glob(".tmp-*")), "the failed write left its partial files"


def test_any_other_writer_failure_is_raised_by_the_next_step(tmp_path):
    model, opt, data = build()
    gate = Gate(error=RuntimeError("xxhash exploded"))
    with gated(gate), pytest.raises(CheckpointWriteError, match=r"step_000000002.*xxhash exploded") as err:
        with PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_every_steps=2) as run:
            next(run.epochs(1))
            step = stepper(run, model, opt, data)
            step(2)
            assert gate.reached.wait(10)
            assert run.saves.wait_idle(10)  # ended; its outcome is taken by the next step
            step()  # step 3 learns of the failure
            raise AssertionError("run.step() did not raise the writer's failure")
    assert isinstance(err.value.__cause__, RuntimeError) and run.global_step == 3
    # the run ended by the exception at a step boundary: no completion marker, and the state of step 3 was saved
    # synchronously by the emergency checkpoint (the injected failure hits only the writer thread)
    assert not (tmp_path / "complete.json").exists()
    infos = CheckpointManager(tmp_path, owner=False).list()
    assert [(c.step, c.manifest.reason) for c in infos] == [(3, "emergency")]


def test_the_final_save_waits_for_the_write_and_the_run_completes(tmp_path):
    model, opt, data = build()
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_every_steps=3) as run:
        for _ in run.epochs(2):
            steps(run, model, opt, data, 16)
    manager = CheckpointManager(tmp_path, owner=False)
    assert manager.completion()["step"] == 32
    assert [c.step for c in manager.list()][0] == 32 and all(not manager.verify(c) for c in manager.list())
    assert not any(t.name == WRITER for t in threading.enumerate()), "the writer thread outlived the run"


def test_wait_for_checkpoint_times_out_while_the_writer_is_held(tmp_path):
    model, opt, data = build()
    with gated(Gate()) as gate, PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_every_steps=1) as run:
        next(run.epochs(1))
        steps(run, model, opt, data, 1)
        assert gate.reached.wait(10)
        with pytest.raises(TimeoutError, match="still runs after 0.1 s"):
            run.wait_for_checkpoint(timeout=0.1)
        gate.release.set()
        assert run.wait_for_checkpoint() == tmp_path / "step_000000001"
        assert run.wait_for_checkpoint() == tmp_path / "step_000000001"  # nothing in flight: returns at once


def test_too_little_host_memory_falls_back_to_synchronous_saves(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("preempt.run.background.host_memory_available", lambda: 1000)
    model, opt, data = build()
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_every_steps=2) as run:
        next(run.epochs(1))
        steps(run, model, opt, data, 2)
        assert run.last_save.step == 2 and not run.last_save.background and run.last_save.durable
        run.request_stop()
        with pytest.raises(Preempted):
            run.step()
    assert "would take more than 50% of the host memory available" in caplog.text


def test_staging_that_fails_falls_back_to_a_synchronous_save(tmp_path, monkeypatch, caplog):
    def refuse(self, payload, later=(), loop_waits=False):
        raise RuntimeError("cudaHostAlloc failed")

    monkeypatch.setattr(Stager, "stage_lazily", refuse)  # what stage() calls too
    model, opt, data = build()
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_every_steps=2) as run:
        next(run.epochs(1))
        steps(run, model, opt, data, 2)
        assert run.last_save.durable and not run.last_save.background
        assert run.last_checkpoint == tmp_path / "step_000000002"
        run.request_stop()
        with pytest.raises(Preempted):
            run.step()
    assert "could not stage the state in host memory (cudaHostAlloc failed)" in caplog.text


def test_async_save_false_never_starts_the_writer(tmp_path):
    model, opt, data = build()
    seen = []
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_every_steps=1, async_save=False) as run:
        next(run.epochs(1))
        steps(run, model, opt, data, 3, on_step=lambda run: seen.extend(t.name for t in threading.enumerate()))
        assert run.last_save.step == 3 and run.last_save.durable and not run.last_save.background
        run.request_stop()
        with pytest.raises(Preempted):
            run.step()
    assert WRITER not in seen
    assert run.staging_prepare_s is None


def test_staging_buffers_are_prepared_in_the_background_for_the_optimizer_state(tmp_path):
    model, opt, data = build()
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_interval=None) as run:
        next(run.epochs(1))
        steps(run, model, opt, data, 2)  # step 1 sizes the buffers for the AdamW moments
        run.wait_for_checkpoint()
        state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        assert run.saves.buffer_nbytes >= 3 * state_bytes  # weights + exp_avg + exp_avg_sq (+ step counters)
        assert run.staging_prepare_s is not None and run.staging_prepare_s >= 0
        run.request_stop()
        with pytest.raises(Preempted):
            run.step()


def test_a_resumed_run_sizes_its_buffers_once_for_the_restored_optimizer_at_its_first_step(tmp_path):
    """The optimizer of a resumed run has its moments from the restore: the buffers are sized for them once, at the
    first step boundary (not at the start, while other ranks may still be restoring, and not twice)."""
    model, opt, data = build()
    with (
        pytest.raises(Preempted),
        PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_interval=None) as run,
    ):
        next(run.epochs(1))
        steps(run, model, opt, data, 2)
        run.request_stop()
        run.step()  # the stop's checkpoint, at step 3
    model, opt, data = build()
    assert not opt.state
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_interval=None) as run:
        assert opt.state and run.global_step == 3  # restored
        assert run.saves.job is None and run.saves.buffer_nbytes == 0  # nothing sized at the start
        next(run.epochs(1))
        steps(run, model, opt, data, 1)  # the first step boundary: sized for the whole state
        run.wait_for_checkpoint()
        state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        assert run.saves.buffer_nbytes >= 3 * state_bytes  # weights + exp_avg + exp_avg_sq
        assert run.saves.prepare_at is None  # and not sized again
        run.request_stop()
        with pytest.raises(Preempted):
            run.step()


def test_a_new_jobs_writer_writes_a_pool_ahead_and_its_first_checkpoint_writes_over_it(tmp_path):
    """The real writer thread: once the buffers are sized for the optimizer's state, the pool appears; the first
    checkpoint's files are the pool's files (same inodes), and its state is that of its step, bit for bit."""
    model, opt, data = build()
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_every_steps=8, keep_last=1) as run:
        next(run.epochs(1))
        step = stepper(run, model, opt, data)
        pools: list[Path] = []
        while not pools and run.global_step < 7:  # sized again after the first optimizer step, then the pool
            step()
            threading.Event().wait(0.2)  # the writer's outcome is taken, and the next job started, at a step
            pools = list(tmp_path.glob(".recycle-*"))
        assert len(pools) == 1, "no pool was written ahead"
        inodes = {f.name: f.stat().st_ino for f in pools[0].iterdir()}
        sizes = {f.name: f.stat().st_size for f in pools[0].iterdir()}
        expected = sum(t.nbytes for t in model.state_dict().values())
        assert set(inodes) == {"model.safetensors", "state.safetensors"} and sizes["model.safetensors"] == expected
        step(8 - run.global_step)  # the first checkpoint, at step 8
        path = run.wait_for_checkpoint(timeout=30)
        assert path == tmp_path / "step_000000008"
        assert {name: (path / name).stat().st_ino for name in inodes} == inodes
        assert list(tmp_path.glob(".recycle-*")) == []
        want = snapshot(model, opt)
    got = loaded(path)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
