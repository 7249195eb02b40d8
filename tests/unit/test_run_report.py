"""The run's story from its history lines: pure accounting, fed hand-written lines (no processes, no clock)."""

from __future__ import annotations

import pytest

from preempt.cli.timeline import build, render


def lines_of_three_processes() -> list[dict]:
    return [
        {"t": 100.0, "event": "start", "step": 0, "pid": 1, "proc_start": 98.0},
        {"t": 105.0, "step": 50, "epoch": 0, "metrics": {"loss": 2.0}},
        {
            "t": 110.0,
            "event": "checkpoint",
            "step": 100,
            "reason": "steps",
            "stall_s": 0.5,
            "write_s": 2.0,
            "background": True,
            "bytes": 1000,
            "at": 107.5,
        },
        {
            "t": 111.0,
            "event": "checkpoint",
            "step": 110,
            "reason": "preempt",
            "stall_s": 1.0,
            "write_s": 1.0,
            "background": False,
            "bytes": 1000,
            "at": 110.0,
        },
        {"t": 111.0, "event": "stop", "step": 110, "cause": "SIGTERM"},
        {"t": 111.5, "event": "exit", "pid": 1},
        # process 2: resumes at 110, checkpoints 200, dies at 230 (its beacon, read by process 3)
        {"t": 125.0, "event": "resume", "step": 110, "pid": 2, "proc_start": 120.0},
        {
            "t": 134.0,
            "event": "checkpoint",
            "step": 200,
            "reason": "steps",
            "stall_s": 0.5,
            "write_s": 1.5,
            "background": True,
            "bytes": 1000,
            "at": 132.0,
        },
        {"t": 135.0, "step": 210, "epoch": 1, "metrics": {"loss": 1.0}},
        # process 3
        {
            "t": 150.0,
            "event": "resume",
            "step": 200,
            "pid": 3,
            "proc_start": 146.0,
            "crashed": {"died_at": 230, "pid": 2},
        },
        {"t": 160.0, "step": 300, "epoch": 2, "metrics": {"loss": 0.5}},
        {"t": 160.0, "event": "complete", "step": 300},
        {"t": 161.0, "event": "exit", "pid": 3},
    ]


def test_three_processes_are_accounted_for():
    r = build(lines_of_three_processes())
    doc = r.to_json()
    assert doc["restarts"] == 2 and doc["complete"] and doc["final_step"] == 300
    assert [(s["cause"], s["step"]) for s in doc["stops"]] == [("SIGTERM", 110), ("killed", 230)]
    p1, p2, p3 = r.processes
    assert (p1.wall_s, p1.startup_s, p1.stall_s) == (13.5, 2.0, 1.5)
    # process 2 ran 10 steps/s from its resume line (t=125, step 110) to its last line (t=135, step 210): step 230
    # comes 2 s later, at t=137; its work since the checkpoint of step 200 (taken at t=132) was done again
    assert p2.end == pytest.approx(137.0) and p2.end_estimated
    assert p2.lost_steps == 30 and p2.lost_s == pytest.approx(137.0 - 132.0)
    assert p3.startup_s == 4.0 and p3.wall_s == 15.0
    assert doc["lost_steps"] == 30
    assert doc["wall_s"] == pytest.approx(13.5 + 17.0 + 15.0)
    assert doc["productive_s"] == pytest.approx(doc["wall_s"] - doc["startup_s"] - doc["checkpoint_stall_s"] - 5.0)
    assert doc["between_processes_s"] == pytest.approx((120.0 - 111.5) + (146.0 - 137.0))
    assert [step for _, step, _, _ in r.metrics["loss"]] == [50, 210, 300]
    text = "\n".join(render(r, "runs/x"))
    assert "3 process(es), 2 restart(s)" in text and "30 (" in text and "goodput" in text


def test_a_rollback_counts_its_steps_as_recomputed():
    r = build(
        [
            {"t": 0.0, "event": "start", "step": 0},
            {"t": 5.0, "event": "checkpoint", "step": 10, "stall_s": 0.0, "write_s": 0.0, "at": 5.0},
            {"t": 8.0, "event": "rollback", "step": 10, "from_step": 16},
            {"t": 20.0, "event": "complete", "step": 40},
        ]
    )
    (p,) = r.processes
    assert p.rollbacks == 1 and p.lost_steps == 6 and p.lost_s == pytest.approx(3.0)
    assert p.end_step == 40


def test_old_and_hostile_lines_never_raise():
    old = [  # a history written before these fields: still a timeline
        {"t": 1.0, "event": "start", "step": 0, "pid": 1},
        {"t": 3.0, "step": 5, "epoch": 0, "metrics": {"loss": 1.0}},
        {"t": 4.0, "event": "stop", "step": 5},
    ]
    r = build(old)
    assert r.processes[0].wall_s == 3.0 and r.processes[0].startup_s == 0.0
    hostile = [
        "not a dict",
        {"t": "soon", "event": "start"},
        {"t": float("nan"), "event": "start"},
        {"t": 1.0, "step": 3},  # before any start line
        {"t": 1.0, "event": "start", "step": -4, "proc_start": 1e300, "crashed": [1, 2]},
        {"t": 2.0, "event": "checkpoint", "step": True, "stall_s": "x"},
        {"t": 2.5, "event": "checkpoint", "step": 3, "stall_s": "x", "write_s": None, "reason": {"a": 1}},
        {"t": 3.0, "step": 2, "metrics": {"loss": "nan", 7: 1.0, "acc": float("inf"), "ok": 0.5}},
        {"t": 4.0, "event": "resume", "step": 1, "crashed": {"died_at": "far"}},
        {"t": 5.0, "event": "error", "error": "x" * 10_000},
    ]
    r = build(hostile)  # type: ignore[arg-type]
    assert len(r.processes) == 2
    assert r.metrics == {"ok": [(3.0, 2, 0.5, 1)]}
    assert len(r.processes[1].cause or "") <= 200
    assert render(r, "d") and r.to_json()["restarts"] == 1


def test_nothing_to_tell():
    assert build([]).to_json()["goodput"] is None
    assert "no process" in render(build([]), "runs/x")[0]
