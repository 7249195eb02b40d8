"""A loop written with Accelerate inside PreemptibleRun: a loader from ``accelerator.prepare`` is refused at once with
what to change, and the loop written as the message says runs (real Accelerate, no mock)."""

from __future__ import annotations

import pytest

accelerate = pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install -e '.[hf]')")

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from preempt import PreemptibleRun  # noqa: E402
from preempt.errors import PreemptError  # noqa: E402


def parts():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), data


def test_a_prepared_loader_is_refused_with_what_to_change(tmp_path):
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt, data = parts()
    model, opt = accelerator.prepare(model, opt)
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_interval=None, log_file=False) as run:
        loader = accelerator.prepare(DataLoader(data, batch_size=4, sampler=run.sampler(data, seed=1)))
        for _ in run.epochs(1):
            refused = r"Accelerate's DataLoaderShard .*give run.batches\(\) the DataLoader"
            with pytest.raises(PreemptError, match=refused):
                next(iter(run.batches(loader)))
            break


def test_the_loop_as_the_message_says_runs_to_the_end(tmp_path):
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt, data = parts()
    model, opt = accelerator.prepare(model, opt)
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_interval=None, log_file=False) as run:
        loader = DataLoader(data, batch_size=4, sampler=run.sampler(data, seed=1))
        for _ in run.epochs(2):
            for x, y in run.batches(loader):
                x, y = x.to(accelerator.device), y.to(accelerator.device)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                accelerator.backward(loss)
                opt.step()
                run.step()
    assert run.global_step == 8 and (tmp_path / "complete.json").is_file()


def train_with_accelerate(save_dir, stop_at: int | None) -> dict[str, torch.Tensor]:
    """The loop as the message says, with dropout; ``stop_at``: a stop requested before that step (the run saves
    and leaves there, as on a signal). Returns the model's and the optimizer's tensors at the end."""
    accelerator = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    data = TensorDataset(torch.randn(24, 4, generator=torch.Generator().manual_seed(5)), torch.arange(24) % 2)
    model, opt = accelerator.prepare(model, opt)
    with PreemptibleRun(save_dir, model=model, optimizer=opt, checkpoint_interval=None, log_file=False) as run:
        loader = DataLoader(data, batch_size=4, sampler=run.sampler(data, seed=1))
        for _ in run.epochs(2):
            for x, y in run.batches(loader):
                if run.global_step + 1 == stop_at:
                    run.request_stop()
                loss = torch.nn.functional.cross_entropy(model(x.to(accelerator.device)), y.to(accelerator.device))
                opt.zero_grad()
                accelerator.backward(loss)
                opt.step()
                run.step()
    inner = opt.optimizer
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    out.update({f"opt.{i}.{k}": v for i, s in inner.state.items() for k, v in s.items() if torch.is_tensor(v)})
    return out


def test_the_loop_as_the_message_says_resumes_bit_exact(tmp_path):
    want = train_with_accelerate(tmp_path / "whole", None)
    with pytest.raises(SystemExit) as stopped:
        train_with_accelerate(tmp_path / "run", 8)  # mid-epoch 1 (6 steps per epoch)
    assert stopped.value.code == 75
    got = train_with_accelerate(tmp_path / "run", None)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
