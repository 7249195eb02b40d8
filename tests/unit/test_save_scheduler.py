"""The save scheduler's decisions, pure, and the scheduler driven with a fake writer: no threads, no sleeps."""

from __future__ import annotations

import errno
import math
from concurrent.futures import Future

import pytest
import torch
from helpers import FakeClock

from preempt import CheckpointManager, CheckpointWriteError
from preempt.checkpoint.cancel import WriteCancelled
from preempt.checkpoint.components import Components
from preempt.checkpoint.staging import ChangedWhileWritten, TornSnapshot
from preempt.cluster.signals import StopFlag
from preempt.errors import LockLostError
from preempt.run.data_cursor import DataCursor
from preempt.run.due import Due, Reason
from preempt.run.loop_state import LoopState
from preempt.run.save_scheduler import SaveScheduler
from preempt.run.snapshot import Snapshot
from preempt.run.write_decisions import STOPS, JobKind, Outcome, adjusted_due, outcome_of, pick, write_mode

R = Reason

# ---------------------------------------------------------------------------- pick


@pytest.mark.parametrize("reason", [R.INTERVAL, R.STEPS, R.PER_EPOCH])
def test_a_periodic_save_due_while_a_write_is_in_flight_is_postponed(reason):
    assert pick(reason, job=JobKind.SAVE, staging=True, postponed=None, dirty=True) == (None, reason)


@pytest.mark.parametrize("reason", [R.BEST, R.MILESTONE, R.PREEMPT, R.WALLTIME])
def test_best_milestone_and_stop_saves_are_taken_now_even_while_writing(reason):
    assert pick(reason, job=JobKind.SAVE, staging=True, postponed=None, dirty=True) == (reason, None)


def test_buffer_sizing_in_flight_postpones_a_save_due_by_the_clock_until_it_ends():
    assert pick(R.INTERVAL, job=JobKind.PREPARE, staging=True, postponed=None, dirty=True) == (None, R.INTERVAL)
    assert pick(None, job=JobKind.PREPARE, staging=True, postponed=R.INTERVAL, dirty=True) == (None, R.INTERVAL)
    assert pick(None, job=None, staging=True, postponed=R.INTERVAL, dirty=True) == (R.INTERVAL, R.INTERVAL)
    assert pick(R.INTERVAL, job=JobKind.PREPARE, staging=False, postponed=None, dirty=True) == (R.INTERVAL, None)


@pytest.mark.parametrize("reason", [R.STEPS, R.PER_EPOCH, R.BEST, R.MILESTONE, R.PREEMPT, R.WALLTIME])
def test_buffer_sizing_in_flight_postpones_no_save_of_its_own_step(reason):
    assert pick(reason, job=JobKind.PREPARE, staging=True, postponed=None, dirty=True) == (reason, None)


def test_a_save_postponed_behind_a_write_keeps_its_turn_when_the_buffers_are_sized_next():
    assert pick(None, job=JobKind.PREPARE, staging=True, postponed=R.STEPS, dirty=True) == (R.STEPS, R.STEPS)


def test_without_staging_nothing_is_postponed():
    assert pick(R.STEPS, job=JobKind.SAVE, staging=False, postponed=None, dirty=True) == (R.STEPS, None)


def test_the_postponed_save_is_taken_once_the_write_ended_and_only_when_something_changed():
    assert pick(None, job=None, staging=True, postponed=R.INTERVAL, dirty=True) == (R.INTERVAL, R.INTERVAL)
    assert pick(None, job=JobKind.SAVE, staging=True, postponed=R.INTERVAL, dirty=True) == (None, R.INTERVAL)
    assert pick(None, job=None, staging=True, postponed=R.INTERVAL, dirty=False) == (None, R.INTERVAL)
    assert pick(None, job=None, staging=True, postponed=None, dirty=True) == (None, None)


# ---------------------------------------------------------------------------- write_mode and adjusted_due


@pytest.mark.parametrize("reason", list(Reason))
def test_stop_final_branch_and_emergency_saves_are_synchronous(reason):
    sync = reason in (R.PREEMPT, R.WALLTIME, R.FINAL, R.BRANCH, R.EMERGENCY)
    assert write_mode(reason, job=None, staging=True).background is not sync
    assert write_mode(reason, job=None, staging=False).background is False
    assert (
        write_mode(reason, job=JobKind.SAVE, staging=True).wait and not write_mode(reason, job=None, staging=True).wait
    )
    # a synchronous save writes from the staging buffers where there are any
    assert (
        write_mode(reason, job=None, staging=True).stage is sync
        and write_mode(reason, job=None, staging=False).stage is False
    )


def test_adjusted_due_waits_for_the_write_then_takes_the_postponed_save_at_the_next_step():
    due = Due(10, 7, 100.0)
    writing = adjusted_due(due, step=12, milestone_steps=5, postponed=R.STEPS, job=True, prepare_at=None)
    assert writing == Due(15, math.inf, math.inf)  # a milestone stays due; periodic ones wait for the write
    assert (
        adjusted_due(due, step=12, milestone_steps=None, postponed=R.STEPS, job=True, prepare_at=None).step == math.inf
    )
    assert adjusted_due(due, step=12, milestone_steps=5, postponed=R.STEPS, job=False, prepare_at=None) == Due(
        13, math.inf, math.inf
    )
    assert adjusted_due(due, step=0, milestone_steps=None, postponed=None, job=False, prepare_at=1) == Due(1, 7, 100.0)
    assert adjusted_due(due, step=0, milestone_steps=None, postponed=None, job=True, prepare_at=1) == due
    assert adjusted_due(due, step=0, milestone_steps=None, postponed=None, job=False, prepare_at=None) == due


# ---------------------------------------------------------------------------- the scheduler, with a fake writer


class _HeldFuture(Future):
    """A job's future that runs the job, in the test's thread, when the test says or when its result is asked."""

    def __init__(self, job) -> None:
        super().__init__()
        self.job = job

    def finish(self) -> None:
        if self.done():
            return
        try:
            self.set_result(self.job())
        except BaseException as e:
            self.set_exception(e)

    def result(self, timeout=None):
        self.finish()
        return super().result(timeout)


class FakeWriter:
    """The BackgroundWriter's interface; a job runs only when the test says (or when its result is asked)."""

    def __init__(self) -> None:
        self.future: _HeldFuture | None = None
        self.submitted = self.joined = 0

    @property
    def busy(self) -> bool:
        return self.future is not None and not self.future.done()

    def submit(self, job) -> Future:
        assert not self.busy, "a job was submitted while another was running"
        self.future = _HeldFuture(job)
        self.submitted += 1
        return self.future

    def join(self) -> None:
        assert self.future is not None and self.future.done(), "joined before the job's outcome was taken"
        self.joined += 1

    def finish(self) -> None:
        assert self.future is not None
        self.future.finish()


def started(tmp_path, writer: FakeWriter, *, optimizer_state_later: bool = False, **manager_options):
    """A scheduler of a fresh process, its buffers' first sizing in flight on ``writer``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    loop, data = LoopState(), DataCursor(())
    data.seed = 1
    snapshot = Snapshot(Components(model), loop, data)
    manager = CheckpointManager(tmp_path, **{"keep_last": None, **manager_options})
    saves = SaveScheduler(manager, loop, snapshot, StopFlag(()), clock=FakeClock(0.0), writer=lambda: writer)
    saves.start(snapshot.capture(), optimizer_state_later=optimizer_state_later)
    return saves, loop, model


def scheduler(tmp_path, writer: FakeWriter, *, reserve: bool = True, **manager_options):
    """A scheduler whose buffers are sized; ``reserve``: the pool it then writes ahead is written (else in flight)."""
    saves, loop, model = started(tmp_path, writer, **manager_options)
    writer.finish()  # the buffers are sized
    saves.take_finished_and_prepare()
    saves.start_pool_if_due()  # the end of that safe point: a pool ahead starts
    if reserve and saves.job is not None:
        writer.finish()
        saves.take_finished_and_prepare()
    return saves, loop, model


def on_disk(manager: CheckpointManager) -> list[tuple[int, str]]:
    return [(c.step, c.manifest.reason) for c in manager.list() if c.status == "valid"]


def test_a_background_save_is_staged_then_written_and_a_periodic_one_waits_for_it(tmp_path):
    writer = FakeWriter()
    saves, loop, model = scheduler(tmp_path, writer)
    assert saves.prepare_s is not None and saves.buffer_nbytes > 0
    loop.stepped()
    saves.save(R.STEPS, "step")
    assert saves.job is not None and saves.job.kind is JobKind.SAVE and not loop.dirty
    assert saves.last_save.step == 1 and saves.last_save.background and not saves.last_save.durable
    assert on_disk(saves.manager) == []  # staged only
    before = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)  # the loop goes on: the snapshot must not see this
    loop.stepped()
    assert saves.pick(R.STEPS) is None and saves.postponed is R.STEPS
    writer.finish()
    saves.take_finished_and_prepare()
    assert on_disk(saves.manager) == [(1, "steps")] and saves.last_checkpoint == tmp_path / "step_000000001"
    written = saves.manager.read(saves.last_info).model
    assert torch.equal(written["weight"], before)  # the state of step 1, not the later one
    assert saves.pick(None) is R.STEPS  # the write that postponed it ended
    saves.save(R.STEPS, "step")
    assert saves.postponed is None and writer.submitted == 4  # prepare, the pool ahead, step 1, step 2
    assert writer.joined == 3  # each job whose outcome was taken: its thread is gone


def test_a_save_due_by_the_clock_while_the_buffers_are_sized_waits_for_them_not_the_loop(tmp_path):
    """A fresh process: its buffers are sized at the start and again once the optimizer has state; an interval
    save due meanwhile is postponed (run.step() returns at once), no pool is started ahead of it, and it is taken
    into the sized buffers at the first step after the sizing ends."""
    writer = FakeWriter()
    saves, loop, _ = started(tmp_path, writer, optimizer_state_later=True)
    assert saves.job is not None and saves.job.kind is JobKind.PREPARE and saves.prepare_s is None
    loop.stepped()
    saves.take_finished_and_prepare()
    assert saves.pick(R.INTERVAL) is None and saves.postponed is R.INTERVAL  # sizing in flight: the loop goes on
    saves.start_pool_if_due()
    assert writer.submitted == 1  # no pool written ahead of the postponed save
    writer.finish()
    loop.stepped()
    # the first sizing ended; the second (for the optimizer's state) starts before the save
    saves.take_finished_and_prepare()
    assert saves.prepare_s is not None and saves.job is not None and saves.job.kind is JobKind.PREPARE
    assert saves.pick(None) is None and saves.postponed is R.INTERVAL
    writer.finish()
    loop.stepped()
    saves.take_finished_and_prepare()
    assert saves.job is None and saves.pick(None) is R.INTERVAL
    saves.save(R.INTERVAL, "step")
    assert saves.postponed is None and saves.last_save.step == 3 and saves.last_save.background
    writer.finish()
    saves.take_finished_and_prepare()
    assert on_disk(saves.manager) == [(3, "interval")]


@pytest.mark.parametrize("reason", [R.STEPS, R.PER_EPOCH])
def test_a_save_of_a_step_count_while_the_buffers_are_sized_is_taken_at_its_step(tmp_path, reason):
    writer = FakeWriter()
    saves, loop, _ = started(tmp_path, writer)
    loop.stepped()
    assert saves.pick(reason) is reason
    saves.save(reason, "step")  # waits for the sizing, then stages
    assert saves.last_save.step == 1 and saves.prepare_s is not None


def test_a_stop_cancels_a_periodic_write_in_flight_and_saves_synchronously(tmp_path):
    writer = FakeWriter()
    saves, loop, _ = scheduler(tmp_path, writer)
    loop.stepped()
    saves.save(R.INTERVAL, "step")
    loop.stepped()
    saves.save(R.PREEMPT, "step")
    assert saves.job is None and on_disk(saves.manager) == [(2, "preempt")]  # step 1's write never committed
    assert saves.failed == 0 and not list(tmp_path.glob(".tmp-*"))
    assert saves.last_save.step == 2 and saves.last_save.durable and not saves.last_save.background


def test_a_stop_waits_for_a_best_write_in_flight(tmp_path):
    writer = FakeWriter()
    saves, loop, _ = scheduler(tmp_path, writer)
    loop.stepped()
    saves.save(R.BEST, "step")
    loop.stepped()
    saves.save(R.PREEMPT, "step")
    assert on_disk(saves.manager) == [(2, "preempt"), (1, "best")]


def test_before_a_stop_a_write_of_the_current_state_is_awaited_not_cancelled(tmp_path):
    writer = FakeWriter()
    saves, loop, _ = scheduler(tmp_path, writer)
    loop.stepped()
    saves.save(R.STEPS, "step")  # the state of this very step: nothing moved since
    saves.before_stop()
    assert on_disk(saves.manager) == [(1, "steps")] and not loop.dirty
    loop.stepped()
    saves.save(R.STEPS, "step")
    loop.stepped()  # the loop moved past the snapshot in flight
    saves.before_stop()
    assert on_disk(saves.manager) == [(1, "steps")] and loop.dirty  # cancelled: the stop must save


@pytest.mark.parametrize(
    ("reason", "writing", "cancel"),
    [
        (R.PREEMPT, R.STEPS, True),
        (R.WALLTIME, R.INTERVAL, True),
        (R.PREEMPT, R.PER_EPOCH, True),
        (R.PREEMPT, R.BEST, False),
        (R.PREEMPT, R.MILESTONE, False),
        (R.FINAL, R.STEPS, False),
        (R.EMERGENCY, R.STEPS, False),
        (R.BEST, R.STEPS, False),
    ],
)
def test_only_a_stop_cancels_and_only_a_periodic_write(reason, writing, cancel):
    p = write_mode(reason, job=JobKind.SAVE, staging=True, writing=writing)
    assert p.cancel is cancel and p.wait is not cancel


def test_a_write_out_of_disk_is_counted_and_the_state_is_due_again(tmp_path, monkeypatch):
    writer = FakeWriter()
    saves, loop, _ = scheduler(tmp_path, writer)
    loop.stepped()
    monkeypatch.setattr(saves.manager, "save", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    saves.save(R.STEPS, "step")
    assert not loop.dirty
    saves.take_outcome()
    assert saves.failed == 1 and loop.dirty and saves.last_checkpoint is None


def test_any_other_write_failure_is_raised_naming_the_step(tmp_path, monkeypatch):
    writer = FakeWriter()
    saves, loop, _ = scheduler(tmp_path, writer)
    loop.stepped()
    monkeypatch.setattr(saves.manager, "save", lambda *a: (_ for _ in ()).throw(ValueError("bad bytes")))
    saves.save(R.STEPS, "step")
    with pytest.raises(CheckpointWriteError, match=r"step_000000001.*bad bytes"):
        saves.take_outcome()
    assert loop.dirty


def test_a_failed_stop_save_raises_save_failed_with_the_last_good_checkpoint(tmp_path, monkeypatch):
    from preempt.errors import SaveFailed

    writer = FakeWriter()
    saves, loop, _ = scheduler(tmp_path, writer)
    loop.stepped()
    saves.save(R.FINAL, "epoch")
    loop.stepped()
    monkeypatch.setattr(saves.manager, "save", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(SaveFailed) as err:
        saves.save(R.PREEMPT, "step")
    assert err.value.last_good == str(tmp_path / "step_000000001")


# ---------------------------------------------------------------------------- a pool written ahead


@pytest.mark.parametrize("reason", list(Reason))
def test_any_save_cancels_a_pool_being_written_ahead(reason):
    assert write_mode(reason, job=JobKind.RESERVE, staging=True).cancel
    assert pick(reason, job=JobKind.RESERVE, staging=True, postponed=None, dirty=True) == (reason, None)


@pytest.mark.parametrize("reason", list(Reason))
def test_a_stop_cuts_the_buffers_sizing_short_and_any_other_save_waits_for_it(reason):
    """Work done ahead for speed never delays a stop: the staging buffers being sized are taken as they are (the
    stop's copy faults the pages not touched yet); a periodic save due meanwhile is postponed, a final one waits."""
    how = write_mode(reason, job=JobKind.PREPARE, staging=True)
    assert (how.cancel, how.wait) == ((True, False) if reason in STOPS else (False, True))


def pool_files(directory) -> dict[str, tuple[int, int]]:
    """name -> (size, inode) of each pool's files."""
    return {f.name: (f.stat().st_size, f.stat().st_ino) for d in directory.glob(".recycle-*") for f in d.iterdir()}


def test_once_the_buffers_are_sized_a_pool_of_the_states_files_is_written_and_the_first_save_writes_over_it(
    tmp_path,
):
    writer = FakeWriter()
    saves, loop, model = scheduler(tmp_path, writer, reserve=False)
    assert saves.job is not None and saves.job.kind is JobKind.RESERVE
    assert saves.wait() is None and saves.job is not None  # waiting for a checkpoint does not wait for it
    writer.finish()
    saves.take_finished_and_prepare()
    pool = pool_files(tmp_path)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert {name: size for name, (size, _) in pool.items()} == saves.sizes  # the tensor bytes of each file
    assert saves.sizes["model.safetensors"] == state_bytes and set(saves.sizes) == {
        "model.safetensors",
        "state.safetensors",
    }
    loop.stepped()
    saves.save(R.STEPS, "step")
    writer.finish()
    saves.take_finished_and_prepare()
    for name, (_, inode) in pool.items():
        assert (tmp_path / "step_000000001" / name).stat().st_ino == inode
    assert pool_files(tmp_path) == {}
    assert torch.equal(saves.manager.read(saves.last_info).model["weight"], model.weight.detach())


def test_a_save_cancels_the_pool_in_flight_and_writes_over_what_it_holds(tmp_path):
    writer = FakeWriter()
    saves, loop, model = scheduler(tmp_path, writer, reserve=False)
    loop.stepped()
    saves.save(R.PREEMPT, "step")  # synchronous: the pool is cancelled first, then taken
    assert saves.last_save.durable and saves.job is None and pool_files(tmp_path) == {}
    assert torch.equal(saves.manager.read(saves.last_info).model["weight"], model.weight.detach())
    assert writer.submitted == 2  # prepare, the pool; nothing more is written ahead while one save took it


def test_the_end_of_the_run_cancels_the_pool_rather_than_waiting(tmp_path):
    writer = FakeWriter()
    saves, _, _ = scheduler(tmp_path, writer, reserve=False)
    cancel = saves.job.cancel
    saves.close()
    assert cancel.is_set() and saves.job is None
    assert set(pool_files(tmp_path)) == {"model.safetensors"}  # cancelled in its first file; that stays for a save


@pytest.mark.parametrize("reason", [R.PREEMPT, R.INTERVAL])
def test_a_save_copies_the_state_while_the_pool_it_cancels_stops_then_writes_over_it(tmp_path, reason):
    """The pool writes zeros of its own: the state's copy need not wait for it to stop (a write of up to 64 MiB)."""
    writer = FakeWriter()
    saves, loop, _ = scheduler(tmp_path, writer, reserve=False)
    order: list[str] = []
    pool = writer.future.job
    writer.future.job = lambda: order.append("pool ended") or pool()
    for name in ("staged_now", "copy"):  # the stop's copy, a background save's copy
        method = getattr(saves.background, name)
        setattr(saves.background, name, lambda *a, m=method: order.append("state copied") or m(*a))
    if reason is R.PREEMPT:
        saves.before_stop()  # the stop tells the pool to stop, and goes on
        assert saves.job.cancel.is_set() and not writer.future.done()
    loop.stepped()
    saves.save(reason, "step")
    assert order == ["state copied", "pool ended"]
    if reason is R.INTERVAL:
        writer.finish()
        saves.take_finished_and_prepare()
    assert on_disk(saves.manager) == [(1, reason.value)] and pool_files(tmp_path) == {}


@pytest.mark.parametrize(
    ("options", "pool_before"), [({"recycle_files": False}, False), ({}, True)], ids=["recycling off", "a pool exists"]
)
def test_no_pool_is_written_ahead_without_recycling_or_when_there_is_one(tmp_path, options, pool_before):
    if pool_before:
        (tmp_path / ".recycle-earlier").mkdir()
        (tmp_path / ".recycle-earlier" / "model.safetensors").write_bytes(b"x")
    writer = FakeWriter()
    saves, _, _ = scheduler(tmp_path, writer, reserve=False, **options)
    assert saves.job is None and writer.submitted == 1


def test_a_pool_that_cannot_be_written_is_a_warning_and_leaves_nothing(tmp_path, monkeypatch, caplog):
    writer = FakeWriter()
    saves, _, _ = scheduler(tmp_path, writer, reserve=False)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("preempt.checkpoint.hashed_io.write_file", full)
    writer.finish()
    saves.take_finished_and_prepare()
    assert saves.job is None and list(tmp_path.glob(".*")) == []
    assert "could not write a pool ahead" in caplog.text and "No space left" in caplog.text


# ---------------------------------------------------------------------------- what a job's end means


@pytest.mark.parametrize(
    ("kind", "error", "outcome"),
    [
        (JobKind.PREPARE, None, Outcome.PREPARED),
        (JobKind.SAVE, None, Outcome.WRITTEN),
        (JobKind.RESERVE, None, Outcome.RESERVED),
        (JobKind.PREPARE, MemoryError(), Outcome.PREPARE_FAILED),
        (JobKind.RESERVE, OSError(errno.ENOSPC, "full"), Outcome.RESERVE_FAILED),
        (JobKind.RESERVE, WriteCancelled(), Outcome.RESERVE_FAILED),
        (JobKind.SAVE, WriteCancelled(), Outcome.CANCELLED),
        (JobKind.SAVE, OSError(errno.ENOSPC, "full"), Outcome.NOT_WRITTEN),
        (JobKind.SAVE, TornSnapshot("moved"), Outcome.TORN),
        (JobKind.SAVE, ChangedWhileWritten("moved"), Outcome.CHANGED),  # (a TornSnapshot too: the narrower wins)
        (JobKind.SAVE, LockLostError("gone"), Outcome.LOCK_LOST),
        (JobKind.SAVE, ValueError("a bug"), Outcome.BROKEN),
    ],
)
def test_each_end_of_a_job_has_one_outcome(kind, error, outcome):
    assert outcome_of(kind, error) is outcome


# ---------------------------------------------------------------------------- the checkpoint writer


def test_one_process_writes_its_checkpoint_through_the_writer_built_for_it(tmp_path):
    """The writer is built once with the manager (the run does it for its peers); a save is one call down to it."""
    from preempt.checkpoint.manager import CheckpointInfo, Pending
    from preempt.run.checkpoint_writer import CheckpointWriter, writer_for
    from preempt.run.peers import Alone

    loop, data = LoopState(), DataCursor(())
    data.seed = 1
    snapshot = Snapshot(Components(torch.nn.Linear(3, 2)), loop, data)
    manager = CheckpointManager(tmp_path, keep_last=None)
    writer = writer_for(manager, Alone())
    assert isinstance(writer, CheckpointWriter)
    payload = snapshot.capture()
    written = writer.write(payload, snapshot.manifest(R.STEPS, "step"))
    assert isinstance(written, CheckpointInfo) and written.step == 0
    loop.stepped()
    deferred = writer.write(payload, snapshot.manifest(R.STEPS, "step"), defer=True)
    assert deferred == Pending()  # nothing written yet: the background writer finishes it
    assert on_disk(manager) == [(0, "steps")]
    finished = writer.finish(deferred, payload, snapshot.manifest(R.STEPS, "step"))
    assert finished.step == 1 and on_disk(manager) == [(1, "steps"), (0, "steps")]  # newest first
