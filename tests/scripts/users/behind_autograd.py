"""Training loops that write the model's state behind autograd's back, one ``--shape`` each, as users write them
(written here after the projects named, not copied), with preempt's default options: a checkpoint every 3 steps,
every checkpoint kept, ``async_save`` as preempt defaults it (``--sync``: ``async_save=False``).

Shapes (small models on synthetic data, 10 steps per epoch, 3 epochs: 30 steps):

- ``sgd_data``: pytorch/examples' word_language_model: an embedding, an LSTM and a decoder, no optimizer (the
  model alone is given to the run), gradients clipped and zeroed by ``model.zero_grad()``, the update
  ``p.data.add_(p.grad, alpha=-lr)``.
- ``teacher``: DINO/BYOL: one module holding ``student`` and ``teacher``, the teacher ``requires_grad_(False)``,
  the optimizer over the student alone, the teacher moved towards the student through ``.data`` after each step.
- ``ema_data``: an exponential moving average of the weights and buffers kept as a frozen submodule of the model
  (timm's ModelEmaV2, but inside the model), updated through ``.data``.
- ``clamp_data``: WGAN's critic: RMSprop, then every weight clipped with ``p.data.clamp_(-c, c)``.
- ``numpy_view``: a frozen buffer (a running sum of the inputs) and a frozen parameter (an output scale) written
  through ``t.numpy()[...]`` at every step.
- ``replaced``: a frozen buffer reassigned to a new tensor at every step (``model.mask = model.mask.roll(1)``),
  and at steps 8 and 17 a parameter replaced (``model.fc.weight = nn.Parameter(...)``) and the optimizer's
  param group and state moved to the new one.
- ``set_epoch_wrapper``: a plain loader wrapper (no ``sampler`` attribute) that calls ``set_epoch`` with its own
  count of epochs on preempt's sampler, as a training library's wrapper does; after a resume that count starts
  at 0 again.

What a test checks with it: ``--live_dir DIR`` gets, after every ``run.step()`` (a stop's too: the checkpoint a
stop writes at step N holds the state of that ``run.step()``), the live state of that step
(``tests/helpers/kept.py``: ``record_live``), which every kept checkpoint must equal. ``--hold_at_step N``: step N
waits before its ``run.step()`` until the run was asked to stop (the event ``holding``, point "step", n N).
``--hold_durable_at_step N``: the same after the write in flight is durable (``run.wait_for_checkpoint()``; the
event says which checkpoint), for a SIGKILL that must come after a durable checkpoint. ``--settle``: before each
``run.step()`` at which a checkpoint is due (every 3rd step) the write in flight is waited for, so that a background
save is taken at its step rather than postponed behind a slow write (the steps of the checkpoints do not depend on
the machine's speed; each background write still runs while the loop trains the next steps).
``--final_out``: the final state (model, optimizer, RNG).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, Dataset

TESTS = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(TESTS / "scripts"))
from train import flatten, wait_for_stop  # noqa: E402

from preempt import PreemptibleRun, _testing  # noqa: E402

# tests/helpers/kept.py alone, by its path: the helpers package imports pytest, and the folder on sys.path would
# shadow top-level modules with its own (cli, distributed, metadata)
_spec = importlib.util.spec_from_file_location("kept", TESTS / "helpers" / "kept.py")
assert _spec is not None and _spec.loader is not None
kept = sys.modules["kept"] = importlib.util.module_from_spec(_spec)  # (its dataclass looks itself up there)
_spec.loader.exec_module(kept)

SHAPES = ("sgd_data", "teacher", "ema_data", "clamp_data", "numpy_view", "replaced", "set_epoch_wrapper")
SAMPLES, BATCH, DIM = 80, 8, 8  # 10 steps per epoch
EVERY = 3  # checkpoint_every_steps
VOCAB, LENGTH = 32, 9


class Features(Dataset):
    """Deterministic features and labels."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(SAMPLES, DIM, generator=g)
        self.y = (self.x[:, 0] + 0.5 * self.x[:, 1] > 0).long()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Tokens(Dataset):
    """Random token sequences; the target is the sequence shifted by one (a language model's)."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i, :-1], self.ids[i, 1:]


def mlp(out: int = 2, norm: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(DIM, 16)]
    if norm:
        layers.append(nn.BatchNorm1d(16))
    return nn.Sequential(*layers, nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, out))


class WordLM(nn.Module):
    """word_language_model's RNNModel in miniature: dropout, encoder, LSTM, decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(VOCAB, 16)
        self.rnn = nn.LSTM(16, 16, batch_first=True)
        self.decoder = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.drop(self.encoder(ids)))
        return self.decoder(self.drop(out))


class StudentTeacher(nn.Module):
    """DINO's two networks in one module; the teacher learns only by the student's moving average."""

    def __init__(self) -> None:
        super().__init__()
        self.student = mlp()
        self.teacher = copy.deepcopy(self.student)
        self.teacher.requires_grad_(False)


class WithEma(nn.Module):
    """A network and its moving average (weights and BatchNorm buffers) as a frozen submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(norm=True)
        self.ema = copy.deepcopy(self.net)
        self.ema.requires_grad_(False)
        self.ema.eval()


class Wgan(nn.Module):
    """A critic trained with weight clipping against a fixed generator of fakes."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(DIM, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        self.generator = nn.Linear(4, DIM)
        self.generator.requires_grad_(False)


class Counted(nn.Module):
    """A classifier with a running sum of its inputs (a buffer) and an output scale (a frozen parameter), both
    updated through NumPy views."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.register_buffer("seen", torch.zeros(DIM))
        self.scale = nn.Parameter(torch.ones(2), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale


class Masked(nn.Module):
    """A body, a mask over its features (a buffer reassigned at every step) and a head whose weight is replaced."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(DIM, 16)
        self.fc = nn.Linear(16, 2)
        self.register_buffer("mask", (torch.arange(16) % 4 != 0).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.body(x)) * self.mask)


class EpochLoader:
    """A loader wrapper that tells the sampler its own count of epochs at each iteration (a plain iterable with a
    length: it exposes neither the DataLoader nor its sampler)."""

    def __init__(self, loader: DataLoader) -> None:
        self._loader = loader
        self._sampler = loader.sampler
        self.epochs_seen = 0

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self):
        self._sampler.set_epoch(self.epochs_seen)
        self.epochs_seen += 1
        return iter(self._loader)


def replace_weight(model: Masked, opt: torch.optim.Optimizer) -> None:
    """``model.fc.weight`` becomes a new Parameter (half the old values); the optimizer follows it, state and all."""
    old = model.fc.weight
    new = nn.Parameter(old.detach() * 0.5)
    model.fc.weight = new
    for group in opt.param_groups:
        group["params"] = [new if p is old else p for p in group["params"]]
    if old in opt.state:
        opt.state[new] = opt.state.pop(old)


def build(shape: str) -> tuple[nn.Module, torch.optim.Optimizer | None, Dataset]:
    if shape == "sgd_data":
        return WordLM(), None, Tokens()
    if shape == "teacher":
        model = StudentTeacher()
        return model, torch.optim.SGD(model.student.parameters(), lr=0.1, momentum=0.9), Features()
    if shape == "ema_data":
        model = WithEma()
        return model, torch.optim.AdamW(model.net.parameters(), lr=1e-2), Features()
    if shape == "clamp_data":
        model = Wgan()
        return model, torch.optim.RMSprop(model.critic.parameters(), lr=5e-3), Features()
    if shape == "numpy_view":
        model = Counted()
        return model, torch.optim.AdamW(model.net.parameters(), lr=1e-2), Features()
    if shape == "replaced":
        model = Masked()
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), Features()
    model = mlp()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), Features()


def train_step(shape: str, model: nn.Module, opt: torch.optim.Optimizer | None, x, y, step: int) -> None:
    """One step's work: forward, backward, the update, and what the shape writes behind autograd after it."""
    ce = nn.functional.cross_entropy
    if shape == "sgd_data":
        lr = 1.0
        model.zero_grad()
        loss = ce(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        return
    assert opt is not None
    opt.zero_grad()
    if shape == "teacher":
        out = model.student(x)
        with torch.no_grad():
            target = model.teacher(x).softmax(-1)
        loss = ce(out, y) + ce(out, target)
    elif shape == "ema_data":
        loss = ce(model.net(x), y)
    elif shape == "clamp_data":
        fake = model.generator(torch.randn(len(x), 4))
        loss = model.critic(fake).mean() - model.critic(x).mean()
    else:
        loss = ce(model(x), y)
    loss.backward()
    opt.step()
    if shape == "teacher":
        m = 0.9
        for ps, pt in zip(model.student.parameters(), model.teacher.parameters(), strict=True):
            pt.data.mul_(m).add_((1 - m) * ps.detach().data)
    elif shape == "ema_data":
        d = 0.8
        ema, net = model.ema.state_dict(keep_vars=True), model.net.state_dict(keep_vars=True)
        for e, s in zip(ema.values(), net.values(), strict=True):
            if e.dtype.is_floating_point:
                e.data.mul_(d).add_(s.data, alpha=1 - d)
            else:
                e.data.copy_(s.data)
    elif shape == "clamp_data":
        for p in model.critic.parameters():
            p.data.clamp_(-0.05, 0.05)
    elif shape == "numpy_view":
        model.seen.numpy()[...] += x.mean(0).numpy()
        model.scale.numpy()[...] *= 0.99
    elif shape == "replaced":
        model.mask = model.mask.roll(1)
        if step in (8, 17):
            replace_weight(model, opt)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save_dir", required=True)
    p.add_argument("--live_dir", required=True, help="the live state after each run.step(), per step")
    p.add_argument("--shape", choices=SHAPES, required=True)
    p.add_argument("--sync", action="store_true", help="PreemptibleRun(async_save=False)")
    p.add_argument("--final_out", default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--hold_at_step", type=int, default=None)
    p.add_argument("--hold_durable_at_step", type=int, default=None)
    p.add_argument("--settle", action="store_true", help="wait for the write in flight where a checkpoint is due")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = args.shape
    model, opt, data = build(shape)
    options = {"async_save": False} if args.sync else {}
    with PreemptibleRun(
        args.save_dir, model=model, optimizer=opt, checkpoint_every_steps=EVERY, keep_last=1000, **options
    ) as run:
        loader = DataLoader(data, batch_size=BATCH, sampler=run.sampler(data, seed=7))
        batches = EpochLoader(loader) if shape == "set_epoch_wrapper" else loader
        _testing.emit("entered", step=run.global_step, epoch=run.epoch, batch=run.batch)
        for _ in run.epochs(args.epochs):
            model.train()
            for x, y in run.batches(batches):
                step = run.global_step + 1
                train_step(shape, model, opt, x, y, step)
                durable = None
                if step == args.hold_durable_at_step or (args.settle and step % EVERY == 0):
                    durable = run.wait_for_checkpoint()
                if step in (args.hold_at_step, args.hold_durable_at_step):
                    name = durable.name if durable is not None else None
                    _testing.emit("holding", point="step", n=step, pid=os.getpid(), durable=name)
                    wait_for_stop(run)  # (a SIGKILL ends it here)
                try:
                    run.step()
                finally:  # a stop's checkpoint is this step's state too
                    kept.record_live(args.live_dir, run.global_step, model, opt)
    if args.final_out:
        out: dict[str, torch.Tensor] = {}
        flatten("model", model.state_dict(), out)
        if opt is not None:
            flatten("optimizer", opt.state_dict(), out)
        out["rng"] = torch.get_rng_state()
        save_file(out, args.final_out)


if __name__ == "__main__":
    main()
