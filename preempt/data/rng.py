"""Every global random number generator, captured and restored.

Python's ``random``, NumPy's global ``np.random``, torch's CPU generator and
each CUDA device's generator. CUDA states are captured only when CUDA has been
initialised in this process: asking earlier would create a context on every
device (hundreds of MB each) for a generator nobody used.

A state read back from a checkpoint (:func:`from_tree`) is checked against
what each generator accepts before any of it is used: a forged one is
refused as damage, never handed to a generator that would crash on it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import struct
from typing import Any, NoReturn, TypeGuard, cast

import numpy as np
import torch

from ..errors import CorruptCheckpointError

Tensor = torch.Tensor  # (RngState has a field named torch)

log = logging.getLogger("preempt")


@dataclasses.dataclass
class RngState:
    """A snapshot of the global generators."""

    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    torch: Tensor
    cuda: list[Tensor]


def capture() -> RngState:
    """Snapshots every global generator (a few microseconds without CUDA)."""
    cuda: list[torch.Tensor] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = list(torch.cuda.get_rng_state_all())
    numpy = cast("tuple[Any, ...]", np.random.get_state(legacy=True))  # legacy=True: always the tuple
    return RngState(random.getstate(), numpy, torch.get_rng_state(), cuda)


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


def from_tree(tree: Any, where: str, field: str = "rng") -> RngState:
    """Inverse of :func:`to_tree`: every value checked against what its generator accepts, before any is used.

    A forged state can crash the process far from here, or quietly replay something else: NumPy reads its key
    at ``pos`` without a bounds check (a large ``pos`` is a segmentation fault at the first draw, 625..99999
    reads past the key), values of 2**32 and more are silently truncated by ``random.setstate``, and an
    all-zero Mersenne Twister key never leaves zero, so rejection loops such as
    ``np.random.standard_normal`` and ``random.normalvariate`` never end. Nothing a generator produced
    is refused: ``pos`` and Python's index run to 624, the key's words are 32-bit, cached Gaussians are finite.

    Args:
        tree: What :func:`to_tree` made, as read back from a checkpoint.
        where: The file it was read from, for messages.
        field: The tree's place in that file (``"rng.now"``), for messages.

    Raises:
        CorruptCheckpointError: A value no generator would have produced; the message names ``where``,
            the field, what was expected and what was found.
    """
    if not isinstance(tree, dict):
        _bad(where, field, "an object", tree)
    return RngState(
        python=_python_state(_get(tree, "python", dict, where, field), where, f"{field}.python"),
        numpy=_numpy_state(_get(tree, "numpy", dict, where, field), where, f"{field}.numpy"),
        torch=_torch_state(_get(tree, "torch", torch.Tensor, where, field), where, f"{field}.torch"),
        cuda=[_cuda_state(t, where, f"{field}.cuda.{i}") for i, t in enumerate(_get(tree, "cuda", list, where, field))],
    )


# ------------------------------------------------------------------ checks

_MT_N = 624  # words of a Mersenne Twister key; every MT19937 here (Python, NumPy, torch's CPU) has 624
_WORD = 1 << 32
# torch's CPUGeneratorImplState (aten/src/ATen/CPUGeneratorImpl.cpp), 5056 bytes on 64-bit: the legacy pod
# (seed u64 @0, left i32 @8, seeded i32 @12, next u64 @16, state u64[624] @24, normal_x, normal_y, normal_rho
# f64 @5016.., normal_is_valid i32 @5040), then next_float_normal_sample f32 @5048 and its valid flag @5052.
# torch itself checks the size, left, seeded and next (set_state: "Invalid mt19937 state"), not the rest.
_TORCH_STATE_SIZE = 5056
_TORCH_KEY = slice(24, 24 + 8 * _MT_N)
# CUDA's Philox state: seed u64, offset i64; set_state takes 16 bytes (or 8, without the offset), and
# an offset that is a multiple of 4.
_CUDA_STATE_SIZE = 16


def _bad(where: str, field: str, expected: str, found: Any) -> NoReturn:
    raise CorruptCheckpointError(f"{where}: {field}: expected {expected}, found {_show(found)}")


def _show(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {tuple(v.shape)}"
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _get(tree: dict[str, Any], key: str, kind: type, where: str, field: str) -> Any:
    value = tree.get(key)
    if not isinstance(value, kind):
        _bad(where, f"{field}.{key}", f"a {kind.__name__}", value)
    return value


def _int(tree: dict[str, Any], key: str, lo: int, hi: int, where: str, field: str) -> int:
    v = tree.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        _bad(where, f"{field}.{key}", f"an integer in {lo}..{hi}", v)
    return v


def _words(t: Any, n: int, where: str, field: str) -> list[int]:
    """The ``n`` 32-bit words of a Mersenne Twister key saved as an int64 tensor (as :func:`to_tree` writes it)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != (n,):
        _bad(where, field, f"an int64 tensor of shape ({n},)", t)
    return _key_words(t.tolist(), where, field)


def _key_words(words: list[int], where: str, field: str) -> list[int]:
    key = words[:_MT_N]
    wrong = next((i for i, w in enumerate(key) if not 0 <= w < _WORD), None)
    if wrong is not None:
        _bad(where, f"{field}[{wrong}]", "a 32-bit word (0..4294967295)", key[wrong])
    # Only the top bit of the first word takes part in the recurrence: with it and every other word zero,
    # the generator yields zeros forever (Python's and NumPy's seeding set that bit for this reason).
    if key[0] & 0x80000000 == 0 and not any(key[1:]):
        _bad(where, field, "a Mersenne Twister key that is not all zero", "an all-zero key")
    return words


def _finite(v: Any) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _python_state(tree: dict[str, Any], where: str, field: str) -> tuple[Any, ...]:
    _int(tree, "version", 3, 3, where, field)  # what random.getstate() gives on Python 3
    words = _words(tree.get("state"), _MT_N + 1, where, f"{field}.state")
    if not 0 <= words[_MT_N] <= _MT_N:
        _bad(where, f"{field}.state[{_MT_N}]", f"an index in 0..{_MT_N}", words[_MT_N])
    gauss = tree.get("gauss_next")
    if gauss is not None and not (isinstance(gauss, float) and math.isfinite(gauss)):
        _bad(where, f"{field}.gauss_next", "null or a finite float", gauss)
    return (3, tuple(words), gauss)


def _numpy_state(tree: dict[str, Any], where: str, field: str) -> tuple[Any, ...]:
    if tree.get("kind") != "MT19937":
        _bad(where, f"{field}.kind", "'MT19937' (np.random.get_state(legacy=True))", tree.get("kind"))
    key = np.asarray(_words(tree.get("key"), _MT_N, where, f"{field}.key"), dtype=np.uint32)
    pos = _int(tree, "pos", 0, _MT_N, where, field)
    has_gauss = _int(tree, "has_gauss", 0, 1, where, field)
    cached = tree.get("cached_gaussian")
    if not _finite(cached):
        _bad(where, f"{field}.cached_gaussian", "a finite number", cached)
    return ("MT19937", key, pos, has_gauss, float(cached))


def _torch_state(t: torch.Tensor, where: str, field: str) -> torch.Tensor:
    if t.dtype != torch.uint8 or t.dim() != 1:
        _bad(where, field, "a uint8 tensor of one dimension (torch.get_rng_state())", t)
    try:
        torch.Generator().set_state(t)  # a fresh generator: what torch accepts, and the global one untouched
    except RuntimeError as e:
        _bad(where, field, "a state torch.set_rng_state accepts", f"{tuple(t.shape)} bytes that it refuses ({e})")
    if t.numel() == _TORCH_STATE_SIZE:  # the layout this torch writes; another size is another layout
        raw = t.numpy().tobytes()
        _key_words(list(struct.unpack(f"<{_MT_N}Q", raw[_TORCH_KEY])), where, f"{field} Mersenne Twister key")
        normal = struct.unpack("<3d", raw[5016:5040])  # x, y, rho: which of them set_state reads varies by version
        (normal_valid,) = struct.unpack("<i", raw[5040:5044])
        (next_float,) = struct.unpack("<f", raw[5048:5052])
        if normal_valid and not all(map(math.isfinite, normal)):
            _bad(where, f"{field} cached normal sample", "finite numbers", normal)
        if raw[5052] and not math.isfinite(next_float):
            _bad(where, f"{field} cached float normal sample", "a finite number", next_float)
    return t


def _cuda_state(t: Any, where: str, field: str) -> torch.Tensor:
    """Checked without CUDA (a checkpoint may be resumed on a machine without it): size and Philox offset."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or tuple(t.shape) != (_CUDA_STATE_SIZE,):
        _bad(where, field, f"a uint8 tensor of shape ({_CUDA_STATE_SIZE},) (torch.cuda.get_rng_state())", t)
    (offset,) = struct.unpack("<q", t.numpy().tobytes()[8:16])
    if offset < 0 or offset % 4:
        _bad(where, f"{field} Philox offset", "a non-negative multiple of 4", offset)
    return t
