"""``shared_read.exchange`` in two real processes (gloo on the CPU): the ranks of one machine through memory they
both map, the ranks of two machines by broadcasts (``machine=`` tells them apart); every rank gets every byte, and a
damaged byte in one rank's share fails the files on both ranks alike."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
import xxhash
from helpers import free_port

from preempt.checkpoint.hashed_io import FileDigest
from preempt.cluster import distributed
from preempt.cluster.shared_read import exchange, plan

pytestmark = pytest.mark.distributed

SIZES = {"model.safetensors": (3 << 20) + 17, "state.json": 5000, "empty.bin": 0, "state.safetensors": 70 << 20}


def one_rank(rank: int, port: int, where: str, wanted: list, machine: str, take_part: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        talk = distributed.Coordinator()
        files = [(n, FileDigest(size, digest)) for n, size, digest in wanted]
        try:
            got = exchange(talk, Path(where), files, take_part=take_part, machine=machine)
            said = {n: xxhash.xxh3_128_hexdigest(bytes(buf)) for n, (buf, _) in got.items()}
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
    if damage:  # a byte of the last piece rank 1 reads
        last = [p for p in plan([w[1] for w in wanted], 2) if p.owner == 1][-1]
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
    assert said == [want, want]


@pytest.mark.parametrize("machines", [("one", "one"), ("one", "two")], ids=["memory", "broadcast"])
def test_a_damaged_byte_in_one_share_fails_on_every_rank_alike(tmp_path, machines):
    said, _ = run_ranks(tmp_path, machines, damage=True)
    assert said[0] == said[1] and "CorruptCheckpointError" in said[0]["error"], said
    assert "state.safetensors: xxh3 mismatch" in said[0]["error"]


def test_a_rank_that_does_not_take_part_leaves_each_to_read_alone(tmp_path):
    said, _ = run_ranks(tmp_path, ("one", "one"), take_part=(True, False))
    assert said == [{}, {}]
