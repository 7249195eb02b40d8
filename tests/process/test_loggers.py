"""TensorBoard and W&B across a stop, a kill and the resume: one run in each, every step once.

TensorBoard is read back from its event files with tensorboard's own EventAccumulator (which applies the purge a
resumed writer asks for); W&B runs offline (``WANDB_MODE=offline``) and its run files (``run-<id>.wandb``, records
in LevelDB's log format) are read here directly.
"""

from __future__ import annotations

import json
import signal
import struct
from pathlib import Path

import pytest
from helpers import PREEMPTED, Spawned, in_step, train_cmd

tensorboard = pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

ARGS = ["--epochs", "2", "--samples", "128", "--metrics", "--report_epoch_end"]  # 8 steps per epoch, 16 in all
WANDB_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}


def scalars(log_dir: Path, tag: str, purge: bool = True) -> list[tuple[int, float]]:
    """(step, value) of every event of ``tag``, as TensorBoard shows them (``purge``) or as written."""
    acc = EventAccumulator(str(log_dir), purge_orphaned_data=purge)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def wandb_records(path: Path) -> list[tuple[str, object]]:
    """The records of a W&B run file: ``("run", id)``, ``("history", (step, {key: value}))``, ``("preempting", None)``.

    The file is a ``:W&B`` header (7 bytes), then LevelDB log blocks of 32 KiB: records with a 7-byte header
    (crc32c, length, type 1 full / 2 first / 3 middle / 4 last), each a protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    out: list[tuple[str, object]] = []
    pos, record = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the rest of a block is padding
            pos += left
            continue
        record += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind not in (1, 4):
            continue
        rec = pb.Record()
        rec.ParseFromString(record)
        record = b""
        which = rec.WhichOneof("record_type")
        if which == "run":
            out.append(("run", rec.run.run_id))
        elif which == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            out.append(("history", (rec.history.step.num, items)))
        elif which == "preempting":
            out.append(("preempting", None))
    return out


def test_a_stop_and_resume_keep_one_tensorboard_log_and_one_wandb_run(tmp_path):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    save_dir = tmp_path / "run"
    args = [*ARGS, "--loggers", "tensorboard,wandb"]
    stop = in_step(11)
    first = Spawned(train_cmd(save_dir, None, [*args, *stop.args]), WANDB_ENV)
    assert first.wait_event(stop.after.kind, **stop.after.fields), first.output
    first.signal(signal.SIGTERM)
    assert first.finish() == PREEMPTED, first.output
    second = Spawned(train_cmd(save_dir, None, args), WANDB_ENV)
    assert second.finish() == 0, second.output
    assert "logger " not in first.output + second.output  # no logger failed

    # TensorBoard: steps 1..16 once each, the epoch ends' reports at their steps
    loss = scalars(save_dir / "tensorboard", "loss")
    assert [s for s, _ in loss] == list(range(1, 17)), loss
    assert [s for s, _ in scalars(save_dir / "tensorboard", "epoch_draw")] == [8, 16]

    # W&B: one id, kept in save_dir/wandb.json; the first process logged steps 1..11 and was marked preempting,
    # the second 12..16, into a run of the same id
    run_id = json.loads((save_dir / "wandb.json").read_text())["id"]
    runs = sorted((save_dir / "wandb").glob("offline-run-*"))
    assert [r.name.rsplit("-", 1)[1] for r in runs] == [run_id, run_id], runs
    steps = []
    for run, want in zip(runs, (range(1, 12), range(12, 17)), strict=True):
        records = wandb_records(run / f"run-{run_id}.wandb")
        assert ("run", run_id) in records
        logged = {step for kind, value in records if kind == "history" for step in [value[0]]}  # type: ignore[index]
        assert logged == set(want), (run.name, sorted(logged))
        steps += [value for kind, value in records if kind == "history"]
    assert ("preempting", None) in wandb_records(runs[0] / f"run-{run_id}.wandb")
    by_step = {step: items for step, items in steps}  # type: ignore[misc]
    assert [by_step[s]["loss"] for s in range(1, 17)] == pytest.approx([v for _, v in loss], rel=1e-6)
    assert set(by_step[8]) >= {"loss", "epoch_draw"} and "epoch_draw" not in by_step[7]


def test_tensorboard_drops_what_a_killed_process_logged_after_its_last_checkpoint(tmp_path):
    """SIGKILL at step 6, after the checkpoint of step 4: the rerun logs steps 5 and 6 again (exactly the same values,
    the resume being exact) and its writer's purge_step=5 makes TensorBoard show them once, from the rerun."""
    save_dir = tmp_path / "run"
    args = [*ARGS, "--loggers", "tensorboard", "--every_steps", "4", "--sync_save"]
    first = Spawned(train_cmd(save_dir, None, [*args, "--kill_at_step", "6:KILL"]))
    assert first.finish() == -signal.SIGKILL, first.output
    second = Spawned(train_cmd(save_dir, None, args))
    assert second.finish() == 0, second.output
    assert second.events_of("resume", step=4), second.events
    written = scalars(save_dir / "tensorboard", "loss", purge=False)
    assert [s for s, _ in written] == [1, 2, 3, 4, 5, 6, *range(5, 17)], written  # both processes' events
    assert written[4:6] == written[6:8], "the recomputed steps logged other values"
    shown = scalars(save_dir / "tensorboard", "loss")
    assert [s for s, _ in shown] == list(range(1, 17)), shown
    assert shown[4:6] == written[6:8]
