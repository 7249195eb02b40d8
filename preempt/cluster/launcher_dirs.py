"""Launchers that give each run a new folder: a ``save_dir`` inside it is a different directory at every rerun.

Hydra's ``@hydra.main`` makes a new output folder per run (``outputs/<date>/<time>``, or the template's
``logs/<task>/runs/<date_time>``), and with ``hydra.job.chdir=True`` (the default before Hydra 1.2) it also makes it
the working directory, so that a relative ``save_dir`` lands there too. A run whose checkpoints go there resumes
from nothing: the rerun gets a new, empty folder, trains from step 0 and exits 0, and nothing says so. This module
finds that case at the start, for a warning naming the fix.

Hydra is never imported here: its state is read only when the program already imported it
(``sys.modules``) and a Hydra run is on (``HydraConfig.initialized()``). No torch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def hydra_output_dir() -> Path | None:
    """This process's Hydra run folder (``hydra.runtime.output_dir``), or None outside a Hydra run."""
    if "hydra" not in sys.modules:
        return None
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return None
        return Path(str(HydraConfig.get().runtime.output_dir))
    except Exception:  # another Hydra, or its config without a runtime: nothing to say
        return None


def inside(save_dir: str | os.PathLike[str], run_dir: Path | None) -> bool:
    """Whether ``save_dir`` (resolved as the process sees it) is ``run_dir`` or under it. Pure but for ``resolve``."""
    if run_dir is None:
        return False
    where, top = Path(save_dir).resolve(), run_dir.resolve()
    return where == top or top in where.parents


def warning(save_dir: str | os.PathLike[str], run_dir: Path) -> str:
    """What the run says when its ``save_dir`` is inside Hydra's run folder."""
    return (
        f"save_dir {save_dir} is inside this run's Hydra output folder {run_dir}, which Hydra makes anew at every run:"
        " a rerun (a requeue) will not find these checkpoints and will start from step 0. Give save_dir a fixed path"
        " that does not depend on the run's time, e.g. in the YAML `save_dir: ${paths.root_dir}/preempt/${task_name}`"
        " rather than `${hydra:runtime.output_dir}/...` (README_PREEMPTION.md, section 11, Hydra)"
    )
