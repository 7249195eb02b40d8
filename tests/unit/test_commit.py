"""Unit tests for preempt.checkpoint.commit: hashed file I/O, names, and the atomic directory commit."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import xxhash

from preempt.checkpoint import aside, commit, deleter, hashed_io, names
from preempt.checkpoint.hashed_io import FileDigest


def _bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


# ------------------------------------------------------------------ write_file / read_file / hash_file


def test_write_file_digest_matches_hash_file_and_xxhash(tmp_path):
    chunks = [b"abc", bytearray(b"def"), memoryview(b"ghij"), np.arange(5, dtype=np.int32), _bytes(1000)]
    expected = b"abc" + b"def" + b"ghij" + np.arange(5, dtype=np.int32).tobytes() + _bytes(1000)
    path = tmp_path / "f.bin"
    d = hashed_io.write_file(path, chunks)
    assert path.read_bytes() == expected
    assert d == FileDigest(len(expected), xxhash.xxh3_128_hexdigest(expected))
    assert hashed_io.hash_file(path) == d
    buf, d2 = hashed_io.read_file(path)
    assert d2 == d
    assert buf.dtype == np.uint8 and buf.tobytes() == expected


def test_write_file_accepts_multidimensional_and_typed_buffers(tmp_path):
    arr = np.arange(12, dtype=np.float64).reshape(3, 4)
    mv = memoryview(np.arange(3, dtype=np.int16))
    d = hashed_io.write_file(tmp_path / "g.bin", [arr, mv])
    data = arr.tobytes() + np.arange(3, dtype=np.int16).tobytes()
    assert (tmp_path / "g.bin").read_bytes() == data
    assert d.size == len(data) == 96 + 6


def test_write_file_empty(tmp_path):
    d = hashed_io.write_file(tmp_path / "e", [])
    assert d == FileDigest(0, xxhash.xxh3_128_hexdigest(b""))
    assert hashed_io.write_file(tmp_path / "e2", [b"", b""]) == d
    assert hashed_io.hash_file(tmp_path / "e") == d
    buf, d3 = hashed_io.read_file(tmp_path / "e", expected_size=0)
    assert buf.size == 0 and d3 == d


def test_write_file_never_overwrites(tmp_path):
    path = tmp_path / "x"
    path.write_bytes(b"old")
    with pytest.raises(FileExistsError):
        hashed_io.write_file(path, [b"new"])
    assert path.read_bytes() == b"old"


def test_many_small_chunks_are_coalesced(tmp_path, monkeypatch):
    """Thousands of small chunks cost a handful of write(2) calls, and the bytes stay exact and in order."""
    small = [_bytes(random.Random(i).randint(0, 3000), seed=i) for i in range(3000)]
    big = _bytes(5 << 20, seed=-1)  # larger than the 4 MiB coalescing buffer: written on its own
    chunks = small[:1500] + [big] + small[1500:]
    expected = b"".join(chunks)
    calls = []
    real_write = os.write

    def counting_write(fd, data):
        calls.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", counting_write)
    d = hashed_io.write_file(tmp_path / "c.bin", chunks)
    monkeypatch.undo()
    assert (tmp_path / "c.bin").read_bytes() == expected
    assert d == FileDigest(len(expected), xxhash.xxh3_128_hexdigest(expected))
    assert len(calls) <= 8, calls
    assert sum(calls) == len(expected)


def test_partial_writes_and_small_chunks(tmp_path, monkeypatch):
    """Short writes from the OS and tiny chunk sizes still produce the exact file and digest."""
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data)[:3]))
    monkeypatch.setattr(hashed_io, "WRITE_CHUNK", 7)
    monkeypatch.setattr(hashed_io, "_COALESCE", 5)
    chunks = [_bytes(n, seed=n) for n in (0, 1, 4, 5, 6, 13, 50, 2)]
    expected = b"".join(chunks)
    d = hashed_io.write_file(tmp_path / "p.bin", chunks)
    monkeypatch.setattr(os, "write", real_write)
    assert (tmp_path / "p.bin").read_bytes() == expected
    assert d == FileDigest(len(expected), xxhash.xxh3_128_hexdigest(expected))
    # read_file and hash_file with a 7-byte chunk exercise their loops too.
    buf, d2 = hashed_io.read_file(tmp_path / "p.bin", expected_size=len(expected))
    assert buf.tobytes() == expected and d2 == d
    assert hashed_io.hash_file(tmp_path / "p.bin") == d


def test_read_file_wrong_size_raises_without_reading(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")

    def no_buffer(*a, **k):
        raise AssertionError("read_file mapped or allocated a buffer for a file of the wrong size")

    monkeypatch.setattr(hashed_io.mmap, "mmap", no_buffer)
    monkeypatch.setattr(hashed_io, "_fresh", no_buffer)
    monkeypatch.setattr(hashed_io, "_read_into_memory", no_buffer)
    with pytest.raises(ValueError, match="size 10 bytes, manifest says 11"):
        hashed_io.read_file(path, expected_size=11)
    with pytest.raises(ValueError, match="size 10 bytes, manifest says 0"):
        hashed_io.read_file(path, expected_size=0)
    monkeypatch.undo()
    buf, d = hashed_io.read_file(path, expected_size=10)
    assert buf.tobytes() == b"0123456789" and d.size == 10


def test_read_file_missing_raises_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        hashed_io.read_file(tmp_path / "nope")


def test_digest_detects_a_flipped_bit(tmp_path):
    data = bytearray(_bytes(4096, seed=9))
    d = hashed_io.write_file(tmp_path / "a", [data])
    data[1234] ^= 0x10
    (tmp_path / "b").write_bytes(data)
    assert hashed_io.hash_file(tmp_path / "b").xxh3_128 != d.xxh3_128
    assert hashed_io.hash_file(tmp_path / "b").size == d.size


def test_file_digest_to_json():
    assert FileDigest(5, "ab" * 16).to_json() == {"size": 5, "xxh3_128": "ab" * 16}


def test_dumps_json_is_canonical():
    assert hashed_io.dumps_json({"b": [1, 2.5], "a": {"y": None, "x": float("nan")}}) == (
        b'{"a":{"x":NaN,"y":null},"b":[1,2.5]}'
    )


# ------------------------------------------------------------------ names


@pytest.mark.parametrize("step, name", [(0, "step_000000000"), (120, "step_000000120"), (10**9, "step_1000000000")])
def test_checkpoint_name(step, name):
    assert names.checkpoint_name(step) == name
    assert names.parse_checkpoint_name(name) == step


def test_checkpoint_names_sort_by_step():
    steps = random.Random(1).sample(range(10**9), 200)
    spelled = [names.checkpoint_name(s) for s in steps]
    assert [names.parse_checkpoint_name(n) for n in sorted(spelled)] == sorted(steps)


@pytest.mark.parametrize(
    "name",
    [
        "step_",
        "step_abc",
        "step_1a",
        "Step_1",
        " step_1",
        "step_-1",
        "step_+1",
        "step_1.5",
        ".tmp-step_000000001-host-1-ab",
        ".replaced-step_000000001-host-1-ab",
        ".trash-step_000000001-host-1-ab",
        "quarantine",
        "complete.json",
        "step_000000001.1",
        "step_000000001\n",  # '$' in the regex also matches before a final newline
        "step_\u0661\u0662",  # Arabic-Indic digits: \d without re.ASCII matches them, int() accepts them
    ],
)
def test_parse_checkpoint_name_rejects_other_names(name):
    assert names.parse_checkpoint_name(name) is None


# ------------------------------------------------------------------ commit_dir


def _make_tmp(save_dir: Path, name: str, content: bytes) -> Path:
    tmp = commit.new_tmp_dir(save_dir, name)
    hashed_io.write_file(tmp / "data.bin", [content])
    hashed_io.write_file(tmp / names.MANIFEST, [b"{}"])
    return tmp


def test_new_tmp_dir_is_hidden_and_unique(tmp_path):
    a = commit.new_tmp_dir(tmp_path, "step_000000001")
    b = commit.new_tmp_dir(tmp_path, "step_000000001")
    assert a != b and a.is_dir() and b.is_dir()
    assert a.name.startswith(".tmp-step_000000001-") and a.parent == tmp_path
    assert names.parse_checkpoint_name(a.name) is None


def test_commit_dir_creates_final(tmp_path):
    tmp = _make_tmp(tmp_path, "step_000000005", b"v1")
    final, replaced = commit.commit_dir(tmp_path, tmp, "step_000000005")
    assert final == tmp_path / "step_000000005"
    assert replaced is None
    assert not tmp.exists()
    assert (final / "data.bin").read_bytes() == b"v1"
    assert sorted(os.listdir(tmp_path)) == ["step_000000005"]


def test_commit_dir_replaces_same_name(tmp_path):
    first, _ = commit.commit_dir(tmp_path, _make_tmp(tmp_path, "step_000000005", b"old"), "step_000000005")
    tmp2 = _make_tmp(tmp_path, "step_000000005", b"new")
    final, replaced = commit.commit_dir(tmp_path, tmp2, "step_000000005")
    assert final == first
    assert (final / "data.bin").read_bytes() == b"new"
    assert replaced is not None and replaced.parent == tmp_path
    assert replaced.name.startswith(".replaced-step_000000005-")
    assert (replaced / "data.bin").read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == sorted(["step_000000005", replaced.name])
    # The leftover is what recover() deletes: the replacement committed.
    rec = commit.recover(tmp_path)
    assert rec.restored == [] and rec.to_delete == [replaced]


# ------------------------------------------------------------------ recover


def _dir(path: Path, content: bytes = b"x") -> Path:
    path.mkdir()
    (path / "data.bin").write_bytes(content)
    return path


def test_recover_interprets_every_leftover(tmp_path):
    s = tmp_path
    _dir(s / "step_000000001", b"one")
    tmp2 = _dir(s / ".tmp-step_000000002-host-1-aa")
    repl1 = _dir(s / ".replaced-step_000000001-host-1-bb", b"old one")  # step_1 present: replacement committed
    _dir(s / ".replaced-step_000000003-host-1-cc", b"three")  # step_3 absent: died between steps 5 and 6
    trash = _dir(s / ".trash-step_000000000-host-1-dd")
    odd = _dir(s / ".replaced-garbage-host-1-ee")  # not a checkpoint name: nothing to restore
    (s / "quarantine").mkdir()
    (s / "complete.json").write_bytes(b"{}")
    _dir(s / "notes")

    rec = commit.recover(s)

    assert rec.restored == ["step_000000003"]
    assert sorted(rec.to_delete) == sorted([tmp2, repl1, trash, odd])
    assert (s / "step_000000003" / "data.bin").read_bytes() == b"three"
    assert not (s / ".replaced-step_000000003-host-1-cc").exists()
    assert (s / "step_000000001" / "data.bin").read_bytes() == b"one"
    # recover() renames but never deletes: the caller does that off the critical path.
    assert all(p.exists() for p in rec.to_delete)
    assert sorted(os.listdir(s)) == sorted(
        [
            "step_000000001",
            "step_000000003",
            tmp2.name,
            repl1.name,
            trash.name,
            odd.name,
            "quarantine",
            "complete.json",
            "notes",
        ]
    )


def test_recover_after_crash_between_rename_steps(tmp_path):
    """Simulates death after step 5 (old renamed aside) and before step 6 (tmp renamed in): the old one is back."""
    commit.commit_dir(tmp_path, _make_tmp(tmp_path, "step_000000007", b"valid"), "step_000000007")
    tmp = _make_tmp(tmp_path, "step_000000007", b"half")
    aside = tmp_path / f".replaced-step_000000007-{names.tag()}"
    os.rename(tmp_path / "step_000000007", aside)  # step 5, then the process dies
    rec = commit.recover(tmp_path)
    assert rec.restored == ["step_000000007"]
    assert rec.to_delete == [tmp]
    assert (tmp_path / "step_000000007" / "data.bin").read_bytes() == b"valid"
    assert not aside.exists()


def test_recover_passes_over_a_replaced_copy_deleted_since_the_listing(tmp_path, monkeypatch):
    """A run started while the last run's deleter finishes: an entry listed may be gone before it is looked at."""
    _dir(tmp_path / "step_000000001")
    kept = _dir(tmp_path / ".replaced-step_000000002-host-1-aa")  # step_2 absent: restored
    listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: [*listdir(p), ".replaced-step_000000001-host-1-gone"])
    rec = commit.recover(tmp_path)
    assert rec.restored == ["step_000000002"] and rec.to_delete == []
    assert not kept.exists() and (tmp_path / "step_000000002" / "data.bin").exists()


def test_a_replaced_checkpoint_leaves_recoverys_sight_before_it_is_deleted(tmp_path, monkeypatch):
    """Its step may be pruned before the slow delete ends; a start must not rename the half-deleted copy back."""
    from preempt.checkpoint.manager import CheckpointManager

    manager = CheckpointManager(tmp_path, keep_last=3)
    handed: list[Path] = []
    monkeypatch.setattr(manager._deleter, "submit", lambda paths: handed.extend(paths))
    model = __import__("torch").nn.Linear(2, 2)
    manager.save_state(step=1, model=model)
    manager.save_state(step=1, model=model)  # the final save of a step saved periodically
    assert [p.name.startswith(names.TRASH) for p in handed] == [True], handed
    assert [e for e in os.listdir(tmp_path) if e.startswith(names.REPLACED)] == []
    manager.close()


def test_recover_missing_or_clean_dir(tmp_path):
    assert commit.recover(tmp_path / "absent") == commit.Recovery()
    _dir(tmp_path / "step_000000001")
    assert commit.recover(tmp_path) == commit.Recovery([], [])


# ------------------------------------------------------------------ small helpers


def test_write_atomic_creates_and_replaces(tmp_path):
    path = tmp_path / "complete.json"
    commit.write_atomic(path, [b'{"a": 1}'])
    assert path.read_bytes() == b'{"a": 1}'
    d = commit.write_atomic(path, [b"sec", b"ond"])
    assert path.read_bytes() == b"second" and d == hashed_io.hash_file(path)
    assert os.listdir(tmp_path) == ["complete.json"]


def test_write_atomic_without_replace_keeps_an_existing_file(tmp_path):
    path = tmp_path / "model.safetensors"
    commit.write_atomic(path, [b"new"], replace=False)
    with pytest.raises(FileExistsError):
        commit.write_atomic(path, [b"other"], replace=False)
    assert path.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["model.safetensors"], "no temporary file is left behind"


def test_move_aside_never_overwrites(tmp_path):
    dests = []
    for i in range(3):
        src = _dir(tmp_path / "step_000000004", f"v{i}".encode())
        dests.append(aside.move_aside(tmp_path, src, names.QUARANTINE))
        assert not src.exists()
    q = tmp_path / "quarantine"
    assert dests == [q / "step_000000004", q / "step_000000004.1", q / "step_000000004.2"]
    assert [(d / "data.bin").read_bytes() for d in dests] == [b"v0", b"v1", b"v2"]


def test_trash_hides_then_remove_tree_deletes(tmp_path):
    src = _dir(tmp_path / "step_000000002")
    (src / "sub").mkdir()
    (src / "sub" / "f").write_bytes(b"1")
    t = commit.trash(tmp_path, src)
    assert t.parent == tmp_path and t.name.startswith(".trash-step_000000002-")
    assert not src.exists() and (t / "sub" / "f").exists()
    assert names.parse_checkpoint_name(t.name) is None
    deleter.remove_tree(t)
    assert not t.exists()
    f = tmp_path / "file"
    f.write_bytes(b"")
    deleter.remove_tree(f)
    assert not f.exists()
    deleter.remove_tree(tmp_path / "missing")  # no error


def test_remove_tree_does_not_follow_symlinks(tmp_path):
    target = _dir(tmp_path / "keep")
    link = tmp_path / "link"
    link.symlink_to(target)
    deleter.remove_tree(link)
    assert not link.exists() and not link.is_symlink()
    assert (target / "data.bin").exists()


def test_fsync_dir(tmp_path):
    hashed_io.fsync_dir(tmp_path)
    with pytest.raises(FileNotFoundError):
        hashed_io.fsync_dir(tmp_path / "absent")


def _synced(monkeypatch, barrier=None):
    """Records what commit makes durable (files by name, directories by path); with ``barrier``, each sync waits at
    it: syncs issued one after another would never meet there (the barrier breaks on its timeout)."""
    import threading

    done: list[str] = []
    lock = threading.Lock()

    def sync_file(fd):
        name = os.readlink(f"/proc/self/fd/{fd}")
        if barrier is not None:
            barrier.wait()
        with lock:
            done.append(Path(name).name)

    real_dir = hashed_io.fsync_dir

    def sync_dir(path):
        if barrier is not None and Path(path).name.startswith(names.TMP_PREFIX):  # a checkpoint's, not the save_dir
            barrier.wait()
        with lock:
            done.append(f"dir:{Path(path).name}")
        real_dir(path)

    monkeypatch.setattr(hashed_io, "_fdatasync", sync_file)
    monkeypatch.setattr(hashed_io, "fsync_dir", sync_dir)
    return done


def test_a_checkpoint_syncs_its_files_and_directory_together_then_the_save_dir(tmp_path, monkeypatch):
    import threading

    import torch

    from preempt import CheckpointManager

    manager = CheckpointManager(tmp_path)
    manager.prepare()
    model = torch.nn.Linear(8, 8)
    # model.safetensors, state.safetensors, state.json, manifest.json and the temporary directory: issued together
    done = _synced(monkeypatch, threading.Barrier(5, timeout=60))
    info = manager.save_state(step=1, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    first = sorted(done[:5])
    assert first[0].startswith(f"dir:{names.TMP_PREFIX}step_000000001")
    assert first[1:] == ["manifest.json", "model.safetensors", "state.json", "state.safetensors"]
    assert done[5:] == [f"dir:{tmp_path.name}"]  # after the rename, the save_dir's entry
    assert manager.verify(info) == []


def test_sync_together_raises_the_first_failure_after_waiting_for_the_others(tmp_path):
    ok = tmp_path / "ok"
    ok.write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="absent"):
        hashed_io.sync_together([ok, tmp_path / "absent", tmp_path / "absent2"], [tmp_path])
    hashed_io.sync_together([ok], [tmp_path])
    hashed_io.sync_together([], [])
