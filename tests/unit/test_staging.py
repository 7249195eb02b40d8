"""Stager (reused host buffers) and BackgroundWriter (one job at a time, errors kept) on their own."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest
import torch

from preempt import CheckpointManager
from preempt.checkpoint import state
from preempt.checkpoint.staging import BackgroundWriter, Stager


def payload(model, opt):
    return state.capture(state.Components(model, opt), {"user": {"losses": [1.0]}})


def objects():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def step(model, opt):
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_snapshot_is_independent_of_the_live_state_and_buffers_are_reused(tmp_path):
    model, opt = objects()
    step(model, opt)
    stager = Stager()
    live = payload(model, opt)
    snap = stager.stage(live)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = {id(t) for ts, _ in snap.tensor_files.values() for t in ts.values()}
    step(model, opt)  # the loop goes on and changes every tensor in place
    for k, v in snap.tensor_files["model.safetensors"][0].items():
        assert torch.equal(v, want[k]) and not torch.equal(v, model.state_dict()[k])
    assert isinstance(snap.json_files["state.json"], bytes)
    again = stager.stage(payload(model, opt))
    assert {id(t) for ts, _ in again.tensor_files.values() for t in ts.values()} == buffers, "buffers must be reused"
    # the staged snapshot writes the same checkpoint as the live state would
    m = CheckpointManager(tmp_path, keep_last=None)
    m.save(again, _manifest(1))
    m.save(payload(model, opt), _manifest(2))
    _, a = m.load(1)
    _, b = m.load(2)
    assert a.model.keys() == b.model.keys() and all(torch.equal(a.model[k], b.model[k]) for k in a.model)
    assert (tmp_path / "step_000000001" / "state.json").read_bytes() == (
        tmp_path / "step_000000002" / "state.json"
    ).read_bytes()


def _manifest(step):
    from preempt.checkpoint.manifest import Cursor, Manifest

    return Manifest(step=step, cursor=Cursor(), reason="manual", created=0.0, files={})


def test_buffers_follow_new_and_vanished_tensors():
    model, opt = objects()
    stager = Stager()
    stager.prepare(payload(model, opt))
    before = stager.nbytes
    assert before == sum(p.numel() * 4 for p in model.parameters())  # no optimizer moments before a step
    step(model, opt)
    stager.stage(payload(model, opt))
    assert stager.nbytes > 2 * before  # exp_avg and exp_avg_sq appeared
    stager.stage(state.capture(state.Components(model, None), {}))
    assert stager.nbytes == before  # the optimizer's buffers are gone with it


def test_writer_runs_one_job_at_a_time_and_its_future_keeps_the_result_or_the_error():
    w = BackgroundWriter()
    started, release = threading.Event(), threading.Event()

    def job():
        started.set()
        assert release.wait(30)
        return 42

    future = w.submit(job)
    assert started.wait(30)
    assert w.busy and not future.done()
    with pytest.raises(RuntimeError, match="a job is still running"):
        w.submit(lambda: None)
    with pytest.raises(TimeoutError):
        future.result(timeout=0.01)
    release.set()
    assert future.result(timeout=30) == 42 and not w.busy

    def fails():
        raise OSError(28, "No space left on device")

    failed = w.submit(fails)
    with pytest.raises(OSError, match="No space left"):
        failed.result(timeout=30)
    assert isinstance(failed.exception(), OSError)  # kept: whoever holds the future sees it


def test_the_writer_thread_lets_go_of_the_job_before_its_future_is_done_and_join_waits_for_its_end():
    """What the job's closure holds (the staged tensors) is released in the writer's thread before anyone sees the
    future done, and after join() the thread is gone: none is left to free torch objects at interpreter exit."""
    w = BackgroundWriter()
    order: list[str] = []

    class Held:
        def __del__(self) -> None:
            order.append(f"released in {threading.current_thread().name}")

    def job_holding(held: Held, go: threading.Event) -> Callable[[], int]:
        return lambda: 7 if go.wait(30) and held is not None else 0

    go = threading.Event()
    future = w.submit(job_holding(Held(), go))  # the writer holds the only reference
    future.add_done_callback(lambda f: order.append("done"))  # run by the thread that sets the result
    go.set()
    assert future.result(timeout=30) == 7 and not w.busy
    w.join()
    assert order == ["released in preempt-writer", "done"]
    assert not [t for t in threading.enumerate() if t.name == "preempt-writer"]


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priorities here")
def test_the_writer_thread_runs_at_a_lower_priority_than_the_loop():
    w = BackgroundWriter()
    future = w.submit(lambda: (threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    tid, nice = future.result(timeout=30)
    assert tid != threading.get_native_id()
    assert nice == min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + 10)
