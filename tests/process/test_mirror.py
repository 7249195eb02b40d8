"""Checkpoints mirrored to a real S3 server (moto_server, tests/s3server.py) by real training processes:
a SIGTERM's checkpoint is in the mirror within the deadline and a new machine resumes from it bit for bit (an object
corrupted in the mirror is detected and the older checkpoint used); a SIGKILL in the middle of an upload never leaves
a checkpoint that looks complete, and a rerun uploads it, carried files by server-side copy; the server stopped
mid-run (training goes on, one warning, uploads catch up) and at the stop (the deadline is kept, the log says which
step the mirror holds). Each state is reached by a file the script waits on, a hold, or a SIGSTOP of the server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import s3server
from helpers import PREEMPTED, Spawned, assert_same_final, free_port, run_python, train_cmd

from preempt.checkpoint.names import MANIFEST, checkpoint_name
from preempt.health.history import read_history
from preempt.mirror.store import MirrorStore
from preempt.mirror.survey import Surveyor

MODEL = ["--epochs", "2", "--samples", "64", "--batch_size", "16"]  # 4 steps per epoch, 8 in all
# test_preemption.py's WORKERS0 (48 steps): its uninterrupted reference run is computed once per test run, shared
REFERENCE = ["--epochs", "3", "--samples", "256", "--dropout", "0.3"]
SAVES = ["--every_steps", "2", "--sync_save"]  # checkpoints at steps 2, 4, 6, 8, each when it is due


def events(save_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_history(save_dir, timeline=False) if e.get("event") == kind]


def wait_until_held(store: MirrorStore, step: int, timeout: float = 120.0) -> int:
    """Waits until the mirror holds ``step`` complete (the uploader's own pace); returns its newest complete step."""
    deadline = time.monotonic() + timeout
    while True:
        surveyed = Surveyor(store).survey()
        if step in surveyed.manifests:
            return surveyed.newest  # type: ignore[return-value]
        assert time.monotonic() < deadline, f"the mirror never held step {step}: {surveyed}"
        time.sleep(0.1)


def test_stop_is_mirrored_and_a_new_machine_resumes_from_the_mirror(tmp_path, reference, mirror_url):
    save_dir, final = tmp_path / "run", tmp_path / "final.safetensors"
    args = [*REFERENCE, "--every_steps", "8", "--sync_save", "--mirror", mirror_url]
    p = Spawned(train_cmd(save_dir, final, [*args, "--hold_at", "step:20"]))
    assert p.wait_event("holding", point="step", n=20)
    p.signal(signal.SIGTERM)
    assert p.finish() == PREEMPTED, p.output
    # SIGTERM -> the stop's checkpoint durable locally -> in the mirror within the deadline, and the line says so
    assert p.events_of("mirror_end", step=20, held=20), p.events
    store = MirrorStore(mirror_url)
    held = Surveyor(store).survey()
    assert 20 in held.manifests and len(held.complete) >= 2, held
    older = max(s for s in held.complete if s < 20)

    # The stop's model object overwritten through the S3 API (same size, other bytes), and the machine gone.
    size = held.listing[20]["model.safetensors"]
    store.put_bytes(20, "model.safetensors", b"\x5a" * size)
    shutil.rmtree(save_dir)
    p = Spawned(train_cmd(save_dir, final, args))
    assert p.finish() == 0, p.output
    assert p.events_of("mirror_pull", step=older, failed=1), p.events  # step 20's object did not verify
    assert f"had no checkpoint; resuming from the mirror's step {older} " in p.output, p.output
    assert f"resumed from {save_dir / checkpoint_name(older)}" in p.output
    assert "mirror holds step 48 (the final checkpoint)" in p.output
    assert_same_final(reference(REFERENCE), final)
    pulls = events(save_dir, "mirror_pull")
    assert [(e["step"], e["failed"]) for e in pulls] == [(older, 1)] and pulls[0]["bytes"] > 0


def test_sigkill_mid_upload_never_looks_complete_and_carried_files_are_copied(tmp_path, mirror_url):
    save_dir = tmp_path / "run"
    args = [*MODEL, *SAVES, "--lora", "--mirror", mirror_url]
    # The loop waits after its first checkpoint for a file nobody writes; the uploader is killed inside step 2's
    # upload, after its first data object and before its manifest.
    hold = ["--wait_file_at", f"saved:1:{tmp_path / 'never'}", "--mirror_kill_at", "after_first_object:2"]
    p = Spawned(train_cmd(save_dir, None, [*args, *hold]))
    assert p.finish() == -signal.SIGKILL, p.output
    assert "mirror_kill after_first_object 2" in p.output
    store = MirrorStore(mirror_url)
    cut = Surveyor(store).survey()
    assert cut.listing[2] and MANIFEST not in cut.listing[2] and cut.complete == [], cut

    # The same machine: it resumes from step 2 and holds in its first step until the mirror holds step 2.
    go = tmp_path / "go"
    p = Spawned(train_cmd(save_dir, None, [*args, "--wait_file_at", f"step:1:{go}"]))
    assert p.wait_event("waiting", point="step", n=1)
    wait_until_held(store, 2)
    go.touch()
    assert p.finish() == 0, p.output
    assert "mirror holds step 8 (the final checkpoint)" in p.output
    done = Surveyor(store).survey()
    assert done.complete == [6, 8], done  # keep_last=2, as in save_dir
    uploads = {e["uploaded"]: e for e in events(save_dir, "mirror")}
    assert {2, 6, 8} <= set(uploads), uploads
    assert uploads[2]["copied"] == [] and uploads[2]["copied_bytes"] == 0  # nothing complete to copy from yet
    base_size = done.manifests[8].files["base.safetensors"].size
    for step in sorted(uploads)[1:]:  # every later checkpoint carries its frozen base: copied, never uploaded again
        assert uploads[step]["copied"] == ["base.safetensors"], uploads
        assert uploads[step]["copied_bytes"] == base_size, uploads
    for step in (6, 8):
        files = done.manifests[step].files
        assert files["base.safetensors"].carried_from is not None
        assert uploads[step]["put_bytes"] == sum(d.size for n, d in files.items() if n != "base.safetensors")
    # the run's records are mirrored too
    assert store.read_text("history.jsonl") and b"run complete" in (store.read_text("train.log") or b"")


def test_server_stopped_mid_run_and_at_the_stop(tmp_path, monkeypatch):
    """SIGSTOP of the server: the loop goes on with one warning, catches up after SIGCONT; SIGSTOP again at the
    stop: the process exits after the deadline, saying which step the mirror holds instead of the stop's."""
    save_dir = tmp_path / "run"
    go1, go2 = tmp_path / "go1", tmp_path / "go2"
    with s3server.start(free_port()) as server:
        for name, value in s3server.env(server.endpoint).items():
            monkeypatch.setenv(name, value)
        url = f"s3://{s3server.new_bucket(server.endpoint)}/run"
        # a stopped server fails an operation in 2 s (op_timeout), not 20 (and its read timeout in 1 s, not 10)
        fast = {"config_kwargs": {"connect_timeout": 1, "read_timeout": 1}, "op_timeout": 2}
        args = [*MODEL, "--epochs", "3", "--every_steps", "1", "--sync_save", "--mirror", url]
        args += ["--mirror_options", json.dumps(fast), "--mirror_deadline", "3"]
        waits = ["--wait_file_at", f"step:3:{go1},step:8:{go2}", "--hold_at", "step:10"]
        p = Spawned(train_cmd(save_dir, None, [*args, *waits]))
        assert p.wait_event("waiting", point="step", n=3)
        server.pause()
        go1.touch()
        # training goes on (it reaches step 8 with the server stopped) and says so once
        assert p.wait_event("waiting", point="step", n=8) and p.wait_event("mirror_down")
        server.resume()
        go2.touch()
        assert p.wait_event("mirror_up")
        assert p.wait_event("holding", point="step", n=10)
        before = p.output.split("reachable again")[0]
        assert before.count("training goes on, uploads are retried") == 1, p.output
        held = wait_until_held(MirrorStore(url), 9)  # the newest checkpoint before the hold, then the uploader idles
        server.pause()
        t0 = time.monotonic()
        p.signal(signal.SIGTERM)
        assert p.finish() == PREEMPTED, p.output
        took = time.monotonic() - t0
        server.resume()
    assert took < 3 + 30, took  # the deadline and the process's own exit (imports torn down, files closed)
    down, up, end = events(save_dir, "mirror_down"), events(save_dir, "mirror_up"), events(save_dir, "mirror_end")
    assert len(down) >= 1 and len(up) == 1 and up[0]["behind"] >= 1, (down, up)
    assert len(end) == 1 and end[0]["step"] == 10 and end[0]["held"] == held, end
    assert end[0]["behind_steps"] >= 1 and end[0]["max_behind_steps"] >= 4 and end[0]["max_behind_s"] > 0, end
    assert os.path.exists(save_dir / checkpoint_name(10) / MANIFEST)  # local durable, whatever the mirror
    # preempt report shows how far behind the mirror was
    r = run_python([sys.executable, "-m", "preempt", "report", str(save_dir), "--json"])
    shown = json.loads(r.stdout)["mirror"]
    assert shown["outages"] == len(down) and shown["max_behind_steps"] >= 4, shown
    assert (shown["end"]["held"], shown["end"]["behind_steps"]) == (held, 1), shown
    assert shown["end"]["behind_s"] >= 3.0, shown  # at least the deadline it waited (more if slow)
