"""Work after the training loop (an export, a final evaluation) belongs inside the ``with`` block, after the loop.

There, a crash in it leaves the run not complete, so the corrected rerun resumes at the last step, trains
nothing again, and does the work; once it succeeded, a late requeue exits at once. Real processes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import ROOT, history_events, run_python

SCRIPT = """
import sys, torch
from preempt import PreemptibleRun
save_dir, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with PreemptibleRun(save_dir, model=model, optimizer=opt, checkpoint_interval=None) as run:
    for _ in run.epochs(2):
        for x in run.batches([torch.randn(3, 4) for _ in range(5)]):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            print("step", run.global_step + 1, flush=True)
            run.step()
    # after the loop, inside the with block: the export
    torch.save(model.state_dict(), out)
    print("exported", run.global_step, flush=True)
"""


def run(script: Path, save_dir: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return run_python([sys.executable, str(script), str(save_dir), str(out)], timeout=120, cwd=ROOT)


def test_a_failed_export_is_redone_by_the_rerun_and_a_finished_run_exits_at_once(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    save_dir, good = tmp_path / "run", tmp_path / "model.pt"

    first = run(script, save_dir, tmp_path / "missing" / "model.pt")  # a bad path: the export raises
    assert first.returncode == 1 and "Parent directory" in first.stderr, first.stderr
    assert history_events(save_dir, "error", step=10) and "exported" not in first.stdout  # trained to the end
    assert not (save_dir / "complete.json").exists()

    second = run(script, save_dir, good)
    assert second.returncode == 0, second.stderr
    assert "step " not in second.stdout and "exported 10" in second.stdout  # no step trained again
    assert history_events(save_dir, "resume", step=10) and good.is_file()
    assert (save_dir / "complete.json").exists()

    stamp = good.stat().st_mtime_ns
    third = run(script, save_dir, good)  # a late requeue of the finished job
    assert third.returncode == 0 and "nothing to do" in third.stderr and "exported" not in third.stdout
    assert good.stat().st_mtime_ns == stamp
