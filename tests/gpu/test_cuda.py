"""CUDA state: per-device RNG, GPU tensors in the optimizer, GradScaler. Needs an NVIDIA GPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from preempt import Preempted, PreemptibleRun
from preempt.checkpoint import state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


class Crash(Exception):
    pass


def build(frozen: bool) -> torch.nn.Module:
    """The model; ``frozen``: a fine-tuning one, a frozen base of 8.1 MiB on the GPU under a trained head of 32 KiB."""
    if not frozen:
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.3), torch.nn.Linear(32, 4)).cuda()
    base = torch.nn.Sequential(torch.nn.Linear(16, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 2048))
    base.requires_grad_(False)
    return torch.nn.Sequential(base, torch.nn.Dropout(0.3), torch.nn.Linear(2048, 4)).cuda()


def train(save_dir, stop_at=None, every=None, crash_at=None, lazy=False, frozen=False, keep_last=2, settle=False):
    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    model = build(frozen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=3)
    data = TensorDataset(torch.randn(64, 16, generator=torch.Generator().manual_seed(1)))
    kw = dict(checkpoint_interval=None, checkpoint_every_steps=every, lazy_snapshot=lazy, keep_last=keep_last)
    with PreemptibleRun(save_dir, model=model, optimizer=opt, scaler=scaler, **kw) as run:
        loader = DataLoader(data, batch_size=8, sampler=run.sampler(data, seed=2), pin_memory=True)
        for _ in run.epochs(2):
            for (x,) in run.batches(loader):
                x = x.cuda(non_blocking=True) + torch.randn(8, 16, device="cuda")  # a draw from the CUDA RNG
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                if run.global_step + 1 == stop_at:
                    run.request_stop()
                if run.global_step + 1 == crash_at:
                    assert run.saves.pinned, "the staging buffers of a CUDA state are pinned"
                    raise Crash  # after the optimizer step: the last checkpoint is the background one before
                run.step()
                if settle:
                    run.wait_for_checkpoint()  # each one durable before the next step: one at every `every` steps
    return model, opt, scaler, torch.cuda.get_rng_state_all()


def assert_same(a, b):
    ref_model, ref_opt, ref_scaler, ref_rng = a
    model, opt, scaler, rng = b
    for x, y in zip(ref_model.state_dict().values(), model.state_dict().values(), strict=True):
        assert x.is_cuda and torch.equal(x, y)
    for s1, s2 in zip(ref_opt.state_dict()["state"].values(), opt.state_dict()["state"].values(), strict=True):
        assert all(torch.equal(s1[k], s2[k]) for k in s1)
        assert all(v.is_cuda for k, v in s2.items() if k != "step")
    assert ref_scaler.state_dict() == scaler.state_dict()
    assert all(torch.equal(x, y) for x, y in zip(ref_rng, rng, strict=True))


def test_cuda_run_resumes_bit_exact_from_a_background_checkpoint(tmp_path):
    """Periodic checkpoints staged through pinned buffers and written by the background writer."""
    ref = train(tmp_path / "ref", every=3)
    with pytest.raises(Crash):
        train(tmp_path / "run", every=3, crash_at=8)
    latest = sorted(p.name for p in (tmp_path / "run").glob("step_*"))[-1]
    assert latest == "step_000000006", latest
    assert_same(ref, train(tmp_path / "run", every=3))


@pytest.mark.parametrize("lazy", [False, True], ids=["staged_at_the_step", "lazy_snapshot"])
def test_a_frozen_base_on_the_gpu_is_carried_not_written_and_the_run_resumes_bit_exact(tmp_path, lazy):
    """Fine-tuning on the GPU: the frozen base (no optimizer holds it) goes to base.safetensors once, and every later
    checkpoint carries it (a hard link, nothing staged, copied or written); the first carried one re-hashes the base
    from the GPU in the writer thread (the guard). The crash's rerun resumes from the last one and ends bit for bit
    as the run that never stopped."""
    from helpers import MiB, assert_writes_what_changed

    ref = train(tmp_path / "ref", every=2, frozen=True, lazy=lazy)
    with pytest.raises(Crash):
        train(tmp_path / "run", every=2, crash_at=9, frozen=True, lazy=lazy, keep_last=None, settle=True)
    ckpts = sorted((tmp_path / "run").glob("step_*"))
    assert [c.name for c in ckpts] == [f"step_00000000{k}" for k in (2, 4, 6, 8)]
    assert (ckpts[0] / "base.safetensors").stat().st_size > 8 * MiB
    report = assert_writes_what_changed(ckpts)  # base carried; at most 2x the changed bytes + 1 MiB written
    print("checkpoint, bytes written, bytes changed:", report)
    assert_same(ref, train(tmp_path / "run", every=2, frozen=True, lazy=lazy))


def test_cuda_run_resumes_bit_exact(tmp_path):
    ref_model, ref_opt, ref_scaler, ref_rng = train(tmp_path / "ref")
    with pytest.raises(Preempted):
        train(tmp_path / "run", stop_at=5)
    model, opt, scaler, rng = train(tmp_path / "run")
    for a, b in zip(ref_model.state_dict().values(), model.state_dict().values(), strict=True):
        assert a.is_cuda and torch.equal(a, b)
    for s1, s2 in zip(ref_opt.state_dict()["state"].values(), opt.state_dict()["state"].values(), strict=True):
        assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert ref_scaler.state_dict() == scaler.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(ref_rng, rng, strict=True))


def test_stager_copies_gpu_tensors_into_pinned_buffers_once_synchronised(tmp_path):
    from preempt.checkpoint.staging import Stager

    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256, device="cuda")).sum().backward()
    opt.step()
    stager = Stager()
    snap = stager.stage(state.capture(state.Components(model, opt), {}))
    bufs = [t for ts, _ in snap.tensor_files.values() for t in ts.values()]
    # pinned by registering the arena's pages: torch's is_pinned() says False for pages it did not allocate (2.11)
    assert bufs and all(t.device.type == "cpu" for t in bufs) and stager.pinned
    want = model.weight.detach().cpu()
    with torch.no_grad():
        model.weight.add_(1.0)  # the GPU moves on; the snapshot must not
    assert torch.equal(snap.tensor_files["model.safetensors"][0]["weight"], want)
