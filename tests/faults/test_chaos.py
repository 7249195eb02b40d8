"""Seeded chaos campaigns: a training job run again and again until it completes, under a stream of faults drawn
from a seed (tests/helpers/chaos.py, chaos_ddp.py), every oracle checked after every process and at the end of each
run. Jobs: the quick-start loop (augmenting workers, async_save), a LoRA-style job carrying its frozen base, two gloo
ranks under torchrun.

The schedules are pure functions of the seed, tested here without processes. The default suite runs short campaigns
of fixed seeds; ``-m slow`` runs 300 faults across the three jobs. A failure's message starts with its seed and
fault: ``python bench/chaos.py --seed S --faults N --jobs JOB`` replays it outside the suite.
"""

from __future__ import annotations

from collections import Counter

import pytest
from helpers.chaos import BETWEEN, CLASSES, LORA, QUICKSTART, SIGNAL_POINTS, STAGES, Campaign, fault_at, schedule
from helpers.chaos_ddp import DDP_CLASSES, DdpCampaign, ddp_fault_at
from helpers.chaos_mirror import MIRROR_CLASSES, MirrorCampaign, mirror_fault_at
from helpers.distributed import free_port

from preempt.checkpoint import commit

SHORT_SEED, SHORT_FAULTS = 20261207, 30
SHORT_DDP_FAULTS = SHORT_MIRROR_FAULTS = 8
LONG_SEED = 70
LONG = {"quickstart": 150, "lora": 50, "ddp": 50, "mirror": 50}  # 300 faults


def test_the_schedule_is_a_pure_function_of_the_seed():
    assert schedule(7, 50) == schedule(7, 50)
    assert schedule(7, 50) != schedule(8, 50)
    assert schedule(7, 50)[:20] == schedule(7, 20), "a longer campaign begins with a shorter one's faults"
    assert fault_at(7, 33) == schedule(7, 50)[33]


def test_the_schedule_draws_every_class_within_its_bounds():
    faults = schedule(1, 2000)
    assert set(Counter(f.kind for f in faults)) == set(CLASSES)
    for f in faults:
        assert f.index == faults.index(f)
        if f.kind in ("sigterm", "sigkill") and f.variant != "in_step":
            assert f.point in SIGNAL_POINTS and f.n >= 1, f
            assert f.kind == "sigkill" or f.point != "step", f
        if f.kind in ("kill_stop_save", "io_error_stop", "io_error"):
            assert f.point in STAGES, f
        if f.kind.startswith("io_error"):  # an error before the rename: the previous checkpoint stays the newest
            assert commit.STAGES.index(f.point) <= commit.STAGES.index("before_rename"), f
        if f.kind not in BETWEEN and f.kind not in ("sigterm", "sigkill"):
            assert 1 <= f.step <= 16, f
        if f.kind == "flip_byte":
            assert len(f.pick) == 3, f


def test_a_schedule_over_some_classes_draws_only_those():
    faults = schedule(3, 200, classes=("sigkill", "flip_byte"))
    assert {f.kind for f in faults} == {"sigkill", "flip_byte"}


def test_the_ddp_schedule_is_a_pure_function_of_the_seed_over_its_classes():
    faults = [ddp_fault_at(5, i) for i in range(500)]
    assert faults == [ddp_fault_at(5, i) for i in range(500)]
    assert {f.kind for f in faults} == set(DDP_CLASSES)
    assert all(f.pick[0] in (0, 1) for f in faults if f.kind in ("kill_rank", "term_rank", "kill_rank_commit"))


def test_the_mirror_schedule_is_a_pure_function_of_the_seed_over_its_classes():
    faults = [mirror_fault_at(5, i) for i in range(500)]
    assert faults == [mirror_fault_at(5, i) for i in range(500)]
    assert {f.kind for f in faults} == set(MIRROR_CLASSES)


def _campaign(
    tmp_path, seed: int, faults: int, job: str = "quickstart", *, strict_report: bool = True, **options
) -> None:
    """``strict_report``: preempt report's lost steps must equal the steps recomputed (else they are only noted: the
    short campaigns of the default suite, which must not fail by chance on the one-step miscount seen once in 300
    faults, see bench/README.md)."""
    lines: list[str] = []
    work = tmp_path / f"chaos-{job}"
    kw = {"log": lines.append, "strict_report": strict_report, **options}
    if job == "ddp":
        result = DdpCampaign(seed, faults, work, **kw).run()
    elif job == "mirror":
        import s3server

        with s3server.start(free_port()) as server:  # its own: the campaign pauses it
            result = MirrorCampaign(seed, faults, work, server, **kw).run()
    else:
        result = Campaign({"quickstart": QUICKSTART, "lora": LORA}[job], seed, faults, work, **kw).run()
    print("\n".join(lines))
    print(result.table())
    assert result.ok, result.failure
    assert sum(result.injected.values()) == faults
    assert result.runs >= 1 and result.survived == result.injected


def test_a_short_seeded_campaign_survives_every_fault(tmp_path):
    """30 faults of a fixed seed (about a minute on a quiet 2-core machine): every oracle after every process."""
    _campaign(tmp_path, SHORT_SEED, SHORT_FAULTS, strict_report=False)


@pytest.mark.distributed
def test_a_short_seeded_campaign_of_two_ranks_survives_every_fault(tmp_path):
    """8 faults of a fixed seed on a 2-rank torchrun job: a rank killed or stopped, the launcher stopped."""
    _campaign(tmp_path, SHORT_SEED, SHORT_DDP_FAULTS, "ddp", strict_report=False)


def test_a_short_seeded_campaign_with_a_mirror_survives_every_fault(tmp_path):
    """8 faults of a fixed seed on the quick-start job with mirror= to a private S3 server: the server paused while a
    process stops, the local save_dir deleted (the next process pulls), a byte flipped in a kept checkpoint."""
    _campaign(tmp_path, SHORT_SEED, SHORT_MIRROR_FAULTS, "mirror", strict_report=False)


@pytest.mark.slow
@pytest.mark.parametrize("job", [pytest.param(j, marks=[pytest.mark.distributed] if j == "ddp" else []) for j in LONG])
def test_a_campaign_of_300_faults_across_the_jobs_survives_every_fault(tmp_path, job):
    _campaign(tmp_path, LONG_SEED, LONG[job], job)


def test_damaged_local_checkpoints_newer_than_the_mirror_are_replaced_by_the_mirrors_newest(tmp_path):
    """Found by the chaos campaign (``python bench/chaos.py --seed 70 --faults 50 --jobs mirror``, fault #24): every
    local checkpoint is newer than the mirror's newest complete one and damaged. The run once quarantined them all and
    started fresh beside the mirror's whole checkpoint (the choice to pull was made from the manifests, before the
    data was verified); it pulls the mirror's step 10 and resumes there."""
    import signal

    import s3server
    from helpers import Spawned, flip_bit, train_cmd

    from preempt import CheckpointManager

    save_dir = tmp_path / "run"
    with s3server.start(free_port()) as server:
        env = s3server.env(server.endpoint)
        mirror = ["--mirror", f"s3://{s3server.new_bucket(server.endpoint)}/run", "--mirror_deadline", "30"]
        args = list(QUICKSTART.args)
        first = Spawned(train_cmd(save_dir, None, [*args, *mirror, "--hold_at", "step:10"]), env)
        assert first.wait_event("holding", point="step", n=10), first.output
        first.signal(signal.SIGTERM)
        assert first.finish() == 75, first.output
        assert "mirror holds step 10" in first.output, first.output
        # a process without the mirror (as one whose uploads never got through) takes the local disk past it
        second = Spawned(train_cmd(save_dir, None, [*args, "--hold_at", "step:8"]), env)
        assert second.wait_event("holding", point="step", n=8), second.output
        second.signal(signal.SIGTERM)
        assert second.finish() == 75, second.output
        kept = [c for c in CheckpointManager(save_dir, owner=False).list() if c.status == "valid"]
        assert kept and min(c.step for c in kept) > 10, [c.name for c in kept]
        for c in kept:
            flip_bit(c.path / "state.json")
        third = Spawned(train_cmd(save_dir, None, [*args, *mirror, "--hold_at", "step:1"]), env)
        entered = third.wait_event("entered")
        third.signal(signal.SIGTERM)
        third.finish()
        assert entered is not None and entered["step"] == 10, (
            f"resumed at {entered}, not the mirror's step 10:\n{third.output}"
        )


def test_a_process_killed_in_its_restore_is_one_of_preempt_reports_processes(tmp_path):
    """Found by the chaos campaign (``python bench/chaos.py --seed 71 --faults 60 --classes
    kill_stop_save,sigkill,io_error_stop,sigterm``: "preempt report counts 10 processes, the campaign ran 11"): a
    resumed process wrote its first history line (``resume``) after its restore, so one SIGKILLed while it read its
    checkpoint left no line. It writes a ``restoring`` line first: three processes, the second killed before its
    first step, having recomputed nothing."""
    import json
    import signal
    import subprocess
    import sys

    from helpers import ROOT, Spawned, train_cmd

    save_dir, args = tmp_path / "run", list(QUICKSTART.args)
    first = Spawned(train_cmd(save_dir, None, [*args, "--hold_at", "step:10"]))
    assert first.wait_event("holding", point="step", n=10), first.output
    first.signal(signal.SIGTERM)
    assert first.finish() == 75, first.output
    killed = Spawned(train_cmd(save_dir, None, [*args, "--signal_at", "load:1:KILL"]))
    assert killed.finish() == -signal.SIGKILL, killed.output
    last = Spawned(train_cmd(save_dir, None, args))
    assert last.finish() == 0, last.output
    out = subprocess.run(
        [sys.executable, "-m", "preempt", "report", "--json", str(save_dir)], capture_output=True, text=True, cwd=ROOT
    )
    report = json.loads(out.stdout)
    assert report["processes"] == 3 and report["lost_steps"] == 0, out.stdout
    second = report["timeline"][1]
    assert second["end"] == "killed" and second["pid"] == killed.proc.pid and not second["reached_run"], second
