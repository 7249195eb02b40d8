"""Unit tests for preempt.checkpoint.tensorfile: streaming safetensors writer and strict in-memory reader."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch as st
import torch

from preempt.checkpoint import hashed_io, tensorfile

DTYPES = sorted(tensorfile._dtypes()[0].items())  # every dtype of the table that this torch has
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def write_and_parse(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None):
    """The real path: stream to disk with write_file, read back verified, parse."""
    written = hashed_io.write_file(path, tensorfile.chunks(tensors, meta))
    buf, read = hashed_io.read_file(path, expected_size=written.size)
    assert read == written
    return tensorfile.parse(buf, str(path))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor's values in row-major order (NaN-safe, dtype-agnostic comparison)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.equal(bits(a), bits(b))


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infinities, denormals, extremes) of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def raw_file(header: dict[str, Any], data: bytes, pad: bool = True) -> np.ndarray:
    head = json.dumps(header).encode()
    if pad:
        head += b" " * (-len(head) % 8)
    return np.frombuffer(len(head).to_bytes(8, "little") + head + data, dtype=np.uint8).copy()


# ------------------------------------------------------------------ round trips


def test_table_has_the_core_dtypes():
    names = set(tensorfile._dtypes()[0])
    assert {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "C64"} <= names
    for name, dtype in tensorfile._dtypes()[0].items():
        assert tensorfile.dtype_name(dtype) == name
        assert tensorfile._ITEMSIZE[name] == dtype.itemsize  # the torch-free table of sizes agrees with torch
    assert tensorfile.dtype_name(torch.complex128) is None


@pytest.mark.parametrize("name, dtype", DTYPES, ids=[n for n, _ in DTYPES])
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (3, 5)], ids=str)
def test_round_trip_every_dtype_and_shape(tmp_path, name, dtype, shape):
    t = random_tensor(dtype, shape, seed=len(shape))
    out, meta = write_and_parse(tmp_path / "t.safetensors", {"x": t})
    assert meta == {}
    assert list(out) == ["x"]
    assert_bitwise_equal(out["x"], t)


def test_round_trip_all_dtypes_in_one_file(tmp_path):
    """Mixed element sizes in one file: each tensor lands aligned and intact."""
    tensors = {f"t_{name}": random_tensor(dtype, (5, 3), seed=i) for i, (name, dtype) in enumerate(DTYPES)}
    tensors["scalar"] = torch.tensor(3.25, dtype=torch.float64)
    tensors["empty"] = torch.empty(0, 4, dtype=torch.int16)
    out, _ = write_and_parse(tmp_path / "t.safetensors", tensors, {"format": "pt"})
    assert out.keys() == tensors.keys()
    for k, t in tensors.items():
        assert_bitwise_equal(out[k], t)


def test_layout_is_aligned_and_sorted(tmp_path):
    """Header padded to 8; tensors by descending element size then name, each offset aligned to its size."""
    tensors = {
        "b8": torch.ones(3, dtype=torch.int8),
        "a8": torch.ones(1, dtype=torch.uint8),
        "f16": torch.ones(3, dtype=torch.float16),
        "d": torch.ones(1, dtype=torch.float64),
        "c": torch.ones(2, dtype=torch.complex64),
        "f": torch.ones(5, dtype=torch.float32),
    }
    data = b"".join(bytes(p) for p in tensorfile.chunks(tensors))
    hlen = int.from_bytes(data[:8], "little")
    assert hlen % 8 == 0
    header = json.loads(data[8 : 8 + hlen])
    assert list(header) == ["c", "d", "f", "f16", "a8", "b8"]
    for key, entry in header.items():
        start = entry["data_offsets"][0]
        assert start % tensors[key].element_size() == 0, key
    assert len(data) == 8 + hlen + sum(t.numel() * t.element_size() for t in tensors.values())


def test_non_contiguous_tensors(tmp_path):
    """Transposed, strided, expanded, conjugated and negated views are saved as their values."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    c = torch.randn(3, 2, dtype=torch.complex64)
    views = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "conj": c.conj(),
        "neg": c.conj().imag,  # a negative view
        "offset": base[2:, 3:],
    }
    assert not any(v.is_contiguous() for k, v in views.items() if k not in ("conj", "neg"))
    out, _ = write_and_parse(tmp_path / "v.safetensors", views)
    for k, v in views.items():
        assert out[k].shape == v.shape
        assert torch.equal(out[k], v.resolve_conj().resolve_neg()), k
    assert torch.equal(out["transposed"], torch.arange(24.0).reshape(4, 6).t())


def test_requires_grad_tensor(tmp_path):
    p = torch.nn.Parameter(torch.randn(3, 4))
    y = p * 2  # a non-leaf with a graph
    out, _ = write_and_parse(tmp_path / "g.safetensors", {"p": p, "y": y})
    assert torch.equal(out["p"], p.detach()) and torch.equal(out["y"], y.detach())
    assert not out["p"].requires_grad


def test_metadata_round_trip_as_strings(tmp_path):
    out, meta = write_and_parse(tmp_path / "m.safetensors", {"x": torch.ones(1)}, {"format": "pt", "n": 3})
    assert meta == {"format": "pt", "n": "3"}


def test_empty_file_round_trip(tmp_path):
    out, meta = write_and_parse(tmp_path / "e.safetensors", {})
    assert out == {} and meta == {}


def test_parse_returns_views_into_the_buffer(tmp_path):
    """No copy: tensors alias the verified buffer."""
    path = tmp_path / "a.safetensors"
    hashed_io.write_file(path, tensorfile.chunks({"x": torch.arange(4, dtype=torch.int32)}))
    buf, _ = hashed_io.read_file(path)
    out, _ = tensorfile.parse(buf, str(path))
    start = buf.ctypes.data
    assert start <= out["x"].data_ptr() < start + buf.size
    buf[-4:] = np.frombuffer(np.int32(99).tobytes(), dtype=np.uint8)
    assert out["x"].tolist() == [0, 1, 2, 99]


def test_unaligned_header_from_elsewhere_still_parses():
    """A writer that does not pad the header leaves tensors unaligned; values still come out right."""
    values = np.array([1.5, -2.0, 3.25], dtype=np.float64)
    header = {"x": {"dtype": "F64", "shape": [3], "data_offsets": [0, 24]}}
    buf = raw_file(header, values.tobytes(), pad=False)
    assert (8 + int.from_bytes(buf[:8].tobytes(), "little")) % 8 != 0
    out, _ = tensorfile.parse(buf, "u.safetensors")
    assert out["x"].tolist() == [1.5, -2.0, 3.25]


# ------------------------------------------------------------------ safetensors interop


@pytest.mark.parametrize("name, dtype", DTYPES, ids=[n for n, _ in DTYPES])
def test_our_files_load_with_safetensors(tmp_path, name, dtype):
    tensors = {
        "a": random_tensor(dtype, (4, 3), seed=1),
        "scalar": random_tensor(dtype, (), seed=2),
        "empty": random_tensor(dtype, (0, 2), seed=3),
        "t": random_tensor(dtype, (3, 5), seed=4).t(),
    }
    path = tmp_path / "ours.safetensors"
    hashed_io.write_file(path, tensorfile.chunks(tensors, {"format": "pt"}))
    loaded = st.load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for k, t in tensors.items():
        assert_bitwise_equal(loaded[k], t)
    with st.safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


@pytest.mark.parametrize("name, dtype", DTYPES, ids=[n for n, _ in DTYPES])
def test_safetensors_files_parse_with_ours(tmp_path, name, dtype):
    tensors = {
        "w": random_tensor(dtype, (6, 2), seed=5),
        "s": random_tensor(dtype, (), seed=6),
        "z": random_tensor(dtype, (2, 0), seed=7),
        "i": torch.arange(5, dtype=torch.int64),
        "h": torch.ones(3, dtype=torch.bfloat16),
    }
    path = tmp_path / "theirs.safetensors"
    st.save_file(tensors, str(path), metadata={"k": "v"})
    buf, _ = hashed_io.read_file(path)
    out, meta = tensorfile.parse(buf, str(path))
    assert meta == {"k": "v"}
    assert out.keys() == tensors.keys()
    for k, t in tensors.items():
        assert_bitwise_equal(out[k], t)


# ------------------------------------------------------------------ check_tensor


def test_check_tensor_rejects_unsupported_with_key():
    with pytest.raises(TypeError, match=r"^opt\.s: torch\.sparse_coo"):
        tensorfile.check_tensor("opt.s", torch.eye(3).to_sparse())
    with pytest.raises(TypeError, match=r"^m\.w: a meta tensor"):
        tensorfile.check_tensor("m.w", torch.empty(2, device="meta"))
    with pytest.raises(TypeError, match=r"^c: dtype torch\.complex128 has no safetensors equivalent"):
        tensorfile.check_tensor("c", torch.zeros(2, dtype=torch.complex128))
    tensorfile.check_tensor("ok", torch.zeros(2))


def test_chunks_rejects_unsupported_dtype_naming_key():
    with pytest.raises(TypeError, match="^bad:"):
        list(tensorfile.chunks({"good": torch.ones(1), "bad": torch.zeros(1, dtype=torch.complex128)}))


# ------------------------------------------------------------------ malformed input

GOOD_HEADER = {
    "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
    "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
}
GOOD_DATA = np.arange(6, dtype=np.float32).tobytes()


def with_entry(key: str, **changes: Any) -> dict[str, Any]:
    h = json.loads(json.dumps(GOOD_HEADER))
    h[key].update(changes)
    return h


def test_good_raw_file_parses():
    """The baseline the malformed cases start from is valid."""
    out, _ = tensorfile.parse(raw_file(GOOD_HEADER, GOOD_DATA), "f")
    assert out["a"].tolist() == [0, 1, 2, 3] and out["b"].tolist() == [4, 5]


def _rejects(buf: np.ndarray, message: str) -> None:
    """Both readers refuse ``buf`` with the same message: parse() in memory, read_header() from a file."""
    with pytest.raises(ValueError, match=message) as e:
        tensorfile.parse(buf, "ckpt/state.safetensors")
    assert str(e.value).startswith("ckpt/state.safetensors: ")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "state.safetensors"
        path.write_bytes(buf.tobytes())
        with pytest.raises(ValueError) as from_file:
            tensorfile.read_header(path)
    assert str(from_file.value) == str(e.value).replace("ckpt/state.safetensors", str(path), 1)


def test_read_header_reads_the_header_alone(tmp_path):
    """Entries in header order, offsets from the data area, metadata; the data itself is never read."""
    path = tmp_path / "m.safetensors"
    hashed_io.write_file(
        path, tensorfile.chunks({"b": torch.ones(2, 3), "a": torch.zeros(4, dtype=torch.int8)}, {"k": "v"})
    )
    header = tensorfile.read_header(path)
    assert header.metadata == {"k": "v"}
    assert [(e.name, e.dtype, e.shape, e.begin, e.end) for e in header.entries] == [
        ("b", "F32", (2, 3), 0, 24),
        ("a", "I8", (4,), 24, 28),
    ]
    assert header.data_start + 28 == path.stat().st_size
    with open(path, "r+b") as f:  # damage the data: the header does not see it
        f.seek(header.data_start)
        f.write(b"\xff" * 28)
    assert tensorfile.read_header(path) == header


@pytest.mark.parametrize("n", [0, 1, 7])
def test_too_short(n):
    _rejects(np.zeros(n, dtype=np.uint8), f"{n} bytes; a safetensors file has at least")


def test_header_length_larger_than_file():
    buf = raw_file(GOOD_HEADER, GOOD_DATA)
    total = buf.size
    buf[:8] = np.frombuffer((total - 8 + 1).to_bytes(8, "little"), dtype=np.uint8)
    _rejects(buf, f"header length {total - 7} exceeds the file")
    buf[:8] = np.frombuffer((2**64 - 1).to_bytes(8, "little"), dtype=np.uint8)
    _rejects(buf, "exceeds the file")


def test_header_length_over_the_limit(monkeypatch):
    buf = raw_file(GOOD_HEADER, GOOD_DATA)
    monkeypatch.setattr(tensorfile, "MAX_HEADER_BYTES", 16)
    _rejects(buf, "exceeds the file")


@pytest.mark.parametrize("head", [b"{not json}     ", b"\xff\xfe\x00\x01" * 4, b"", b'{"a": 1'])
def test_header_not_json(head):
    buf = np.frombuffer(len(head).to_bytes(8, "little") + head + GOOD_DATA, dtype=np.uint8).copy()
    _rejects(buf, "header is not valid JSON")


def test_header_not_an_object():
    _rejects(raw_file([1, 2], b""), "header is not a JSON object")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["F99", "f32", "", 5, None, "C128"])
def test_unknown_dtype(dtype):
    _rejects(raw_file(with_entry("a", dtype=dtype), GOOD_DATA), r"entry 'a': unknown dtype")


@pytest.mark.parametrize(
    "offsets",
    [[0, 10000], [0, 25], [-4, 12], [16, 0], [0], [0, 16, 24], "0,16", [0.0, 16.0], [False, 16]],
    ids=str,
)
def test_offsets_outside_the_data(offsets):
    _rejects(raw_file(with_entry("a", data_offsets=offsets), GOOD_DATA), r"entry 'a': data_offsets")


def test_overlapping_entries():
    header = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
    }
    _rejects(raw_file(header, GOOD_DATA[:16]), "overlaps the previous entry")


def test_two_entries_on_the_same_bytes():
    header = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "I32", "shape": [4], "data_offsets": [0, 16]},
    }
    _rejects(raw_file(header, GOOD_DATA[:16]), "overlaps the previous entry")


def test_hole_between_entries():
    header = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [20, 28]},
    }
    _rejects(raw_file(header, GOOD_DATA + b"\0" * 4), "entry 'b' leaves a hole at byte 16")


def test_hole_at_the_start():
    header = {"b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}
    _rejects(raw_file(header, GOOD_DATA[:16]), "leaves a hole at byte 0")


@pytest.mark.parametrize("extra", [1, 8, 100])
def test_trailing_bytes(extra):
    _rejects(raw_file(GOOD_HEADER, GOOD_DATA + b"\0" * extra), f"{extra} bytes after the last tensor")


@pytest.mark.parametrize(
    "changes",
    [
        dict(shape=[5]),
        dict(shape=[2]),
        dict(shape=[]),
        dict(shape=[2, 2, 2]),
        dict(dtype="F64"),
        dict(dtype="BF16"),
    ],
    ids=str,
)
def test_shape_size_mismatch(changes):
    _rejects(raw_file(with_entry("a", **changes), GOOD_DATA), r"entry 'a': shape .* needs \d+ bytes")


@pytest.mark.parametrize("shape", [[-1, -4], [2.0, 2], "4", [True, 4], None])
def test_bad_shapes(shape):
    _rejects(raw_file(with_entry("a", shape=shape), GOOD_DATA), r"entry 'a': shape must be a list")


@pytest.mark.parametrize("entry", [{"dtype": "F32", "shape": [4]}, [1, 2], "x"])
def test_bad_entries(entry):
    header = dict(GOOD_HEADER)
    header["a"] = entry
    _rejects(raw_file(header, GOOD_DATA), "entry 'a' must have exactly dtype, shape and data_offsets")


def test_extra_field_in_entry():
    _rejects(raw_file(with_entry("a", extra=1), GOOD_DATA), "must have exactly")


@pytest.mark.parametrize("meta", [{"k": 1}, [1], "x", {"k": None}])
def test_bad_metadata(meta):
    header = dict(GOOD_HEADER, __metadata__=meta)
    _rejects(raw_file(header, GOOD_DATA), "__metadata__ must map strings to strings")


def test_truncated_file_rejected():
    """A file cut anywhere inside its data area is rejected, never parsed as shorter tensors."""
    full = raw_file(GOOD_HEADER, GOOD_DATA)
    hlen = int.from_bytes(full[:8].tobytes(), "little")
    for n in range(8 + hlen, full.size):
        _rejects(full[:n].copy(), "data_offsets|bytes after the last tensor")


# ------------------------------------------------------------------ hostile input


@pytest.mark.parametrize(
    "shape", [[0, 1 << 63], [0, 1 << 70], [1 << 31, 0, 1 << 31, 4], [0, 1 << 62], [1 << 31, 0, 1 << 31]], ids=str
)
def test_empty_tensor_whose_strides_overflow_is_refused(shape):
    """Any other shape must match its bytes; an empty one must not crash torch.empty() (TypeError, RuntimeError)."""
    header = {"e": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}
    extent = 1
    for d in shape:
        extent *= max(d, 1)
    if extent <= tensorfile.MAX_EXTENT:
        out, _ = tensorfile.parse(raw_file(header, b""), "f")
        assert out["e"].numel() == 0 and list(out["e"].shape) == shape
    else:
        _rejects(raw_file(header, b""), r"entry 'e': shape \[.*\]: its non-zero dimensions multiply to more than")


def test_too_many_dimensions_are_refused():
    ok = {"e": {"dtype": "F32", "shape": [1] * 64, "data_offsets": [0, 4]}}
    assert tensorfile.parse(raw_file(ok, b"\0" * 4), "f")[0]["e"].dim() == 64
    bad = {"e": {"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}}
    _rejects(raw_file(bad, b"\0" * 4), r"entry 'e': shape must be a list of at most 64")


@pytest.mark.parametrize(
    "head",
    [b"[" * 100_000, b'{"a": ' + b"1" * 5000 + b"}"],
    ids=["deep", "huge-int"],
)
def test_header_json_that_python_cannot_hold_is_a_value_error(head):
    buf = np.frombuffer(len(head).to_bytes(8, "little") + head, dtype=np.uint8).copy()
    _rejects(buf, r"header is not valid JSON \((RecursionError|ValueError)")


def test_long_keys_are_cut_in_messages():
    header = {"k" * 100_000: {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}
    with pytest.raises(ValueError, match=r"entry 'kkk.*\(100002 characters\): unknown dtype 'F99'") as e:
        tensorfile.parse(raw_file(header, b"\0" * 4), "f")
    assert len(str(e.value)) < 400


def _pickle_payload() -> bytes:
    import pickle

    return pickle.dumps({"weight": [1.0, 2.0]})


def _torch_save_payload() -> bytes:
    import io

    f = io.BytesIO()
    torch.save({"weight": torch.ones(3)}, f)
    return f.getvalue()


@pytest.mark.parametrize(
    "make, found",
    [
        (_pickle_payload, r"found a pickle stream \(protocol \d\): preempt never unpickles"),
        (_torch_save_payload, r"found a zip archive \(what torch.save writes\)"),
        (lambda: b"\x80\x04K\x01.", r"5 bytes; .*found a pickle stream"),
        (lambda: b"\x93NUMPY\x01\x00v\x00{'descr': '<f4'}", r"found a NumPy .npy file"),
    ],
    ids=["pickle", "torch.save", "tiny-pickle", "npy"],
)
def test_a_pickle_or_torch_save_file_is_named_as_such(make, found):
    _rejects(np.frombuffer(make(), dtype=np.uint8).copy(), found)


def test_a_valid_file_that_starts_like_a_pickle_still_parses():
    """A header of 0x0280 bytes starts with 80 02, the bytes of a protocol-2 pickle: the sniffing is only a hint."""
    key = "k" * (0x280 - len(json.dumps({"": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}})))
    buf = raw_file({key: {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}, b"", pad=False)
    assert buf[:2].tolist() == [0x80, 0x02]
    assert list(tensorfile.parse(buf, "f")[0]) == [key]
    assert tensorfile.foreign_format(buf[:8].tobytes()) == "a pickle stream (protocol 2)"
