"""train_lightning.py's model as a LightningCLI project: ``python train_lightning_cli.py fit --config x.yaml``.

The user's code is a plain LightningCLI; PreemptCallback comes from the YAML config alone (``trainer.callbacks``).
``FINAL_OUT`` in the environment: where the final model and optimizer tensors are written after ``fit``.
``BLOCK_SIGNALS=1``: SIGTERM/USR1/USR2 blocked from the first statement, so that a SLURM warning that comes during
the seconds of imports stays pending until the run installs its handlers (as train.py's --block_signals).
``DATAMODULE=1``: ``LightningCLI(Net, Data)``, the training data from a LightningDataModule class (``data:`` in the
YAML may configure it), as most LightningCLI projects give it.
``OVERWRITE_CONFIG=1``: ``save_config_kwargs={"overwrite": True}``; by default LightningCLI's own default, as a user
has it: its SaveConfigCallback refuses to overwrite a ``config.yaml`` already in the log directory.
``HOLD_AT_STEP=N``: a ``Steps`` callback (progress events) that holds this process's N-th optimizer step until the
run is asked to stop, given through ``trainer_defaults`` so that the config (and the config.yaml LightningCLI writes)
is the same with or without it: the stopped process and its rerun run one config, as a requeued job does.
"""

import os
import signal

if os.environ.get("BLOCK_SIGNALS") == "1":  # first, before any import that takes time
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2])

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_lightning import Data, Net, Steps, write_final  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    data = Data if os.environ.get("DATAMODULE") == "1" else None
    hold = os.environ.get("HOLD_AT_STEP")
    cli = LightningCLI(
        Net,
        data,
        save_config_kwargs={"overwrite": True} if os.environ.get("OVERWRITE_CONFIG") == "1" else None,
        trainer_defaults={"callbacks": [Steps(int(hold), 0.0)]} if hold else None,
    )
    final = os.environ.get("FINAL_OUT")
    if final:
        write_final(final, cli.model, cli.trainer)
    print(f"done at step {cli.trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
