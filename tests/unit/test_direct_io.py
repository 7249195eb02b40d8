"""Writes that bypass the page cache (preempt.checkpoint.direct_io): the pure choice of each write, then real files."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
from helpers import direct_io_supported

from preempt.checkpoint import commit, direct_io, state, tensorfile
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
        for piece in (head, body, unaligned):
            view = memoryview(piece).cast("B")
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
        got = list(tensorfile.pieces(tensors, meta))
        want = list(tensorfile.pieces(*live.tensor_files[name]))  # the live tensors: one piece per tensor
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
        assert commit.hash_file(tmp_path / name) == digests[name]


def test_tensors_that_are_not_one_buffer_are_written_one_by_one():
    base = torch.arange(20, dtype=torch.float32)
    ok = {"a": base[:8], "b": base[8:20]}  # views of one storage at their places: one piece
    assert len(list(tensorfile.pieces(ok))) == 2
    gap = {"a": base[:8], "b": base[9:20]}  # a hole between them
    swapped = {"a": base[12:20], "b": base[:12]}  # "a" comes first in the file, not in memory
    neg = {"a": torch._neg_view(base[:8]), "b": base[8:20]}  # a lazily negated view: its bytes are not its values
    for tensors in (gap, swapped, neg):
        assert len(list(tensorfile.pieces(tensors))) == 3


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
