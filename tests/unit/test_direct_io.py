"""Writes and reads that bypass the page cache (preempt.checkpoint.direct_io): the pure choice of each write, then
real files."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
from helpers import direct_io_supported

from preempt.checkpoint import direct_io, hashed_io, state, tensorfile
from preempt.checkpoint.manager import write_payload
from preempt.checkpoint.staging import Stager

KB = 1024
MB = 1 << 20


@pytest.mark.parametrize(
    ("pos", "addr", "n", "want"),
    [
        (0, 4096 * 7, 3 * MB, (3 * MB, True)),  # aligned memory at an aligned position: all of it direct
        (0, 4096 * 7, 3 * MB + 100, (3 * MB, True)),  # the last partial block is left for a buffered write
        (3 * MB, 4096 * 7, 100, (100, False)),  # ... which is this one
        (100, 4196, 3 * MB, (3996, False)),  # aligned as the file, mid-block: buffered up to the block's end
        (4096, 8192 + 16, 3 * MB, (3 * MB, False)),  # memory not aligned as the file: never direct
        (0, 0, 512 * KB, (512 * KB, False)),  # aligned, but too short to be worth a switch
        (0, 0, 0, (0, False)),
    ],
)
def test_each_write_is_direct_only_for_whole_blocks_of_memory_aligned_as_the_file(pos, addr, n, want):
    assert direct_io.span(pos, addr, n) == want


def aligned(nbytes: int, fill: int = 0) -> np.ndarray:
    raw = np.empty(nbytes + direct_io.BLOCK, dtype=np.uint8)
    start = -raw.ctypes.data % direct_io.BLOCK
    out = raw[start : start + nbytes]
    out[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8) ^ fill
    return out


def test_a_sink_writes_every_byte_in_order_and_sends_the_aligned_blocks_direct(tmp_path):
    head = b"h" * 4096  # bytes objects are not page-aligned: buffered
    body = aligned(3 * MB + 1000, fill=7)  # direct but for its last 1000 bytes
    unaligned = aligned(2 * MB + 1)[1:]  # one byte off: buffered
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        sink = direct_io.Sink(fd)
        for chunk in (head, body, unaligned):
            view = memoryview(chunk).cast("B")
            while view:
                view = view[sink.write(view) :]
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == head + body.tobytes() + unaligned.tobytes()
    assert sink.pos == 4096 + body.nbytes + unaligned.nbytes
    # where the filesystem refuses O_DIRECT, every write goes through the page cache and nothing fails
    assert sink.direct_bytes == (3 * MB if direct_io_supported(tmp_path) else 0)


def mlp_payload() -> state.Payload:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    return state.capture(state.Components(model, opt), {})


def test_a_staged_file_is_its_header_and_one_page_aligned_buffer_laid_out_as_the_file():
    live = mlp_payload()
    staged = Stager().stage(live)
    for name, (tensors, meta) in staged.tensor_files.items():
        got = list(tensorfile.chunks(tensors, meta))
        want = list(tensorfile.chunks(*live.tensor_files[name]))  # the live tensors: one chunk per tensor
        assert len(want) == 1 + len(tensors)
        assert len(got) == 2, name
        assert len(got[0]) % tensorfile.DATA_ALIGN == 0  # the data starts on a block boundary
        assert direct_io.address(got[1]) % direct_io.BLOCK == 0
        assert b"".join(bytes(p) for p in got) == b"".join(bytes(p) for p in want)  # the same file


def test_a_staged_checkpoint_bypasses_the_page_cache_and_reads_back_equal(tmp_path, caplog):
    from safetensors.torch import load_file

    live = mlp_payload()
    staged = Stager().stage(live)
    with caplog.at_level(logging.DEBUG, logger="preempt"):
        digests = write_payload(tmp_path, staged)
    said = {}
    for r in caplog.records:
        if "bypassed the page cache" in r.getMessage():
            path, direct, size = r.args
            said[path] = direct
    want = {}
    for name, (tensors, _meta) in live.tensor_files.items():
        blocks = sum(t.nbytes for t in tensors.values()) // direct_io.BLOCK * direct_io.BLOCK
        if blocks >= direct_io.MIN_DIRECT:  # every whole block of the data area: the header is buffered
            want[tmp_path / name] = blocks
    assert said == (want if direct_io_supported(tmp_path) else {})
    for name, (tensors, _meta) in live.tensor_files.items():
        back = load_file(tmp_path / name)  # the safetensors library reads the padded header
        assert back.keys() == tensors.keys()
        assert all(torch.equal(back[k], t) for k, t in tensors.items())
        assert hashed_io.hash_file(tmp_path / name) == digests[name]


def test_tensors_that_are_not_one_buffer_are_written_one_by_one():
    base = torch.arange(20, dtype=torch.float32)
    ok = {"a": base[:8], "b": base[8:20]}  # views of one storage at their places: one chunk
    assert len(list(tensorfile.chunks(ok))) == 2
    gap = {"a": base[:8], "b": base[9:20]}  # a hole between them
    swapped = {"a": base[12:20], "b": base[:12]}  # "a" comes first in the file, not in memory
    neg = {"a": torch._neg_view(base[:8]), "b": base[8:20]}  # a lazily negated view: its bytes are not its values
    for tensors in (gap, swapped, neg):
        assert len(list(tensorfile.chunks(tensors))) == 3


def test_a_direct_write_the_kernel_refuses_is_written_through_the_page_cache_and_the_sink_stops_trying(
    tmp_path, monkeypatch
):
    # A misaligned direct write is what a device with a larger logical block refuses: forced here, EINVAL for real.
    tried = []

    def misaligned(pos, addr, n, *args):
        tried.append(n)
        return n, True

    monkeypatch.setattr(direct_io, "span", misaligned)
    data = aligned(2 * MB + 3)[3:]
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        sink = direct_io.Sink(fd)
        view = memoryview(data)
        while view:
            view = view[sink.write(view) :]
        assert sink.write(memoryview(data)) == data.nbytes  # no longer asks for a direct write
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == data.tobytes() * 2
    assert sink.direct_bytes == 0 and tried == [data.nbytes]  # the second write went straight to the page cache


# ------------------------------------------------------------------ a restore's reads


def _uncached_file(path, data: bytes) -> None:
    """Writes ``data`` to ``path`` durably, then has the kernel drop its clean pages: the file is cold."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if _cached(path):
        pytest.skip(f"{path.parent} keeps its files in memory (tmpfs): no cold file to read")


def _cached(path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        return direct_io.cached(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def test_a_restore_reads_a_cold_file_past_the_page_cache_and_maps_a_cached_one(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 * MB + 100, dtype=np.uint8).tobytes()
    path = tmp_path / "state.safetensors"
    _uncached_file(path, data)
    want = hashed_io.FileDigest(len(data), __import__("xxhash").xxh3_128_hexdigest(data))

    buf, got = hashed_io.read_file(path, len(data), direct=True)
    assert bytes(buf) == data and got == want
    assert buf.flags.writeable and not hashed_io.is_mapping(buf)
    assert _cached(path) == (not direct_io_supported(tmp_path))  # read direct: still not in the page cache

    path.read_bytes()  # now it is (as after preempt prefetch)
    assert _cached(path)
    again, got = hashed_io.read_file(path, len(data), direct=True)  # mapped: the page cache has it
    assert bytes(again) == data and got == want and hashed_io.is_mapping(again)

    mapped, got = hashed_io.read_file(path, len(data))  # to check a file only: its mapping, no copy
    assert hashed_io.is_mapping(mapped) and got == want


def test_a_file_read_without_o_direct_is_read_through_the_page_cache(tmp_path, monkeypatch):
    data = bytes(range(256)) * (2 * MB // 256) + b"end"
    path = tmp_path / "f"
    _uncached_file(path, data)
    monkeypatch.setattr(direct_io, "_O_DIRECT", 0)  # a system without the flag
    buf, got = hashed_io.read_file(path, len(data), direct=True)
    assert bytes(buf) == data and got == hashed_io.hash_file(path) and hashed_io.is_mapping(buf)
    assert _cached(path)


def test_a_file_too_large_for_the_memory_available_is_mapped_not_read_direct(tmp_path, monkeypatch):
    from preempt.checkpoint import readahead

    data = b"z" * (2 * MB)
    path = tmp_path / "f"
    _uncached_file(path, data)
    monkeypatch.setattr(readahead, "host_memory_available", lambda *a: 2 * MB)  # the file would take all of it
    buf, got = hashed_io.read_file(path, len(data), direct=True)
    assert bytes(buf) == data and hashed_io.is_mapping(buf)


def test_a_direct_read_the_kernel_refuses_says_so_before_reading_anything(tmp_path):
    data = b"x" * (2 * MB)
    path = tmp_path / "f"
    _uncached_file(path, data)
    if not direct_io_supported(tmp_path):
        pytest.skip(f"{tmp_path} has no O_DIRECT")
    view = memoryview(aligned(2 * MB))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(direct_io.DirectRefused):
            list(direct_io.read_whole(fd, view, len(data), chunk=direct_io.BLOCK + 1))  # not whole blocks: EINVAL
        chunks = list(direct_io.read_whole(fd, view, len(data), chunk=MB))  # the descriptor is as it was
    finally:
        os.close(fd)
    assert [p.nbytes for p in chunks] == [MB, MB] and bytes(view) == data


def test_a_direct_read_asks_for_memory_of_whole_aligned_blocks(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"y" * 5000)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="whole blocks"):
            list(direct_io.read_whole(fd, memoryview(aligned(5000)), 5000))  # 5000 bytes: the last block cut
        with pytest.raises(ValueError, match="starts on a block"):
            list(direct_io.read_whole(fd, memoryview(aligned(8192 + 1))[1:], 5000))
    finally:
        os.close(fd)


def test_a_restored_checkpoint_was_read_past_the_page_cache_and_is_equal(tmp_path):
    from preempt import CheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    manager = CheckpointManager(tmp_path, keep_last=1)
    info = manager.save_state(step=1, model=model, optimizer=opt)
    big = [info.path / name for name in ("model.safetensors", "state.safetensors")]
    for path in big:
        _uncached_file(path, path.read_bytes())

    model2 = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 3))
    opt2 = torch.optim.AdamW(model2.parameters())
    _, loaded = manager.load("latest")
    moment = loaded.tree["optimizer"]["state"][0]["exp_avg"]
    state.apply(state.Components(model2, opt2), loaded)
    supported = direct_io_supported(tmp_path)
    assert [_cached(p) for p in big] == [not supported] * 2
    if supported:  # read into memory of its own: the optimizer keeps it as it is, no copy
        assert all(size < direct_io.MIN_DIRECT for _, size in loaded.mapped)  # only the small JSON is mapped
        assert opt2.state[model2[0].weight]["exp_avg"].data_ptr() == moment.data_ptr()
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(v, opt2.state_dict()["state"][0][k]), k


@pytest.mark.parametrize(
    ("resident", "pages", "want"), [(0, 10, False), (5, 10, False), (6, 10, True), (10, 10, True), (0, 0, False)]
)
def test_a_file_mostly_in_the_page_cache_is_read_through_it(resident, pages, want):
    assert direct_io.through_cache(resident, pages) is want


def test_a_byte_range_lands_in_the_same_bytes_of_the_files_memory_and_nothing_else(tmp_path):
    data = bytes(np.arange(5 * direct_io.BLOCK + 300, dtype=np.uint64).astype(np.uint8) ^ 0x5A)
    path = tmp_path / "f"
    path.write_bytes(data)
    memory = aligned(6 * direct_io.BLOCK, fill=0)
    memory[:] = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        lo, n = 2 * direct_io.BLOCK, len(data) - 2 * direct_io.BLOCK  # three whole blocks and the short last one
        chunks = list(direct_io.read_range(fd, memoryview(memory), lo, n, chunk=direct_io.BLOCK))
    finally:
        os.close(fd)
    assert b"".join(bytes(p) for p in chunks) == data[lo:]
    assert [p.nbytes for p in chunks] == [direct_io.BLOCK] * 3 + [300]
    assert bytes(memory[lo : len(data)]) == data[lo:] and not memory[:lo].any()


def test_a_range_past_the_files_end_fails_naming_where_it_ended(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"z" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="ended at 100 of 5000"):
            list(direct_io.read_range(fd, memoryview(aligned(8192)), 0, 5000))
    finally:
        os.close(fd)


def test_a_refused_direct_read_of_a_range_goes_on_through_the_page_cache_or_says_so(tmp_path):
    data = bytes(np.arange(3 * MB, dtype=np.uint64).astype(np.uint8))
    path = tmp_path / "f"
    _uncached_file(path, data)
    if not direct_io_supported(tmp_path):
        pytest.skip(f"{tmp_path} has no O_DIRECT")
    odd = direct_io.BLOCK + 1  # reads of other than whole blocks: the kernel refuses them (EINVAL)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert direct_io.set_direct(fd)
        with pytest.raises(direct_io.DirectRefused):
            list(direct_io.read_range(fd, memoryview(aligned(3 * MB)), MB, MB, chunk=odd, fall_back=False))
        view = memoryview(aligned(3 * MB))
        got = b"".join(bytes(p) for p in direct_io.read_range(fd, view, MB, 2 * MB, chunk=odd))
        assert got == data[MB:] and bytes(view[MB:]) == data[MB:]
        assert not direct_io.set_direct(fd, False)  # the refusal cleared the flag for the reads after it
    finally:
        os.close(fd)


def test_o_direct_is_not_set_where_the_system_has_none(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(b"a")
    monkeypatch.setattr(direct_io, "_O_DIRECT", 0)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert direct_io.set_direct(fd) is False
    finally:
        os.close(fd)


def test_bytes_in_memory_are_hashed_as_their_file_would_be_in_order():
    import xxhash

    bufs = [aligned(3 * hashed_io.LOAD_CHUNK + 5, fill=7), np.zeros(0, dtype=np.uint8), memoryview(b"abc")]
    want = [hashed_io.FileDigest(len(bytes(b)), xxhash.xxh3_128_hexdigest(bytes(b))) for b in bufs]
    assert hashed_io.digests_of(bufs) == want == [hashed_io.digest_of(b) for b in bufs]
