"""Several files of one checkpoint read at once (preempt.checkpoint.files.read_all): what is returned, which error is
raised when several files fail, and that the reads overlap."""

from __future__ import annotations

import threading

import pytest
import xxhash

from preempt.checkpoint import files, hashed_io
from preempt.checkpoint.hashed_io import FileDigest
from preempt.errors import CorruptCheckpointError


def _files(tmp_path, contents: dict[str, bytes]) -> dict[str, FileDigest]:
    listed = {}
    for name, data in contents.items():
        (tmp_path / name).write_bytes(data)
        listed[name] = FileDigest(len(data), xxhash.xxh3_128_hexdigest(data))
    return listed


def test_the_kept_files_bytes_are_returned_and_the_checked_ones_only_verified(tmp_path):
    listed = _files(tmp_path, {"a": b"a" * 10, "b": b"bb" * 700, "c": b"c"})
    got = files.read_all(tmp_path, listed, ["a", "b"], ["c"])
    assert sorted(got) == ["a", "b"] and bytes(got["a"]) == b"a" * 10 and bytes(got["b"]) == b"bb" * 700
    assert bytes(files.read_all(tmp_path, listed, ["c"])["c"]) == b"c"  # one file alone: read in this thread


def test_of_several_damaged_files_the_first_in_order_is_named_whatever_ends_first(tmp_path):
    listed = _files(tmp_path, {"big": b"x" * (4 << 20), "small": b"y" * 10, "ok": b"z"})
    (tmp_path / "big").write_bytes(b"X" * (4 << 20))  # same size, other bytes: found only at the end of its read
    (tmp_path / "small").write_bytes(b"Y" * 10)  # found at once
    with pytest.raises(CorruptCheckpointError, match="big: xxh3 mismatch"):
        files.read_all(tmp_path, listed, ["ok", "big", "small"])
    with pytest.raises(CorruptCheckpointError, match="small: xxh3 mismatch"):
        files.read_all(tmp_path, listed, ["small", "big"])
    with pytest.raises(CorruptCheckpointError, match="lists no absent"):
        files.read_all(tmp_path, listed, ["ok", "absent"])


def test_the_files_are_read_side_by_side(tmp_path, monkeypatch):
    listed = _files(tmp_path, {f"f{i}": bytes([i]) * 100 for i in range(files.READERS)})
    meet = threading.Barrier(files.READERS, timeout=60)  # read one after the other, they would never all meet here
    real = hashed_io.read_file

    def read(path, *args, **kwargs):
        meet.wait()
        return real(path, *args, **kwargs)

    monkeypatch.setattr(hashed_io, "read_file", read)
    got = files.read_all(tmp_path, listed, sorted(listed))
    assert {name: bytes(buf) for name, buf in got.items()} == {f"f{i}": bytes([i]) * 100 for i in range(files.READERS)}
