"""Sharded state (FSDP2 ``fully_shard`` on the CPU, gloo): saved by 2 ranks, resumed on 2 ranks and on 1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import PREEMPTED, MiB, Spawned, StoppedRun, assert_writes_what_changed
from helpers import torchrun as _torchrun
from safetensors.torch import load_file

from preempt.checkpoint.manager import CheckpointManager
from preempt.health.history import read_history

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_fsdp.py"


def torchrun(save_dir: Path, args: list[str], nproc: int = 2) -> Spawned:
    return _torchrun(save_dir, None, args, nproc, script=SCRIPT)


@pytest.fixture(scope="module")
def uninterrupted(reference) -> dict[str, torch.Tensor]:
    """The final state of an uninterrupted run on 2 ranks."""
    return load_file(str(reference.torchrun([], script=SCRIPT)))


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> StoppedRun:
    """2 ranks, each writing its shards in the background (held until the loop has done the next step), rank 1
    alone signalled before step 7: a background checkpoint of step 4 and the stop's of step 7. Made once; each test
    takes a copy
    (a torchrun of two FSDP ranks costs 4.3 to 5.0 s of CPU here, its agent and ranks forked)."""
    save_dir = tmp_path_factory.mktemp("fsdp_stopped") / "run"
    env = {"PREEMPT_LOG_LEVEL": "DEBUG"}
    run = _torchrun(save_dir, None, ["--slow_write", "--self_signal", "1:7"], 2, script=SCRIPT, env=env)
    run.finish(timeout=180)
    return StoppedRun(save_dir, run.output)


def assert_stopped_for_rank_1_at_7(stopped: StoppedRun) -> None:
    """Rank 0's history: the ranks stopped at step 7 for rank 1's signal, exit code 75."""
    markers = [m for m in read_history(stopped.save_dir, timeline=False) if m.get("event") in ("stopping", "stop")]
    said = [(m["event"], m["step"], m.get("cause"), m.get("code")) for m in markers]
    assert said == [("stopping", 7, "a stop signal received by rank 1", None), ("stop", 7, "signal", PREEMPTED)], said


def test_fsdp_state_saved_by_two_ranks_resumes_on_two_and_on_one(tmp_path, uninterrupted, stopped):
    assert_stopped_for_rank_1_at_7(stopped)
    info = CheckpointManager(stopped.save_dir, owner=False).list()[0]
    assert info.step == 7
    files = set(info.manifest.files)
    assert {"pieces_00000.safetensors", "pieces_00001.safetensors", "rank_00001.json"} <= files, files
    assert not [f for f in files if f.endswith(".distcp") or f == "dcp_metadata.json"], "all in the files of pieces"
    assert not (info.path / ".metadata").exists(), "DCP's pickled index must not be written"

    run2, run1 = stopped.copy_to(tmp_path / "run"), stopped.copy_to(tmp_path / "run1")
    two = torchrun(run2, ["--dump_start", str(tmp_path / "start2"), "--final_out", str(tmp_path / "f2")])
    assert two.finish(timeout=180) == 0, two.output
    one = torchrun(run1, ["--dump_start", str(tmp_path / "start1")], nproc=1)
    assert one.finish(timeout=180) == 0, one.output
    assert one.events_of("entered", rank=0, step=7, world=1), one.events

    start2, start1 = load_file(str(tmp_path / "start2")), load_file(str(tmp_path / "start1"))
    assert start2.keys() == start1.keys() and len(start2) == 16  # 4 parameters, 3 tensors of AdamW state each
    assert all(torch.equal(start2[k], start1[k]) for k in start2), "1 rank loaded other values than 2 ranks"
    assert float(start2["optim.0.weight.step"]) == 7.0
    want, got = uninterrupted, load_file(str(tmp_path / "f2"))
    assert want.keys() == got.keys()
    assert [k for k in want if not torch.equal(want[k], got[k])] == [], "resumed on 2 ranks: not bit-exact"


def test_sharded_checkpoints_are_written_in_the_background_by_every_rank_and_resume_bit_exact(
    tmp_path, uninterrupted, stopped
):
    """Each rank copies its shards and goes on training while its writer writes them; a stop during that write
    waits for it, then saves its own step. The background checkpoint holds the state of its step, not a later one:
    a resume request naming it from a new save_dir reads the shards from there and ends bit-exact."""
    lines = stopped.output.splitlines()
    written = [i for i, line in enumerate(lines) if "step_000000004 (steps) written in" in line]
    assert len(written) == 2 and all("in the background" in lines[i] for i in written), stopped.output
    for rank in (0, 1):  # step 4's shards became durable after the loop had done step 5 (the write is held until then)
        assert f"rank {rank} slow_write 4" in lines, stopped.output
        assert lines.index(f"rank {rank} step 5") < min(written), "the loop did not go on during the write"
    assert_stopped_for_rank_1_at_7(stopped)
    infos = {c.step: c for c in CheckpointManager(stopped.save_dir, owner=False).list()}
    assert sorted(infos) == [4, 7] and infos[7].manifest.reason == "preempt"
    assert {"pieces_00000.safetensors", "pieces_00001.safetensors"} <= set(infos[4].manifest.files)

    source = stopped.copy_to(tmp_path / "src") / infos[4].path.name
    resumed = torchrun(tmp_path / "other", ["--resume", str(source), "--final_out", str(tmp_path / "f")])
    assert resumed.finish(timeout=180) == 0, resumed.output
    assert resumed.events_of("entered", rank=1, step=4), resumed.events
    got = load_file(str(tmp_path / "f"))
    assert uninterrupted.keys() == got.keys()
    assert [k for k in uninterrupted if not torch.equal(uninterrupted[k], got[k])] == [], "not bit-exact"
    assert CheckpointManager(tmp_path / "other", owner=False).list()[0].manifest.lineage["source"] == str(source)


# ---------------------------------------------------------------- fine-tuning: the frozen base carried by each rank

LORA = ["--lora", "--keep_last", "1000"]  # a frozen base of ~4 MiB with trained adapters; every checkpoint kept


@pytest.fixture(scope="module")
def lora_uninterrupted(reference) -> dict[str, torch.Tensor]:
    """The final state of an uninterrupted LoRA run on 2 ranks."""
    return load_file(str(reference.torchrun(LORA, script=SCRIPT)))


def assert_bit_exact(want: dict[str, torch.Tensor], got_path: Path) -> None:
    got = load_file(str(got_path))
    assert want.keys() == got.keys(), sorted(want.keys() ^ got.keys())
    assert [k for k in want if not torch.equal(want[k], got[k])] == [], "not bit-exact"


def test_lora_each_rank_carries_its_pieces_of_the_base_and_a_sigterm_resumes_bit_exact_on_two_and_one(
    tmp_path, lora_uninterrupted
):
    """FSDP2 on 2 ranks, a frozen base that no optimizer holds: each rank writes its pieces of it once
    (base_0000R.safetensors), and every later checkpoint, the resumed run's too, links them and writes at most twice
    what changed + 1 MiB. A SIGTERM to rank 1 stops both at step 7; the rerun on 2 ranks ends bit for bit as the
    uninterrupted run, and 1 process loads from the same checkpoint what 2 ranks load, base included.

    Would catch: the base written through DCP at every checkpoint, a rank that never learns its file is durable
    (rank 1 would write its pieces every time), a base not restored (or restored only on 2 ranks)."""
    save_dir = tmp_path / "run"
    stopped = torchrun(save_dir, [*LORA, "--self_signal", "1:7"])
    stopped.finish(timeout=180)
    assert stopped.events_of("stop", step=7), (stopped.events, stopped.output)
    one = tmp_path / "one"
    shutil.copytree(save_dir, one, symlinks=True)

    two = torchrun(save_dir, [*LORA, "--dump_start", str(tmp_path / "start2"), "--final_out", str(tmp_path / "f2")])
    assert two.finish(timeout=180) == 0, two.output
    assert two.events_of("resume", step=7), two.events
    assert_bit_exact(lora_uninterrupted, tmp_path / "f2")

    alone = torchrun(one, [*LORA, "--dump_start", str(tmp_path / "start1")], nproc=1)
    assert alone.finish(timeout=180) == 0, alone.output
    start2, start1 = load_file(str(tmp_path / "start2")), load_file(str(tmp_path / "start1"))
    assert start2.keys() == start1.keys() and "model.0.base.weight" in start1
    assert [k for k in start2 if not torch.equal(start2[k], start1[k])] == [], "1 process loaded other values"

    ckpts = sorted(save_dir.glob("step_*"))
    first = json.loads((ckpts[0] / "manifest.json").read_text())["files"]
    bases = ["base_00000.safetensors", "base_00001.safetensors"]
    assert all(name in first and "carried_from" not in first[name] for name in bases), first
    assert sum((ckpts[0] / name).stat().st_size for name in bases) > 4 * MiB
    trained = load_file(str(ckpts[0] / "pieces_00001.safetensors"))
    assert "model.0.a" in trained and not [k for k in trained if ".base." in k], sorted(trained)  # the base apart
    report = assert_writes_what_changed(ckpts, bases)  # a base written again (4 MiB) fails here
    print("checkpoint, bytes written, bytes changed:", report)
    from preempt.cli.main import main

    assert main(["verify", str(save_dir)]) == 0
    out = tmp_path / "exported.safetensors"  # the whole weights put together from both ranks' pieces, no torch
    assert main(["export", str(save_dir), "--out", str(out)]) == 0
    exported, final = load_file(str(out)), load_file(str(tmp_path / "f2"))
    weights = {k.removeprefix("model."): v for k, v in final.items() if k.startswith("model.")}
    assert exported.keys() == weights.keys() and "0.base.weight" in exported
    assert [k for k in weights if not torch.equal(weights[k], exported[k])] == []


def test_lora_a_sigkill_resumes_from_the_last_checkpoint_bit_exact(tmp_path, lora_uninterrupted):
    """Rank 1 is killed (SIGKILL) before step 11, after the checkpoint of step 8 (synchronous saves: durable at the
    step): rank 0 leaves without adding one, and the rerun on 2 ranks resumes from step 8, carrying the base
    pieces, and ends bit for bit."""
    save_dir = tmp_path / "run"
    killed = torchrun(save_dir, [*LORA, "--sync_save", "--kill_at", "1:11"])
    assert killed.finish(timeout=180) != 0, killed.output
    assert [c.step for c in CheckpointManager(save_dir, owner=False).list()] == [8, 4], killed.output
    rerun = torchrun(save_dir, [*LORA, "--sync_save", "--final_out", str(tmp_path / "f")])
    assert rerun.finish(timeout=180) == 0, rerun.output
    assert rerun.events_of("resume", step=8), rerun.events
    assert_bit_exact(lora_uninterrupted, tmp_path / "f")
    newest = CheckpointManager(save_dir, owner=False).list()[0]
    assert all(newest.manifest.files[f"base_0000{r}.safetensors"].carried_from is not None for r in (0, 1))


def test_a_base_piece_changed_behind_autograd_on_one_rank_is_found_by_the_guard_and_written(tmp_path):
    """Rank 1 changes its piece of a frozen weight through ``.data`` (no version counter moves) after the checkpoint
    of step 4. The guard, at that process's first carried checkpoint (step 8), hashes the pieces about to be carried:
    rank 1's differ from its file, so it is written afresh (with the change) and a warning names it; rank 0's is
    carried. Would catch: a rank that carries what its version counters say without the guard."""
    save_dir = tmp_path / "run"
    run = torchrun(save_dir, [*LORA, "--sync_save", "--poke_base", "1:6"])
    assert run.finish(timeout=180) == 0, run.output
    infos = {c.step: c for c in CheckpointManager(save_dir, owner=False).list()}
    files = infos[8].manifest.files
    assert files["base_00000.safetensors"].carried_from == 4, files
    assert files["base_00001.safetensors"].carried_from is None, files
    assert "base_00001.safetensors" in run.output and "behind autograd" in run.output, run.output
    before = load_file(str(infos[4].path / "base_00001.safetensors"))["model.0.base.weight"]
    after = load_file(str(infos[8].path / "base_00001.safetensors"))["model.0.base.weight"]
    assert torch.equal(after[0, 0], before[0, 0] + 1.0) and torch.equal(after[1:], before[1:])  # float32 sums
