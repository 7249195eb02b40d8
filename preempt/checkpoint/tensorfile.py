"""Tensors to and from the safetensors format, without pickle.

The writer streams each tensor's bytes straight from its memory (no
serialisation into one big buffer first) so that a save runs at the speed of
the disk; :func:`preempt.checkpoint.hashed_io.write_file` hashes them on the way. The files
are standard safetensors: ``safetensors.torch.load_file`` reads them.

The reader parses a file that has already been read into memory and verified,
checks every header entry (dtype, shape, offsets inside the buffer, no
overlaps or holes), and returns tensors that are views into that buffer: no
copy, and nothing in the file can execute code. :func:`read_header` applies
the same checks (one validator) to the header of a file on disk without
reading its tensor data: what ``preempt inspect`` shows.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

MAX_HEADER_BYTES = 100 << 20
MAX_DIMS = 64  # more dimensions than any tensor has; bounds the work an empty tensor with a huge shape costs
MAX_EXTENT = 1 << 62  # the product of a shape's non-zero dimensions: torch's strides are int64

# The format's dtypes and their sizes: headers are checked without torch (preempt ls/verify never import it).
_ITEMSIZE: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "C64": 8,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
}
_TORCH_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "C64": "complex64",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}


@functools.cache
def _dtypes() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    """The format's dtypes that this torch has, by name and by torch dtype (imports torch on first use)."""
    import torch

    by_name = {k: getattr(torch, v) for k, v in _TORCH_NAMES.items() if hasattr(torch, v)}
    return by_name, {v: k for k, v in by_name.items()}


def itemsize(dtype: str) -> int:
    """The bytes of one element of the safetensors dtype ``dtype`` (a name a validated header holds)."""
    return _ITEMSIZE[dtype]


def dtype_name(dtype: torch.dtype) -> str | None:
    """The safetensors name of a torch dtype, or None when the format has none."""
    return _dtypes()[1].get(dtype)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a dense tensor in row-major order (a view when possible)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data


def check_tensor(key: str, t: torch.Tensor) -> None:
    """Raises TypeError naming ``key`` for a tensor the format cannot hold."""
    import torch

    if t.layout != torch.strided:
        raise TypeError(f"{key}: {t.layout} tensors are not supported; convert with .to_dense()")
    if t.is_quantized:
        raise TypeError(f"{key}: quantized tensors are not supported")
    if t.device.type == "meta":
        raise TypeError(f"{key}: a meta tensor has no data to save")
    if t.dtype not in _dtypes()[1]:
        raise TypeError(f"{key}: dtype {t.dtype} has no safetensors equivalent")


DATA_ALIGN = 4096  # a tensor file's data starts at a multiple of this: its bytes may be written O_DIRECT


def layout(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, int, int]]:
    """Where each tensor's bytes lie in a file's data area: (key, begin, end), in the file's order.

    By descending element size, then by name (what the safetensors library
    does), so that every tensor starts at an offset aligned to its element size.
    """
    out, offset = [], 0
    for key in sorted(tensors, key=lambda k: (-tensors[k].element_size(), k)):
        t = tensors[key]
        end = offset + t.numel() * t.element_size()
        out.append((key, offset, end))
        offset = end
    return out


def chunks(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> Iterator[Any]:
    """Yields the header, then the tensors' bytes: a complete safetensors file (:func:`layout`).

    The header is padded so that the data starts at a multiple of
    :data:`DATA_ALIGN`. Tensors that lie in one buffer exactly as in the file
    (a staged snapshot: :class:`preempt.checkpoint.staging.Stager`) are yielded as that
    one buffer, which :func:`preempt.checkpoint.hashed_io.write_file` can write without the
    page cache; any others one by one, straight from their memory.
    """
    if sys.byteorder != "little":
        raise RuntimeError("preempt writes little-endian safetensors files; big-endian hosts are not supported")
    by_dtype = _dtypes()[1]
    places = layout(tensors)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for key, begin, end in places:
        t = tensors[key]
        check_tensor(key, t)
        header[key] = {"dtype": by_dtype[t.dtype], "shape": list(t.shape), "data_offsets": [begin, end]}
    yield header_bytes(header)
    whole = _one_buffer(tensors, places)
    if whole is not None:
        yield whole
        return
    for key, _begin, _end in places:
        yield tensor_bytes(tensors[key])


def header_bytes(header: Mapping[str, Any]) -> bytes:
    """The length and the JSON of a header, padded with spaces so that the data starts on :data:`DATA_ALIGN`."""
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % DATA_ALIGN)
    return len(head).to_bytes(8, "little") + head


def _one_buffer(tensors: Mapping[str, torch.Tensor], places: list[tuple[str, int, int]]) -> memoryview | None:
    """The data area as one view, when every tensor is a dense CPU view at its place in one buffer; else None."""
    import torch

    full = [(tensors[key], begin) for key, begin, end in places if end > begin]
    if not full:
        return None
    storage = full[0][0].untyped_storage()
    base = full[0][0].data_ptr() - full[0][1]
    for t, begin in full:
        if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg() or t.data_ptr() != base + begin:
            return None
        if t.untyped_storage().data_ptr() != storage.data_ptr():
            return None
    area = torch.empty(0, dtype=torch.uint8).set_(storage, base - storage.data_ptr(), (places[-1][2],), (1,))
    return area.numpy().data


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor as a safetensors header describes it; offsets count from the start of the data area."""

    name: str
    dtype: str  # the safetensors name, e.g. "F32"
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclasses.dataclass(frozen=True)
class Header:
    """A validated safetensors header: its entries in header order, its metadata, where the data starts."""

    entries: list[Entry]
    metadata: dict[str, str]
    data_start: int  # 8 + the header's length


def read_header(path: str | os.PathLike[str]) -> Header:
    """The header of a safetensors file, read and validated without reading any tensor data.

    The caller refuses what is not a regular file first (opening a FIFO blocks).

    Raises:
        ValueError: The header is malformed (the same rules as :func:`parse`).
        OSError: The file cannot be read.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        first = f.read(8)
        raw = f.read(_header_length(first, size, str(path)))
    return _validate_header(first, raw, size, str(path))


def validate(buf: np.ndarray, where: str) -> Header:
    """The validated header of a safetensors file held in memory (no torch: what ``preempt verify`` checks).

    Raises:
        ValueError: The bytes are not a well-formed safetensors file.
    """
    first = buf[:8].tobytes()
    hlen = _header_length(first, int(buf.size), where)
    return _validate_header(first, buf[8 : 8 + hlen].tobytes(), int(buf.size), where)


def restamped(buf: np.ndarray, header: Header, metadata: Mapping[str, str]) -> Iterator[Any]:
    """The safetensors file ``buf`` (validated as ``header``) with ``metadata`` instead of its own, as chunks.

    The entries keep their offsets, so the data area is yielded as it is (a view of ``buf``); the new header is
    padded as :func:`chunks` pads it, which keeps every tensor at the alignment it had. No torch.
    """
    doc: dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}} if metadata else {}
    for e in header.entries:
        doc[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
    yield header_bytes(doc)
    yield buf[header.data_start :].data


def merged(parts: list[tuple[np.ndarray, Header]], metadata: Mapping[str, str]) -> Iterator[Any]:
    """One safetensors file holding every tensor of ``parts`` (validated files in memory), as chunks. No torch.

    Laid out as :func:`layout` lays out a file (by descending element size, then name), so every tensor starts
    at an offset aligned to its element size; each tensor's bytes are yielded as a view of its source.

    Raises:
        ValueError: Two parts hold a tensor of the same name.
    """
    found: dict[str, tuple[np.ndarray, Header, Entry]] = {}
    for buf, header in parts:
        for e in header.entries:
            if e.name in found:
                raise ValueError(f"tensor {_short(e.name)} is in two of the files to merge")
            found[e.name] = (buf, header, e)
    doc: dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}} if metadata else {}
    order = sorted(found, key=lambda k: (-_ITEMSIZE[found[k][2].dtype], k))
    offset = 0
    for name in order:
        e = found[name][2]
        doc[name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.end - e.begin]}
        offset += e.end - e.begin
    yield header_bytes(doc)
    for name in order:
        buf, header, e = found[name]
        if e.end > e.begin:
            yield buf[header.data_start + e.begin : header.data_start + e.end].data


def parse(buf: np.ndarray, where: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors (views into ``buf``) and metadata of a safetensors file held in memory.

    Args:
        buf: The whole file as a uint8 array.
        where: The file's path, for messages.

    Raises:
        ValueError: The bytes are not a well-formed safetensors file, or hold a dtype this torch lacks.
    """
    import torch

    header = validate(buf, where)
    by_name = _dtypes()[0]
    data = buf[header.data_start :]
    out: dict[str, torch.Tensor] = {}
    for e in _by_offset(header.entries):
        dtype = by_name.get(e.dtype)
        if dtype is None:
            raise ValueError(
                f"{where}: entry {_short(e.name)}: dtype {e.dtype} is not supported by torch {torch.__version__}"
            )
        if e.begin == e.end:
            out[e.name] = torch.empty(e.shape, dtype=dtype)
            continue
        chunk = data[e.begin : e.end]
        if chunk.ctypes.data % _ITEMSIZE[e.dtype]:
            chunk = chunk.copy()  # a file from elsewhere with unaligned tensors
        out[e.name] = torch.from_numpy(chunk).view(dtype).reshape(e.shape)
    return out, header.metadata


def _header_length(first: bytes, size: int, where: str) -> int:
    """The header length the first 8 bytes give, checked against the file's ``size`` and the limit."""
    if size < 8 or len(first) < 8:
        raise ValueError(
            f"{where}: {size} bytes; a safetensors file has at least an 8-byte header length{_foreign_hint(first)}"
        )
    hlen = int.from_bytes(first, "little")
    if hlen > min(size - 8, MAX_HEADER_BYTES):
        raise ValueError(
            f"{where}: header length {hlen} exceeds the file ({size} bytes) or {MAX_HEADER_BYTES}{_foreign_hint(first)}"
        )
    return hlen


def _validate_header(first: bytes, raw: bytes, size: int, where: str) -> Header:
    """Checks every rule of the header ``raw`` of a ``size``-byte file whose first 8 bytes are ``first``.

    Dtype names, shapes (at most :data:`MAX_DIMS` dimensions, extent at most
    :data:`MAX_EXTENT`), byte counts, offsets inside the data area with no
    overlap, hole or trailing bytes, and metadata of strings.
    """
    if len(raw) != int.from_bytes(first, "little"):
        raise ValueError(f"{where}: ends inside its header (changed while being read?)")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad UTF-8 or syntax, a 5000-digit integer, nesting too deep
        raise ValueError(f"{where}: header is not valid JSON ({type(e).__name__}: {e}){_foreign_hint(first)}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where}: header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{where}: __metadata__ must map strings to strings")
    data_start = 8 + len(raw)
    data_size = size - data_start
    entries = []
    for key, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{where}: entry {_short(key)} must have exactly dtype, shape and data_offsets")
        dtype = entry["dtype"]
        if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
            raise ValueError(f"{where}: entry {_short(key)}: unknown dtype {_short(dtype)}")
        shape = entry["shape"]
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise ValueError(
                f"{where}: entry {_short(key)}: shape must be a list of at most {MAX_DIMS} non-negative integers,"
                f" found {_short(shape)}"
            )
        if math.prod(max(d, 1) for d in shape) > MAX_EXTENT:
            # Matters for empty tensors only (any other shape must match its bytes): torch computes their
            # strides all the same, and raises TypeError or RuntimeError, not ValueError, when they overflow.
            raise ValueError(
                f"{where}: entry {_short(key)}: shape {_short(shape)}: its non-zero dimensions multiply to more"
                f" than {MAX_EXTENT}"
            )
        offs = entry["data_offsets"]
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            or not 0 <= offs[0] <= offs[1] <= data_size
        ):
            raise ValueError(
                f"{where}: entry {_short(key)}: data_offsets {_short(offs)} outside the {data_size}-byte data area"
            )
        need = math.prod(shape) * _ITEMSIZE[dtype]
        if need != offs[1] - offs[0]:
            raise ValueError(
                f"{where}: entry {_short(key)}: shape {shape} of {dtype} needs {need} bytes,"
                f" data_offsets span {offs[1] - offs[0]}"
            )
        entries.append(Entry(key, dtype, tuple(shape), offs[0], offs[1]))
    pos = 0
    for entry in _by_offset(entries):
        if entry.begin != pos:
            what = "overlaps the previous entry" if entry.begin < pos else f"leaves a hole at byte {pos}"
            raise ValueError(f"{where}: entry {_short(entry.name)} {what}")
        pos = entry.end
    if pos != data_size:
        raise ValueError(f"{where}: {data_size - pos} bytes after the last tensor")
    return Header(entries, {str(k): v for k, v in metadata.items()}, data_start)


def foreign_format(head: bytes) -> str | None:
    """What a file that is not the expected format looks like it is, from its first bytes, or None.

    Used only to explain a file that already failed to parse: a valid
    safetensors file may begin with the same bytes as a pickle.
    """
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive (what torch.save writes)"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return f"a pickle stream (protocol {head[1]})"
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy .npy file"
    return None


def _by_offset(entries: list[Entry]) -> list[Entry]:
    return sorted(entries, key=lambda e: (e.begin, e.end, e.name))


def _foreign_hint(first: bytes) -> str:
    kind = foreign_format(first)
    if kind is None:
        return ""
    return f"; expected safetensors, found {kind}: preempt never unpickles (a pickle can run code)"


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 200 else f"{text[:160]}... ({len(text)} characters)"
