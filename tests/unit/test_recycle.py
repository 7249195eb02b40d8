"""Recycling: the next save writes over a pruned checkpoint's files in place, and never into anything else.

The point is speed on disks where new blocks are slow (bench/README.md); what these tests hold is that it changes
nothing a reader sees (bit-exact load, verify ok, nothing extra in the checkpoint), never writes outside save_dir
through a planted symlink, hard link or FIFO, and never keeps more than one pruned checkpoint's files.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import direct_io_supported
from test_checkpoint import objects

from preempt.checkpoint import cancel, hashed_io, recycle
from preempt.checkpoint.manager import CheckpointManager

pytestmark = pytest.mark.timeout(60)  # a FIFO opened the wrong way blocks forever: fail instead


def names(d: Path) -> list[str]:
    return sorted(os.listdir(d))


def pool_of(d: Path) -> Path:
    (pool,) = recycle.pools(d)
    return pool


def test_the_next_save_writes_over_the_pruned_files_in_place(tmp_path):
    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path, keep_last=1, carry_unchanged=False)  # step 2 would carry step 1's files
    m.prepare()
    m.save_state(step=1, model=model, optimizer=opt)
    inodes = {f: os.stat(tmp_path / "step_000000001" / f).st_ino for f in ("model.safetensors", "state.safetensors")}
    m.save_state(step=2, model=model, optimizer=opt)  # prunes step 1: its files become the pool
    pool = pool_of(tmp_path)
    assert {f: os.stat(pool / f).st_ino for f in inodes} == inodes
    with torch.no_grad():
        model[0].weight.add_(1.0)  # a different state, same sizes (not through .data: carrying would not see it)
    info = m.save_state(step=3, model=model, optimizer=opt)
    # the same inodes (the same disk blocks) now hold step 3; the pool is step 2's files
    assert {f: os.stat(info.path / f).st_ino for f in inodes} == inodes
    assert m.verify(info) == []
    loaded, got = CheckpointManager(tmp_path, owner=False).load("latest")
    assert loaded.step == 3
    for k, v in model.state_dict().items():
        assert torch.equal(got.model[k], v), k
    assert names(tmp_path)[1:] == ["step_000000003"] and names(tmp_path)[0].startswith(".recycle-")


def test_a_bigger_recycled_file_is_cut_and_extra_files_go(tmp_path):
    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path, keep_last=1)
    m.prepare()
    pool = tmp_path / ".recycle-by-hand"
    pool.mkdir()
    (pool / "model.safetensors").write_bytes(os.urandom(1 << 20))  # larger than the new content
    (pool / "rank_1.safetensors").write_bytes(b"a file the new checkpoint does not have")
    (pool / "sub").mkdir()
    (pool / "sub" / "x").write_bytes(b"x")
    ino = os.stat(pool / "model.safetensors").st_ino
    info = m.save_state(step=1, model=model, optimizer=opt)
    assert os.stat(info.path / "model.safetensors").st_ino == ino
    listed = json.loads((info.path / "manifest.json").read_text())["files"]
    assert names(info.path) == sorted([*listed, "manifest.json"])
    assert os.path.getsize(info.path / "model.safetensors") == listed["model.safetensors"]["size"] < 1 << 20
    assert m.verify(info) == []
    assert not recycle.pools(tmp_path)


def test_planted_links_and_fifos_in_a_pool_are_replaced_never_written_through(tmp_path):
    save_dir, outside = tmp_path / "run", tmp_path / "outside"
    save_dir.mkdir()
    outside.mkdir()
    target = outside / "victim"
    target.write_bytes(b"precious")
    pool = save_dir / ".recycle-planted"
    pool.mkdir()
    os.symlink(target, pool / "model.safetensors")
    os.link(target, pool / "state.safetensors")  # a second name of the file outside
    os.mkfifo(pool / "state.json")
    (pool / "manifest.json").mkdir()
    model, opt, *_ = objects()
    m = CheckpointManager(save_dir, keep_last=1)
    m.prepare()
    info = m.save_state(step=1, model=model, optimizer=opt)
    assert target.read_bytes() == b"precious" and os.stat(target).st_nlink == 1
    assert m.verify(info) == []
    for f in names(info.path):
        assert (info.path / f).is_file() and not (info.path / f).is_symlink(), f


def test_a_pool_that_is_a_symlink_is_never_taken(tmp_path):
    save_dir, outside = tmp_path / "run", tmp_path / "outside"
    save_dir.mkdir()
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"precious")
    os.symlink(outside, save_dir / ".recycle-link")
    model, opt, *_ = objects()
    m = CheckpointManager(save_dir, keep_last=1)
    assert recycle.pools(save_dir) == []
    m.prepare()  # the start removes the link (not what it points at)
    assert m.wait(10)
    m.save_state(step=1, model=model, optimizer=opt)
    assert (outside / "model.safetensors").read_bytes() == b"precious" and names(outside) == ["model.safetensors"]
    assert not (save_dir / ".recycle-link").is_symlink()


def test_the_start_keeps_the_fullest_pool_and_renames_the_others_out_of_reach(tmp_path):
    for size, name in ((300, ".recycle-whole"), (100, ".recycle-part"), (200, ".recycle-newer-part")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x" * size)
    assert [p.name for p in recycle.pools(tmp_path)] == [".recycle-whole", ".recycle-newer-part", ".recycle-part"]
    m = CheckpointManager(tmp_path)
    m.prepare()
    assert m.wait(10)
    assert names(tmp_path) == [".recycle-whole"]  # the most to write over

    off = CheckpointManager(tmp_path, recycle_files=False)
    off.prepare()
    assert off.wait(10)
    assert names(tmp_path) == []


def test_recycling_off_deletes_what_it_prunes(tmp_path):
    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path, keep_last=1, recycle_files=False)
    m.prepare()
    for step in (1, 2, 3):
        m.save_state(step=step, model=model, optimizer=opt)
    assert m.wait(10)
    assert names(tmp_path) == ["step_000000003"]


def test_never_more_than_one_checkpoint_of_extra_space(tmp_path, monkeypatch):
    """At every moment a save is writing, the directories holding checkpoint data number at most keep_last + 1."""
    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path, keep_last=2)
    m.prepare()
    seen = []
    real = hashed_io.write_file

    def counting(path, chunks, **kw):
        seen.append(len([e for e in os.listdir(tmp_path) if not e.startswith(".trash-")]))
        return real(path, chunks, **kw)

    monkeypatch.setattr(hashed_io, "write_file", counting)
    for step in range(1, 8):
        m.save_state(step=step, model=model, optimizer=opt)
        m.wait(10)
    assert max(seen) == 3  # 2 kept + the one being written (the pool is what it writes into)
    assert len(os.listdir(tmp_path)) == 3  # 2 kept + the pool


def test_the_options_are_checked():
    from preempt.checkpoint.retention import RetentionPolicy
    from preempt.run.config import RunConfig

    with pytest.raises(ValueError, match="recycle_files: expected True or False"):
        RetentionPolicy(recycle="yes")  # type: ignore[arg-type]
    assert RunConfig(recycle_files=0).retention().recycle is False


def test_ls_shows_the_pool_and_prune_deletes_it(tmp_path):
    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path, keep_last=1)
    m.prepare()
    m.save_state(step=1, model=model, optimizer=opt)
    m.save_state(step=2, model=model, optimizer=opt)
    m.close(10)
    pool = pool_of(tmp_path)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "preempt", *args], capture_output=True, text=True, timeout=60)

    out = cli("ls", str(tmp_path))
    assert out.returncode == 0 and f"{pool.name}/:" in out.stdout and "for the next save to write over" in out.stdout
    doc = json.loads(cli("ls", str(tmp_path), "--json").stdout)
    assert [p["name"] for p in doc["recycled"]] == [pool.name] and doc["recycled"][0]["bytes"] > 0
    dry = cli("prune", str(tmp_path), "--keep-last", "1")
    assert "and 1 recycling directory" in dry.stdout and pool.is_dir()
    done = cli("prune", str(tmp_path), "--keep-last", "1", "--yes")
    assert done.returncode == 0, done.stderr
    assert [n for n in names(tmp_path) if n != "lock"] == ["step_000000002"]


def test_a_cancelled_write_is_kept_for_the_next_save_and_a_failed_one_is_not(tmp_path, monkeypatch):
    import threading

    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path, keep_last=2, carry_unchanged=False)  # the same state, written each time
    m.prepare()
    m.save_state(step=1, model=model, optimizer=opt)
    stop = threading.Event()
    stop.set()  # as a stop does to a periodic write in flight
    with cancel.cancellable(stop), pytest.raises(cancel.WriteCancelled):
        m.save_state(step=2, model=model, optimizer=opt)
    pool = pool_of(tmp_path)  # the cancelled write's files (nothing was pruned yet)
    inode = os.stat(pool / "model.safetensors").st_ino
    info = m.save_state(step=2, model=model, optimizer=opt)  # the stop's save writes over the cancelled one's files
    assert os.stat(info.path / "model.safetensors").st_ino == inode and m.verify(info) == []
    assert names(tmp_path) == ["step_000000001", "step_000000002"]

    real = hashed_io.write_file

    def full(path, chunks, **kw):
        if Path(path).name == "state.json":
            raise OSError(28, "No space left on device")
        return real(path, chunks, **kw)

    monkeypatch.setattr(hashed_io, "write_file", full)
    with pytest.raises(OSError):
        m.save_state(step=3, model=model, optimizer=opt)
    assert names(tmp_path) == ["step_000000001", "step_000000002"]  # a failed write's space goes back at once


def test_a_cancelled_write_gives_back_what_it_took_and_one_pool_stays(tmp_path):
    import threading

    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path, keep_last=1, carry_unchanged=False)  # the same state, written each time
    m.prepare()
    m.save_state(step=1, model=model, optimizer=opt)
    m.save_state(step=2, model=model, optimizer=opt)  # step 1's files become the pool
    whole = recycle.file_bytes(pool_of(tmp_path))
    (tmp_path / ".recycle-part").mkdir()  # what an earlier cancelled write left
    (tmp_path / ".recycle-part" / "model.safetensors").write_bytes(b"x" * 10)
    stop = threading.Event()
    stop.set()
    with cancel.cancellable(stop), pytest.raises(cancel.WriteCancelled):
        m.save_state(step=3, model=model, optimizer=opt)  # takes the whole pool, is cancelled, gives it back
    assert m.wait(10)
    (pool,) = recycle.pools(tmp_path)  # one pool: the one with the most to write over
    assert recycle.file_bytes(pool) == whole
    assert names(tmp_path) == [pool.name, "step_000000002"]


def test_a_pool_is_written_past_the_page_cache_so_a_save_over_it_flushes_nothing(tmp_path, caplog):
    """A direct write over pages still dirty in the page cache makes the kernel write them back first: a stop that
    cancels a pool being written would pay for the pool's zeros. Written direct, the pool leaves none."""
    caplog.set_level(logging.DEBUG, logger="preempt")
    sizes = {"state.safetensors": (9 << 20) + 123, "model.safetensors": 5 << 20, "rng.safetensors": 10}
    pool = recycle.reserve(tmp_path, sizes)
    assert {f.name: f.stat().st_size for f in pool.iterdir()} == sizes
    assert all(not any(f.read_bytes()) for f in pool.iterdir())  # zeros
    direct = {Path(r.args[0]).name: r.args[1] for r in caplog.records if "bypassed the page cache" in r.getMessage()}
    if direct_io_supported(tmp_path):
        assert direct == {"state.safetensors": 9 << 20, "model.safetensors": 5 << 20}  # all but the unaligned tail
