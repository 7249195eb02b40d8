"""Sharded state (FSDP2 ``fully_shard`` on the CPU, gloo): saved by 2 ranks, resumed on 2 ranks and on 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import Spawned, StoppedRun
from helpers import torchrun as _torchrun
from safetensors.torch import load_file

from preempt.checkpoint.manager import CheckpointManager

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_fsdp.py"


def torchrun(save_dir: Path, args: list[str], nproc: int = 2) -> Spawned:
    return _torchrun(save_dir, None, args, nproc, script=SCRIPT)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final state of an uninterrupted run on 2 ranks."""
    tmp = tmp_path_factory.mktemp("fsdp_ref")
    ref = torchrun(tmp / "ref", ["--final_out", str(tmp / "ref.safetensors")])
    assert ref.finish(timeout=180) == 0, ref.output
    return load_file(str(tmp / "ref.safetensors"))


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> StoppedRun:
    """2 ranks, each writing its shards in the background (its writer made 0.4 s slow), rank 1 alone signalled
    before step 7: a background checkpoint of step 4 and the stop's of step 7. Made once; each test takes a copy
    (a torchrun of two FSDP ranks costs 4.3 to 5.0 s of CPU here, its agent and ranks forked)."""
    save_dir = tmp_path_factory.mktemp("fsdp_stopped") / "run"
    env = {"PREEMPT_LOG_LEVEL": "DEBUG"}
    run = _torchrun(save_dir, None, ["--slow_write", "0.4", "--self_signal", "1:7"], 2, script=SCRIPT, env=env)
    run.finish(timeout=180)
    return StoppedRun(save_dir, run.output)


def test_fsdp_state_saved_by_two_ranks_resumes_on_two_and_on_one(tmp_path, reference, stopped):
    assert "stopping on a stop signal received by rank 1 at step 7 " in stopped.output, stopped.output
    info = CheckpointManager(stopped.save_dir, owner=False).list()[0]
    assert info.step == 7
    files = set(info.manifest.files)
    assert {"__0_0.distcp", "__1_0.distcp", "dcp_metadata.json", "rank_00001.json"} <= files, files
    assert not (info.path / ".metadata").exists(), "DCP's pickled index must not be written"

    run2, run1 = stopped.copy_to(tmp_path / "run"), stopped.copy_to(tmp_path / "run1")
    two = torchrun(run2, ["--dump_start", str(tmp_path / "start2"), "--final_out", str(tmp_path / "f2")])
    assert two.finish(timeout=180) == 0, two.output
    one = torchrun(run1, ["--dump_start", str(tmp_path / "start1")], nproc=1)
    assert one.finish(timeout=180) == 0, one.output
    assert "rank 0 start step 7 world 1" in one.output, one.output

    start2, start1 = load_file(str(tmp_path / "start2")), load_file(str(tmp_path / "start1"))
    assert start2.keys() == start1.keys() and len(start2) == 16  # 4 parameters, 3 tensors of AdamW state each
    assert all(torch.equal(start2[k], start1[k]) for k in start2), "1 rank loaded other values than 2 ranks"
    assert float(start2["optim.0.weight.step"]) == 7.0
    want, got = reference, load_file(str(tmp_path / "f2"))
    assert want.keys() == got.keys()
    assert [k for k in want if not torch.equal(want[k], got[k])] == [], "resumed on 2 ranks: not bit-exact"


def test_sharded_checkpoints_are_written_in_the_background_by_every_rank_and_resume_bit_exact(
    tmp_path, reference, stopped
):
    """Each rank copies its shards and goes on training while its writer writes them; a stop during that write
    waits for it, then saves its own step. The background checkpoint holds the state of its step, not a later one:
    a resume request naming it from a new save_dir reads the shards from there and ends bit-exact."""
    lines = stopped.output.splitlines()
    written = [i for i, line in enumerate(lines) if "step_000000004 (steps) written in" in line]
    assert len(written) == 2 and all("in the background" in lines[i] for i in written), stopped.output
    for rank in (0, 1):  # step 4's shards became durable after the loop had left step 4 (its writer sleeps 0.4 s)
        assert f"rank {rank} slow_write 4" in lines, stopped.output
        assert lines.index(f"rank {rank} step 5") < min(written), "the loop did not go on during the write"
    assert "stopping on a stop signal received by rank 1 at step 7 " in stopped.output, stopped.output
    infos = {c.step: c for c in CheckpointManager(stopped.save_dir, owner=False).list()}
    assert sorted(infos) == [4, 7] and infos[7].manifest.reason == "preempt"
    assert {"__0_0.distcp", "__1_0.distcp", "dcp_metadata.json"} <= set(infos[4].manifest.files)

    source = stopped.copy_to(tmp_path / "src") / infos[4].path.name
    resumed = torchrun(tmp_path / "other", ["--resume", str(source), "--final_out", str(tmp_path / "f")])
    assert resumed.finish(timeout=180) == 0, resumed.output
    assert "rank 1 start step 4 " in resumed.output, resumed.output
    got = load_file(str(tmp_path / "f"))
    assert reference.keys() == got.keys()
    assert [k for k in reference if not torch.equal(reference[k], got[k])] == [], "not bit-exact"
    assert CheckpointManager(tmp_path / "other", owner=False).list()[0].manifest.lineage["source"] == str(source)
