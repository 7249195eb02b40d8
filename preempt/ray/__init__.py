"""Ray Train: a PreemptibleRun inside a ``TorchTrainer``'s ``train_loop_per_worker``, its checkpoints reported to Ray.

The run works in a Ray Train worker unchanged: Ray's process group is torch.distributed's, so the ranks agree on a
stop as under torchrun, and the run watches Ray's drain of its node as an advance notice
(:mod:`preempt.cluster.ray_notice`). This part adds the two things only Ray knows of: where the run's save_dir goes
(``save_dir()``: inside the Ray run's own directory of ``RunConfig(storage_path=...)``, so that Ray can be told of a
checkpoint there without copying it) and telling Ray of the newest checkpoint when the run ends, stopped or done
(``reporting(run)``), so that ``result.checkpoint`` names the step preempt resumes from; a stop signal to a worker
caught by preempt, not Ray (``signals``); a stop signal to the driver passed on to the workers, the driver leaving
once their checkpoint is durable (``fit(trainer)``, ``driver``). README_PREEMPTION.md, "Ray Train".

Owns: ``train`` (the save_dir, the report, the stay after a drain), ``signals`` (a worker's stop signals), ``driver``
(the driver's).

May import: :mod:`preempt.run` and the parts below it, and ray. Nothing in preempt imports this part; ``import
preempt`` never imports ray (an import-linter contract in pyproject.toml). This ``__init__`` is the part's face: it
imports ray when its functions are called.
"""

from .driver import fit
from .train import reporting, save_dir

__all__ = ["fit", "reporting", "save_dir"]
