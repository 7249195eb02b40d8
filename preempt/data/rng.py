"""Every global random number generator, captured and restored.

Python's ``random``, NumPy's global ``np.random``, torch's CPU generator and
each CUDA device's generator. CUDA states are captured only when CUDA has been
initialised in this process: asking earlier would create a context on every
device (hundreds of MB each) for a generator nobody used.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger("preempt")


@dataclasses.dataclass
class RngState:
    """A snapshot of the global generators."""

    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    torch: torch.Tensor
    cuda: list[torch.Tensor]


def capture() -> RngState:
    """Snapshots every global generator (a few microseconds without CUDA)."""
    cuda: list[torch.Tensor] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = list(torch.cuda.get_rng_state_all())
    return RngState(random.getstate(), np.random.get_state(legacy=True), torch.get_rng_state(), cuda)


def restore(state: RngState) -> None:
    """Puts every generator back to ``state``."""
    random.setstate(state.python)
    np.random.set_state(state.numpy)
    torch.set_rng_state(state.torch)
    if not state.cuda:
        return
    if not torch.cuda.is_available():
        log.warning(
            "the checkpoint holds CUDA RNG states for %d device(s) but CUDA is not available here;"
            " GPU randomness will not replay",
            len(state.cuda),
        )
        return
    n = torch.cuda.device_count()
    if n != len(state.cuda):
        log.warning(
            "the checkpoint holds CUDA RNG states for %d device(s), this process sees %d; restoring the first %d",
            len(state.cuda),
            n,
            min(n, len(state.cuda)),
        )
    for i, s in enumerate(state.cuda[:n]):
        torch.cuda.set_rng_state(s, i)


def to_tree(state: RngState) -> dict[str, Any]:
    """A tree of tensors and JSON for :mod:`preempt.checkpoint.codec`."""
    version, internal, gauss = state.python
    kind, key, pos, has_gauss, cached = state.numpy
    return {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss},
        "numpy": {
            "kind": kind,
            "key": torch.from_numpy(np.asarray(key, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": state.torch.clone(),
        "cuda": [s.cpu().clone() for s in state.cuda],
    }


def from_tree(tree: Any, where: str) -> RngState:
    """Inverse of :func:`to_tree`, with checks that name ``where``.

    Raises:
        ValueError: The tree does not have the shape :func:`to_tree` makes.
    """
    try:
        py = tree["python"]
        npy = tree["numpy"]
        internal = tuple(int(x) for x in py["state"].tolist())
        key = np.asarray(npy["key"].numpy(), dtype=np.uint32)
        state = RngState(
            python=(int(py["version"]), internal, py["gauss_next"]),
            numpy=(str(npy["kind"]), key, int(npy["pos"]), int(npy["has_gauss"]), float(npy["cached_gaussian"])),
            torch=tree["torch"].to(torch.uint8),
            cuda=[t.to(torch.uint8) for t in tree["cuda"]],
        )
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"{where}: RNG state is malformed ({type(e).__name__}: {e})") from None
    if len(internal) != 625 or state.numpy[0] != "MT19937" or key.size != 624:
        raise ValueError(f"{where}: RNG state has unexpected sizes (python {len(internal)}, numpy {key.size})")
    return state
