"""Lightning and LightningCLI: one callback gives a Lightning run what PreemptibleRun gives a loop.

``PreemptCallback("runs/exp1", checkpoint_every_steps=500)`` in ``Trainer(callbacks=[...])`` or in a LightningCLI
config (``class_path: preempt.lightning.PreemptCallback``): stop signals flag the run, the stop lands at the next
optimizer step with one checkpoint through preempt's commit and exit code 75, and rerunning the same command
resumes bit for bit. README_PREEMPTION.md, "Lightning and LightningCLI".

Owns: the callback (``callback``), what a checkpoint keeps of Lightning's own state (``trainer_state``), and the
training loader handed to Lightning in place of the user's, whose batches come from the run (``batches``), and a
rerun's LightningCLI config file, which LightningCLI's SaveConfigCallback would refuse as a previous run's
(``cli_config``).

May import: :mod:`preempt.run` and the parts below it, and Lightning. Nothing in preempt imports this part; ``import
preempt`` never imports Lightning (an import-linter contract in pyproject.toml). This ``__init__`` is the part's
face: it imports Lightning.
"""

from .callback import PreemptCallback

__all__ = ["PreemptCallback"]
