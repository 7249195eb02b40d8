"""Lazy snapshots of a state on a GPU (``lazy_snapshot=True``): the copies on a side stream, the next optimizer step
ordered after them on the GPU, the host never waiting for them. Needs an NVIDIA GPU.

``hold`` queues a sleep kernel of about a second on the stager's side stream before the snapshot: its copies then
wait behind it, so they are still to be made when the loop queues its next ``optimizer.step()``. Only the ordering on
the GPU keeps that step from changing what is copied (``test_without_the_ordering_...`` shows the hold is real).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import model_and_optimizer_tensors, read_into

from preempt import PreemptibleRun
from preempt.checkpoint import pinned, state
from preempt.checkpoint.side_stream import SideStreams, StreamedCopies
from preempt.checkpoint.staging import Stager
from preempt.run.save_scheduler import SaveScheduler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]

HOLD_CYCLES = 2_000_000_000  # GPU clock cycles: about a second at 2 GHz
LAZY = dict(checkpoint_interval=None, checkpoint_every_steps=2, keep_last=None, lazy_snapshot=True)


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(64, 256, device="cuda")
    return model, opt, x


def train_step(model, opt, x) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()


snapshot = model_and_optimizer_tensors


def loaded(path: Path) -> dict[str, torch.Tensor]:
    model, opt, _ = build()
    return read_into(path, model, opt)


def differing(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    assert want.keys() == got.keys()
    return [k for k in want if not torch.equal(want[k].cpu(), got[k].cpu())]


def hold(run) -> None:
    """The side stream of this GPU sleeps for about a second: the next snapshot's copies queue behind it."""
    stager = run.saves.stager
    if stager.side_streams is None:
        stager.side_streams = SideStreams()
    with torch.cuda.stream(stager.side_streams.get(torch.device("cuda", torch.cuda.current_device()))):
        torch.cuda._sleep(HOLD_CYCLES)


def lazy_run_to_step_3(tmp_path: Path):
    """Steps 1-3 of a lazy run whose step-2 copies are held; returns (step 2's values, its pending copies, path)."""
    model, opt, x = build()
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, **LAZY) as run:
        train_step(model, opt, x)
        run.step()
        run.wait_for_checkpoint()  # the buffers are sized for the moments, outside what is tested
        hold(run)
        train_step(model, opt, x)
        run.step()  # step 2 is snapshotted: its copies are queued behind the hold
        assert run.last_save.step == 2 and not run.last_save.durable
        want = snapshot(model, opt)  # on the loop's stream, before step 3's optimizer
        pending = run.saves.job.staging  # the snapshot's staging completion: its copies still to be made
        train_step(model, opt, x)  # step 3: its optimizer.step() is queued after the copies
        copies_done = [e.query() for e in pending.streamed.copied.values()]
        run.step()
        path = run.wait_for_checkpoint()
    return want, pending, copies_done, path


def test_the_step_after_a_lazy_gpu_snapshot_waits_for_its_copies_on_the_gpu_not_the_host(tmp_path):
    want, pending, copies_done, path = lazy_run_to_step_3(tmp_path)
    assert isinstance(pending.streamed, StreamedCopies) and pending.pairs == []  # nothing left to the writer thread
    names = {name.split(":")[1] for name, *_ in pending.streamed.pairs}
    assert len(names) == 4 + 4 * 2  # the parameters and their exp_avg and exp_avg_sq (AdamW's step is on the CPU)
    assert copies_done == [False], "step 3's optimizer was queued while the held copies were still to be made"
    assert path == tmp_path / "step_000000002"
    assert differing(want, loaded(path)) == []


def test_without_the_ordering_the_held_copies_would_read_the_next_step(tmp_path, monkeypatch):
    """What the wait on the GPU prevents: with the hook only comparing the version counters (no optimizer step has
    changed them yet), the held copies are made after step 3's optimizer.step() and step 2's checkpoint holds
    step 3's values. So the hold is real and the test above fails without the ordering."""
    monkeypatch.setattr(StreamedCopies, "order", lambda self: self.verdict.decide())
    want, _pending, copies_done, path = lazy_run_to_step_3(tmp_path)
    assert copies_done == [False] and path == tmp_path / "step_000000002"
    assert differing(want, loaded(path)) != []


def test_without_the_optimizers_hook_the_writer_sees_the_step_moved_the_counters(tmp_path, monkeypatch, caplog):
    """With no hook at all the writer compares the counters once the copies are made: optimizer.step() has moved them,
    so step 2's snapshot is not written, and the run copies at the step from then on."""
    monkeypatch.setattr(SaveScheduler, "_optimizer_stepping", lambda self, *a: None)
    model, opt, x = build()
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, **LAZY) as run:
        for i in range(1, 5):
            if i == 2:
                run.wait_for_checkpoint()
                hold(run)
            train_step(model, opt, x)
            run.step()
            if i == 3:
                assert run.wait_for_checkpoint() is None
        want = snapshot(model, opt)
        path = run.wait_for_checkpoint()
    assert "the checkpoint of step 2 is not written" in caplog.text and "changed in place" in caplog.text
    assert path == tmp_path / "step_000000004"
    assert differing(want, loaded(path)) == []


def test_a_parameter_changed_in_place_before_the_copies_drops_that_snapshot(tmp_path, caplog):
    model, opt, x = build()
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, **LAZY) as run:
        train_step(model, opt, x)
        run.step()
        run.wait_for_checkpoint()
        hold(run)
        train_step(model, opt, x)
        run.step()  # step 2, held
        with torch.no_grad():
            model[0].weight.mul_(0.5)  # the user's own change, queued while the copies are still to be made
        train_step(model, opt, x)  # step 3: the optimizer's hook sees the counter moved
        run.step()
        assert run.wait_for_checkpoint() is None  # step 2's snapshot is torn: not written
        train_step(model, opt, x)  # step 4: copied at the step
        run.step()
        want = snapshot(model, opt)
        path = run.wait_for_checkpoint()
    assert "0.weight was changed in place before its copy was made" in caplog.text
    assert path == tmp_path / "step_000000004" and not (tmp_path / "step_000000002").exists()
    assert differing(want, loaded(path)) == []


def pinned_by_torch() -> int:
    """Bytes of pinned blocks torch's host allocator holds now."""
    stats = torch.cuda.host_memory_stats()
    keys = [k for k in stats if k.startswith("allocated_bytes") and k.endswith(".current")]
    assert keys, f"no allocated_bytes.*.current in torch.cuda.host_memory_stats(): {sorted(stats)[:20]}"
    return stats[keys[0]]


def test_pinned_buffers_lock_exactly_their_bytes_and_unlock_when_dropped():
    """torch's pinned allocator rounds a block up to a power of two; the stager's arenas register their own pages.
    (torch's ``is_pinned()`` says False for pages it did not allocate, so CUDA itself is asked: registering a range
    again fails while it is registered, and unregistering it fails once it is not.)"""
    cudart = torch.cuda.cudart()
    t = torch.randn(3 * 2**20 + 5, device="cuda")  # 12 MiB + 20 B: the allocator would pin 16 MiB
    before = pinned_by_torch()
    stager = Stager()
    payload = state.Payload(tensor_files={"model.safetensors": ({"t": t}, {})}, json_files={})
    staged = stager.stage(payload)
    buf = staged.tensor_files["model.safetensors"][0]["t"]
    assert stager.pinned and stager.pinned_exactly
    assert pinned_by_torch() == before, "no block of torch's pinned allocator"
    assert torch.equal(buf, t.cpu())
    ptr, size = buf.data_ptr(), buf.numel() * buf.element_size()
    assert int(cudart.cudaHostRegister(ptr, size, 0)) != 0, "the buffer's pages are registered already"
    pinned.forget_error()
    stager.stage(state.Payload(tensor_files={}, json_files={}))  # the file is gone: its arena is dropped
    assert not stager.pinned
    assert int(cudart.cudaHostUnregister(ptr)) != 0, "the dropped arena's pages were unregistered"
    pinned.forget_error()
    assert torch.equal(buf, t.cpu()), "and its memory is still the buffer's (alive while a view holds it)"


def test_a_refused_registration_falls_back_and_leaves_no_error_for_the_next_kernel(monkeypatch):
    """CUDA refuses a registration here (a range inside one registered already): the arena comes from torch's pinned
    allocator instead, and the refusal's error does not surface at the training's next kernel."""
    held = torch.empty(1 << 20, dtype=torch.uint8)
    unlock = pinned.lock(held, held)
    lock = pinned.lock
    monkeypatch.setattr(pinned, "lock", lambda data, owner: lock(held[:4096], owner))  # registered already: refused
    t = torch.randn(1000, device="cuda")
    stager = Stager()
    staged = stager.stage(state.Payload(tensor_files={"model.safetensors": ({"t": t}, {})}, json_files={}))
    assert stager.pinned and not stager.pinned_exactly  # torch's allocator
    assert torch.equal(staged.tensor_files["model.safetensors"][0]["t"], t.cpu())
    torch.ones(8, device="cuda").mul_(2).sum().item()  # the next kernels run
    unlock()


def test_a_lazy_gpu_run_resumes_bit_exact_after_a_crash(tmp_path):
    """End to end with lazy snapshots: background checkpoints at steps 3 and 6, a crash at 8, the rerun resumes
    from 6 and ends as a run that never stopped."""
    from test_cuda import Crash, assert_same, train

    ref = train(tmp_path / "ref", every=3, lazy=True)
    with pytest.raises(Crash):
        train(tmp_path / "run", every=3, crash_at=8, lazy=True)
    latest = sorted(p.name for p in (tmp_path / "run").glob("step_*"))[-1]
    assert latest == "step_000000006", latest
    assert_same(ref, train(tmp_path / "run", every=3, lazy=True))
