"""The documentation's trainings run: every Python (or YAML) block of README.md and README_PREEMPTION.md that shows
a training is executed as written, in a process of its own, with tiny stand-ins for what the block assumes (a
model, a data set, a ``train_step``), and must complete (exit 0, the run marked complete). A documented snippet
that crashes fails here.

A block is marked in the Markdown by the comment on the line before its fence: ``<!-- docs-test: KIND -->`` says
how it is run (the stand-ins and the context it needs: ``PRELUDES``, ``WRAP``), ``<!-- docs-test: skip REASON -->``
says why not (it needs GPUs, a bucket or a cloud, and which test covers that instead). Every block that shows a
training must carry one of the two (``test_every_training_block_is_marked``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
from helpers import ROOT

DOCS = ("README.md", "README_PREEMPTION.md")
FENCE = re.compile(r"(?:<!-- docs-test: (?P<tag>[^>]*?) -->\n[ \t]*)?```(?P<lang>\w+)\n(?P<body>.*?)```", re.S)
TRAINS = ("run.step(", "PreemptCallback", "hf.install(", "trainer.fit(", "PreemptibleRun(")

COMMON = """
import torch
from torch.utils.data import DataLoader, TensorDataset
from preempt import PreemptibleRun

torch.manual_seed(0)
torch.set_num_threads(1)


def make_dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 2, (96,), generator=g))


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 2))


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def train_step(*args):  # train_step(model, batch) or train_step(batch)
    batch = args[-1]
    opt.zero_grad()
    loss = _loss(model, batch)
    loss.backward()
    opt.step()
    sched.step()
    return loss


loss_fn = _loss


def evaluate(model, loader=None):
    with torch.no_grad():
        return float(_loss(model, train_set[:32]))


train_set = make_dataset()
model = make_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, 10)
scaler = torch.amp.GradScaler("cpu")
val_loader = DataLoader(train_set, batch_size=32)
save_dir, epochs, accum = "runs/exp1", 2, 2
"""

LIGHTNING = """
import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self, lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Data(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))
        return DataLoader(data, batch_size=8, shuffle=True)


model, dm = Model(), Data()
"""

HF = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
g = torch.Generator().manual_seed(0)
ds = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, 16), generator=g)]


def collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


args = TrainingArguments(
    output_dir="out", max_steps=6, per_device_train_batch_size=4, report_to=[], use_cpu=True, save_strategy="no"
)
"""

ACCELERATE = """
import types

import torch
from torch.utils.data import DataLoader


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 2)

    def forward(self, x, labels):
        return types.SimpleNamespace(loss=torch.nn.functional.cross_entropy(self.net(x), labels))


torch.manual_seed(0)
model = Model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5)
rows = [{"x": torch.randn(8), "labels": torch.tensor(i % 2)} for i in range(32)]
train_loader = DataLoader(rows, batch_size=4, shuffle=True)
"""

FABRIC = """
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
train_set = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
model = torch.nn.Sequential(
    torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.25), torch.nn.Linear(16, 4), torch.nn.LogSoftmax(dim=1)
)
optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
"""

NANOGPT = (
    COMMON
    + """
import contextlib

data = torch.randint(0, 16, (512,), generator=torch.Generator().manual_seed(0))
model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
_forward = model.forward
model.forward = lambda x, y: torch.nn.functional.cross_entropy(_forward(x).view(-1, 16), y.view(-1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ctx, max_iters = contextlib.nullcontext(), 12


def get_batch():
    ix = torch.randint(len(data) - 9, (4,))
    return torch.stack([data[i : i + 8] for i in ix]), torch.stack([data[i + 1 : i + 9] for i in ix])
"""
)
RAY = """
import atexit

import ray
import torch
from ray.cluster_utils import Cluster
from torch.utils.data import TensorDataset

# A local cluster of one node for the block's TorchTrainer, every port Ray's choice (other tests run beside this one;
# RAY_ADDRESS in the job's processes: Ray Train's helpers that look for "the" cluster must not find another test's)
_cluster = Cluster()
_cluster.add_node(num_cpus=2, include_dashboard=False, dashboard_agent_listen_port=None)
ray.init(address=_cluster.address, runtime_env={"env_vars": {"RAY_ADDRESS": _cluster.address}})
atexit.register(lambda: (ray.shutdown(), _cluster.shutdown()))  # the driver first (the other order exits 1)
g = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 2, (96,), generator=g))


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


loss_fn = torch.nn.functional.cross_entropy
"""
PRELUDES = {"loop": COMMON, "in_run": COMMON, "in_epoch": COMMON, "lightning": LIGHTNING, "hf": HF, "nanogpt": NANOGPT}
PRELUDES["accelerate"] = ACCELERATE
PRELUDES["fabric"] = FABRIC
PRELUDES["ray"] = RAY
# The context a fragment needs: the run (``in_run``) or also an epoch (``in_epoch``) around it.
WRAP = {
    "in_run": (
        "with PreemptibleRun(save_dir, model=model, optimizer=opt, scheduler=sched, checkpoint_interval=None) as run:\n"
        "    loader = DataLoader(train_set, batch_size=16, sampler=run.sampler(train_set, seed=0))\n",
        4,
    ),
    "in_epoch": (
        "with PreemptibleRun(save_dir, model=model, optimizer=opt, scheduler=sched, checkpoint_interval=None) as run:\n"
        "    loader = DataLoader(train_set, batch_size=16, sampler=run.sampler(train_set, seed=0))\n"
        "    for epoch in run.epochs(2):\n",
        8,
    ),
}
CLI_MAIN = LIGHTNING.replace("model, dm = Model(), Data()\n", "") + (
    "\nfrom lightning.pytorch.cli import LightningCLI\n\nLightningCLI(Model, Data)\n"
)


def blocks() -> list[tuple[str, int, str, str | None, str]]:
    """(file, line, language, tag, body) of every fenced block of the docs."""
    found = []
    for name in DOCS:
        text = (ROOT / name).read_text()
        for m in FENCE.finditer(text):
            line = len(text[: m.start("lang")].splitlines())  # (the fence's backticks are on that line)
            found.append((name, line, m["lang"], m["tag"], m["body"]))
    return found


def shows_training(lang: str, body: str) -> bool:
    return lang in ("python", "yaml") and any(word in body for word in TRAINS)


def test_every_training_block_is_marked():
    unmarked = [f"{f}:{line}" for f, line, lang, tag, body in blocks() if shows_training(lang, body) and tag is None]
    assert not unmarked, f"blocks that show a training without a docs-test mark: {unmarked}"
    run = {tag for _, _, _, tag, _ in blocks() if tag and not tag.startswith("skip")}
    # the quick start, a hand-written loop, Lightning, its CLI, the Trainer, Accelerate, Fabric and Ray are run
    assert {"loop", "lightning", "lightning_cli", "hf", "accelerate", "fabric", "ray"} <= run, run
    for f, line, _, tag, _ in blocks():
        if tag and tag.startswith("skip"):
            assert re.match(r"skip \S.{10,}", tag), f"{f}:{line}: a skip says why: {tag!r}"
        elif tag:
            assert tag in PRELUDES or tag == "lightning_cli", f"{f}:{line}: unknown docs-test kind {tag!r}"


RUN = [(f, line, tag, body) for f, line, _, tag, body in blocks() if tag and not tag.startswith("skip")]


@pytest.mark.parametrize(("doc", "line", "kind", "body"), RUN, ids=[f"{f}:{line}" for f, line, _, _ in RUN])
def test_a_documented_training_runs_as_written(tmp_path, doc, line, kind, body):
    if kind in ("lightning", "lightning_cli", "fabric"):
        pytest.importorskip("lightning", reason="Lightning is not installed (pip install -e '.[lightning]')")
    if kind == "ray":
        pytest.importorskip("ray.train", reason="ray is not installed (pip install -e '.[ray]')")
    if kind in ("hf", "accelerate"):
        pytest.importorskip("transformers" if kind == "hf" else "accelerate", reason="pip install -e '.[hf]'")
    if kind == "lightning_cli":
        (tmp_path / "run.yaml").write_text(body)
        (tmp_path / "main.py").write_text(CLI_MAIN)
        cmd = [sys.executable, "main.py", "fit", "--config", "run.yaml", "--trainer.max_epochs=2"]
    else:
        code = textwrap.dedent(body)
        if kind in WRAP:
            head, indent = WRAP[kind]
            code = head + textwrap.indent(code, " " * indent)
        (tmp_path / "block.py").write_text(PRELUDES[kind] + "\n# ---- the block of the docs ----\n" + code)
        cmd = [sys.executable, "block.py"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{doc}:{line} ({kind}) failed:\n{r.stdout}\n{r.stderr}"
    complete = list(tmp_path.rglob("complete.json"))
    assert complete, f"{doc}:{line}: the run did not complete:\n{r.stderr}"
