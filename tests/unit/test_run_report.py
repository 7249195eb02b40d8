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
    assert p2.recomputed == [(132.0, 200, pytest.approx(137.0), 230)]  # from when step 200 was taken to its end
    assert p3.startup_s == 4.0 and p3.wall_s == 15.0
    assert doc["lost_steps"] == 30
    assert doc["wall_s"] == pytest.approx(13.5 + 17.0 + 15.0)
    # each clean end's teardown, from its end line to its exit line (0.5 s, 1 s), is no productive time
    assert (p1.teardown_s, p2.teardown_s, p3.teardown_s) == (0.5, 0.0, 1.0) and doc["teardown_s"] == 1.5
    assert doc["productive_s"] == pytest.approx(
        doc["wall_s"] - doc["startup_s"] - doc["checkpoint_stall_s"] - 5.0 - 1.5
    )
    assert doc["between_processes_s"] == pytest.approx((120.0 - 111.5) + (146.0 - 137.0))
    assert [step for _, step, _, _ in r.metrics["loss"]] == [50, 210, 300]
    text = "\n".join(render(r, "runs/x"))
    assert "3 process(es), 2 restart(s)" in text and "30 (" in text and "goodput" in text


def stop_and_resume(exit_lines: bool) -> list[dict]:
    """A stop at t=10 and a resume whose process started at t=13; with exit lines 1.5 s and 0.2 s after each end."""
    return [
        {"t": 1.0, "event": "start", "step": 0, "pid": 1, "proc_start": 0.0},
        {"t": 10.0, "event": "stop", "step": 90, "cause": "SIGTERM"},
        *([{"t": 11.5, "event": "exit", "pid": 1}] if exit_lines else []),
        {"t": 14.0, "event": "resume", "step": 90, "pid": 2, "proc_start": 13.0},
        {"t": 20.0, "event": "complete", "step": 150},
        *([{"t": 20.2, "event": "exit", "pid": 2}] if exit_lines else []),
    ]


def test_teardown_is_told_apart_from_the_time_between_processes():
    """From a run's end line to its exit line is the process's teardown (no productive time); from the exit line to
    the next start is between processes, and the text says that this begins with the interpreter's own exit."""
    r = build(stop_and_resume(exit_lines=True))
    p1, p2 = r.processes
    assert (p1.ended, p1.exited, p1.teardown_s) == (10.0, 11.5, 1.5)
    assert p2.teardown_s == pytest.approx(0.2)
    assert p1.wall_s == 11.5 and p1.productive_s == 11.5 - 1.0 - 1.5
    doc = r.to_json()
    assert doc["teardown_s"] == pytest.approx(1.7) and doc["between_processes_s"] == 1.5
    assert doc["between_processes"] == [{"after_process": 1, "s": 1.5, "from": "exit line"}]
    assert [p["teardown_s"] for p in doc["timeline"]] == [1.5, pytest.approx(0.2)]
    assert doc["productive_s"] + doc["startup_s"] + doc["checkpoint_stall_s"] + doc["lost_s"] + doc[
        "teardown_s"
    ] == pytest.approx(doc["wall_s"])
    text = "\n".join(render(r, "runs/x"))
    assert "teardown 1.70 s" in text
    assert "between processes (not in the wall time): 1.50 s: the interpreter's exit after an exit line" in text

    # A history without exit lines (before they were written): as before, each process ends at its end line.
    old = build(stop_and_resume(exit_lines=False))
    assert [p.teardown_s for p in old.processes] == [0.0, 0.0] and old.processes[0].wall_s == 10.0
    assert old.gaps() == [{"after_process": 1, "s": 3.0, "from": "end line"}]
    assert "from the last line of a process that left no exit line" in "\n".join(render(old, "runs/x"))


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


def test_a_restart_is_split_into_start_up_restore_and_the_first_steps_warm_up():
    """made_at splits the start-up at the run's making; first_step says when the first step(s) ended, and the pace of
    the later lines what a steady step costs. A history from before these fields leaves them unsaid (None)."""
    lines = [
        {"t": 100.0, "event": "resume", "step": 10, "pid": 1, "proc_start": 90.0, "made_at": 97.5},
        {"t": 101.0, "event": "first_step", "step": 11},
        {"t": 111.0, "step": 111, "epoch": 0, "metrics": {"loss": 1.0}},  # 100 steps in 10 s: 0.1 s each
        {"t": 111.0, "event": "complete", "step": 111},
    ]
    (p,) = build(lines).processes
    split = p.split()
    assert split["before_run_s"] == 7.5 and split["restore_s"] == 2.5
    assert split["first_steps"] == 1 and split["first_steps_s"] == 1.0
    assert split["step_s"] == pytest.approx(0.1) and split["warmup_s"] == pytest.approx(0.9)
    text = "\n".join(render(build(lines), "run"))
    assert "#1 before the run 7.50 s, restore 2.50 s, first step 1.00 s (0.90 s beyond steady ones)" in text, text
    assert build(lines).to_json()["timeline"][0]["startup"] == split

    old = [line for line in lines if line.get("event") != "first_step"]
    old[0] = {k: v for k, v in old[0].items() if k != "made_at"}
    assert set(build(old).processes[0].split().values()) == {None}
    assert "start-up of each process" not in "\n".join(render(build(old), "run"))
    absurd = [{**lines[0], "made_at": 80.0}, *lines[1:]]  # before the process started: not a split
    assert build(absurd).processes[0].split()["restore_s"] is None


def test_a_process_killed_in_its_restore_counts_as_a_process_that_ran_no_step():
    """Its restoring line is its only one; its neighbours' steps are accounted as without it."""
    lines = [
        {"t": 1.0, "event": "restoring", "pid": 1, "proc_start": 0.0},
        {"t": 2.0, "event": "start", "step": 0, "pid": 1, "proc_start": 0.0},
        {"t": 9.0, "event": "checkpoint", "step": 80, "reason": "steps", "stall_s": 0.1, "write_s": 0.1, "at": 8.9},
        {"t": 10.0, "step": 90, "metrics": {"loss": 1.0}},  # then SIGKILLed at step 90
        {"t": 12.5, "event": "restoring", "pid": 2, "proc_start": 12.0, "made_at": 12.2},  # SIGKILLed reading 80
        {"t": 14.0, "event": "restoring", "pid": 3, "proc_start": 13.0},
        {"t": 15.0, "event": "resume", "step": 80, "pid": 3, "proc_start": 13.0, "crashed": {"died_at": 90}},
        {"t": 20.0, "event": "complete", "step": 150},
    ]
    r = build(lines)
    p1, p2, p3 = r.processes
    assert [p.reached_run for p in r.processes] == [True, False, True]
    assert (p1.start_step, p1.end_step, p1.lost_steps) == (0, 90, 10)  # what process 3 did again, not process 2
    assert (p2.start_step, p2.end_step, p2.lost_steps, p2.how) == (80, 80, 0, "killed")
    assert (p2.started, p2.end, p2.wall_s) == (12.0, 12.5, 0.5) and p2.made == 12.2
    assert (p3.start_step, p3.entered, p3.startup_s, p3.resumed) == (80, 15.0, 2.0, True)
    assert r.to_json()["lost_steps"] == 10
    assert "killed in its restore" in "\n".join(render(r, "runs/x"))


def test_the_same_process_past_its_restoring_line_is_one_process():
    lines = [
        {"t": 1.0, "event": "restoring", "pid": 7, "proc_start": 0.5, "made_at": 0.8},
        {"t": 2.0, "event": "resume", "step": 40, "pid": 7, "proc_start": 0.5, "made_at": 0.8},
        {"t": 3.0, "event": "stop", "step": 45, "cause": "SIGTERM"},
    ]
    (p,) = build(lines).processes
    assert (p.reached_run, p.resumed, p.start_step, p.end_step, p.startup_s, p.how) == (True, True, 40, 45, 1.5, "stop")
    assert p.split()["restore_s"] == pytest.approx(1.2)
