"""``shared_read.exchange`` in two real processes (gloo on the CPU): the ranks of one machine through memory they
both map, the ranks of two machines by broadcasts (``machine=`` tells them apart); every rank gets every byte, and a
damaged byte in one rank's share fails the files on both ranks alike."""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
import xxhash
from helpers import free_port

from preempt.checkpoint.hashed_io import FileDigest
from preempt.cluster import distributed
from preempt.cluster.shared_read import byte_ranges, exchange

pytestmark = pytest.mark.distributed

SIZES = {"model.safetensors": (3 << 20) + 17, "state.json": 5000, "empty.bin": 0, "state.safetensors": 70 << 20}
COPIED = "model.safetensors"  # the file the caller copies out (a model's weights)


def mapped_share(buf: np.ndarray) -> float:
    """The share of the pages of ``buf`` that this process has mapped now (``/proc/self/pagemap``'s present bit)."""
    page = mmap.PAGESIZE
    first, last = buf.ctypes.data // page, (buf.ctypes.data + buf.nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
    return float(np.count_nonzero(entries >> np.uint64(63))) / len(entries)


def one_rank(rank: int, port: int, where: str, wanted: list, machine: str, take_part: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        talk = distributed.Coordinator()
        files = [(n, FileDigest(size, digest)) for n, size, digest in wanted]
        try:
            got = exchange(talk, Path(where), files, take_part=take_part, machine=machine, copied=[COPIED])
            # before anything here reads them: the pages of the file the caller copies out are mapped already
            mapped = {n: mapped_share(buf) for n, (buf, _) in got.items() if n == COPIED}
            said = {n: xxhash.xxh3_128_hexdigest(bytes(buf)) for n, (buf, _) in got.items()}
            said.update({f"{n} mapped": share for n, share in mapped.items()})
        except Exception as e:
            said = {"error": f"{type(e).__name__}: {e}"}
        Path(out, f"rank{rank}.json").write_text(json.dumps(said))
    finally:
        dist.destroy_process_group()


def run_ranks(
    tmp_path: Path, machines: tuple[str, str], *, damage: bool = False, take_part=(True, True)
) -> tuple[list[dict], dict]:
    where = tmp_path / "step_000000001"
    where.mkdir()
    wanted = []
    for i, (name, size) in enumerate(SIZES.items()):
        data = bytes((i * 7 + k) % 251 for k in range(min(size, 4096))) * (size // 4096 + 1)
        (where / name).write_bytes(data[:size])
        wanted.append([name, size, xxhash.xxh3_128_hexdigest(data[:size])])
    if damage:  # a byte of the last range rank 1 reads
        last = [p for p in byte_ranges([w[1] for w in wanted], 2) if p.owner == 1][-1]
        path = where / wanted[last.file][0]
        data = bytearray(path.read_bytes())
        data[last.offset + last.length - 1] ^= 0x40
        path.write_bytes(bytes(data))
    args = (free_port(), str(where), wanted)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=one_rank, args=(r, *args, machines[r], take_part[r], str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    want = {name: digest for name, _, digest in wanted}
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)], want


@pytest.mark.parametrize("machines", [("one", "one"), ("one", "two")], ids=["memory", "broadcast"])
def test_every_rank_gets_every_byte(tmp_path, machines):
    said, want = run_ranks(tmp_path, machines)
    assert [{n: d for n, d in s.items() if not n.endswith(" mapped")} for s in said] == [want, want]


def test_the_file_copied_out_is_mapped_in_each_ranks_view_before_it_is_used(tmp_path):
    """The ranks of one machine: each rank's private view of the memory they share maps the model's pages as the
    ranges land (its own) and while it hashes (the other's), rather than a fault per page when the model copies
    them in (which is after every file is verified)."""
    said, _ = run_ranks(tmp_path, ("one", "one"))
    assert [s[f"{COPIED} mapped"] for s in said] == [1.0, 1.0], said


@pytest.mark.parametrize("machines", [("one", "one"), ("one", "two")], ids=["memory", "broadcast"])
def test_a_damaged_byte_in_one_share_fails_on_every_rank_alike(tmp_path, machines):
    said, _ = run_ranks(tmp_path, machines, damage=True)
    assert said[0] == said[1] and "CorruptCheckpointError" in said[0]["error"], said
    assert "state.safetensors: xxh3 mismatch" in said[0]["error"]


def test_a_rank_that_does_not_take_part_leaves_each_to_read_alone(tmp_path):
    said, _ = run_ranks(tmp_path, ("one", "one"), take_part=(True, False))
    assert said == [{}, {}]
