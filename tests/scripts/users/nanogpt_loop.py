"""A nanoGPT-style training loop, written here in the style of that project's ``train.py`` (not copied from it).

No DataLoader: each batch is ``block``-long windows at random offsets of one token array, drawn with
``torch.randint`` from the global generator; the next batch is drawn ("prefetched") right after the forward pass,
before the backward, as nanoGPT does to overlap the host with the device; gradient accumulation over micro-steps;
a ``GradScaler`` with float16 autocast (on the CPU); the learning rate set by hand each iteration from a cosine
schedule of the iteration number; an estimate of the loss every ``eval_interval`` iterations; a
``while True`` loop that ends at ``max_iters``; ``logging.basicConfig(level=logging.WARNING)``.

The prefetched batch is carried from one iteration to the next, outside the model and optimizer: with
``--prefetch tracked`` the script hands it to the run (``track={"batch": ...}``, the guide's pattern: its state is
the globals ``X, Y``, which exist only once the loop has drawn them inside the run); with ``--prefetch untracked``
it does not, and a resume is inexact (``preempt check`` finds it: tests/process/test_check.py).

``--hold_at_step N``: the iteration that makes step N waits before ``run.step()`` until the run was asked to
stop (the test signals it then). ``--final_out``: the model's and optimizer's tensors and the losses at the end.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train import flatten, wait_for_stop  # noqa: E402

from preempt import PreemptibleRun, _testing  # noqa: E402

block, batch_size, vocab = 16, 8, 64


class TinyGPT(torch.nn.Module):
    def __init__(self, n_embd: int = 32) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, n_embd)
        self.pos = torch.nn.Embedding(block, n_embd)
        self.block = torch.nn.TransformerEncoderLayer(n_embd, 2, 64, dropout=0.1, batch_first=True)
        self.head = torch.nn.Linear(n_embd, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        logits = self.head(self.block(x, src_mask=mask, is_causal=True))
        return torch.nn.functional.cross_entropy(logits.view(-1, vocab), targets.view(-1))


data = torch.randint(0, vocab, (4096,), generator=torch.Generator().manual_seed(0))


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - block - 1, (batch_size,))
    x = torch.stack([data[i : i + block] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block] for i in ix])
    return x, y


class Prefetched:
    """The batch drawn for the next iteration (the globals X, Y), as the run saves and restores it."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"x": X, "y": Y}  # noqa: F821  (defined by the loop, inside the run)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        global X, Y
        X, Y = state["x"], state["y"]


def get_lr(it: int, max_iters: int, lr: float = 1e-3, warmup: int = 4) -> float:
    if it < warmup:
        return lr * (it + 1) / warmup
    return 0.1 * lr + 0.9 * lr * 0.5 * (1.0 + math.cos(math.pi * (it - warmup) / max(1, max_iters - warmup)))


def main() -> None:
    global X, Y
    p = argparse.ArgumentParser()
    p.add_argument("--save_dir", required=True)
    p.add_argument("--final_out", default=None)
    p.add_argument("--max_iters", type=int, default=24)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--eval_interval", type=int, default=5)
    p.add_argument("--every_steps", type=int, default=None)
    p.add_argument("--prefetch", choices=("tracked", "untracked"), default="tracked")
    p.add_argument("--hold_at_step", type=int, default=None)
    p.add_argument("--sync_save", action="store_true", help="PreemptibleRun(async_save=False)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    torch.manual_seed(1337)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    track = {"batch": Prefetched()} if args.prefetch == "tracked" else {}
    losses: list[float] = []
    with PreemptibleRun(
        args.save_dir,
        model=model,
        optimizer=optimizer,
        scaler=scaler,
        track=track,
        checkpoint_interval=None,
        checkpoint_every_steps=args.every_steps,
        async_save=not args.sync_save,
    ) as run:
        run.user_state.setdefault("losses", [])
        losses = run.user_state["losses"]
        if run.resumed_from is None or args.prefetch == "untracked":
            X, Y = get_batch()  # the first batch (tracked: a resumed run has the one the stopped run drew)
        while True:
            it = run.global_step
            for group in optimizer.param_groups:
                group["lr"] = get_lr(it, args.max_iters)
            if it % args.eval_interval == 0:
                model.eval()
                with torch.no_grad():
                    losses.append(round(float(model(*get_batch())), 6))  # a draw of its own, as estimate_loss
                model.train()
            if it >= args.max_iters:
                break
            for _ in range(args.accum):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(X, Y) / args.accum
                X, Y = get_batch()  # prefetch the next batch while the backward runs
                scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            print(f"step {run.global_step + 1}", flush=True)
            if run.global_step + 1 == args.hold_at_step:
                _testing.emit("holding", point="step", n=run.global_step + 1, pid=os.getpid())
                wait_for_stop(run)
            run.step()
    if args.final_out:
        out: dict[str, torch.Tensor] = {}
        flatten("model", model.state_dict(), out)
        flatten("optimizer", optimizer.state_dict(), out)
        flatten("scaler", scaler.state_dict(), out)
        out["losses"] = torch.tensor(losses, dtype=torch.float64)
        out["rng"] = torch.get_rng_state()
        save_file(out, args.final_out)
    print(f"done at step {run.global_step}", flush=True)


if __name__ == "__main__":
    main()
