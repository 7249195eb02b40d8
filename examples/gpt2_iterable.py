"""A small GPT-2 trained on a sharded byte stream with evaluation as it goes, preemptible with preempt.

    python examples/gpt2_iterable.py --save_dir runs/gpt2
    timeout --signal=TERM 20 python examples/gpt2_iterable.py --save_dir runs/gpt2   # stopped: saves, exits 75
    python examples/gpt2_iterable.py --save_dir runs/gpt2                             # continues where it stopped

A new user's training script, built from README.md and the guide alone:

- model: transformers' GPT2LMHeadModel built from a tiny GPT2Config (byte-level, 256 tokens; nothing is
  downloaded), dropout on. Without transformers installed, or with --model tiny, a small causal transformer in
  plain torch takes its place.
- data: an IterableDataset over shard files of synthetic text (written once into --data_dir, from a seed), the
  shards split across 2 DataLoader workers with persistent_workers=True. Each worker shuffles its shards at the
  start of an epoch and masks a random 10% of every sequence's input bytes (both drawn inside the worker). Its
  state_dict()/load_state_dict() hold its position, so a resumed epoch continues each worker where it stood.
- AdamW, linear warm-up then cosine decay (LambdaLR), gradient accumulation, gradient clipping.
- evaluation on a validation DataLoader with 2 workers every --eval_every optimizer steps and at each epoch's
  end, reported with run.report({"val_loss": ...}); keep_best=1 keeps the checkpoint with the lowest val_loss.

--final_out FILE writes every tensor of the final state (model, optimizer, scheduler, random generators, the
recorded losses) to compare runs with torch.equal (tests/process/test_example_gpt2.py does).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from preempt import PreemptibleRun, _testing

MASK = 0  # the byte that replaces a masked input byte; the text never contains it
WORDS = (
    "the a of to and in is was for on that with as by at from it his her they this which be are were or had an not"
    " time river stone light garden winter morning city window music paper number field voice water island"
).split()
TRAIN_SHARDS, VAL_SHARDS = 4, 2
HOLD_LIMIT_S = 120.0  # a test hold that no signal releases ends here


# ------------------------------------------------------------------------------------------------ data


def write_shards(data_dir: Path, prefix: str, shards: int, sequences: int, seq_len: int, seed: int) -> list[Path]:
    """``shards`` files of ``sequences * (seq_len + 1)`` bytes of made-up sentences, written once, from a seed.

    Each file is written to a temporary name and renamed, so a file that exists is whole; one of another size
    (other settings) is written again.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    size = sequences * (seq_len + 1)
    files = []
    for s in range(shards):
        path = data_dir / f"{prefix}_{seq_len}_{s:03d}.bin"
        files.append(path)
        if path.is_file() and path.stat().st_size == size:
            continue
        rng = np.random.default_rng([seed, s, int(prefix == "val")])
        weights = 1.0 / np.arange(1, len(WORDS) + 1)  # Zipf-like: a few words are frequent
        text = bytearray()
        while len(text) < size:
            words = rng.choice(WORDS, size=int(rng.integers(4, 12)), p=weights / weights.sum())
            text += (" ".join(words).capitalize() + ". ").encode("ascii")
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(bytes(text[:size]))
        os.replace(tmp, path)
    return files


class ShardStream(IterableDataset):
    """Sequences of ``seq_len + 1`` bytes (input and next-byte target) from shard files.

    Worker ``w`` of ``n`` reads shards ``w, w + n, ...``. With ``shuffle`` it draws the order of its shards when
    an epoch starts; with ``mask_prob`` it replaces that fraction of input bytes by MASK (draws from the worker's
    torch generator). Its state is where it stands: the order, the shard and the next sequence in it, updated
    before each ``yield`` so that a state taken after a sample counts it.
    """

    def __init__(self, files: list[Path], seq_len: int, mask_prob: float = 0.0, shuffle: bool = False) -> None:
        self.files = [str(f) for f in files]
        self.seq_len = seq_len
        self.mask_prob = mask_prob
        self.shuffle = shuffle
        self.position: dict[str, Any] = {"order": [], "shard": 0, "offset": 0}
        self._resume: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return dict(self.position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from ``state`` (from state_dict) at the next ``iter()``."""
        if not isinstance(state, dict) or set(state) != {"order", "shard", "offset"}:
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"ShardStream state: expected the keys ['offset', 'order', 'shard'], found {found}")
        self._resume = state

    def __iter__(self):
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = self.files[w::n]
        resume, self._resume = self._resume, None
        if resume is not None:
            order, first, offset = [int(i) for i in resume["order"]], int(resume["shard"]), int(resume["offset"])
        else:
            order = torch.randperm(len(mine)).tolist() if self.shuffle else list(range(len(mine)))
            first, offset = 0, 0
        span = self.seq_len + 1
        for s in range(first, len(order)):
            data = np.fromfile(mine[order[s]], dtype=np.uint8)
            for k in range(offset if s == first else 0, len(data) // span):
                seq = torch.from_numpy(data[k * span : (k + 1) * span].astype(np.int64))
                x, y = seq[:-1].clone(), seq[1:]
                if self.mask_prob:
                    x[torch.rand(self.seq_len) < self.mask_prob] = MASK
                self.position = {"order": order, "shard": s, "offset": k + 1}
                yield x, y


# ------------------------------------------------------------------------------------------------ models


class TinyCausalLM(nn.Module):
    """The fallback model: token and position embeddings, pre-norm transformer blocks under a causal mask, a head
    tied to the token embedding."""

    def __init__(self, vocab: int, positions: int, width: int, layers: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(positions, width)
        self.drop = nn.Dropout(dropout)
        block = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        h = self.drop(self.tok(ids) + self.pos(torch.arange(length)))
        mask = nn.Transformer.generate_square_subsequent_mask(length)
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))


def make_model(args: argparse.Namespace) -> tuple[nn.Module, str]:
    """GPT-2 from transformers when it is installed (--model auto) or asked for; else the fallback."""
    if args.model != "tiny":
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError as e:
            if args.model == "gpt2":
                raise SystemExit(f"--model gpt2 needs the optional transformers package ({e})") from None
            print("transformers is not installed: using the built-in tiny causal transformer", flush=True)
        else:
            config = GPT2Config(
                vocab_size=256,
                n_positions=args.seq_len,
                n_embd=args.n_embd,
                n_layer=args.n_layer,
                n_head=args.n_head,
                bos_token_id=MASK,
                eos_token_id=MASK,
            )  # dropout 0.1 on embeddings, residuals and attention (GPT-2's defaults)
            return GPT2LMHeadModel(config), "gpt2"
    return TinyCausalLM(256, args.seq_len, args.n_embd, args.n_layer, args.n_head, 0.1), "tiny"


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x) if isinstance(model, TinyCausalLM) else model(input_ids=x).logits
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def warmup_cosine(warmup: int, total: int):
    """The factor of the peak learning rate after ``step`` scheduler steps: linear warm-up, then cosine to 0."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


# ------------------------------------------------------------------------------------------------ test hooks


class Hold:
    """Test hook ``--hold_at WHERE:K``: the K-th time this process is at WHERE, it prints ``test hook: holding
    ...`` and waits there until the run has been asked to stop (by the test's signal), at most HOLD_LIMIT_S.

    ``step:K``: inside its K-th optimizer step, after ``optimizer.step()`` and before ``run.step()``, once the
    checkpoint being written in the background (if any) is durable (so a SIGKILL there has it behind it).
    ``eval:K``: in its K-th evaluation, once the first validation batch has arrived (the workers are alive).
    """

    def __init__(self, spec: str | None) -> None:
        self.where, self.k = None, 0
        self.counts = {"step": 0, "eval": 0}
        if spec is not None:
            where, _, k = spec.partition(":")
            if where not in self.counts or not k.isdigit() or int(k) < 1:
                raise SystemExit(f"--hold_at: expected step:K or eval:K with K >= 1, got {spec!r}")
            self.where, self.k = where, int(k)

    def __call__(self, where: str, run: PreemptibleRun) -> None:
        self.counts[where] += 1
        if (where, self.counts[where]) != (self.where, self.k):
            return
        if where == "step":
            run.wait_for_checkpoint(HOLD_LIMIT_S)
        step = run.global_step + 1 if where == "step" else run.global_step  # the step being made, or the last one
        print(f"test hook: holding in {where} {self.k} at step {step}", flush=True)
        _testing.emit("holding", point=where, n=self.k, step=step)  # what the tests wait for
        deadline = time.monotonic() + HOLD_LIMIT_S
        while not run.stop_requested and time.monotonic() < deadline:
            time.sleep(0.005)  # the signal's handler runs in this thread, between two sleeps


# ------------------------------------------------------------------------------------------------ training


def evaluate(model: nn.Module, loader: DataLoader, run: PreemptibleRun, hold: Hold) -> float:
    """The mean next-byte loss over the validation shards (dropout off), recorded with run.report."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i, (x, y) in enumerate(loader):
            if i == 0:
                hold("eval", run)
            total += lm_loss(model, x, y).item() * y.numel()
            count += y.numel()
    model.train()
    val_loss = total / count
    run.user_state["evals"].append([run.global_step, val_loss])
    print(f"evaluation at step {run.global_step}: val_loss {val_loss:.4f}", flush=True)
    run.report({"val_loss": val_loss})  # a safe point: a stop that came during the evaluation is taken here
    return val_loss


def flatten(prefix: str, tree: Any, out: dict[str, torch.Tensor]) -> None:
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree.detach().clone().contiguous()
    elif isinstance(tree, dict):
        for k, v in tree.items():
            flatten(f"{prefix}.{k}", v, out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            flatten(f"{prefix}.{i}", v, out)
    elif isinstance(tree, (int, float, bool)):
        out[prefix] = torch.tensor(float(tree), dtype=torch.float64)


def write_final(path: Path, model: nn.Module, opt: Any, sched: Any, user_state: dict[str, Any]) -> None:
    """Every tensor of the final state, in one safetensors file."""
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    flatten("model", model.state_dict(), out)
    flatten("optimizer", opt.state_dict(), out)
    flatten("scheduler", {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}, out)
    flatten("user_state", user_state, out)
    out["rng.torch"] = torch.get_rng_state()
    out["rng.numpy"] = torch.from_numpy(np.random.get_state()[1].astype(np.int64))
    out["rng.python"] = torch.tensor(random.getstate()[1], dtype=torch.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save_dir", default="runs/gpt2_iterable", help="checkpoint directory")
    p.add_argument("--data_dir", type=Path, default=Path("data/gpt2_iterable"), help="where the shards are written")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps_per_epoch", type=int, default=50, help="optimizer steps per epoch (sizes the shards)")
    p.add_argument("--eval_every", type=int, default=25, help="evaluate every N optimizer steps (and at epoch ends)")
    p.add_argument("--val_sequences", type=int, default=32, help="validation sequences per validation shard")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--mask_prob", type=float, default=0.1, help="fraction of input bytes masked in the workers")
    p.add_argument("--num_workers", type=int, default=2)
    p.add_argument("--model", choices=["auto", "gpt2", "tiny"], default="auto", help="auto: gpt2 if installed")
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_embd", type=int, default=64)
    p.add_argument("--n_head", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup_steps", type=int, default=None, help="default: 10%% of all steps")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, the initialisation and dropout")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (keep it the same across a resume)")
    p.add_argument("--checkpoint_interval", type=float, default=60.0, help="seconds between periodic checkpoints")
    p.add_argument("--checkpoint_every_steps", type=int, default=None)
    p.add_argument("--final_out", type=Path, default=None, help="write every tensor of the final state here")
    p.add_argument("--hold_at", default=None, help="test hook, step:K or eval:K (see Hold)")
    args = p.parse_args(argv)
    for flag in ("epochs", "steps_per_epoch", "eval_every", "val_sequences", "batch_size", "accum", "seq_len"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag}: expected an integer >= 1, got {getattr(args, flag)}")
    if args.num_workers not in (0, 1, 2, 4):
        p.error(f"--num_workers: expected 0, 1, 2 or 4 (the 4 shards are split evenly), got {args.num_workers}")
    batches = args.steps_per_epoch * args.accum
    if batches % max(args.num_workers, 1):
        p.error(
            f"--steps_per_epoch {args.steps_per_epoch} x --accum {args.accum} = {batches} batches per epoch:"
            f" expected a multiple of --num_workers {args.num_workers} (every worker makes as many)"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # another thread count may sum in another order
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    hold = Hold(args.hold_at)

    # Shards sized so that every worker yields whole batches and an epoch is --steps_per_epoch optimizer steps.
    per_shard = args.steps_per_epoch * args.accum * args.batch_size // TRAIN_SHARDS
    if per_shard * TRAIN_SHARDS != args.steps_per_epoch * args.accum * args.batch_size:
        raise SystemExit(f"--steps_per_epoch x --accum x --batch_size: expected a multiple of {TRAIN_SHARDS}")
    train_files = write_shards(args.data_dir, "train", TRAIN_SHARDS, per_shard, args.seq_len, args.seed)
    val_files = write_shards(args.data_dir, "val", VAL_SHARDS, args.val_sequences, args.seq_len, args.seed)

    model, kind = make_model(args)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * args.steps_per_epoch
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, total // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup, total))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{kind}: {n_params / 1e6:.2f}M parameters; {args.epochs} epochs x {args.steps_per_epoch} steps", flush=True)

    train_set = ShardStream(train_files, args.seq_len, mask_prob=args.mask_prob, shuffle=True)
    val_set = ShardStream(val_files, args.seq_len)
    with PreemptibleRun(
        args.save_dir,
        model=model,
        optimizer=opt,
        scheduler=sched,
        checkpoint_interval=args.checkpoint_interval or None,
        checkpoint_every_steps=args.checkpoint_every_steps,
        keep_last=2,
        keep_best=1,
        best_metric="val_loss",
    ) as run:
        us = run.user_state
        us.setdefault("losses", [])  # the mean loss of every optimizer step
        us.setdefault("evals", [])  # [step, val_loss] of every evaluation
        us.setdefault("epoch", {"loss": 0.0, "steps": 0})  # this epoch's running sums: a resumed epoch's too
        loader = DataLoader(
            train_set,
            batch_size=args.batch_size,
            num_workers=args.num_workers,
            persistent_workers=args.num_workers > 0,  # the same workers for every epoch
        )
        # Its own generator: each evaluation's iterator draws its workers' base seed from it, not from torch's
        # global generator, whose stream (dropout) preempt saves and replays. An evaluation then changes no random
        # state of the training, so the one redone after a resume (below) leaves the training as it was.
        val_loader = DataLoader(
            val_set, batch_size=args.batch_size, num_workers=args.num_workers, generator=torch.Generator()
        )

        def evaluated() -> bool:
            return bool(us["evals"]) and us["evals"][-1][0] == run.global_step

        if run.resumed_from is not None:
            print(f"resuming at step {run.global_step}/{total} (epoch {run.epoch}, batch {run.batch})", flush=True)
        for epoch in run.epochs(args.epochs):
            # A stop at an evaluation step saves in run.step(), before the evaluation ran: do it now. (It draws
            # nothing from the global generators, which preempt puts back when run.batches() reaches the batch.)
            if run.global_step > 0 and run.global_step % args.eval_every == 0 and not evaluated():
                evaluate(model, val_loader, run, hold)
            step_loss = 0.0
            for x, y in run.batches(loader):
                loss = lm_loss(model, x, y)
                (loss / args.accum).backward()
                step_loss += loss.item() / args.accum
                if run.batch % args.accum:  # run.batch counts this epoch's batches, resumes included
                    continue
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                us["losses"].append(step_loss)
                us["epoch"]["loss"] += step_loss
                us["epoch"]["steps"] += 1
                hold("step", run)
                run.step(metrics={"loss": step_loss})  # the safe point: after the optimizer step
                step_loss = 0.0
                if run.global_step % args.eval_every == 0:
                    evaluate(model, val_loader, run, hold)
            if not evaluated():
                evaluate(model, val_loader, run, hold)
            done = us["epoch"]
            if done["steps"]:
                print(
                    f"epoch {epoch} done: mean loss {done['loss'] / done['steps']:.4f} over {done['steps']} steps",
                    flush=True,
                )
            us["epoch"] = {"loss": 0.0, "steps": 0}

    if args.final_out is not None:
        write_final(args.final_out, model, opt, sched, run.user_state)
    best = min(run.user_state["evals"], key=lambda e: e[1])
    print(f"finished at step {run.global_step}; best val_loss {best[1]:.4f} at step {best[0]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
