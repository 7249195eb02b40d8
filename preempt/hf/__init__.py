"""The Hugging Face Trainer: one line after the Trainer is built gives it what PreemptibleRun gives a loop.

``preempt.hf.install(trainer, "runs/exp1", checkpoint_every_steps=500)`` on any ``transformers.Trainer`` (or a
subclass: ``SFTTrainer``, ``Seq2SeqTrainer``...), then ``trainer.train()`` unchanged: stop signals flag the run, the
stop lands after the next optimizer step with one checkpoint through preempt's commit and exit code 75, and
rerunning the same script resumes bit for bit. README_PREEMPTION.md, "Hugging Face Trainer".

Owns: the installer and the Trainer's methods it takes over (``install``), and what a checkpoint keeps of the
Trainer's own state: ``trainer.state``, the counters it keeps in memory (loss, flos, seconds), its callbacks' states
and trl's counts (``trainer_state``).

May import: :mod:`preempt.run` and the parts below it, and transformers. Nothing in preempt imports this part;
``import preempt`` never imports transformers (an import-linter contract in pyproject.toml). This ``__init__`` is the
part's face: it imports transformers.
"""

from .install import install

__all__ = ["install"]
