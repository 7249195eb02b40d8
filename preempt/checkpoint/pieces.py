"""The ranks' files of pieces: where each piece of a sharded tensor lies in the whole tensor. No torch.

Under FSDP2 each rank writes its local pieces of the model's and optimizer's tensors into safetensors files of its
own (``base_0000R.safetensors``, ``pieces_0000R.safetensors``: :func:`preempt.cluster.sharded.pieces_apart`). A
file's metadata :data:`LAYOUT` maps each tensor it holds to the whole tensor's shape and the offset where the piece
begins. This module reads and checks that layout (:func:`layout_of`), says where two pieces meet (:func:`overlap`,
pure), and assembles whole tensors from the pieces without torch, for ``preempt export`` (:func:`assembled`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from . import tensorfile

LAYOUT = "preempt.layout"  # a file's metadata: {key: {"size": whole shape, "offset": where its piece begins}}

Box = tuple[tuple[int, int], ...]  # per dimension: (where it begins in the whole tensor, how many)


def layout_of(
    metadata: Mapping[str, str], shapes: Mapping[str, Sequence[int]], where: str
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each tensor of a file of pieces: (the whole tensor's shape, where the piece begins), checked.

    ``shapes``: the shape of each tensor the file holds.

    Raises:
        ValueError: The layout is missing, is not JSON, does not list exactly the file's tensors, or places a piece
            outside its whole tensor (naming ``where`` and the tensor).
    """
    try:
        layout = json.loads(metadata.get(LAYOUT, "null"))
    except ValueError:
        layout = None
    if not isinstance(layout, dict) or set(layout) != set(shapes):
        raise ValueError(f"{where}: its metadata {LAYOUT!r} does not list exactly the tensors the file holds")
    out = {}
    for key, shape in shapes.items():
        entry = layout[key]
        size = _ints(entry.get("size") if isinstance(entry, dict) else None, len(shape))
        offset = _ints(entry.get("offset") if isinstance(entry, dict) else None, len(shape))
        if size is None or offset is None or any(o + n > z for o, n, z in zip(offset, shape, size, strict=True)):
            raise ValueError(f"{where}: {key!r}: a piece of shape {tuple(shape)} and layout {entry} does not fit")
        out[key] = (size, offset)
    return out


def _ints(x: Any, n: int) -> tuple[int, ...] | None:
    if not isinstance(x, list) or len(x) != n or not all(type(i) is int and i >= 0 for i in x):
        return None
    return tuple(x)


def overlap(a: tuple[int, ...], a_shape: Sequence[int], b: tuple[int, ...], b_shape: Sequence[int]) -> Box | None:
    """Where the box of shape ``a_shape`` at ``a`` and the one of shape ``b_shape`` at ``b`` meet (None: nowhere)."""
    box = []
    for a0, an, b0, bn in zip(a, a_shape, b, b_shape, strict=True):
        lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
        if lo >= hi:
            return None
        box.append((lo, hi - lo))
    return tuple(box)


def check_apart(key: str, box: Box, others: Sequence[Box], where: str) -> None:
    """Raises ValueError when the piece ``box`` of ``key`` (in ``where``) overlaps one of ``others``: the pieces of a
    tensor cover it once, so that counting what they hold says whether they cover it whole."""
    at, shape = tuple(lo for lo, _ in box), tuple(n for _, n in box)
    for other in others:
        if overlap(at, shape, tuple(lo for lo, _ in other), tuple(n for _, n in other)) is not None:
            raise ValueError(f"{where}: {key!r}: a piece at {list(at)} overlaps another file's piece of it")


def assembled(
    files: Sequence[tuple[str, np.ndarray, tensorfile.Header]], prefix: str, metadata: Mapping[str, str]
) -> tuple[int, Iterator[Any]]:
    """One safetensors file of the whole tensors whose keys start with ``prefix`` (named without it), put together
    from the ranks' files of pieces (path, the file in memory, its validated header). No torch.

    Returns the number of tensors and the file's chunks to write.

    Raises:
        ValueError: A layout that does not check, two files that disagree on a tensor's shape or dtype, or pieces
            that do not cover a whole tensor exactly once.
    """
    wholes: dict[str, tuple[tuple[int, ...], str, np.ndarray, list[Box]]] = {}  # key -> shape, dtype, bytes, boxes
    for where, buf, header in files:
        entries = {e.name: e for e in header.entries}
        layout = layout_of(header.metadata, {k: e.shape for k, e in entries.items()}, where)
        for key, (size, offset) in layout.items():
            if not key.startswith(prefix):
                continue
            e = entries[key]
            item = tensorfile.itemsize(e.dtype)
            if key not in wholes:
                wholes[key] = (size, e.dtype, np.zeros((*size, item), dtype=np.uint8), [])
            shape, dtype, whole, boxes = wholes[key]
            if shape != size or dtype != e.dtype:
                raise ValueError(f"{where}: {key!r}: {list(size)} {e.dtype}, where another file says {list(shape)}")
            if math.prod(e.shape) == 0:
                continue
            box = tuple(zip(offset, e.shape, strict=True))
            check_apart(key, box, boxes, where)
            boxes.append(box)
            data = buf[header.data_start + e.begin : header.data_start + e.end].reshape(*e.shape, item)
            whole[tuple(slice(lo, lo + n) for lo, n in box)] = data
    for key, (size, _, _, boxes) in wholes.items():
        held = sum(math.prod(n for _, n in box) for box in boxes)
        if held != math.prod(size):
            raise ValueError(f"{key!r}: the files of pieces hold {held} of its {math.prod(size)} values")
    order = sorted(wholes, key=lambda k: (-tensorfile.itemsize(wholes[k][1]), k))
    doc: dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}} if metadata else {}
    at = 0
    for key in order:
        size, dtype, whole, _ = wholes[key]
        doc[key[len(prefix) :]] = {"dtype": dtype, "shape": list(size), "data_offsets": [at, at + whole.nbytes]}
        at += whole.nbytes

    def pieces() -> Iterator[Any]:
        yield tensorfile.header_bytes(doc)
        for key in order:
            if wholes[key][2].nbytes:
                yield wholes[key][2].data

    return len(order), pieces()
