"""The ``preempt`` command run in-process on a small run's save_dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def small_run(d: Path) -> Path:
    """``d``: the save_dir of a real PreemptibleRun of 8 steps in this process, a checkpoint every 3 steps, all kept
    (RNG states, sampler cursor, best metric, history, provenance, complete.json)."""
    from torch.utils.data import DataLoader, TensorDataset

    from preempt import PreemptibleRun

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g))
    kw = dict(checkpoint_interval=None, checkpoint_every_steps=3, keep_last=None, best_metric="loss", keep_best=1)
    with PreemptibleRun(d, model=model, optimizer=opt, **kw) as run:
        loader = DataLoader(data, batch_size=8, sampler=run.sampler(data, seed=3))
        for _ in run.epochs(2):
            for x, y in run.batches(loader):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                run.step(metrics={"loss": loss.item()})
    return d


def cli(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    """``preempt ARGS`` in this process (``preempt.cli.main.main``): exit code, stdout, stderr."""
    from preempt.cli.main import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def cli_json(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, dict]:
    """The same with ``--json``: exit code and the parsed output."""
    rc, out, _ = cli(capsys, *args, "--json")
    return rc, json.loads(out)
