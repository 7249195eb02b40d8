"""LatentWire in miniature: one text -> shared latents -> two frozen decoders, preemptible end to end.

    python examples/latentwire_train.py --save_dir runs/latentwire                 # ~1 minute on 2 CPU cores
    timeout --signal=TERM 20 python examples/latentwire_train.py --save_dir runs/lw --samples 2048 --epochs 3
    python examples/latentwire_train.py --save_dir runs/lw --samples 2048 --epochs 3 --auto_resume  # continues
    preempt verify runs/lw

What it trains (the shape of seed 001's LatentWire job, scaled down to a CPU):

* an encoder reads the question and its context as UTF-8 bytes and turns them
  into --latent_len x --d_z latent vectors (the "wire");
* one small adapter per receiving model maps those latents into that model's
  input-embedding space (an MLP, then scaled to the model's embedding RMS);
* two FROZEN decoder language models, stand-ins for Llama and Qwen, read
  [adapted latents][--warm_anchor_text][answer so far] and must produce the
  answer. They tokenise differently ("llama": one token per character, width
  64; "qwen": one token per word with a character fallback, width 96), so each
  needs its own adapter. They are built in and warmed up for a few seconds on
  question/answer text (deterministic, no download), then frozen; --llama_id /
  --qwen_id load local Hugging Face model directories instead (needs
  `transformers`, optional, offline only);
* the loss, per decoder, averaged over the two: the teacher-forced
  cross-entropy of the whole answer (and its end token), plus
  --first_token_ce_weight x the cross-entropy of the first answer token, plus
  the mean cross-entropy of the first --K answer tokens (see --K).

Data: a SQuAD-like set of question/context/answer triples generated offline
and deterministically (--dataset synthetic), or a local SQuAD JSON file
(--dataset squad --data_file train-v1.1.json).

Preemption: everything runs inside preempt.PreemptibleRun. SIGTERM, SIGINT or
SIGUSR1/2 make the next step boundary write a checkpoint and exit with code
75; rerunning the same command with --auto_resume continues at the exact
batch, and the final state equals that of an uninterrupted run bit for bit
(the run is deterministic: fixed seeds and a fixed torch thread count, on
CPU). Rerun once complete, it exits 0 at once.

Without --auto_resume, a save_dir that already holds checkpoints is refused
(exit 2), complete or not: a job script that forgot the flag would otherwise
start from zero at every requeue and never finish. --restart starts over in
the same save_dir on purpose (the old checkpoints are moved to
save_dir/superseded/, not deleted); it is for one command typed by hand,
never for a job script, where every requeue would start over again.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import xxhash
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from preempt import CheckpointManager, PreemptibleRun

IGNORE = -100  # target padding, skipped by the cross-entropy

# ---------------------------------------------------------------------------------------------------- data

_FIRST = "Mara Tomas Ilse Joren Petra Anouk Bram Lucia Oskar Nadia Emil Sanne Viktor Ada Rune Clara Felix Ines".split()
_LAST = "Quill Varga Holt Ember Lindqvist Moreau Okafor Brandt Castell Ferro Ishida Kovac Navarro Olsen Reyes".split()
_CITIES = "Tolen Varna Ostrik Belmar Caldera Dunmore Eskar Fennick Galloway Harrow Istra Jorvik Kesh Lorwen".split()
_FIELDS = "botany astronomy chemistry geology law medicine music painting philosophy poetry physics zoology".split()
_SCHOOLS = "Veld Institute|Royal Academy|Northern College|Harbour School|Old University|Lyceum of Arts".split("|")
_THINGS = "violin cello flute harp organ piano trumpet guitar drums oboe".split()
_COLOURS = "red blue green amber violet silver crimson teal ochre white".split()
_SHIPS = "Albatross Heron Meridian Northwind Seagull Tempest Valiant Wanderer".split()


@dataclass(frozen=True)
class Example:
    question: str
    context: str
    answer: str


def synthetic_squad(n: int, seed: int) -> list[Example]:
    """``n`` SQuAD-like examples: a short biography, a question about one fact, the answer a span of it.

    A pure function of (n, seed): no download, the same bytes on every machine.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        who = name.split()[0]
        facts = {
            "city": rng.choice(_CITIES),
            "year": str(rng.randint(1620, 1990)),
            "field": rng.choice(_FIELDS),
            "school": rng.choice(_SCHOOLS),
            "thing": rng.choice(_THINGS),
            "colour": rng.choice(_COLOURS),
            "ship": rng.choice(_SHIPS),
            "count": str(rng.randint(2, 40)),
        }
        sentences = {
            "birth": f"{name} was born in {facts['city']} in {facts['year']}.",
            "study": f"{who} studied {facts['field']} at the {facts['school']}.",
            "play": f"{who} played the {facts['thing']} and liked the colour {facts['colour']}.",
            "ship": f"{who} sailed on the {facts['ship']} for {facts['count']} years.",
        }
        questions = [
            ("birth", f"Where was {name} born?", facts["city"]),
            ("birth", f"In which year was {name} born?", facts["year"]),
            ("study", f"What did {name} study?", facts["field"]),
            ("study", f"Where did {name} study?", facts["school"]),
            ("play", f"Which instrument did {name} play?", facts["thing"]),
            ("play", f"Which colour did {name} like?", facts["colour"]),
            ("ship", f"On which ship did {name} sail?", facts["ship"]),
            ("ship", f"For how many years did {name} sail?", facts["count"]),
        ]
        topic, question, answer = rng.choice(questions)
        # Two sentences: the birth (which introduces the name) and one more; the question is about either.
        second = topic if topic != "birth" else rng.choice(["study", "play", "ship"])
        context = f"{sentences['birth']} {sentences[second]}"
        out.append(Example(question, context, answer))
    return out


def read_squad(path: Path, n: int) -> list[Example]:
    """The first ``n`` answerable questions of a SQuAD v1.1/v2.0 JSON file, in file order."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SystemExit(f"--data_file {path}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SystemExit(f"--data_file {path}: not a readable JSON file ({e})") from None
    out: list[Example] = []
    try:
        for article in doc["data"]:
            for para in article["paragraphs"]:
                for qa in para["qas"]:
                    if qa.get("is_impossible") or not qa.get("answers"):
                        continue
                    out.append(Example(qa["question"].strip(), para["context"].strip(), qa["answers"][0]["text"]))
                    if len(out) == n:
                        return out
    except (KeyError, TypeError, IndexError) as e:
        raise SystemExit(
            f"--data_file {path}: expected SQuAD JSON ({{'data': [{{'paragraphs': [{{'context', 'qas': [...]}}]}}]}}),"
            f" missing {e}"
        ) from None
    if not out:
        raise SystemExit(f"--data_file {path}: no answerable question found")
    if len(out) < n:
        print(f"note: {path} holds {len(out)} answerable questions; using all of them (--samples {n})", flush=True)
    return out


# ----------------------------------------------------------------------------------------------- tokenisers


class CharTokenizer:
    """One token per character (the "llama" stand-in's tokenisation)."""

    SPECIALS = ("<pad>", "<eos>", "<unk>")

    def __init__(self, texts: list[str]) -> None:
        chars = sorted({c for t in texts for c in t})
        self.itos = [*self.SPECIALS, *chars]
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.pad_id, self.eos_id, self.unk_id = 0, 1, 2

    def encode(self, text: str) -> list[int]:
        return [self.stoi.get(c, self.unk_id) for c in text]

    @property
    def vocab_size(self) -> int:
        return len(self.itos)


class WordTokenizer:
    """One token per frequent word with its leading space, characters otherwise (the "qwen" stand-in's)."""

    SPECIALS = ("<pad>", "<eos>", "<unk>")

    def __init__(self, texts: list[str], max_words: int = 2000) -> None:
        counts = collections.Counter(w for t in texts for w in self._words(t))
        words = [w for w, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if c >= 2][:max_words]
        chars = sorted({c for t in texts for c in t})
        self.itos = [*self.SPECIALS, *chars, *[w for w in words if w not in chars]]
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.pad_id, self.eos_id, self.unk_id = 0, 1, 2

    @staticmethod
    def _words(text: str) -> list[str]:
        # Like SentencePiece, a space is assumed before the first word: "Paris" and " Paris" are one token.
        return [" " + w for w in text.split(" ")] if text else []

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for w in self._words(text):
            if w in self.stoi:
                ids.append(self.stoi[w])
            else:
                ids.extend(self.stoi.get(c, self.unk_id) for c in w)
        return ids

    @property
    def vocab_size(self) -> int:
        return len(self.itos)


# ---------------------------------------------------------------------------------------------- the models


class Block(nn.Module):
    """A pre-norm transformer block (self-attention, then an MLP)."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, *, causal: bool = False, keep: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = None if keep is None else keep[:, None, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class ByteEncoder(nn.Module):
    """UTF-8 bytes -> ``latent_len`` x ``d_z`` latents.

    Pairs of bytes become one vector (a strided convolution), two transformer
    blocks read them, and ``latent_len`` learned queries attend to the result.
    """

    PAD = 256
    PATCH = 2

    def __init__(self, max_bytes: int, latent_len: int, d_z: int, d: int = 96, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(257, d // 2)
        self.patch = nn.Conv1d(d // 2, d, kernel_size=self.PATCH, stride=self.PATCH)
        self.pos = nn.Parameter(torch.randn(-(-max_bytes // self.PATCH), d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, 4, dropout) for _ in range(2))
        self.queries = nn.Parameter(torch.randn(latent_len, d) * 0.02)
        self.q, self.kv = nn.Linear(d, d), nn.Linear(d, 2 * d)
        self.out = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d_z))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pad = -ids.shape[1] % self.PATCH
        ids = F.pad(ids, (0, pad), value=self.PAD)
        keep = (ids != self.PAD).view(ids.shape[0], -1, self.PATCH).any(-1)
        x = self.patch(self.embed(ids).transpose(1, 2)).transpose(1, 2)
        x = x + self.pos[: x.shape[1]]
        for blk in self.blocks:
            x = blk(x, keep=keep)
        k, v = self.kv(x).chunk(2, dim=-1)
        q = self.q(self.queries).expand(ids.shape[0], -1, -1)
        z = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, :])
        return self.out(z + self.queries)


class Adapter(nn.Module):
    """Latents -> one decoder's embedding space, scaled to that decoder's embedding RMS (as LatentWire calibrates)."""

    def __init__(self, d_z: int, d_model: int, embed_rms: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(d_z), nn.Linear(d_z, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model)
        )
        self.gain = nn.Parameter(torch.ones(()))
        self.register_buffer("embed_rms", torch.tensor(float(embed_rms)))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.net(z)
        return h * (self.gain * self.embed_rms / h.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())


class TinyLM(nn.Module):
    """A small causal decoder language model: the built-in stand-in for a frozen Llama or Qwen."""

    def __init__(self, vocab: int, d: int, layers: int = 2, heads: int = 4, max_len: int = 160) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, 0.0) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.max_len = max_len

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        x = embeds + self.pos[: embeds.shape[1]]
        for blk in self.blocks:
            x = blk(x, causal=True)
        return self.head(self.ln(x))


class Decoder:
    """A frozen decoder LM and its tokeniser, as the training sees it (built-in or Hugging Face)."""

    def __init__(self, name: str, tokenizer: Any, embed: nn.Module, logits: Any, d_model: int, max_len: int) -> None:
        self.name, self.tokenizer, self.d_model, self.max_len = name, tokenizer, d_model, max_len
        self._embed, self._logits = embed, logits
        self.embed_rms = float(embed.weight.detach().pow(2).mean().sqrt())

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._embed(ids)

    def logits(self, embeds: torch.Tensor) -> torch.Tensor:
        return self._logits(embeds)


def warm_up(lm: TinyLM, tok: Any, texts: list[str], steps: int, seed: int) -> None:
    """Trains ``lm`` briefly as a language model of ``texts``, deterministically (its own generator, no dropout)."""
    seqs = [(tok.encode(t) + [tok.eos_id])[: lm.max_len] for t in texts]
    width = max(len(s) for s in seqs)
    data = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    for i, s in enumerate(seqs):
        data[i, : len(s)] = torch.tensor(s)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3, weight_decay=0.0)
    lm.train()
    for _ in range(steps):
        batch = data[torch.randint(0, len(seqs), (16,), generator=g)]
        batch = batch[:, : int((batch != IGNORE).sum(1).max())]  # no columns of padding only
        inputs = batch[:, :-1].clamp(min=0)  # IGNORE -> pad id 0 as input; its targets are ignored anyway
        loss = F.cross_entropy(lm(lm.tok(inputs)).flatten(0, 1), batch[:, 1:].flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    lm.eval().requires_grad_(False)


def builtin_decoder(name: str, texts: list[str], warmup_steps: int, seed: int) -> Decoder:
    """A built-in frozen decoder ("llama" or "qwen"), warmed up on ``texts`` (question, anchor, answer)."""
    i = ("llama", "qwen").index(name)
    tok = CharTokenizer(texts) if name == "llama" else WordTokenizer(texts)
    width = (64, 96)[i]
    torch.manual_seed(seed * 1000 + i)  # the initial weights, independent of what ran before
    lm = TinyLM(tok.vocab_size, width)
    warm_up(lm, tok, texts, warmup_steps, seed * 1000 + 100 + i)
    return Decoder(name, tok, lm.tok, lm, width, lm.max_len)


class _HFTokenizer:
    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.eos_id = tok.eos_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if self.eos_id is None:
            raise SystemExit(f"{tok.name_or_path}: the tokenizer has no end-of-sequence token")

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])


def hf_decoder(name: str, path: str) -> Decoder:
    """A local Hugging Face causal LM directory as a frozen decoder (offline: nothing is downloaded)."""
    import transformers  # checked in parse_args

    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    model.float().eval().requires_grad_(False)  # float32: the adapters train on the CPU here
    cfg = model.config
    max_len = int(getattr(cfg, "max_position_embeddings", 2048) or 2048)
    return Decoder(
        name,
        _HFTokenizer(tok),
        model.get_input_embeddings(),
        lambda e: model(inputs_embeds=e).logits,
        int(cfg.hidden_size),
        max_len,
    )


def weights_digest(modules: list[nn.Module]) -> str:
    """xxh3-128 of every parameter and buffer, in order: proves that a resumed run sees the same frozen decoders."""
    h = xxhash.xxh3_128()
    for m in modules:
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            h.update(name.encode())
            h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ the batches


def encode_bytes(texts: list[str], max_bytes: int) -> torch.Tensor:
    out = torch.full((len(texts), max_bytes), ByteEncoder.PAD, dtype=torch.long)
    for i, t in enumerate(texts):
        b = t.encode("utf-8")[:max_bytes]
        out[i, : len(b)] = torch.tensor(list(b), dtype=torch.long)
    return out


def anchor_and_answers(tok: Any, anchor: str, answers: list[str], max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The anchor's tokens and each answer's tokens (plus the end token), as the decoder would see them in text.

    Tokenising "Answer: " and "Paris" apart gives other tokens than
    tokenising "Answer: Paris": word and BPE tokenisers attach the space to the
    word after it. So each answer is tokenised together with the anchor and
    split after the anchor's tokens; when the anchor's trailing space merges
    into the answer, the anchor is taken without it. Answers are padded with
    IGNORE and cut to ``max_tokens`` (the end token is then lost).
    """
    fulls = [tok.encode(anchor + a) for a in answers]
    head = tok.encode(anchor)
    if not all(f[: len(head)] == head for f in fulls):
        head = tok.encode(anchor.rstrip())
    seqs = [
        (f[len(head) :] if f[: len(head)] == head else tok.encode(a)) + [tok.eos_id]
        for f, a in zip(fulls, answers, strict=True)
    ]
    seqs = [s[:max_tokens] for s in seqs]
    out = torch.full((len(seqs), max(len(s) for s in seqs)), IGNORE, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return torch.tensor([head], dtype=torch.long), out


def decoder_loss(
    dec: Decoder, prefix: torch.Tensor, anchor: torch.Tensor, targets: torch.Tensor, k: int, first_weight: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """[latent prefix][anchor][answer[:-1]] -> the answer's cross-entropies (see the module docstring)."""
    b = prefix.shape[0]
    inputs = targets[:, :-1].masked_fill(targets[:, :-1] == IGNORE, dec.tokenizer.pad_id)
    parts = [prefix, dec.embed(anchor).expand(b, -1, -1), dec.embed(inputs)]
    logits = dec.logits(torch.cat(parts, dim=1))
    start = prefix.shape[1] + anchor.shape[1] - 1  # the position that predicts the first answer token
    logits = logits[:, start : start + targets.shape[1]]
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none")
    ce = ce.view_as(targets)
    mask = (targets != IGNORE).float()
    ce_all = (ce * mask).sum() / mask.sum()
    ce_first = ce[:, 0].mean()
    loss = ce_all + first_weight * ce_first
    if k > 0:
        loss = loss + (ce[:, :k] * mask[:, :k]).sum() / mask[:, :k].sum()
    hits = (logits[:, 0].argmax(-1) == targets[:, 0]).sum().item()
    return loss, {"ce": ce_all.item(), "first": ce_first.item(), "hits": hits}


# --------------------------------------------------------------------------------------------- arguments


def _bounded(kind: type, low: float, what: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value >= low or (kind is float and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_POSITIVE = _bounded(int, 1, "an integer >= 1")
_COUNT = _bounded(int, 0, "an integer >= 0")
_WEIGHT = _bounded(float, 0.0, "a finite number >= 0")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, or 0 to turn periodic checkpoints off, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="latentwire_train.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--dataset",
        choices=("synthetic", "squad"),
        default="synthetic",
        help="synthetic: SQuAD-like examples generated offline and deterministically (default);"
        " squad: a local SQuAD JSON file named by --data_file",
    )
    g.add_argument("--data_file", type=Path, default=None, help="SQuAD v1.1/v2.0 JSON file (with --dataset squad)")
    g.add_argument("--samples", type=_POSITIVE, default=4096, help="training examples (default 4096)")
    g.add_argument(
        "--max_bytes",
        type=_POSITIVE,
        default=160,
        help="the encoder reads the first MAX_BYTES bytes of 'question: ... context: ...' (default 160)",
    )
    g = p.add_argument_group("model and loss")
    g.add_argument(
        "--latent_len",
        type=_POSITIVE,
        default=16,
        help="latent vectors per example, the length of the soft prefix (default 16; seed 001 used 32)",
    )
    g.add_argument(
        "--d_z",
        type=_POSITIVE,
        default=64,
        help="width of each latent vector (default 64; seed 001 used 256 for 8B models)",
    )
    g.add_argument(
        "--K",
        type=_COUNT,
        default=4,
        help="the first K answer tokens get an extra cross-entropy term of weight 1 (the mean over those"
        " K tokens), on top of the whole answer's: the start of the answer is what the latents must"
        " get right. 0 turns it off. This is our reading of seed 001, which lists --K among the loss"
        " settings next to --first_token_ce_weight without defining it (default 4, as in seed 001)",
    )
    g.add_argument(
        "--first_token_ce_weight",
        type=_WEIGHT,
        default=0.5,
        help="extra weight of the first answer token's cross-entropy (default 0.5, as in seed 001)",
    )
    g.add_argument(
        "--warm_anchor_text",
        default="Answer: ",
        help="text put between the latent prefix and the answer, in each decoder's own tokens"
        " (default 'Answer: '; '' for none)",
    )
    g.add_argument(
        "--llama_id",
        default=None,
        help="a local Hugging Face causal-LM directory to use instead of the built-in 'llama' decoder"
        " (needs transformers; offline, nothing is downloaded)",
    )
    g.add_argument("--qwen_id", default=None, help="the same for the 'qwen' decoder")
    g.add_argument(
        "--warmup_steps",
        type=_COUNT,
        default=120,
        help="steps of the built-in decoders' deterministic language-model warm-up before they are frozen"
        " (default 120; it is redone identically at every start, resumes included)",
    )
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=_POSITIVE, default=3, help="epochs (default 3)")
    g.add_argument("--batch_size", type=_POSITIVE, default=32, help="examples per optimizer step (default 32)")
    g.add_argument(
        "--lr",
        type=_bounded(float, 1e-12, "a learning rate > 0"),
        default=2e-3,
        help="peak learning rate of AdamW; 5%% warm-up, then cosine decay to 10%% (default 2e-3)",
    )
    g.add_argument("--seed", type=_COUNT, default=0, help="seed of data, initialisation and dropout (default 0)")
    g.add_argument(
        "--threads",
        type=_POSITIVE,
        default=1,
        help="torch CPU threads (default 1). Keep it the same between a run and its resumption: another"
        " thread count can change the order of floating-point sums, and the result in the last bits",
    )
    g = p.add_argument_group("preemption")
    g.add_argument("--save_dir", default="runs/latentwire", help="checkpoint directory (default runs/latentwire)")
    g.add_argument(
        "--checkpoint_interval",
        type=_seconds,
        default=30.0,
        help="seconds between periodic checkpoints; 0 turns them off (a stop signal still saves)"
        " (default 30; seed 001 used 300 on a cluster)",
    )
    g.add_argument(
        "--auto_resume",
        action="store_true",
        help="continue from the newest valid checkpoint in --save_dir (put it in every job script that"
        " can be requeued). Without it, a save_dir holding checkpoints is refused (exit 2)",
    )
    g.add_argument(
        "--restart",
        action="store_true",
        help="start over even though --save_dir holds checkpoints (complete or not); they are moved"
        " to save_dir/superseded/, not deleted. Not for job scripts: each requeue would start over",
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--log_every",
        type=_POSITIVE,
        default=None,
        help="print a progress line every N steps (default: about 20 lines per run)",
    )
    g.add_argument(
        "--debug",
        action="store_true",
        help="a line per step with each decoder's losses and the gradient norm; preempt's own debug log",
    )
    g.add_argument(
        "--final_out",
        type=Path,
        default=None,
        help="on completion, write every tensor of the final state (encoder, adapters, optimizer,"
        " scheduler, RNGs, epoch statistics) to this safetensors file, to compare runs bit for bit",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, checked; a bad value exits with code 2 and a message naming the flag."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.dataset == "squad" and args.data_file is None:
        p.error("--dataset squad needs --data_file PATH (a local SQuAD JSON file; nothing is downloaded)")
    if args.dataset == "synthetic" and args.data_file is not None:
        p.error("--data_file is read only with --dataset squad")
    if args.auto_resume and args.restart:
        p.error("--auto_resume and --restart exclude each other: continue the run, or start it over")
    for flag in ("llama_id", "qwen_id"):
        path = getattr(args, flag)
        if path is None:
            continue
        try:
            import transformers  # noqa: F401
        except ImportError:
            p.error(
                f"--{flag} needs the optional 'transformers' package (pip install transformers);"
                " without --llama_id/--qwen_id the example uses its built-in decoders"
            )
        if not (Path(path) / "config.json").is_file():
            p.error(
                f"--{flag} {path}: expected a local Hugging Face model directory holding config.json"
                " (offline: model names are not downloaded)"
            )
    return args


# -------------------------------------------------------------------------------------------- training


def check_save_dir(args: argparse.Namespace) -> None:
    """Decides, before the expensive set-up, whether there is anything to do in --save_dir.

    A requeue of a finished run exits 0 here, before it loads two decoders
    (PreemptibleRun would find it complete too, but only once the models and
    the optimizer exist). Without --auto_resume or --restart, a save_dir that
    holds a run is refused rather than silently started over.
    """
    if args.restart:
        return
    manager = CheckpointManager(args.save_dir, owner=False)  # owner=False: only looks, changes nothing
    if args.auto_resume:
        done = manager.completion()
        if done is not None:
            print(f"{args.save_dir} is complete (step {done.get('step')}); nothing to do", file=sys.stderr)
            raise SystemExit(0)
        return
    found = [c for c in manager.list() if c.status == "valid"]
    if not found:
        return
    c = found[0]
    where = f"step {c.step}, epoch {c.manifest.cursor.epoch}, batch {c.manifest.cursor.batch}"
    print(
        f"error: {args.save_dir} already holds checkpoints (newest: {c.path.name}, {where}).\n"
        "  --auto_resume   continue that run where it stopped (what a requeued job wants)\n"
        "  --restart       start over; the old checkpoints are moved to save_dir/superseded/\n"
        "  or name another --save_dir",
        file=sys.stderr,
    )
    raise SystemExit(2)


def fresh_epoch_stats(n_decoders: int) -> dict[str, Any]:
    """Running sums of one epoch, kept in run.user_state so that a resumed epoch's summary covers all of it."""
    return {"loss": 0.0, "ce": [0.0] * n_decoders, "hits": [0] * n_decoders, "n": 0, "steps": 0}


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
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    flatten("model", model.state_dict(), out)
    flatten("optimizer", opt.state_dict(), out)
    flatten("scheduler", {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}, out)
    flatten("stats", {k: v for k, v in user_state.items() if k != "decoders"}, out)
    out["rng.torch"] = torch.get_rng_state()
    out["rng.numpy"] = torch.from_numpy(np.random.get_state()[1].astype(np.int64))
    out["rng.python"] = torch.tensor(random.getstate()[1], dtype=torch.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path), metadata={"decoders": json.dumps(user_state.get("decoders"))})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t_start = time.monotonic()
    # Same seeds and the same thread count: the CPU kernels used here then give the same bits on every run.
    # (On a GPU add torch.use_deterministic_algorithms(True); on CPU it only costs a second of imports.)
    torch.set_num_threads(args.threads)
    if args.debug:
        logging.getLogger("preempt").setLevel(logging.DEBUG)
    check_save_dir(args)

    # Data and frozen decoders: rebuilt identically at every start, so they need no checkpoint.
    if args.dataset == "synthetic":
        data = synthetic_squad(args.samples, seed=args.seed)
        corpus = synthetic_squad(2048, seed=args.seed + 10_000)  # the decoders' own "pretraining" text
    else:
        data = read_squad(args.data_file, args.samples)
        corpus = []  # the file's own questions and answers are the warm-up text
    anchor_text = args.warm_anchor_text
    lm_texts = [f"{e.question} {anchor_text}{e.answer}" for e in corpus + data]
    decoders = [
        hf_decoder(name, path) if path else builtin_decoder(name, lm_texts, args.warmup_steps, args.seed)
        for name, path in (("llama", args.llama_id), ("qwen", args.qwen_id))
    ]
    frozen = [m for d in decoders for m in (d._embed, d._logits) if isinstance(m, nn.Module)]
    digest = weights_digest(frozen)
    t_ready = time.monotonic()

    enc_ids = encode_bytes([f"question: {e.question} context: {e.context}" for e in data], args.max_bytes)
    anchors, answers = [], []
    for d in decoders:
        room = d.max_len - args.latent_len - len(d.tokenizer.encode(anchor_text))
        if room < 2:
            raise SystemExit(
                f"--latent_len {args.latent_len} and the anchor leave no room for an answer in the {d.name} decoder,"
                f" which reads at most {d.max_len} positions"
            )
        anchor, targets = anchor_and_answers(d.tokenizer, anchor_text, [e.answer for e in data], room)
        anchors.append(anchor)
        answers.append(targets)
    dataset = TensorDataset(enc_ids, *answers)

    # The trainable part: the encoder and one adapter per decoder. This is what the checkpoints hold.
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    model = nn.ModuleDict(
        {
            "encoder": ByteEncoder(args.max_bytes, args.latent_len, args.d_z),
            **{f"adapter_{d.name}": Adapter(args.d_z, d.d_model, d.embed_rms) for d in decoders},
        }
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps_per_epoch = math.ceil(len(dataset) / args.batch_size)
    total = args.epochs * steps_per_epoch
    warm = max(1, total // 20)

    def lr_factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    log_every = args.log_every or max(1, total // 20)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"latentwire: {len(dataset)} examples, {args.epochs} epochs x {steps_per_epoch} steps of {args.batch_size},"
        f" latents {args.latent_len}x{args.d_z}, {n_params / 1e6:.2f}M trainable parameters;"
        f" frozen decoders {', '.join(f'{d.name} (width {d.d_model})' for d in decoders)}"
        f" ready in {t_ready - t_start:.1f} s",
        flush=True,
    )

    with PreemptibleRun(
        args.save_dir,
        model=model,
        optimizer=opt,
        scheduler=sched,
        checkpoint_interval=args.checkpoint_interval or None,
        keep_last=2,
        auto_resume=not args.restart,
        exit_if_complete=not args.restart,  # --restart starts over a completed run too
    ) as run:
        us = run.user_state
        if us.setdefault("decoders", digest) != digest:
            raise SystemExit(
                f"the frozen decoders differ from those {args.save_dir} was trained with (digest {digest},"
                f" checkpoint {us['decoders']}): another --seed, --warmup_steps, --threads, torch version or"
                " model directory? The run cannot continue exactly; use --restart or another --save_dir"
            )
        us.setdefault("epoch", fresh_epoch_stats(len(decoders)))
        us.setdefault("history", [])
        sampler = run.sampler(dataset, shuffle=True, seed=args.seed)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
        if run.resumed_from is None:
            print(f"training from scratch; checkpoints in {args.save_dir}", flush=True)
        else:
            print(f"resuming at step {run.global_step}/{total} (epoch {run.epoch}, batch {run.batch})", flush=True)
        t0, s0 = time.monotonic(), run.global_step
        for epoch in run.epochs(args.epochs):
            t_epoch, s_epoch = time.monotonic(), run.global_step
            model.train()
            for enc, *targets in run.batches(loader):
                z = model["encoder"](enc)
                losses, infos = [], []
                for d, anchor, y in zip(decoders, anchors, targets, strict=True):
                    loss_d, info = decoder_loss(
                        d, model[f"adapter_{d.name}"](z), anchor, y, args.K, args.first_token_ce_weight
                    )
                    losses.append(loss_d)
                    infos.append(info)
                loss = torch.stack(losses).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()

                st = us["epoch"]
                st["loss"] += loss.item() * len(enc)
                st["n"] += len(enc)
                st["steps"] += 1
                for i, info in enumerate(infos):
                    st["ce"][i] += info["ce"] * len(enc)
                    st["hits"][i] += info["hits"]
                step = run.global_step + 1
                if args.debug or step % log_every == 0 or step == total:
                    rate = (step - s0) / max(time.monotonic() - t0, 1e-9)
                    line = (
                        f"step {step:5d}/{total}  epoch {epoch}  loss {loss.item():.4f}"
                        f"  lr {sched.get_last_lr()[0]:.2e}  {rate:.1f} steps/s  eta {(total - step) / rate:.0f} s"
                    )
                    if args.debug:
                        line += "  |" + "".join(
                            f" {d.name}: ce {x['ce']:.3f} first {x['first']:.3f}"
                            for d, x in zip(decoders, infos, strict=True)
                        )
                        line += f"  grad {grad_norm.item():.3f}"
                    print(line, flush=True)
                run.step(metrics={"loss": loss.item()})  # the safe point: last statement of the iteration

            st = us["epoch"]
            if st["n"]:
                summary = {
                    "epoch": epoch,
                    "loss": st["loss"] / st["n"],
                    **{f"ce_{d.name}": st["ce"][i] / st["n"] for i, d in enumerate(decoders)},
                    **{f"first_acc_{d.name}": st["hits"][i] / st["n"] for i, d in enumerate(decoders)},
                }
                us["history"].append(summary)
                secs = time.monotonic() - t_epoch
                here = run.global_step - s_epoch
                print(
                    f"epoch {epoch} done: mean loss {summary['loss']:.4f}; answer CE "
                    + ", ".join(f"{d.name} {summary[f'ce_{d.name}']:.3f}" for d in decoders)
                    + "; first-token accuracy "
                    + ", ".join(f"{d.name} {summary[f'first_acc_{d.name}']:.3f}" for d in decoders)
                    + f"; {st['steps']} steps ({here} in this process, {secs:.1f} s)",
                    flush=True,
                )
                run.report({"epoch_loss": summary["loss"]})
            us["epoch"] = fresh_epoch_stats(len(decoders))

    if args.final_out is not None:
        write_final(args.final_out, model, opt, sched, run.user_state)
    first, last = run.user_state["history"][0]["loss"], run.user_state["history"][-1]["loss"]
    print(
        f"finished: step {run.global_step}, epoch-mean loss {first:.3f} -> {last:.3f};"
        f" {time.monotonic() - t_start:.1f} s in this process; final checkpoint {run.last_checkpoint}",
        flush=True,
    )


if __name__ == "__main__":
    main()
