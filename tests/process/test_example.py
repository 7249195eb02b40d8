"""The runnable example and README's first command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch
from helpers import PREEMPTED, ROOT, Spawned, history_events, run_python

from preempt import CheckpointManager

QUICKSTART = [sys.executable, str(ROOT / "examples" / "quickstart.py")]
TINY = ["--samples", "3000", "--epochs", "2", "--checkpoint_interval", "0.3"]


def final_tensors(save_dir) -> dict[str, torch.Tensor]:
    manager = CheckpointManager(save_dir, owner=False)
    done = manager.completion()
    assert done is not None, f"{save_dir} is not complete"
    # The final state: "final", or a periodic save that happened to fall on the last epoch boundary (then
    # nothing had changed since, and no "final" one was written).
    info, loaded = manager.load(done["step"])
    assert info.name == done["checkpoint"] and info.manifest.cursor.epoch == 2
    out = {f"model.{k}": v for k, v in loaded.model.items()}
    for i, s in loaded.tree["optimizer"]["state"].items():
        out.update({f"opt.{i}.{k}": v for k, v in s.items()})
    return out


def test_quickstart_stopped_and_resumed_equals_uninterrupted(tmp_path):
    ref = run_python([*QUICKSTART, *TINY, "--save_dir", str(tmp_path / "ref")])
    assert ref.returncode == 0, ref.stderr
    p = Spawned([*QUICKSTART, *TINY, "--save_dir", str(tmp_path / "run")], {"PREEMPT_LOG_LEVEL": "DEBUG"})
    p.wait_event("checkpoint", reason="interval")
    p.signal(signal.SIGTERM)
    assert p.finish() == PREEMPTED, p.output
    again = run_python([*QUICKSTART, *TINY, "--save_dir", str(tmp_path / "run")])
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stderr
    a, b = final_tensors(tmp_path / "ref"), final_tensors(tmp_path / "run")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_readme_demo_command(tmp_path):
    """README's first set-up command, run as written, without a terminal: the LatentWire example stopped by SIGTERM
    once it reports epoch 1 (on progress, not a timer, so on any machine: exit 75 mid-epoch), resumed with
    --auto_resume at that batch, found complete, listed, verified."""
    r = subprocess.run(
        ["bash", str(ROOT / "examples" / "demo.sh")],
        env={**os.environ, "DEMO_SAMPLES": "512"},  # a quarter of the training, the same four steps
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "== exit code 75" in r.stdout, r.stdout
    demo = ROOT / "runs" / "latentwire_demo"  # (the demo's own save_dir, in the checkout)
    (stop,) = history_events(demo, "stop", cause="SIGTERM")
    resumed = history_events(demo, "resume")[0]
    assert (stop["epoch"], resumed["epoch"]) == (1, 1) and stop["batch"] > 0 and resumed["batch"] > 0, (stop, resumed)
    assert "is complete" in r.stderr, r.stderr
    assert "resuming at step" in r.stdout and "epoch 2 done" in r.stdout, r.stdout
    assert "valid (latest)" in r.stdout and "run complete" in r.stdout and "all ok" in r.stdout, r.stdout
    assert "DAMAGED" not in r.stdout
