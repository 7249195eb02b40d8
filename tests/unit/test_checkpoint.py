"""CheckpointManager on its own: round trip, fallback, quarantine, retention, failures mid-write."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from preempt import CheckpointManager, CorruptCheckpointError, IncompatibleStateError, NoCheckpointError
from preempt.checkpoint import commit, hashed_io, state
from preempt.errors import CheckpointError


def objects(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    sched.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return model, opt, sched, scaler


def test_round_trip_restores_every_component(tmp_path):
    model, opt, sched, scaler = objects(0)
    m = CheckpointManager(tmp_path)
    m.prepare()
    info = m.save_state(step=7, model=model, optimizer=opt, scheduler=sched, scaler=scaler, user_state={"k": [1, 2]})
    assert info.path == tmp_path / "step_000000007"
    model2, opt2, sched2, scaler2 = objects(1)
    info2, loaded = m.load("latest")
    state.apply(state.Components(model2, opt2, sched2, scaler2), loaded)
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for i in s1["state"]:
        for k in s1["state"][i]:
            assert torch.equal(s1["state"][i][k], s2["state"][i][k])
    assert sched.state_dict() == sched2.state_dict()
    assert scaler.state_dict() == scaler2.state_dict()
    assert loaded.tree["user"] == {"k": [1, 2]}
    assert loaded.tree["optimizer_class"] == "torch.optim.adamw.AdamW"  # for inspect; apply() above ignored it
    assert opt2.param_groups[0]["betas"] == (0.8, 0.95)


def test_files_are_standard_safetensors(tmp_path):
    from safetensors.torch import load_file

    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path)
    m.prepare()
    info = m.save_state(step=1, model=model, optimizer=opt)
    weights = load_file(str(info.path / "model.safetensors"))
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    manifest = json.loads((info.path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "state.safetensors", "state.json"}
    assert manifest["provenance"] == {} and manifest["format"] == "preempt-checkpoint"


@pytest.mark.parametrize("recycle", [True, False])
def test_keep_last_prunes_in_the_background(tmp_path, recycle):
    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path, keep_last=2, recycle_files=recycle)
    m.prepare()
    for step in range(1, 6):
        m.save_state(step=step, model=model, optimizer=opt)
    assert m.wait(10)
    left = sorted(os.listdir(tmp_path))
    assert left[-2:] == ["step_000000004", "step_000000005"]
    # recycling keeps one pruned checkpoint's files for the next save, never more
    assert [e.split("-")[0] for e in left[:-2]] == ([".recycle"] if recycle else [])


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_corrupt_newest_is_quarantined_and_never_counts_toward_keep_last(tmp_path, caplog):
    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path, keep_last=1)
    m.prepare()
    m.save_state(step=1, model=model, optimizer=opt)
    m.save_state(step=2, model=model, optimizer=opt)
    m.wait(10)
    flip(tmp_path / "step_000000002" / "state.safetensors")
    fresh = CheckpointManager(tmp_path, keep_last=1)
    fresh.prepare()
    # Only step 2 exists (keep_last=1), and it is broken: nothing valid remains.
    with pytest.raises(NoCheckpointError, match="1 corrupt"):
        fresh.load("latest")
    assert (tmp_path / "quarantine" / "step_000000002").is_dir()
    assert "xxh3 mismatch (manifest" in caplog.text

    # Broken newer checkpoints must not push out the last good one.
    m2 = CheckpointManager(tmp_path / "b", keep_last=1)
    m2.prepare()
    m2.save_state(step=10, model=model, optimizer=opt)
    good = tmp_path / "b" / "step_000000010"
    # a newer checkpoint that is broken (manifest missing): discovery sees it as incomplete
    broken = tmp_path / "b" / "step_000000011"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"junk")
    m3 = CheckpointManager(tmp_path / "b", keep_last=1)
    m3.prepare()
    info, _ = m3.load("latest")
    assert info.path == good
    assert (tmp_path / "b" / "quarantine" / "step_000000011").is_dir()
    m3.save_state(step=11, model=model, optimizer=opt)  # no collision with the quarantined one
    m3.wait(10)
    assert sorted(p.name for p in (tmp_path / "b").glob("step_*")) == ["step_000000011"]


def test_read_only_manager_changes_nothing(tmp_path):
    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path, carry_unchanged=False)  # two copies: the same state, carried, would be one file
    m.prepare()
    m.save_state(step=1, model=model, optimizer=opt)
    m.save_state(step=2, model=model, optimizer=opt)
    flip(tmp_path / "step_000000002" / "model.safetensors")
    before = sorted(os.listdir(tmp_path))
    ro = CheckpointManager(tmp_path, owner=False)
    info, _ = ro.load("latest")
    assert info.step == 1
    assert sorted(os.listdir(tmp_path)) == before
    assert ro.verify(ro.list()[0])[0].startswith(str(tmp_path / "step_000000002" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="read-only"):
        ro.prune()


@pytest.mark.parametrize("recycle", [True, False])
@pytest.mark.parametrize("fail_on", ["state.safetensors", "state.json", "manifest.json", "rename"])
def test_failed_write_leaves_previous_checkpoint_and_no_partial(tmp_path, monkeypatch, fail_on, recycle):
    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path, recycle_files=recycle, carry_unchanged=False)  # every file written, to fail
    m.prepare()
    m.save_state(step=1, model=model, optimizer=opt)
    real_write, real_commit = hashed_io.write_file, commit.commit_dir

    def write(path, chunks, **kw):
        if Path(path).name == fail_on:
            raise OSError(28, "No space left on device")
        return real_write(path, chunks, **kw)

    def commit_dir(*a):
        if fail_on == "rename":
            raise OSError(5, "Input/output error")
        return real_commit(*a)

    monkeypatch.setattr(hashed_io, "write_file", write)
    monkeypatch.setattr(commit, "commit_dir", commit_dir)
    with pytest.raises(OSError):
        m.save_state(step=2, model=model, optimizer=opt)
    monkeypatch.undo()
    # No partial checkpoint left, recycling or not: after a full disk its space goes back at once.
    assert sorted(os.listdir(tmp_path)) == ["step_000000001"]
    info, _ = CheckpointManager(tmp_path).load("latest")
    assert info.step == 1


def test_same_step_saved_twice_replaces_and_recovery_restores_interrupted_replacement(tmp_path):
    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path)
    m.prepare()
    m.save_state(step=3, model=model, optimizer=opt, user_state={"v": 1})
    m.save_state(step=3, model=model, optimizer=opt, user_state={"v": 2})
    m.wait(10)
    assert sorted(os.listdir(tmp_path)) == ["step_000000003"]
    assert m.load(3)[1].tree["user"] == {"v": 2}
    # A crash between the two renames of a replacement leaves .replaced-step_3 and no step_3.
    os.rename(tmp_path / "step_000000003", tmp_path / ".replaced-step_000000003-host-1-ab")
    (tmp_path / ".tmp-step_000000003-host-1-cd").mkdir()
    m2 = CheckpointManager(tmp_path)
    m2.prepare()
    m2.wait(10)
    assert sorted(os.listdir(tmp_path)) == ["step_000000003"]
    assert m2.load("latest")[1].tree["user"] == {"v": 2}


def test_save_dir_checks_happen_at_start(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CheckpointError, match=f"save_dir {f}: expected a directory, found a file"):
        CheckpointManager(f).prepare()
    with pytest.raises(CheckpointError, match="not a writable directory"):
        CheckpointManager("/proc/self/preempt-cannot-exist").prepare()
    CheckpointManager(tmp_path / "a" / "b").prepare()
    assert (tmp_path / "a" / "b").is_dir()


def test_symlinked_file_is_rejected(tmp_path):
    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path)
    m.prepare()
    info = m.save_state(step=1, model=model, optimizer=opt)
    outside = tmp_path / "outside.safetensors"
    os.rename(info.path / "model.safetensors", outside)
    os.symlink(outside, info.path / "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match="symlink"):
        CheckpointManager(tmp_path, owner=False).read(info)


def test_wrapped_and_prefixed_models_load(tmp_path):
    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path)
    m.prepare()
    m.save_state(step=1, model=torch.nn.DataParallel(model), optimizer=opt)
    model.cpu()  # where a GPU is present, DataParallel moved the model to it
    info, loaded = m.load("latest")
    assert all(not k.startswith("module.") for k in loaded.model)
    # into a torch.compile wrapper (state_dict keys start with _orig_mod.)
    target, *_ = objects(5)
    compiled = torch.compile(target)
    state.load_model(compiled, loaded)
    assert torch.equal(target[0].weight, model[0].weight)
    # a hand-rolled checkpoint saved from a DDP-wrapped model has "module." keys
    prefixed = state.Loaded(loaded.path, {f"module.{k}": v for k, v in loaded.model.items()}, {})
    target2, *_ = objects(6)
    state.load_model(target2, prefixed)
    assert torch.equal(target2[2].bias, model[2].bias)


def test_missing_component_state_is_an_error(tmp_path):
    model, opt, sched, _ = objects()
    m = CheckpointManager(tmp_path)
    m.prepare()
    m.save_state(step=1, model=model, optimizer=opt)
    _, loaded = m.load("latest")
    with pytest.raises(IncompatibleStateError, match="holds no scheduler state"):
        state.apply(state.Components(model, opt, sched), loaded)


def test_load_by_step_and_best(tmp_path):
    from preempt.checkpoint.manifest import Cursor, Manifest

    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path, keep_last=None, best_metric="loss", keep_best=1)
    m.prepare()
    for step, value in ((1, 0.9), (2, 0.4), (3, 0.7)):
        best = {"metric": "loss", "mode": "min", "value": value, "step": step}
        manifest = Manifest(step=step, cursor=Cursor(), reason="best", created=0.0, files={}, best=best, is_best=True)
        m.save(state.capture(state.Components(model, opt), {"user": {}}), manifest)
    assert m.load("best")[0].step == 2
    assert m.load(3)[0].step == 3
    with pytest.raises(NoCheckpointError, match="no valid checkpoint at step 9"):
        m.load(9)


def test_best_follows_the_mode_the_manifests_record(tmp_path):
    """A read-only manager (default mode "min") ranks a run's "max" metric as the run did."""
    from torch.utils.data import DataLoader, TensorDataset

    from preempt import PreemptibleRun

    model, opt, *_ = objects()
    data = TensorDataset(torch.randn(16, 6))
    kw = dict(checkpoint_interval=None, keep_last=None, best_metric="acc", best_mode="max")
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, **kw) as run:
        loader = DataLoader(data, batch_size=4, sampler=run.sampler(data, seed=0))
        for _ in run.epochs(1):
            for _, acc in zip(run.batches(loader), (0.2, 0.6, 0.9, 0.4), strict=True):
                run.step(metrics={"acc": acc})
    reader = CheckpointManager(tmp_path, owner=False)
    ranked = reader.candidates("best")
    assert [c.manifest.best_value for c in ranked] == [0.9, 0.6, 0.2]
    assert reader.load("best")[0].step == ranked[0].step


def test_best_mode_falls_back_to_the_managers_and_refuses_a_bad_one(tmp_path):
    from preempt.checkpoint.manifest import Cursor, Manifest

    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path, keep_last=None)
    m.prepare()

    def save(step: int, best: dict) -> None:
        manifest = Manifest(step=step, cursor=Cursor(), reason="best", created=0.0, files={}, best=best, is_best=True)
        m.save(state.capture(state.Components(model, opt), {"user": {}}), manifest)

    save(1, {"metric": "acc", "value": 0.5, "step": 1})  # no mode recorded
    save(2, {"metric": "acc", "value": 0.8, "step": 2})
    assert [c.step for c in m.candidates("best")] == [1, 2]
    assert [c.step for c in CheckpointManager(tmp_path, best_mode="max").candidates("best")] == [2, 1]
    save(3, {"metric": "acc", "mode": "sideways", "value": 0.1, "step": 3})
    with pytest.raises(NoCheckpointError, match="best.mode: expected 'min' or 'max', found 'sideways'"):
        m.load("best")


def test_close_finishes_deletions_and_stops_the_thread(tmp_path):
    import threading

    model, opt, *_ = objects()
    m = CheckpointManager(tmp_path, keep_last=1, recycle_files=False)
    m.prepare()
    for step in (1, 2, 3):
        m.save_state(step=step, model=model, optimizer=opt)
    assert any(t.name == "preempt-deleter" for t in threading.enumerate())
    assert m.close(10)
    assert sorted(os.listdir(tmp_path)) == ["step_000000003"]
    m.save_state(step=4, model=model, optimizer=opt)  # a closed manager starts a new thread when needed
    assert m.close(10) and sorted(os.listdir(tmp_path)) == ["step_000000004"]


def _mapped_files() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps (Linux)")
def test_a_restored_run_keeps_no_mapping_of_the_checkpoint_files(tmp_path):
    """Loading maps the files (no copy); once restored, nothing the run keeps may pin them."""
    import gc

    from preempt.checkpoint import state

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    manager = CheckpointManager(tmp_path)
    manager.save_state(step=1, model=model, optimizer=opt, tracked={"t": _TensorHolder()})
    path = tmp_path / "step_000000001"

    model2 = torch.nn.Linear(64, 64)
    opt2 = torch.optim.AdamW(model2.parameters())
    holder = _TensorHolder()
    info, loaded = manager.load("latest")
    assert loaded.mapped and str(path / "state.safetensors") in _mapped_files()  # zero-copy read
    state.apply(state.Components(model2, opt2, tracked={"t": holder}), loaded)
    del loaded
    gc.collect()
    assert str(path) not in _mapped_files(), "a restored tensor still views the checkpoint's mapping"
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(v, opt2.state_dict()["state"][0][k]), k
    assert torch.equal(holder.t, torch.arange(4.0))


class _TensorHolder:
    def __init__(self):
        self.t = torch.arange(4.0)

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, sd):
        self.t = sd["t"]


def test_save_state_creates_a_missing_save_dir(tmp_path):
    """The class says "created if missing": true of the manager used without a run too."""
    info = CheckpointManager(tmp_path / "new" / "run").save_state(step=1, model=torch.nn.Linear(2, 2))
    assert info.path == tmp_path / "new" / "run" / "step_000000001" and (info.path / "manifest.json").is_file()
