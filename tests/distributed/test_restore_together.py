"""Two ranks (torchrun, gloo on the CPU) restore a checkpoint together: each reads a share of its files past the page
cache and the ranks exchange the rest (``preempt.cluster.shared_read``). The resume is bit-exact, and a damaged
share fails the checkpoint on both ranks alike: both fall back to the older checkpoint, as a process alone does."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import DDP_ARGS as ARGS
from helpers import StoppedRun, assert_equal_finals, ddp_finals, torchrun

from preempt.checkpoint import state
from preempt.checkpoint.manager import CheckpointManager
from preempt.cluster.shared_read import byte_ranges

pytestmark = pytest.mark.distributed

DEBUG = {"PREEMPT_LOG_LEVEL": "DEBUG"}  # torchrun() logs every rank's lines


@pytest.fixture(scope="module")
def uninterrupted(reference) -> list[dict[str, torch.Tensor]]:
    return ddp_finals(reference.torchrun(ARGS))


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> StoppedRun:
    """Checkpoints of steps 8 and 10 (rank 1 signals itself before step 10; synchronous saves)."""
    save_dir = tmp_path_factory.mktemp("together") / "run"
    p = torchrun(save_dir, None, [*ARGS, "--self_signal", "1:10", "--sync_save"])
    p.finish(timeout=120)
    steps = [c.step for c in CheckpointManager(save_dir, owner=False).list() if c.status == "valid"]
    assert steps == [10, 8], p.output
    return StoppedRun(save_dir, p.output)


def test_two_ranks_read_shares_of_the_checkpoint_and_resume_bit_exact(tmp_path, uninterrupted, stopped):
    save_dir, final = stopped.copy_to(tmp_path / "run"), tmp_path / "final.safetensors"
    p = torchrun(save_dir, final, ARGS, env=DEBUG)
    assert p.finish() == 0, p.output
    assert p.events_of("resume", step=10), p.events
    shares = {
        int(r): int(n) for r, n in re.findall(r"rank (\d): read (\d+) of the \d+ bytes of \S+step_000000010", p.output)
    }
    assert set(shares) == {0, 1} and all(shares.values()), p.output  # each rank read a part, not the whole
    assert re.search(r"rank 1: \S+/step_000000010 was read while rank 0 chose it", p.output), p.output
    assert_equal_finals(uninterrupted, ddp_finals(final))


def kept_in_order(info) -> list[str]:
    """The files a restore keeps, in the order the ranks share them (CheckpointManager.read's)."""
    files = info.manifest.files
    return [state.MODEL_FILE, state.STATE_FILE, state.STATE_JSON, *sorted(f for f in files if f.startswith("rank_"))]


def test_a_damaged_share_fails_the_checkpoint_on_both_ranks_alike(tmp_path, uninterrupted, stopped):
    save_dir, final = stopped.copy_to(tmp_path / "run"), tmp_path / "final.safetensors"
    info = CheckpointManager(save_dir, owner=False).list()[0]
    names = kept_in_order(info)
    sizes = [info.manifest.files[n].size for n in names]
    # the last byte of the last range rank 1 reads: damage in rank 1's share, which rank 0 only receives
    last = [p for p in byte_ranges(sizes, 2) if p.owner == 1][-1]
    damaged = info.path / names[last.file]
    data = bytearray(damaged.read_bytes())
    data[last.offset + last.length - 1] ^= 0x01
    damaged.write_bytes(bytes(data))

    p = torchrun(save_dir, final, ARGS, env=DEBUG)
    assert p.finish() == 0, p.output
    assert p.events_of("resume", step=8), p.events  # both ranks from step 8: one resume, one run
    assert re.search(rf"rank 1: \S*{damaged.name}: xxh3 mismatch", p.output), p.output  # rank 1 found it too
    assert any(q.name.startswith("step_000000010") for q in (save_dir / "quarantine").iterdir())
    assert_equal_finals(uninterrupted, ddp_finals(final))
