"""RunLog, History and Progress on real files in tmp_path, with fake clocks."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from pathlib import Path

import pytest
import torch
from helpers import FakeClock

from preempt import _log
from preempt.health.history import HISTORY_FILE, LOG_FILE, History, RunLog, read_history
from preempt.health.progress import ETA_CAP_S, Progress, eta_seconds, fmt_number


def strict_lines(path: Path) -> list[dict]:
    """Every line parsed as strict JSON (no NaN/Infinity literals)."""

    def reject(name: str) -> None:
        raise AssertionError(f"non-JSON constant {name} in {path}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


@pytest.fixture
def preempt_logger():
    """The ``preempt`` logger with its handlers, filters, level and propagation restored afterwards."""
    lg = _log.log
    saved = (list(lg.handlers), list(lg.filters), lg.level, lg.propagate)
    lg.setLevel(logging.INFO)  # under pytest the root logger has handlers, so _log.setup() sets no level
    yield lg
    for h in list(lg.handlers):
        if h not in saved[0]:
            lg.removeHandler(h)
            h.close()
    lg.handlers[:] = saved[0]
    lg.filters[:] = saved[1]
    lg.setLevel(saved[2])
    lg.propagate = saved[3]


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# ----------------------------------------------------------------------------------------------------- History


def test_history_appends_across_restarts(tmp_path: Path) -> None:
    clock = FakeClock(1000.0)
    with History(tmp_path, clock=clock) as h:
        h.marker("start", pid=1)
        h.record(1, 0, {"loss": 2.5}, lr=0.1, step_time_s=0.25, gpu_mem={"allocated": 123})
        h.record(2, 0, {"loss": 2.25})
    clock.t = 2000.0
    with History(tmp_path, clock=clock) as h:  # the requeued job
        h.record(3, 0, {"loss": 2.0}, lr=[0.1, 0.01])
    lines = strict_lines(tmp_path / HISTORY_FILE)
    assert lines == [
        {"t": 1000.0, "event": "start", "pid": 1},
        {
            "t": 1000.0,
            "step": 1,
            "epoch": 0,
            "metrics": {"loss": 2.5},
            "lr": 0.1,
            "step_time_s": 0.25,
            "gpu_mem": {"allocated": 123},
        },
        {"t": 1000.0, "step": 2, "epoch": 0, "metrics": {"loss": 2.25}},
        {"t": 2000.0, "step": 3, "epoch": 0, "metrics": {"loss": 2.0}, "lr": [0.1, 0.01]},
    ]


def test_each_line_is_on_disk_before_close(tmp_path: Path) -> None:
    h = History(tmp_path)
    h.record(1, 0, {"loss": 1.0})
    assert len(strict_lines(tmp_path / HISTORY_FILE)) == 1  # read by another open file: no buffering
    h.close()
    h.close()  # idempotent
    h.record(2, 0, {"loss": 1.0})  # after close: dropped
    assert len(strict_lines(tmp_path / HISTORY_FILE)) == 1


def test_resume_marker_and_timeline(tmp_path: Path) -> None:
    with History(tmp_path, clock=FakeClock()) as h:
        for step in range(1, 6):
            h.record(step, 0, {"loss": 1.0 / step})
    with History(tmp_path, clock=FakeClock()) as h:  # killed after step 5; its last checkpoint was step 3
        h.marker("resume", step=3, from_="runs/x/step_000000003")
        h.record(4, 0, {"loss": 0.5})
    raw = strict_lines(tmp_path / HISTORY_FILE)
    assert raw[5] == {"t": 1000.0, "event": "resume", "step": 3, "from": "runs/x/step_000000003"}
    assert [d.get("step") for d in read_history(tmp_path, timeline=False)] == [1, 2, 3, 4, 5, 3, 4]
    timeline = read_history(tmp_path / HISTORY_FILE)
    assert [(d.get("event"), d["step"]) for d in timeline] == [
        (None, 1),
        (None, 2),
        (None, 3),
        ("resume", 3),
        (None, 4),
    ]
    assert timeline[-1]["metrics"] == {"loss": 0.5}


def test_torn_last_line(tmp_path: Path) -> None:
    with History(tmp_path) as h:
        h.record(1, 0, {"loss": 1.0})
    with open(tmp_path / HISTORY_FILE, "ab") as f:
        f.write(b'{"t":1.0,"step":2,"ep')  # the process was killed inside a write
    with History(tmp_path) as h:
        h.record(2, 0, {"loss": 0.5})
    text = (tmp_path / HISTORY_FILE).read_text()
    assert text.endswith('\n{"t":' + text.rsplit('{"t":', 1)[1])  # our line starts on a fresh line
    assert [d["step"] for d in read_history(tmp_path)] == [1, 2]


def test_rank_other_than_0_writes_nothing(tmp_path: Path) -> None:
    save_dir = tmp_path / "run"
    with History(save_dir, rank=1) as h:
        assert not h.active
        h.record(1, 0, {"loss": 1.0})
        h.marker("resume", step=0)
    assert not save_dir.exists()


def test_non_finite_and_tensor_values(tmp_path: Path) -> None:
    with History(tmp_path) as h:
        h.record(1, 0, {"loss": float("nan"), "hi": float("inf"), "lo": -float("inf"), "acc": torch.tensor(0.5)})
        h.record(2, 0, {"loss": torch.tensor([1.0, 2.0])}, lr=torch.tensor(0.25))
    a, b = strict_lines(tmp_path / HISTORY_FILE)
    assert a["metrics"] == {"loss": "nan", "hi": "inf", "lo": "-inf", "acc": 0.5}
    assert b["metrics"] == {"loss": [1.0, 2.0]} and b["lr"] == 0.25


def test_write_error_is_logged_once(tmp_path: Path, preempt_logger: logging.Logger) -> None:
    seen = Collect()
    preempt_logger.addHandler(seen)
    h = History(tmp_path)
    os.close(h._fd)  # writes fail from now on (EBADF), as they would on a full disk
    h._fd = os.open(os.devnull, os.O_RDONLY)
    h.record(1, 0, {})
    h.record(2, 0, {})
    assert sum("cannot append" in m for m in seen.messages) == 1
    h.close()


# ------------------------------------------------------------------------------------------------------ RunLog


LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (INFO|WARNING|ERROR|DEBUG) ")


def test_runlog_writes_lines_and_detaches(tmp_path: Path, preempt_logger: logging.Logger) -> None:
    run = RunLog(tmp_path)
    run.start()
    preempt_logger.info("checkpoint %s written", "step_1")
    preempt_logger.warning("something odd")
    run.close()
    run.close()  # idempotent
    preempt_logger.info("after close")
    assert not [h for h in preempt_logger.handlers if isinstance(h, logging.FileHandler)]
    lines = (tmp_path / LOG_FILE).read_text().splitlines()
    assert len(lines) == 3, lines
    assert all(LINE.match(line) for line in lines), lines
    assert re.search(rf"INFO ==== start \(fresh\) pid {os.getpid()} host \S+ ====$", lines[0])
    assert lines[1].endswith("INFO checkpoint step_1 written")
    assert lines[2].endswith("WARNING something odd")
    assert "[rank" not in "".join(lines)


def test_runlog_resumed_marker_and_appends(tmp_path: Path, preempt_logger: logging.Logger) -> None:
    with RunLog(tmp_path) as run:
        run.start()
        preempt_logger.info("first process")
    with open(tmp_path / LOG_FILE, "a") as f:
        f.write("2025-01-01 00:00:00.000 INFO half a li")  # killed mid-line
    with RunLog(tmp_path) as run:
        run.start(resumed_from=tmp_path / "step_000000120", step=120)
        preempt_logger.info("second process")
    lines = (tmp_path / LOG_FILE).read_text().splitlines()
    assert len(lines) == 5
    assert lines[2].endswith("half a li")
    assert f"==== start (resumed from {tmp_path / 'step_000000120'} at step 120) pid" in lines[3]
    assert lines[4].endswith("second process")


def test_runlog_marker_not_on_console(tmp_path: Path, preempt_logger: logging.Logger) -> None:
    seen = Collect()
    preempt_logger.addHandler(seen)
    with RunLog(tmp_path) as run:
        run.start()
        preempt_logger.info("hello")
    assert seen.messages == ["hello"]


def test_two_runlogs_no_duplicate_handlers(tmp_path: Path, preempt_logger: logging.Logger) -> None:
    def files() -> int:
        return sum(isinstance(h, logging.FileHandler) for h in preempt_logger.handlers)

    a = RunLog(tmp_path)
    b = RunLog(tmp_path)  # a was never closed (an earlier run in the same process)
    assert files() == 1
    preempt_logger.info("once")
    assert (tmp_path / LOG_FILE).read_text().count("once") == 1
    a.close()  # closing the replaced one does not detach the new one
    preempt_logger.info("twice")
    b.close()
    assert files() == 0
    assert (tmp_path / LOG_FILE).read_text().count("twice") == 1


def test_console_handler_attached_first(tmp_path: Path, preempt_logger: logging.Logger) -> None:
    """With no logging set up, the file handler must not stop _log.setup() from adding the stderr handler."""
    root = logging.getLogger()
    saved_root = list(root.handlers)
    preempt_logger.handlers[:] = []
    root.handlers[:] = []
    try:
        with RunLog(tmp_path):
            kinds = sorted(type(h).__name__ for h in preempt_logger.handlers)
            assert kinds == ["_Console", "_FileHandler"]
    finally:
        root.handlers[:] = saved_root


def test_runlog_rank_tag(tmp_path: Path, preempt_logger: logging.Logger) -> None:
    with RunLog(tmp_path, rank=0, world_size=4):
        preempt_logger.info("hello")
    assert (tmp_path / LOG_FILE).read_text().splitlines()[0].endswith("INFO [rank 0] hello")


def test_runlog_other_rank_silent(tmp_path: Path, preempt_logger: logging.Logger) -> None:
    seen = Collect()
    preempt_logger.addHandler(seen)
    with RunLog(tmp_path / "run", rank=1, world_size=2) as run:
        run.start()
        preempt_logger.warning("rank 1 says")
        preempt_logger.error("rank 1 lost its peers")
    preempt_logger.info("after")
    assert not (tmp_path / "run").exists()
    # Nothing below ERROR reached any handler while silenced: an error that ends the rank does.
    assert seen.messages == ["rank 1 lost its peers", "after"]


def test_runlog_all_ranks(tmp_path: Path, preempt_logger: logging.Logger) -> None:
    seen = Collect()
    preempt_logger.addHandler(seen)
    with RunLog(tmp_path, rank=1, world_size=2, log_all_ranks=True) as run:
        run.start()
        preempt_logger.info("rank 1 says")
    assert not (tmp_path / LOG_FILE).exists()
    lines = (tmp_path / "train.rank1.log").read_text().splitlines()
    assert "INFO [rank 1] ==== start (fresh)" in lines[0]
    assert lines[1].endswith("INFO [rank 1] rank 1 says")
    assert seen.messages == ["rank 1 says"]


def test_runlog_threads_and_tracebacks(tmp_path: Path, preempt_logger: logging.Logger) -> None:
    with RunLog(tmp_path):

        def talk(k: int) -> None:
            for i in range(200):
                preempt_logger.info("thread %d line %d %s", k, i, "x" * 200)

        threads = [threading.Thread(target=talk, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        try:
            raise ValueError("boom")
        except ValueError:
            preempt_logger.exception("failed")
    text = (tmp_path / LOG_FILE).read_text()
    lines = text.splitlines()
    body = [line for line in lines if " INFO thread " in line]
    assert len(body) == 800 and all(LINE.match(line) and line.endswith("x" * 200) for line in body)
    assert "ERROR failed\nTraceback (most recent call last):" in text and "ValueError: boom" in text


def test_runlog_bad_rank(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        RunLog(tmp_path, rank=2, world_size=2)


# ---------------------------------------------------------------------------------------------------- Progress


def test_progress_throttle_rate_and_eta() -> None:
    clock = FakeClock(0.0)
    p = Progress(1000, every_s=30.0, clock=clock)
    first = p.update(0, 0, 0, 100, {"loss": 2.3456789})
    assert first == "step 0/1000 | epoch 0 batch 0/100 | loss 2.346"  # at once, no rate yet
    clock.t = 29.9
    assert p.update(299, 2, 99, 100, {"loss": 1.0}) is None
    clock.t = 30.0
    line = p.update(300, 3, 0, 100, {"loss": 1.5, "lr": 3e-4})
    assert line == "step 300/1000 | epoch 3 batch 0/100 | loss 1.5 lr 0.0003 | 10 steps/s | ETA 1m10s"
    clock.t = 50.0
    assert p.update(500, 5, 0, 100) is None
    clock.t = 60.0  # the rate is over the window since the last line: 300 steps in 30 s
    assert p.update(600, 6, 0, 100) == "step 600/1000 | epoch 6 batch 0/100 | 10 steps/s | ETA 40 s"
    clock.t = 90.0  # 15 steps in 30 s
    assert p.update(615, 6, 15, None) == "step 615/1000 | epoch 6 batch 15 | 2.00 s/step | ETA 12m50s"


def test_progress_never_absurd_eta() -> None:
    clock = FakeClock(0.0)
    p = Progress(10**9, every_s=1.0, clock=clock)
    p.update(5, 0, 5, None)
    clock.t = 100.0
    assert p.update(5, 0, 5, None) == "step 5/1000000000 | epoch 0 batch 5"  # no progress: no rate, no ETA
    clock.t = 1e6
    line = p.update(6, 0, 6, None)  # one step in ~11.6 days
    assert line == "step 6/1000000000 | epoch 0 batch 6 | 11d13h/step | ETA >99d"
    p2 = Progress(100, every_s=0.0, clock=clock)
    p2.update(1, 0, 1, None)
    assert "ETA" not in p2.update(2, 0, 2, None)  # the clock did not advance: rate unknown
    p3 = Progress(None, every_s=0.0, clock=clock)
    p3.update(1, 0, 1, None)
    clock.t += 1
    assert p3.update(3, 0, 3, None) == "step 3 | epoch 0 batch 3 | 2 steps/s"  # no total: no ETA
    p4 = Progress(10, every_s=0.0, clock=clock)
    p4.update(9, 0, 9, None)
    clock.t += 1
    assert "ETA" not in p4.update(12, 0, 12, None)  # past the total
    assert eta_seconds(100, None) is None and eta_seconds(100, 0.0) is None
    assert eta_seconds(100, float("nan")) is None and eta_seconds(100, float("inf")) is None
    assert eta_seconds(100, 1e-12) == ETA_CAP_S
    assert eta_seconds(100, 4.0) == 25.0


def test_progress_steps_backwards_no_rate() -> None:
    clock = FakeClock(0.0)
    p = Progress(100, every_s=1.0, clock=clock)
    p.update(50, 0, 50, None)
    clock.t = 10.0
    assert p.update(40, 0, 40, None) == "step 40/100 | epoch 0 batch 40"


def test_fmt_number() -> None:
    assert fmt_number(2.3456789) == "2.346"
    assert fmt_number(3e-4) == "0.0003"
    assert fmt_number(1.2e-5) == "1.200e-05"
    assert fmt_number(123456.0) == "1.235e+05"
    assert fmt_number(0.0) == "0"
    assert fmt_number(7) == "7"
    assert fmt_number(float("nan")) == "nan" and fmt_number(-float("inf")) == "-inf"
    assert fmt_number(torch.tensor(0.5)) == "0.5"


def test_epoch_summary() -> None:
    p = Progress(None)
    s = p.epoch_summary(
        3,
        {"train_loss": 0.2345678, "eval_loss": 0.3456789},
        253.4,
        best={"eval_loss": 0.30123, "epoch": 2},
        peak_gpu_mem=int(4.5 * (1 << 30)),
    )
    assert s == (
        "epoch 3 done in 4m13s | train_loss 0.2346 eval_loss 0.3457 | best eval_loss 0.3012 (epoch 2)"
        " | peak GPU memory 4.5 GiB"
    )
    assert p.epoch_summary(0, {}, None) == "epoch 0 done"


def test_progress_validation() -> None:
    with pytest.raises(ValueError, match="every_s"):
        Progress(10, every_s=-1)
    with pytest.raises(ValueError, match="total_steps"):
        Progress(-5)
