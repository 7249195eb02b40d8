"""train_lightning.py's model as a LightningCLI project: ``python train_lightning_cli.py fit --config x.yaml``.

The user's code is a plain LightningCLI; PreemptCallback comes from the YAML config alone (``trainer.callbacks``).
``FINAL_OUT`` in the environment: where the final model and optimizer tensors are written after ``fit``.
``BLOCK_SIGNALS=1``: SIGTERM/USR1/USR2 blocked from the first statement, so that a SLURM warning that comes during
the seconds of imports stays pending until the run installs its handlers (as train.py's --block_signals).
``DATAMODULE=1``: ``LightningCLI(Net, Data)``, the training data from a LightningDataModule class (``data:`` in the
YAML may configure it), as most LightningCLI projects give it.
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
from train_lightning import Data, Net, write_final  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    data = Data if os.environ.get("DATAMODULE") == "1" else None
    cli = LightningCLI(Net, data, save_config_kwargs={"overwrite": True})
    final = os.environ.get("FINAL_OUT")
    if final:
        write_final(final, cli.model, cli.trainer)
    print(f"done at step {cli.trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
