"""LightningCLI with PreemptCallback from a YAML config: a job stopped by a signal and rerun with the same command.

``tests/scripts/train_lightning_cli.py`` is a plain ``LightningCLI(Net)`` (train_lightning.py's model, 3 epochs of 12
batches) with LightningCLI's own defaults: its SaveConfigCallback writes ``config.yaml`` into the trainer's log
directory and refuses to start when one is there. Each job is one YAML file, the same in both of its processes (the
stopped one holds at a step through ``HOLD_AT_STEP`` in its environment, outside the config). The rerun must resume
and end bit for bit as an uninterrupted run, whatever the logger: without one and with W&B's the log directory is the
same in both processes, so the rerun meets the config.yaml of the stopped process; CSV and TensorBoard make a new
``version_N`` each process. A rerun whose config changed is still refused with Lightning's message.
"""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="Lightning is not installed (pip install -e '.[lightning]')")

from helpers import PREEMPTED, ROOT, Spawned, assert_same_final  # noqa: E402
from helpers.reference import run_to_end  # noqa: E402

CLI = ROOT / "tests" / "scripts" / "train_lightning_cli.py"

CONFIG = """\
seed_everything: 0
trainer:
  max_epochs: {epochs}
  accelerator: cpu
  devices: {devices}
  strategy: {strategy}
  logger: {logger}
  default_root_dir: {root}
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  num_sanity_val_steps: 0
  limit_val_batches: 0
  callbacks:
    - class_path: preempt.lightning.PreemptCallback
      init_args: {{save_dir: {save_dir}, checkpoint_every_steps: 5, checkpoint_interval: null}}
"""

# trainer.logger in the YAML; the W&B-style ones keep one directory across processes (trainer.log_dir is their
# save_dir, or default_root_dir without a logger), the others a new version_N directory per process
LOGGERS = {
    "none": "false",
    "csv": "{{class_path: lightning.pytorch.loggers.CSVLogger, init_args: {{save_dir: {root}}}}}",
    "tensorboard": "{{class_path: lightning.pytorch.loggers.TensorBoardLogger, init_args: {{save_dir: {root}}}}}",
    "wandb": "{{class_path: lightning.pytorch.loggers.WandbLogger, init_args: {{save_dir: {root}, offline: true}}}}",
}
FIXED_DIR = {"none", "wandb"}
NEEDS = {"tensorboard": "tensorboard", "wandb": "wandb"}
STOP_AT = 19  # epoch 1, batch 7 of 12


class Job:
    """One job: its YAML at ``tmp_path/<name>.yaml``, its log directory's root and its save_dir under
    ``tmp_path/<name>``; every process of it runs the same command."""

    def __init__(
        self, tmp_path: Path, name: str, logger: str = "none", datamodule: bool = False, devices: int = 1
    ) -> None:
        if logger in NEEDS:
            pytest.importorskip(NEEDS[logger], reason=f"{NEEDS[logger]} is not installed: no {logger} logger to test")
        self.config = tmp_path / f"{name}.yaml"
        self.root, self.save_dir = tmp_path / name / "root", tmp_path / name / "run"
        self.final = tmp_path / name / "final.safetensors"
        self.logger, self.devices = logger, devices
        self.env = {
            "FINAL_OUT": str(self.final),
            "DATAMODULE": "1" if datamodule else "0",
            # W&B offline, its files under the job's directory only
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            **{var: str(tmp_path / name / "wandb-home") for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR")},
        }
        self.write()

    def write(self, epochs: int = 3) -> None:
        """The job's YAML (``epochs``: another config for the same job)."""
        logger = LOGGERS[self.logger].format(root=self.root)
        strategy = "ddp" if self.devices > 1 else "auto"
        where = {"root": self.root, "save_dir": self.save_dir}
        text = CONFIG.format(epochs=epochs, devices=self.devices, strategy=strategy, logger=logger, **where)
        self.config.write_text(text)

    def start(self, hold_at: int | None = None) -> Spawned:
        env = dict(self.env)
        if hold_at is not None:
            env["HOLD_AT_STEP"] = str(hold_at)
        return Spawned([sys.executable, str(CLI), "fit", "--config", str(self.config)], env)

    def stop(self, sig: signal.Signals = signal.SIGUSR1, at: int = STOP_AT) -> Spawned:
        """The job's first process, stopped by ``sig`` at step ``at`` (it holds there until the signal lands; under
        DDP rank 0, the process started, holds and is signalled)."""
        p = self.start(hold_at=at)
        assert p.wait_event("holding", point="step", n=at, rank=0, timeout=180), p.output
        p.signal(sig)
        assert p.finish(timeout=180) == PREEMPTED, p.output
        assert p.events_of("stop", cause=sig.name, step=at), p.events
        return p

    def configs(self) -> dict[Path, bytes]:
        """Every config.yaml LightningCLI wrote for the job, and what it holds."""
        return {path.relative_to(self.root): path.read_bytes() for path in sorted(self.root.rglob("config.yaml"))}


def uninterrupted(reference, datamodule: bool) -> Path:
    """The final state of an uninterrupted job of the same config, made once per session (any logger: none)."""

    def make(out: Path) -> None:
        job = Job(out, "ref", datamodule=datamodule)
        run_to_end(job.start())
        shutil.copy(job.final, out / "final.safetensors")

    return reference.made(["train_lightning_cli.py", CONFIG, str(datamodule)], make) / "final.safetensors"


@pytest.mark.parametrize(
    ("logger", "datamodule"),
    [("none", False), ("none", True), ("csv", False), ("tensorboard", False), ("wandb", False)],
    ids=["no_logger", "no_logger_datamodule_class", "csv", "tensorboard", "wandb_offline"],
)
def test_a_stopped_lightning_cli_job_reruns_with_the_same_command_and_ends_bit_exact(
    tmp_path, reference, logger, datamodule
):
    """salt's setting: a LightningCLI project, SLURM's --signal=USR1; the callback comes from the YAML alone. The
    data from the module's own hooks, or from a LightningDataModule class given to LightningCLI. The rerun gets past
    SaveConfigCallback, whose config.yaml from the stopped process is in the same directory without a logger or with
    W&B's, and in a new version directory with CSV's or TensorBoard's."""
    expected = uninterrupted(reference, datamodule)
    job = Job(tmp_path, "job", logger, datamodule)
    job.stop()
    assert not list(tmp_path.rglob("hpc_ckpt_*")), "Lightning's own SLURM handler must not save"
    first = job.configs()
    assert len(first) == 1, first
    r = job.start()
    assert r.finish() == 0, r.output
    assert r.events_of("resume", step=STOP_AT), r.events
    assert_same_final(expected, job.final)
    after = job.configs()
    if logger in FIXED_DIR:  # the stopped process's file, written again with the same content
        assert after == first and list(first) == [Path("config.yaml")], after
    else:  # each process its own version_N directory: the rerun never met the first file
        assert [p.parent.name for p in after] == ["version_0", "version_1"], after
        assert len(set(after.values())) == 1, after


@pytest.mark.parametrize("logger", ["none", "wandb"], ids=["no_logger", "wandb_offline"])
def test_a_rerun_with_another_config_or_without_the_runs_save_dir_is_still_refused_by_lightning(tmp_path, logger):
    """LightningCLI's protection stays where the rerun is not the same run: the config changed (one more epoch), or
    the save_dir holds nothing of the run (moved away: a new run into the old log directory). Lightning's own error,
    before preempt starts; the stopped process's config.yaml and checkpoint untouched."""
    job = Job(tmp_path, "job", logger)
    job.stop(signal.SIGTERM)
    first = job.configs()
    refusal = f"SaveConfigCallback expected {job.root / 'config.yaml'} to NOT exist"

    job.write(epochs=4)
    changed = job.start()
    assert changed.finish() == 1, changed.output
    assert refusal in changed.output and not changed.events_of("resume"), changed.output

    job.write()
    moved = job.save_dir.rename(tmp_path / "elsewhere")
    fresh = job.start()
    assert fresh.finish() == 1, fresh.output
    assert refusal in fresh.output and not job.save_dir.exists(), fresh.output
    assert job.configs() == first

    moved.rename(job.save_dir)  # back: the same command resumes the same run
    r = job.start()
    assert r.finish() == 0, r.output
    assert r.events_of("resume", step=STOP_AT), r.events


@pytest.mark.distributed
def test_ddp_a_stopped_lightning_cli_job_reruns_past_its_config_on_both_ranks(tmp_path):
    """strategy="ddp" with 2 CPU processes (Lightning starts rank 1 from rank 0): the check of the config file and its
    answer cross the ranks as SaveConfigCallback's own do (trainer.log_dir and a broadcast from rank 0), and the job
    resumes on both. (Bit-exactness under DDP: test_lightning.py's DDP test.)"""
    job = Job(tmp_path, "job", devices=2)
    job.stop(at=8)  # 6 steps an epoch on each rank: epoch 1, batch 2
    first = job.configs()
    r = job.start()
    assert r.finish(timeout=180) == 0, r.output
    assert r.events_of("resume", step=8), r.events
    assert job.configs() == first
