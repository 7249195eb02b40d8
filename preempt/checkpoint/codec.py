"""Nested state (dicts, lists, tensors, numbers) to tensors plus JSON, and back.

A ``state_dict()`` is a tree. Its tensors go to a safetensors file under
dotted keys; the rest of the tree becomes JSON in which each tensor is a
reference ``{"__tensor__": key}``. Types JSON lacks are tagged the same way:
tuples, dicts whose keys are not strings (the optimizer's ``state`` is keyed
by parameter index), and NumPy arrays. Nothing else is accepted: there is no
pickle anywhere, so a value of another type is an error that names its key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import UnsupportedStateError
from . import safe_io
from .tensorfile import foreign_format

if TYPE_CHECKING:  # imported where tensors are met: loads() needs no torch (preempt verify never imports it)
    import torch

TENSOR = "__tensor__"
NDARRAY = "__ndarray__"
TUPLE = "__tuple__"
ITEMS = "__items__"  # a dict whose keys are not all plain strings
_MARKERS = frozenset({TENSOR, NDARRAY, TUPLE, ITEMS})
_SCALAR_KEYS = (str, int, float, bool, type(None))
_TOO_DEEP = "nested too deeply (or a container holds itself); state must be a tree of modest depth"


def encode(tree: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Encodes ``tree``; tensors are added to ``tensors`` under keys starting with ``prefix``.

    Raises:
        UnsupportedStateError: A value is neither a tensor, an array nor JSON-able,
            or the tree refers to itself (or nests deeper than the stack allows).
    """
    try:
        return _encode(tree, prefix, tensors)
    except RecursionError:
        raise UnsupportedStateError(f"{prefix or 'state'}: {_TOO_DEEP}") from None


def _encode(tree: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    import torch

    if isinstance(tree, torch.Tensor):
        return {TENSOR: _put(tensors, prefix, tree)}
    if isinstance(tree, np.ndarray):
        arr = np.require(tree, requirements=["C"])  # keeps 0-d arrays 0-d, unlike ascontiguousarray
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        try:
            t = torch.from_numpy(arr)
        except (TypeError, ValueError):
            raise UnsupportedStateError(f"{prefix}: NumPy dtype {tree.dtype} cannot be saved") from None
        return {NDARRAY: _put(tensors, prefix, t)}
    if isinstance(tree, np.generic):
        return _encode(tree.item(), prefix, tensors)
    if tree is None or isinstance(tree, (bool, int, str)):
        return tree
    if isinstance(tree, float):
        return tree
    if isinstance(tree, Mapping):
        plain = all(isinstance(k, str) for k in tree) and not (len(tree) == 1 and next(iter(tree)) in _MARKERS)
        if plain:
            return {k: _encode(v, _join(prefix, k), tensors) for k, v in tree.items()}
        items = []
        for k, v in tree.items():
            if not isinstance(k, _SCALAR_KEYS):
                raise UnsupportedStateError(f"{prefix}: dict key {k!r} of type {type(k).__name__} cannot be saved")
            items.append([k, _encode(v, _join(prefix, str(k)), tensors)])
        return {ITEMS: items}
    if isinstance(tree, tuple):
        return {TUPLE: [_encode(v, _join(prefix, str(i)), tensors) for i, v in enumerate(tree)]}
    if isinstance(tree, list):
        return [_encode(v, _join(prefix, str(i)), tensors) for i, v in enumerate(tree)]
    raise UnsupportedStateError(
        f"{prefix or 'state'}: a {type(tree).__module__}.{type(tree).__qualname__} can be saved neither as a tensor"
        " nor as JSON (preempt never pickles); return tensors, numbers, strings, lists or dicts from state_dict()"
    )


def decode(tree: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    """Inverse of :func:`encode`.

    Raises:
        ValueError: A reference names a tensor that is not there, a tag is
            malformed, or the tree nests deeper than the stack allows.
    """
    try:
        return _decode(tree, tensors, where)
    except RecursionError:
        raise ValueError(f"{where}: {_TOO_DEEP}") from None


def _decode(tree: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:

    if isinstance(tree, list):
        return [_decode(v, tensors, where) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        ((tag, value),) = tree.items()
        if tag in (TENSOR, NDARRAY):
            if not isinstance(value, str) or value not in tensors:
                raise ValueError(f"{where}: reference to tensor {_short(value)}, which the tensor file does not hold")
            t = tensors[value]
            return t.numpy() if tag == NDARRAY else t
        if tag == TUPLE:
            if not isinstance(value, list):
                raise ValueError(f"{where}: {TUPLE} must hold a list, found {type(value).__name__}")
            return tuple(_decode(v, tensors, where) for v in value)
        if tag == ITEMS:
            if not isinstance(value, list) or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], _SCALAR_KEYS) for p in value
            ):
                raise ValueError(f"{where}: {ITEMS} must hold [key, value] pairs whose keys are JSON scalars")
            return {k: _decode(v, tensors, where) for k, v in value}
    return {k: _decode(v, tensors, where) for k, v in tree.items()}


def loads(data: bytes | bytearray | memoryview | np.ndarray, where: str) -> Any:
    """Parses a JSON document of a checkpoint (``state.json``), naming ``where`` in every error.

    Raises:
        ValueError: The bytes are not JSON: bad UTF-8 or syntax, an integer of
            more than 4300 digits, nesting deeper than the stack allows. A
            pickle or a zip archive (``torch.save``) is named as such.
    """
    if isinstance(data, (memoryview, np.ndarray)):
        data = data.tobytes()  # a NumPy buffer from hashed_io.read_file
    try:
        if safe_io.json_depth(bytes(data)) > safe_io.MAX_DEPTH:  # before parsing: no RecursionError anywhere after
            raise ValueError(f"nested deeper than {safe_io.MAX_DEPTH} levels")
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        kind = foreign_format(bytes(data[:8]))
        found = f"found {kind}: preempt never unpickles (a pickle can run code)" if kind else f"{type(e).__name__}: {e}"
        raise ValueError(f"{where}: expected JSON, {found}") from None


def check_json(value: Any, where: str) -> None:
    """Raises UnsupportedStateError unless ``value`` is plain JSON (str keys; finite or not floats)."""
    try:
        _check_json(value, where)
    except RecursionError:
        raise UnsupportedStateError(f"{where}: {_TOO_DEEP}") from None


def _check_json(value: Any, where: str) -> None:
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise UnsupportedStateError(f"{where}: key {k!r} is not a string; JSON object keys must be")
            _check_json(v, f"{where}.{k}")
        return
    raise UnsupportedStateError(f"{where}: a {type(value).__name__} is not JSON (use numbers, strings, lists, dicts)")


def dumps(tree: Any) -> bytes:
    """JSON text of an encoded tree, keeping dict order (restored dicts iterate as the saved ones did)."""
    return json.dumps(tree, separators=(",", ":"), allow_nan=True).encode()


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _put(tensors: dict[str, torch.Tensor], key: str, t: torch.Tensor) -> str:
    k, n = key, 1
    while k in tensors:
        k = f"{key}~{n}"
        n += 1
    tensors[k] = t
    return k


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 200 else f"{text[:160]}... ({len(text)} characters)"
