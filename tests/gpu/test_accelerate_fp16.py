"""Accelerate's fp16 mixed precision on a GPU: the prepared optimizer's GradScaler is saved and restored as the
run's scaler without being passed, and a stop mid-epoch with accumulation 2 resumes bit-exact (model, optimizer,
scaler, the CPU's and the GPU's generators). Needs an NVIDIA GPU."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install -e '.[hf]')")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from preempt import PreemptibleRun  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


@pytest.fixture(autouse=True)
def fresh_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def train(save_dir, stop_at: int | None):
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, mixed_precision="fp16")
    assert accelerator.scaler is not None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Dropout(0.2), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(72, 16, generator=g), torch.randint(0, 4, (72,), generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    with PreemptibleRun(save_dir, model=model, optimizer=optimizer, scheduler=scheduler, log_file=False) as run:
        assert run.components.scaler is accelerator.scaler  # taken from the prepared optimizer
        for _ in run.epochs(2):
            for x, y in run.batches(loader):
                assert x.device.type == "cuda"
                if stop_at is not None and run.global_step + 1 == stop_at:
                    run.request_stop()
                with accelerator.accumulate(model):
                    loss = torch.nn.functional.cross_entropy(model(x), y) + torch.randn((), device="cuda") * 1e-3
                    accelerator.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                run.step()
    out = {f"model.{k}": v.cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    inner = optimizer.optimizer
    out.update({f"opt.{i}.{k}": v.cpu() for i, s in inner.state.items() for k, v in s.items() if torch.is_tensor(v)})
    out["scale"] = accelerator.scaler.get_scale() * torch.ones(())
    out["rng.cuda"] = torch.cuda.get_rng_state()
    out["rng.cpu"] = torch.get_rng_state()
    return out


def test_fp16_with_accelerate_s_scaler_resumes_bit_exact(tmp_path):
    want = train(tmp_path / "whole", None)
    with pytest.raises(SystemExit) as stopped:
        train(tmp_path / "run", 7)  # 18 batches an epoch, 9 steps: mid-epoch 0
    assert stopped.value.code == 75
    got = train(tmp_path / "run", None)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ: {differ}"
