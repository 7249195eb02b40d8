"""A LightningCLI job with PreemptCallback on the live SLURM cluster, salt's setting: --signal=B:USR1@N --requeue.

The job (``slurm/lightning.sbatch``, ``--time=1``) has more work than one allocation holds. SLURM's SIGUSR1 comes
before the time limit; the callback saves at the next optimizer step and requeues the job itself, once per stop;
Lightning's own SLURM handler never saves (no ``hpc_ckpt_*``) nor requeues. The requeued job reruns the same
command, resumes, and the final state equals a run outside SLURM under ``torch.equal``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="Lightning is not installed (pip install -e '.[lightning]')")

from helpers import PREEMPTED, ROOT, Spawned, assert_same_final  # noqa: E402
from slurmjobs import Cluster, slurm_cluster  # noqa: E402, F401

pytestmark = pytest.mark.slurm

CLI = ROOT / "tests" / "scripts" / "train_lightning_cli.py"
CONFIG = """\
seed_everything: 0
trainer:
  max_epochs: 3
  accelerator: cpu
  devices: 1
  logger: false
  default_root_dir: {root}
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  num_sanity_val_steps: 0
  limit_val_batches: 0
  callbacks:
    - class_path: train_lightning.Steps
      init_args: {{hold_at: null, step_sleep: {sleep}}}
    - class_path: preempt.lightning.PreemptCallback
      init_args: {{save_dir: {save_dir}, checkpoint_every_steps: 10, checkpoint_interval: null}}
"""


def config(d: Path, sleep: float) -> Path:
    path = d / f"sleep_{sleep}.yaml"
    path.write_text(CONFIG.format(root=d, sleep=sleep, save_dir=d / "run"))
    return path


@pytest.mark.timeout(900)
def test_lightning_cli_job_requeues_itself_on_usr1_and_finishes_bit_exact(
    slurm_cluster: Cluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref_cmd = [sys.executable, str(CLI), "fit", "--config", str(config(ref_dir, 0.0))]
    ref = Spawned(ref_cmd, {"FINAL_OUT": str(ref_dir / "final.safetensors")})
    assert ref.finish() == 0, ref.output
    # 36 steps of 2 s: 72 s of work; one --time=2 allocation trains at most ~60 s before an @60 warning, less its
    # start, so the job needs at least one requeue however fast it starts (at 1.3 s a step, 47 s, a start of under
    # 13 s on a quiet machine finished in one allocation), and makes up to ~30 steps an allocation (--time=1 with @20
    # made 1 to 8 steps a start on a busy machine and took over 10 requeues)
    final = tmp_path / "final.safetensors"
    cmd = [sys.executable, str(CLI), "fit", "--config", str(config(tmp_path, 2.0))]
    options = ["--time=2", "--signal=B:USR1@60", f"--export=ALL,BLOCK_SIGNALS=1,FINAL_OUT={final}"]
    job = slurm_cluster.submit("lightning.sbatch", cmd, tmp_path / "job.out", options)
    info = job.wait_done(timeout=600)
    log = job.log
    assert info["JobState"] == "COMPLETED", job.describe()
    assert "DUE TO TIME LIMIT" not in log, f"the job reached its time limit\n{log}"
    restarts = int(info["Restarts"])
    assert restarts >= 1, log
    # one stop per restart, each on the warning's SIGUSR1 and requeueing the job itself; each run after resumed
    history = job.history()
    stops = history.events_of("stop")
    assert len(stops) == restarts, job.describe()
    assert all(s["cause"] == "SIGUSR1" and s["requeued"] and s["code"] == PREEMPTED for s in stops), stops
    resumes = history.events_of("resume")
    assert [r["step"] for r in resumes] == [s["step"] for s in stops], (stops, resumes)
    assert history.events_of("complete"), job.describe()
    assert "Handling auto-requeue signal" not in log and not list(tmp_path.rglob("hpc_ckpt_*")), log
    assert_same_final(ref_dir / "final.safetensors", final)
