"""Real torchrun processes (2 ranks, gloo on the CPU) stopped by real signals, and resumed.

Each test starts ``torchrun --standalone --nproc_per_node=N tests/scripts/train_ddp.py``:
a DDP model, ``run.sampler`` sharding the data by rank, AdamW, dropout and a
draw from the global RNG per step, so every rank's random state matters.
"""

from __future__ import annotations

import errno
import json
import random
import re
import signal
from dataclasses import dataclass

import pytest
import torch
from helpers import DDP_ARGS as ARGS
from helpers import (
    PREEMPTED,
    History,
    MiB,
    Spawned,
    StoppedRun,
    assert_equal_finals,
    assert_writes_what_changed,
    ddp_finals,
    ranks_by_hand,
    torchrun,
)

from preempt.checkpoint.manager import CheckpointManager
from preempt.errors import PEER_LOST_EXIT_CODE

pytestmark = pytest.mark.distributed

TOTAL = 24  # steps of ARGS on 2 ranks


@pytest.fixture(scope="module")
def uninterrupted(reference) -> list[dict[str, torch.Tensor]]:
    """Each rank's final state of the uninterrupted run."""
    return ddp_finals(reference.torchrun(ARGS))


def stopped_steps(events: Spawned | History) -> list[int]:
    """The step at which each rank stopped with exit code 75 (the ``stopped`` events of train_ddp.py), rank 0's
    first."""
    return [e["step"] for e in sorted(events.events_of("stopped", code=PREEMPTED), key=lambda e: e["rank"])]


# One stop by default; a second stop of the resumed ranks, and synchronous saves, under -m slow (the ranks'
# synchronous saves run by default in the stopped_at_10 fixture, resumed ranks stop in the single-process tests)
@pytest.mark.parametrize(
    ("mode", "stops"),
    [("async", 1), pytest.param("async", 2, marks=pytest.mark.slow), pytest.param("sync", 2, marks=pytest.mark.slow)],
)
def test_sigterm_to_the_agent_resumes_bit_exact(tmp_path, uninterrupted, mode, stops):
    rnd = random.Random()
    seed = rnd.randrange(1 << 30)
    rnd.seed(seed)
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    # The ranks stop at the step where the signal is seen or one later: the second target must lie beyond that.
    at = [rnd.randrange(3, 10), rnd.randrange(13, TOTAL - 2)][:stops]
    extra = ["--sync_save"] if mode == "sync" else []
    for target in at:
        p = torchrun(save_dir, final, [*ARGS, *extra, "--step_sleep", "0.05"])
        assert p.wait_event("step", rank=0, step=target, timeout=120), p.output
        p.signal(signal.SIGTERM)
        assert p.finish() != 0, p.output
        # torchrun's agent sends SIGTERM to both ranks; one that agreed to the stop before its own copy arrived
        # stopped for the other rank's signal (the cause is what the ranks agreed on)
        stops = stopped_steps(p)
        assert len(stops) == 2 and stops[0] == stops[1], f"seed {seed}: both ranks must stop at one step\n{p.events}"
        info = CheckpointManager(save_dir, owner=False).list()[0]
        assert info.step == stops[0] and set(info.manifest.files) >= {"rank_00001.json", "model.safetensors"}
    p = torchrun(save_dir, final, ARGS, env={"PREEMPT_LOG_LEVEL": "DEBUG"})
    assert p.finish() == 0, p.output
    assert p.events_of("resume", step=info.step), p.events
    # rank 1 read the checkpoint while rank 0 chose it, and loaded what it had read (bit-exact below)
    assert re.search(rf"rank 1: \S+/step_{info.step:09d} was read while rank 0 chose it", p.output), p.output
    assert_equal_finals(uninterrupted, ddp_finals(final))


def test_rank_0_writes_in_the_background_and_a_failed_write_costs_nothing_else(tmp_path, uninterrupted):
    """async_save under torchrun: rank 0's write runs behind the loop; one that fails (ENOSPC) is reported
    (``checkpoint_failed``), leaves no partial directory, the next one is written, and the training is bit-exact as
    without checkpoints failing.

    The loop waits for each write to end (--settle_saves): on a busy machine the whole run could otherwise go by
    while the first write is in flight, every later save postponed behind it, and the second write never made."""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    # routine background checkpoints are said at DEBUG
    args = [*ARGS, "--fail_write", "2", "--settle_saves"]
    p = torchrun(save_dir, final, args, env={"PREEMPT_LOG_LEVEL": "DEBUG"})
    assert p.finish() == 0, p.output
    out = p.output
    (failed,) = p.events_of("fail_write")  # the write that the script made fail
    written = [e["step"] for e in p.events_of("checkpoint", background=True)]  # rank 0's, in the background
    # every save is taken when due (every 4th step); the second one failed, the others were written
    assert failed["step"] == 8 and written == [4, 12, 16, 20, 24], (out, p.events)
    assert p.events_of("checkpoint_failed", step=8, errno=errno.ENOSPC), p.events
    assert not [d.name for d in save_dir.iterdir() if d.name.startswith(".tmp-")], out
    manager = CheckpointManager(save_dir, owner=False)
    for info in manager.list():
        assert info.status == "valid" and {"rank_00001.json", "model.safetensors"} <= set(info.manifest.files)
        manager.read(info)  # every file of every rank verifies
    assert_equal_finals(uninterrupted, ddp_finals(final))


def rerun_from_step_4(save_dir, final, uninterrupted, before: str) -> None:
    """The checkpoint of step 4 is the only valid one; a torchrun of both ranks resumes from it, bit-exact."""
    manager = CheckpointManager(save_dir, owner=False)
    assert [c.step for c in manager.list() if c.status == "valid"] == [4], before
    p = torchrun(save_dir, final, ARGS)
    assert p.finish() == 0, p.output
    assert p.events_of("resume", step=4), p.events
    assert_equal_finals(uninterrupted, ddp_finals(final))


# rank 0 killed too, under -m slow: the same commit seen from the other side
@pytest.mark.parametrize("rank", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_sigkill_of_one_rank_during_a_save_keeps_the_previous_checkpoint(tmp_path, uninterrupted, rank):
    """Rank 1 dies while writing its files at the step; rank 0 dies in its background write of its own."""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    args = [*ARGS, "--signal_at", "after_tensor_files:2:KILL", "--signal_rank", str(rank)]  # the save of step 8
    p = torchrun(save_dir, final, args)
    assert p.finish(timeout=180) != 0, p.output
    assert "signal_at after_tensor_files 2 SIGKILL" in p.output, p.output
    rerun_from_step_4(save_dir, final, uninterrupted, p.output)


@dataclass(frozen=True)
class StoppedRanks(StoppedRun):
    """A stopped run, with the events its ranks told."""

    history: History


@pytest.fixture(scope="module")
def stopped_at_10(tmp_path_factory: pytest.TempPathFactory) -> StoppedRanks:
    """A 2-rank run that rank 1 alone signals before step 10 (its own SIGTERM, as a scheduler that signals one node
    would): checkpoints of steps 8 and 10 (keep_last=2), stopped mid-epoch 0 (12 steps). Made once; the tests that
    start from it each take a copy (a torchrun of two ranks costs 3.1 to 3.5 s of CPU here, forked; 16.6 s fresh).

    Synchronous saves: a background write still in flight at step 8 would postpone that checkpoint to step 9.
    """
    save_dir = tmp_path_factory.mktemp("ddp_stopped") / "run"
    p = torchrun(save_dir, None, [*ARGS, "--self_signal", "1:10", "--sync_save"])
    rc = p.finish(timeout=120)  # must not hang: rank 0 never received a signal
    steps = [c.step for c in CheckpointManager(save_dir, owner=False).list() if c.status == "valid"]
    assert steps == [10, 8], p.output
    return StoppedRanks(save_dir, p.output, History([rc], [p.output], [list(p.events)]))


def test_a_signal_to_one_rank_stops_both_at_the_same_step(tmp_path, uninterrupted, stopped_at_10):
    """Rank 1 alone gets SIGTERM: rank 0 learns of it at the step's agreement, both save step 10 and stop; the
    rerun of both ends bit-exact."""
    told = stopped_at_10.history
    stops = {e["rank"]: (e["step"], e["cause"]) for e in told.events_of("stopped", code=PREEMPTED)}
    assert stops == {0: (10, "signal"), 1: (10, "SIGTERM")}, told.events  # rank 0 for rank 1's signal
    assert told.events_of("stopping", step=10, cause="a stop signal received by rank 1"), told.events
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    stopped_at_10.copy_to(save_dir)
    info = CheckpointManager(save_dir, owner=False).list()[0]
    assert info.step == 10 and info.manifest.reason == "preempt" and "rank_00001.safetensors" in info.manifest.files
    p = torchrun(save_dir, final, ARGS)
    assert p.finish() == 0, p.output
    assert p.events_of("resume", step=10), p.events
    assert_equal_finals(uninterrupted, ddp_finals(final))


def test_resume_on_one_rank_continues_at_the_global_sample(tmp_path, stopped_at_10):
    """2 ranks stopped mid-epoch, resumed by 1 process: the epoch's samples are each trained exactly once."""
    stop = 10
    before = stopped_at_10.history.events_of("step", epoch=0)  # each rank's steps, with their samples
    seen = [i for e in before if e["step"] <= stop for i in e["idx"]]
    assert len(seen) == stop * 2 * 8, before  # two ranks, 8 samples each per step
    save_dir = tmp_path / "run"
    stopped_at_10.copy_to(save_dir)
    q = torchrun(save_dir, None, ARGS, nproc=1)
    assert q.finish() == 0, q.output
    assert q.events_of("resume", step=stop), q.events
    rest = [i for e in q.events_of("step", rank=0, epoch=0) for i in e["idx"]]
    assert sorted(seen + rest) == list(range(192)), (sorted(seen), sorted(rest))


def test_resume_from_another_runs_checkpoint_continues_bit_exact(tmp_path, uninterrupted, stopped_at_10):
    """resume=<a checkpoint of another save_dir> on 2 ranks: rank 1 loads it too (with its own random state), the
    new timeline records the request, and the run ends equal to the uninterrupted one."""
    stopped_at_10.copy_to(tmp_path / "src")
    source = tmp_path / "src" / "step_000000008"
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = torchrun(save_dir, final, [*ARGS, "--resume", str(source)])
    assert p.finish() == 0, p.output
    assert sorted((e["rank"], e["step"]) for e in p.events_of("entered")) == [(0, 8), (1, 8)], p.events
    latest = CheckpointManager(save_dir, owner=False).list()[0]
    assert latest.manifest.lineage["request"]["resume"] == str(source.resolve()), latest.manifest.lineage
    assert latest.manifest.lineage["source"] == str(source), latest.manifest.lineage
    assert_equal_finals(uninterrupted, ddp_finals(final))


def test_resume_an_earlier_step_of_the_same_run_moves_the_later_ones_aside(tmp_path, uninterrupted, stopped_at_10):
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    stopped_at_10.copy_to(save_dir)
    p = torchrun(save_dir, final, [*ARGS, "--resume", "8"])
    assert p.finish() == 0, p.output
    assert "moved 1 checkpoint(s) of the previous timeline" in p.output, p.output
    assert (save_dir / "superseded" / "step_000000010").is_dir()
    assert sorted((e["rank"], e["step"]) for e in p.events_of("entered")) == [(0, 8), (1, 8)], p.events
    assert_equal_finals(uninterrupted, ddp_finals(final))


def test_weights_only_loads_the_weights_on_every_rank(tmp_path, uninterrupted, stopped_at_10):
    """Fine-tuning from another run's weights on 2 ranks: both start from them (else the replicas would differ)."""
    stopped_at_10.copy_to(tmp_path / "src")
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    p = torchrun(save_dir, final, [*ARGS, "--resume", str(tmp_path / "src"), "--weights_only"])
    assert p.finish() == 0, p.output
    assert "loaded the weights of" in p.output, p.output
    assert sorted((e["rank"], e["step"]) for e in p.events_of("entered")) == [(0, 0), (1, 0)], p.events
    r0, r1 = ddp_finals(final)
    weights = [k for k in r0 if k.startswith("model.")]
    assert weights and all(torch.equal(r0[k], r1[k]) for k in weights), "the ranks' replicas differ"
    assert not all(torch.equal(r0[k], uninterrupted[0][k]) for k in weights), "the loaded weights made no difference"


# rank 0 dying too, under -m slow: the same watch seen from the other side
@pytest.mark.parametrize("dies", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_a_rank_that_dies_is_noticed_by_the_other_which_exits_80_and_the_rerun_resumes(tmp_path, uninterrupted, dies):
    """Two ranks started by hand (no torchrun agent to kill the survivor, as across the nodes of a job); one dies
    after step 6. The other leaves at its next collective with exit code 80 and says why (rank 1 too, which
    otherwise logs nothing); no checkpoint is added; a rerun of both resumes from step 4, bit-exact.

    Rank 1 kills itself before step 7's forward, so rank 0's next collective is DDP's gradient all-reduce inside
    ``loss.backward()``, outside preempt (it raised a RuntimeError, exit code 1, before the run turned such errors
    into PeerLost). Rank 0 is killed from outside, at whatever point the signal lands."""
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    ranks = ranks_by_hand(save_dir, final, [*ARGS, "--step_sleep", "0.2", *(["--die_at", "1:7"] if dies else [])])
    assert ranks[dies].wait_event("step", rank=dies, step=6, timeout=120), ranks[dies].output
    if not dies:
        ranks[dies].signal(signal.SIGKILL)
    assert ranks[dies].finish() == -signal.SIGKILL
    survivor = ranks[1 - dies]
    assert survivor.finish(timeout=120) == PEER_LOST_EXIT_CODE, survivor.output
    said = re.findall(r"rank (\d) of 2 lost the other ranks during (.+?) \(", survivor.output)
    assert said and said[0][0] == str(1 - dies), survivor.output
    if dies:
        assert said[0][1] == "a collective of the training loop", survivor.output
    assert "a rerun of all ranks continues from it (exit code 80)" in survivor.output, survivor.output
    assert "Traceback" not in survivor.output, survivor.output
    if dies == 1:  # rank 0 keeps the history: the run's end is the error, with the message
        events = [json.loads(line) for line in (save_dir / "history.jsonl").read_text().splitlines()]
        ends = [e for e in events if e.get("event") in ("stop", "complete", "error")]
        assert ends and ends[-1]["event"] == "error", ends
        assert ends[-1]["error"].startswith("rank 0 of 2 lost the other ranks during"), ends[-1]
    rerun_from_step_4(save_dir, final, uninterrupted, survivor.output)


def test_rank_0_carries_the_frozen_base_and_a_sigterm_resumes_bit_exact(tmp_path):
    """A fine-tuning under DDP (a frozen part of ~4 MiB that no optimizer holds): rank 0 writes base.safetensors
    once, every later checkpoint (the resumed process's too) links it (carried_from) and writes at most twice what
    changed + 1 MiB (rank 1's random state among it); a SIGTERM to rank 0 at step 10 stops both ranks there, and
    the rerun of both ends bit for bit as an uninterrupted run. Every checkpoint verifies.

    Would catch: rank 0 writing the base again at every checkpoint (or at the first one after the resume), and a
    resume that does not restore the frozen part or either rank's state exactly."""
    frozen = [*ARGS, "--frozen"]
    ref = tmp_path / "reference"
    p = torchrun(ref / "run", ref / "final.safetensors", frozen)
    assert p.finish() == 0, p.output

    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    # every checkpoint kept, to measure each; synchronous saves: one at every 4th step exactly
    args = [*frozen, "--keep_last", "1000", "--sync_save"]
    p = torchrun(save_dir, final, [*args, "--self_signal", "0:10"])
    p.finish(timeout=120)
    assert stopped_steps(p) == [10, 10], (p.output, p.events)
    p = torchrun(save_dir, final, args)
    assert p.finish() == 0, p.output
    assert p.events_of("resume", step=10), p.events
    assert_equal_finals(ddp_finals(ref / "final.safetensors"), ddp_finals(final))

    ckpts = sorted(save_dir.glob("step_*"))
    assert [int(c.name[5:]) for c in ckpts] == [4, 8, 10, 12, 16, 20, 24], p.output
    first = json.loads((ckpts[0] / "manifest.json").read_text())["files"]
    assert "carried_from" not in first["base.safetensors"] and "rank_00001.safetensors" in first
    assert (ckpts[0] / "base.safetensors").stat().st_size > 4 * MiB
    report = assert_writes_what_changed(ckpts)  # a base written again (4 MiB) fails here
    print("checkpoint, bytes written, bytes changed:", report)
    from preempt.cli.main import main

    assert main(["verify", str(save_dir)]) == 0


def test_ranks_that_do_not_share_the_save_dir_are_refused_by_every_rank_before_anything_is_loaded(tmp_path):
    """Each rank given a save_dir of its own, without a mirror: rank 1 does not see the lock file rank 0 wrote, and
    both ranks leave at the start with one line saying so and what such ranks need (a mirror), no traceback of a
    checkpoint that could not be found, nothing written in rank 1's directory."""
    p = torchrun(tmp_path / "run", None, [*ARGS, "--save_dir_per_rank"])
    assert p.finish() != 0, p.output
    said = "rank 1 does not see the save_dir as rank 0 does (its lock file is missing)"
    assert p.output.count(said) == 2, p.output  # both ranks learn it at the same collective
    assert "need a mirror (mirror=...)" in p.output and "NoCheckpointError" not in p.output, p.output
    assert not list((tmp_path / "run" / "rank1").glob("step_*")) and not list(
        (tmp_path / "run" / "rank0").glob("step_*")
    )
