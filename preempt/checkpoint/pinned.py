"""Page-locked (pinned) host memory of exactly the size asked, for copies from a GPU.

A copy from a GPU into host memory runs on the GPU's copy engine, beside the
training's kernels, only when the host memory is page-locked. torch's pinned
allocator (``torch.empty(..., pin_memory=True)``) rounds every block up to the
next power of two (``torch.cuda.host_memory_stats``' documentation says so), so
the staging arena of a 1.5 GiB state would lock 2 GiB. :func:`lock` instead
registers the pages of memory already allocated (``cudaHostRegister``): exactly
its bytes are locked, and :func:`unlock` gives them back before the memory is
freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process, not only the current one


def nbytes(data: torch.Tensor) -> int:
    return data.numel() * data.element_size()


def lock(data: torch.Tensor, owner: Any) -> Callable[[], None]:
    """Page-locks the bytes of ``data`` (a contiguous CPU tensor) until the returned function is called, or until
    ``owner`` is collected (whichever comes first; ``owner`` must hold ``data``, so that the memory is unlocked
    before it can be freed).

    Raises:
        RuntimeError: CUDA refused (no device, or the memory could not be locked); nothing is locked then.
    """
    if data.device.type != "cpu" or not data.is_contiguous():
        raise ValueError(f"pinned.lock: a contiguous CPU tensor is needed, got one on {data.device}")
    ptr, size = data.data_ptr(), nbytes(data)
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, size, PORTABLE))
    if err != 0:
        forget_error()
        raise RuntimeError(f"cudaHostRegister of {size} bytes at {ptr:#x} failed: cudaError {err}")
    return weakref.finalize(owner, unlock, ptr)


def unlock(ptr: int) -> None:
    """Unregisters the pages locked at ``ptr`` (best effort: at the process's end CUDA may be gone already)."""
    try:
        if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
            forget_error()
    except Exception:  # noqa: BLE001  (nothing to do about it; the memory is freed next)
        pass


def forget_error() -> None:
    """Drops the error a failed CUDA call left behind in this thread.

    The CUDA runtime keeps the last error of each host thread until it is asked for. torch asks after every kernel
    launch and raises what it finds, so a refused registration, which this module handles, would fail the training's
    next kernel as if that kernel had failed (seen with torch 2.11: "pointer does not correspond to a registered
    memory region" from an unrelated ``.cuda()``). A kernel launched here takes the error and drops it.
    """
    try:
        torch.zeros(1, device="cuda")
    except Exception:  # noqa: BLE001  (the error being dropped)
        pass
