"""Carrying unchanged files: what is decided, linked, guarded, loaded, pruned, recycled and shown."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from preempt import _testing
from preempt.checkpoint import carry, deleter, hashed_io, names, recycle
from preempt.checkpoint.carry import CarryOptions, decide, fingerprint
from preempt.checkpoint.manager import CheckpointManager
from preempt.checkpoint.manifest import Cursor, Manifest
from preempt.checkpoint.retention import Kept, RetentionPolicy, select_kept
from preempt.cli.main import main

BASE, MODEL = "base.safetensors", "model.safetensors"


def lora(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A frozen base (64 KiB) with a trained head and a BatchNorm between them."""
    torch.manual_seed(seed)
    base = torch.nn.Linear(128, 128)
    base.requires_grad_(False)
    model = torch.nn.Sequential(base, torch.nn.BatchNorm1d(128), torch.nn.Linear(128, 2))
    return model, torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        loss = model(torch.randn(8, 128)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def flip(path: Path) -> None:
    """A bit flipped in place: every name of the inode sees it."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    with open(path, "r+b") as f:
        f.write(bytes(data))


def same_inode(a: Path, b: Path) -> bool:
    return os.stat(a).st_ino == os.stat(b).st_ino


def step_dir(d: Path, step: int) -> Path:
    return d / names.checkpoint_name(step)


# ----------------------------------------------------------------------------- the pure decisions


def test_fingerprint_moves_with_every_change_autograd_sees():
    t = torch.zeros(4, 4)
    before = fingerprint(t)
    assert fingerprint(t) == before and fingerprint(t.detach()) == before  # a detached alias: the same
    t.add_(1)
    assert fingerprint(t) != before  # in place: the version counter
    assert fingerprint(t.t()) != fingerprint(t)  # stride
    assert fingerprint(t[1:]) != fingerprint(t)  # offset and shape
    assert fingerprint(t.view(16)) != fingerprint(t)
    with torch.inference_mode():
        assert fingerprint(torch.zeros(2)) is None  # no version counter: never carried


def test_decide():
    fp = {"w": (1, 0, 3, (2,), (1,), "torch.float32", "cpu")}
    args = dict(source_present=True, shared=1, carry_limit=10)
    assert decide(fp, dict(fp), **args) == ("carry", "unchanged")
    assert decide(fp, {"w": (1, 0, 4, (2,), (1,), "torch.float32", "cpu")}, **args)[0] == "write"
    assert decide(fp, {**fp, "b": fp["w"]}, **args)[0] == "write"  # a tensor more or less
    assert decide(None, fp, **args)[0] == "write"
    assert decide(fp, None, **args)[0] == "write"
    assert decide(fp, fp, source_present=False, shared=1, carry_limit=10) == ("write", "its durable copy is gone")
    assert decide(fp, fp, source_present=True, shared=10, carry_limit=10)[0] == "write"  # a fresh copy


def test_only_the_frozen_base_is_ever_carried():
    """The files of trained tensors, buffers and the optimizer are written at every checkpoint, whatever their
    version counters say: a loop may train them behind autograd (``p.data.add_``)."""
    assert carry.carriable(BASE) and carry.carriable("base_00003.safetensors")
    others = (MODEL, "state.safetensors", "pieces_00000.safetensors", "rank_00001.safetensors", "base_3.safetensors")
    assert not any(carry.carriable(n) for n in others)
    assert carry.marked_never({"format": "pt", "preempt.carry": "never"}) and not carry.marked_never({"format": "pt"})


def test_options_are_checked():
    assert CarryOptions.of(True).enabled and not CarryOptions.of(False).enabled
    with pytest.raises(ValueError, match="carry_unchanged: expected True, False or CarryOptions, got 'yes'"):
        CarryOptions.of("yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="carry_limit: expected an integer >= 1, got 0"):
        CarryOptions(carry_limit=0)
    from preempt import PreemptibleRun

    with pytest.raises(ValueError, match="carry_unchanged"):
        PreemptibleRun("x", carry_unchanged=1)  # type: ignore[arg-type]


def test_retention_keeps_a_checkpoint_that_shares_nothing_with_the_newest():
    def k(step: int, base_from: int) -> Kept:
        return Kept(step, None, frozenset({(MODEL, step), (BASE, base_from)}))

    policy = RetentionPolicy(keep_last=2)
    assert select_kept(policy, [k(1, 1), k(2, 1), k(3, 3), k(4, 3)]) == {4, 3, 2}  # 3 and 4 share one base
    assert select_kept(policy, [k(1, 1), k(2, 2), k(3, 3)]) == {3, 2}  # nothing shared
    assert select_kept(policy, [k(1, 1), k(2, 1), k(3, 1)]) == {3, 2}  # none shares nothing: nothing more
    assert select_kept(policy, [k(2, 2), k(3, 2), k(4, 4)]) == {4, 3}  # the newest wrote its own


# ----------------------------------------------------------------------------- grouping, linking, loading


def test_the_frozen_base_is_written_once_then_linked_and_every_checkpoint_loads_whole(tmp_path):
    model, opt = lora()
    m = CheckpointManager(tmp_path, keep_last=None)
    m.prepare()
    m.save_state(step=1, model=model, optimizer=opt)
    train(model, opt)
    info = m.save_state(step=2, model=model, optimizer=opt)
    one, two = step_dir(tmp_path, 1), step_dir(tmp_path, 2)
    assert same_inode(one / BASE, two / BASE) and not same_inode(one / MODEL, two / MODEL)
    assert set(load_file(str(two / BASE))) == {"0.weight", "0.bias"}  # buffers and the head stay in the model file
    assert "1.running_mean" in load_file(str(two / MODEL))
    doc = json.loads((two / "manifest.json").read_text())["files"]
    assert doc[BASE]["carried_from"] == 1 and "carried_from" not in doc[MODEL]
    assert info.manifest.files[BASE].carried_from == 1
    assert m.verify(info) == []
    _, loaded = CheckpointManager(tmp_path, owner=False).load("latest")
    live = model.state_dict()
    assert loaded.model.keys() == live.keys() and all(torch.equal(loaded.model[k], v) for k, v in live.items())
    _, weights = CheckpointManager(tmp_path, owner=False).load(1, weights_only=True)
    assert set(weights.model) == set(live)


def test_nothing_frozen_or_carrying_off_writes_what_it_wrote_before(tmp_path):
    model, opt = lora()
    m = CheckpointManager(tmp_path / "off", carry_unchanged=False)
    m.save_state(step=1, model=model, optimizer=opt)
    m.save_state(step=2, model=model, optimizer=opt)
    assert sorted(os.listdir(step_dir(tmp_path / "off", 2))) == [
        "manifest.json",
        MODEL,
        "state.json",
        "state.safetensors",
    ]
    assert not same_inode(step_dir(tmp_path / "off", 1) / MODEL, step_dir(tmp_path / "off", 2) / MODEL)
    full = torch.nn.Linear(4, 4)
    m = CheckpointManager(tmp_path / "full")
    m.save_state(step=1, model=full, optimizer=torch.optim.SGD(full.parameters(), lr=0.1))
    assert BASE not in os.listdir(step_dir(tmp_path / "full", 1))


def test_a_link_that_fails_writes_the_file(tmp_path, monkeypatch, caplog):
    model, opt = lora()
    m = CheckpointManager(tmp_path, keep_last=None)
    m.save_state(step=1, model=model, optimizer=opt)

    def no_links(*a, **k):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(hashed_io.os, "link", no_links)
    caplog.set_level(logging.DEBUG, logger="preempt")
    info = m.save_state(step=2, model=model, optimizer=opt)
    assert not same_inode(step_dir(tmp_path, 1) / BASE, info.path / BASE)
    assert info.manifest.files[BASE].carried_from is None
    assert info.manifest.files[BASE] == CheckpointManager(tmp_path).list()[1].manifest.files[BASE]  # same bytes
    assert "cannot link" in caplog.text and "EXDEV" in caplog.text
    assert m.verify(info) == []


def test_a_source_pruned_between_plan_and_write_is_written(tmp_path):
    model, opt = lora()
    m = CheckpointManager(tmp_path, keep_last=None)
    m.save_state(step=1, model=model, optimizer=opt)
    from preempt.checkpoint import state

    payload = m.mark_carried(state.capture(state.Components(model, opt), {}, group_frozen=True), 2)
    assert BASE in payload.carried
    deleter.remove_tree(step_dir(tmp_path, 1))  # gone meanwhile (ENOENT at the link)
    manifest = Manifest(step=2, cursor=Cursor(), reason="manual", created=1.0, files={})
    info = m.save(payload, manifest)
    assert info.manifest.files[BASE].carried_from is None and m.verify(info) == []
    assert m.save_state(step=3, model=model, optimizer=opt).manifest.files[BASE].carried_from == 2


def test_pruning_the_source_leaves_the_later_checkpoint_whole(tmp_path):
    model, opt = lora()
    m = CheckpointManager(tmp_path, keep_last=1, recycle_files=False)
    m.save_state(step=1, model=model, optimizer=opt)
    train(model, opt)
    info = m.save_state(step=2, model=model, optimizer=opt)  # carries step 1's base, then prunes step 1
    assert m.wait(10)
    assert not step_dir(tmp_path, 1).exists() and info.manifest.files[BASE].carried_from == 1
    assert os.stat(info.path / BASE).st_nlink == 1
    assert CheckpointManager(tmp_path).verify(info) == []
    _, loaded = CheckpointManager(tmp_path, owner=False).load("latest")
    assert torch.equal(loaded.model["0.weight"], model[0].weight)


def test_recycling_never_writes_into_a_file_a_kept_checkpoint_links(tmp_path):
    model, opt = lora()
    m = CheckpointManager(tmp_path, keep_last=1)
    m.save_state(step=1, model=model, optimizer=opt)
    train(model, opt)
    two = m.save_state(step=2, model=model, optimizer=opt)  # step 1 pruned into the pool; its base is step 2's too
    (pool,) = recycle.pools(tmp_path)
    assert same_inode(pool / BASE, two.path / BASE) and os.stat(pool / BASE).st_nlink == 2
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the base changes: step 3 writes it, taking the pool
    train(model, opt)
    three = m.save_state(step=3, model=model, optimizer=opt)
    assert three.manifest.files[BASE].carried_from is None
    # step 2 was pruned into the pool meanwhile; its base (once shared) still holds step 1-2's bytes
    digest = two.manifest.files[BASE]
    (pool,) = recycle.pools(tmp_path)
    assert hashed_io.hash_file(pool / BASE) == digest
    assert CheckpointManager(tmp_path).verify(three) == []


def test_a_flipped_bit_in_the_newest_shared_file_leaves_an_older_checkpoint(tmp_path, caplog):
    """carry_limit 2: the base is written at steps 1, 3, 5...; retention keeps a checkpoint of the previous one."""
    model, opt = lora()
    m = CheckpointManager(tmp_path, keep_last=2, carry_unchanged=CarryOptions(carry_limit=2))
    for step in range(1, 5):
        train(model, opt)
        m.save_state(step=step, model=model, optimizer=opt)
    assert m.wait(10)
    origins = {c.step: c.manifest.files[BASE].carried_from for c in m.list()}
    assert origins == {4: 3, 3: None, 2: 1}  # 3 and 4 share one inode; 2 shares nothing with them: kept
    flip(step_dir(tmp_path, 4) / BASE)  # damages 3 as well
    info, loaded = CheckpointManager(tmp_path).load("latest")
    assert info.step == 2
    assert sorted(p.name for p in (tmp_path / "quarantine").iterdir()) == [names.checkpoint_name(s) for s in (3, 4)]
    assert CheckpointManager(tmp_path).verify(info) == []


def test_quarantine_moves_only_the_damaged_checkpoint(tmp_path):
    model, opt = lora()
    m = CheckpointManager(tmp_path, keep_last=None)
    for step in (1, 2):
        train(model, opt)
        m.save_state(step=step, model=model, optimizer=opt)
    flip(step_dir(tmp_path, 2) / MODEL)  # its own file, not the shared base
    info, _ = CheckpointManager(tmp_path).load("latest")
    assert info.step == 1 and (tmp_path / "quarantine" / names.checkpoint_name(2) / BASE).is_file()
    assert CheckpointManager(tmp_path).verify(info) == []  # its base, one inode with the quarantined one, is whole


# ----------------------------------------------------------------------------- the guard


def write_behind_autograd(model: torch.nn.Module, how: str) -> None:
    if how == "data":
        model[0].weight.data.add_(1.0)  # .data: a version counter of its own
    else:
        model[0].weight.numpy()[0, 0] += 1.0  # through NumPy: no counter at all


@pytest.mark.parametrize("how", ["data", "numpy"])
def test_a_change_the_version_counters_miss_is_caught_at_the_checkpoint_it_would_make_stale(tmp_path, caplog, how):
    """Any carried checkpoint, not the first or every 10th: the base is hashed at every step that would carry it;
    once caught, it is written at every checkpoint, marked so in its file, and a resumed process trusts it no more."""
    model, opt = lora()
    m = CheckpointManager(tmp_path, keep_last=None, carry_unchanged=CarryOptions(carry_limit=100))
    for step in range(1, 5):
        assert m.save_state(step=step, model=model, optimizer=opt).manifest.files[BASE].carried_from == (
            None if step == 1 else 1
        )
    version = model[0].weight._version
    write_behind_autograd(model, how)
    info = m.save_state(step=5, model=model, optimizer=opt)
    assert model[0].weight._version == version  # unseen by the counters...
    assert info.manifest.files[BASE].carried_from is None  # ...but the hash at the step saw it
    assert "base.safetensors: its content differs from" in caplog.text and "behind autograd" in caplog.text
    _, loaded = CheckpointManager(tmp_path, owner=False).load("latest")
    assert torch.equal(loaded.model["0.weight"], model[0].weight)
    caplog.clear()
    six = m.save_state(step=6, model=model, optimizer=opt)  # unchanged since: written all the same, no new warning
    assert six.manifest.files[BASE].carried_from is None and not same_inode(info.path / BASE, six.path / BASE)
    assert "behind autograd" not in caplog.text
    from preempt.checkpoint import state, tensorfile

    assert carry.marked_never(tensorfile.read_header(six.path / BASE).metadata)
    resumed = CheckpointManager(tmp_path, keep_last=None)  # a new process resumes from step 6
    latest, _ = resumed.load("latest")
    assert resumed.loaded(latest, state.capture(state.Components(model, opt), {}, group_frozen=True)) == []
    seven = resumed.save_state(step=7, model=model, optimizer=opt)
    assert seven.manifest.files[BASE].carried_from is None


def test_every_checkpoint_equals_the_state_at_its_step_with_a_momentum_teacher(tmp_path):
    """DINO's teacher: frozen, no optimizer holds it, updated through .data after each step. Every checkpoint holds
    its own step's teacher (the stronger oracle: each kept checkpoint against the live state at its step)."""
    torch.manual_seed(0)
    student, teacher = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    teacher.requires_grad_(False)
    model = torch.nn.ModuleDict({"student": student, "teacher": teacher})
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    m = CheckpointManager(tmp_path, keep_last=None)
    live = {}
    for step in range(1, 11):
        opt.zero_grad()
        student(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        for pt, ps in zip(teacher.parameters(), student.parameters(), strict=True):
            pt.data.mul_(0.9).add_(ps.data, alpha=0.1)
        m.save_state(step=step, model=model, optimizer=opt)
        live[step] = {k: v.clone() for k, v in model.state_dict().items()}
    for step, want in live.items():
        _, loaded = CheckpointManager(tmp_path, owner=False).load(step)
        stale = [k for k, v in want.items() if not torch.equal(loaded.model[k], v)]
        assert stale == [], f"step {step}'s checkpoint holds {stale} from another step"


def test_a_model_without_an_optimizer_is_trained_by_hand_and_never_carried(tmp_path):
    """word_language_model: no optimizer, ``p.data.add_(p.grad, alpha=-lr)``: no base, every tensor written."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    m = CheckpointManager(tmp_path, keep_last=None)
    for step in (1, 2):
        model.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)
        info = m.save_state(step=step, model=model)
        assert BASE not in info.manifest.files and info.manifest.carried == {}
        _, loaded = CheckpointManager(tmp_path, owner=False).load(step)
        assert all(torch.equal(loaded.model[k], v) for k, v in model.state_dict().items())


def test_a_buffer_replaced_at_the_same_address_is_not_taken_for_unchanged():
    """The recorded tensors are held: a new tensor cannot take a recorded one's memory with a fresh counter."""
    carrier = carry.Carrier()
    from preempt.checkpoint import state

    t = torch.zeros(1024)
    payload = state.Payload({BASE: ({"t": t}, {})}, {})
    carrier.mark_carried(payload, 1)
    carrier.durable(Path("/nowhere"), 1, {BASE: hashed_io.FileDigest(1, "0" * 32)})
    assert carrier.sources[BASE].tensors["t"] is t
    ptr = t.data_ptr()
    del t, payload
    fresh = torch.ones(1024)
    assert fresh.data_ptr() != ptr


# ----------------------------------------------------------------------------- manifest, export, ls, inspect


def test_manifest_round_trip_keeps_carried_from():
    files = {MODEL: hashed_io.FileDigest(10, "a" * 32), BASE: hashed_io.FileDigest(20, "b" * 32, 3)}
    m = Manifest(step=5, cursor=Cursor(), reason="steps", created=1.0, files=files)
    back = Manifest.from_json(m.to_json(), "manifest.json")
    assert back.files[BASE].carried_from == 3 and back.files[MODEL].carried_from is None
    assert back.origins() == {(MODEL, 5), (BASE, 3)} and set(back.carried) == {BASE}
    assert "carried_from" not in json.loads(m.to_json())["files"][MODEL]


def test_export_writes_one_standalone_file_and_ls_inspect_show_what_was_carried(tmp_path, capsys):
    model, opt = lora()
    m = CheckpointManager(tmp_path, keep_last=None)
    m.save_state(step=1, model=model, optimizer=opt)
    train(model, opt)
    m.save_state(step=2, model=model, optimizer=opt)
    out = tmp_path.parent / f"{tmp_path.name}-export.safetensors"
    assert main(["export", str(tmp_path), "--out", str(out)]) == 0
    got = load_file(str(out))
    live = model.state_dict()
    assert got.keys() == live.keys() and all(torch.equal(got[k], v) for k, v in live.items())
    capsys.readouterr()
    assert main(["ls", str(tmp_path), "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    base_size = m.list()[0].manifest.files[BASE].size
    assert rows[2]["carried_bytes"] == base_size and rows[2]["carried_from"] == [1]
    assert rows[1]["carried_bytes"] == 0 and rows[1]["written_bytes"] == rows[1]["bytes"]
    assert main(["ls", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "written" in text.splitlines()[0] and "carried" in text.splitlines()[0] and " from 1 " in text
    assert main(["inspect", str(tmp_path), "2"]) == 0
    text = capsys.readouterr().out
    assert "carried from 1" in text and "base.safetensors: 2 tensors" in text


# ----------------------------------------------------------------------------- staging sized for what changes


def test_marking_carried_files_hashes_at_the_step_what_it_carries_and_what_a_writer_reads_later(monkeypatch):
    """A carried file's live tensors hash to its source's digest at the step (a stop's save too: there is no other
    marking); a file that a writer reads after the step gets its digest at the step; a synchronous save's written file
    is not hashed."""
    from preempt.checkpoint import state

    monkeypatch.setattr(carry, "exists", lambda _path: True)  # (the sources are made up)
    hashed = []
    monkeypatch.setattr(carry, "digest_of", lambda ts, meta, real=carry.digest_of: hashed.append(1) or real(ts, meta))
    carrier = carry.Carrier()
    t = torch.zeros(16)
    payload = state.Payload({BASE: ({"w": t}, {}), MODEL: ({"h": torch.zeros(2)}, {})}, {})
    first = carrier.mark_carried(payload, 1)
    assert not first.carried and first.at_step == {} and hashed == []  # written while the loop waits: no hash
    digest = carry.digest_of({"w": t}, {})
    carrier.durable(Path("/nowhere"), 1, {BASE: digest, MODEL: digest})
    hashed.clear()
    second = carrier.mark_carried(payload, 2)
    assert list(second.carried) == [BASE] and list(second.tensor_files) == [MODEL] and len(hashed) == 1
    assert second.at_step == {BASE: second.carried[BASE].digest}
    carrier.durable(Path("/nowhere"), 2, {BASE: carry.dataclasses.replace(digest, carried_from=1), MODEL: digest})
    t.numpy()[0] = 1.0  # behind autograd
    third = carrier.mark_carried(payload, 3, read_later={BASE})
    assert not third.carried and carry.marked_never(third.tensor_files[BASE][1]) and third.at_step == {}
    fresh = carry.Carrier()
    fresh.mark_carried(payload, 1)
    assert fresh.mark_carried(payload, 1, read_later={BASE}).at_step == {BASE: carry.digest_of({"w": t}, {})}


def lora_run(tmp_path: Path, **kw):
    from preempt import PreemptibleRun

    model, opt = lora()
    kw = {"async_save": True, "checkpoint_every_steps": 2, "keep_last": None, "checkpoint_interval": None} | kw
    return model, opt, PreemptibleRun(tmp_path, model=model, optimizer=opt, **kw)


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, s in opt.state_dict()["state"].items():
        out.update({f"opt.{pid}.{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def loaded_state(path: Path) -> dict[str, torch.Tensor]:
    from preempt.checkpoint import state

    model, opt = lora(seed=1)  # other values: everything must come from the checkpoint
    manager = CheckpointManager(path.parent, owner=False)
    info = next(c for c in manager.list() if c.path == path)
    state.apply(state.Components(model, opt), manager.read(info))
    return state_of(model, opt)


def test_the_frozen_base_gets_no_staging_buffer_and_each_checkpoint_is_its_steps_state(tmp_path):
    """Would fail if the base were staged (buffers the size of the model) or if reading it where it lives let
    a later step's bytes into a checkpoint."""
    model, opt, run = lora_run(tmp_path)
    base_bytes = sum(p.nbytes for p in model[0].parameters())
    expected = {}
    with run:
        for step in range(1, 7):
            train(model, opt)
            run.step()
            if step % 2 == 0:
                expected[step] = state_of(model, opt)
            run.wait_for_checkpoint(timeout=60)
            assert run.saves.buffer_nbytes < base_bytes  # the head, BatchNorm and momentum only
    assert run.saves.buffer_nbytes > 0
    assert BASE not in run.saves.sizes and MODEL in run.saves.sizes  # no pool written ahead for the base either
    for step, want in expected.items():
        got = loaded_state(step_dir(tmp_path, step))
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), step
    files = json.loads((step_dir(tmp_path, 4) / "manifest.json").read_text())["files"]
    assert files[BASE]["carried_from"] == 2


def writer_gate(at: str = "after_tensor_files"):
    """A fault point that holds the background writer at the commit stage ``at`` of its first checkpoint: (reached,
    release, the hook for the fault point ``commit``). The test waits for ``reached``, lets it go with ``release``."""
    import threading

    reached, release = threading.Event(), threading.Event()

    def gate(stage: str, cancel: object = None) -> None:
        if stage == at and threading.current_thread().name == "preempt-writer":
            if not reached.is_set():
                reached.set()
                assert release.wait(30)

    return reached, release, gate


def test_a_base_changed_while_the_writer_reads_it_is_not_committed_and_is_copied_from_then_on(tmp_path, caplog):
    """The writer is held after the tensor files (a fault point), the loop changes a frozen weight in place:
    that checkpoint would mix two states, so it is dropped with a warning, and the next one stages the base."""
    reached, release, gate = writer_gate()
    model, opt, run = lora_run(tmp_path, keep_last=None)
    _testing.install("commit", gate)
    try:
        with run:
            train(model, opt)
            run.step()
            train(model, opt)
            run.step()  # step 2: staged, its base read where it lives; the writer is held
            assert reached.wait(30)
            with torch.no_grad():
                model[0].weight.add_(1.0)  # e.g. an EMA update of a frozen module between steps
            release.set()
            run.wait_for_checkpoint(timeout=60)
            assert not step_dir(tmp_path, 2).exists()
            assert "the checkpoint of step 2 is not written: base.safetensors:0.weight was changed in place" in (
                caplog.text
            )
            train(model, opt)
            run.step()  # step 3: the state is due again (the loop moved since its last durable checkpoint)
            train(model, opt)
            run.step()  # step 4
            want = state_of(model, opt)
            run.wait_for_checkpoint(timeout=60)
            assert run.saves.buffer_nbytes >= sum(p.nbytes for p in model[0].parameters())  # the base is copied now
    finally:
        _testing.install("commit", None)
        release.set()
    got = loaded_state(step_dir(tmp_path, 4))
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_carried_file_changed_after_its_step_while_the_writer_runs_is_still_committed(tmp_path):
    """A linked file is not read: its bytes are the source's, equal to the tensors at the step. The loop's next
    step may change those tensors while the write goes on (a second checkpoint of the same step, a best after a
    periodic one, is written while the next optimizer.step() runs): the checkpoint must be committed all the same,
    and hold the state of its step. Fails where the writer checks the carried files' tensors after writing."""
    reached, release, gate = writer_gate()
    model, opt, run = lora_run(tmp_path, keep_last=None)
    with run:
        for _ in range(2):
            train(model, opt)
            run.step()  # step 2: the base written
        run.wait_for_checkpoint(timeout=60)
        _testing.install("commit", gate)
        try:
            for _ in range(2):
                train(model, opt)
                run.step()  # step 4: the base carried from step 2; the writer is held after the tensor files
            want = state_of(model, opt)
            assert reached.wait(30)
            with torch.no_grad():
                model[0].weight.add_(1.0)  # after step 4: the carried file's tensor changes under the writer
            release.set()
            assert run.wait_for_checkpoint(timeout=60) == step_dir(tmp_path, 4)
        finally:
            _testing.install("commit", None)
            release.set()
    files = json.loads((step_dir(tmp_path, 4) / "manifest.json").read_text())["files"]
    assert files[BASE]["carried_from"] == 2
    got = loaded_state(step_dir(tmp_path, 4))
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_base_written_behind_autograd_before_the_writer_reads_it_is_not_committed(tmp_path, caplog):
    """The base is read where it lives by a background write; the loop changes it through .data before the writer
    reads it (the writer is held at a fault point): the file would hold a later step's bytes, which no version
    counter shows. The writer's digest differs from the one taken at the step: that checkpoint is not committed, and
    the base is copied at the step and written from then on. Every kept checkpoint holds its step's state."""
    reached, release, gate = writer_gate("before_tensor_files")
    model, opt, run = lora_run(tmp_path, keep_last=None)
    _testing.install("commit", gate)
    live = {}
    try:
        with run:
            for _ in (1, 2):
                train(model, opt)
                run.step()  # step 2: a background save; the writer is held before it reads the base
            assert reached.wait(30)
            model[0].weight.data.add_(1.0)  # behind autograd, after the step, before the writer reads it
            release.set()
            run.wait_for_checkpoint(timeout=60)
            assert not step_dir(tmp_path, 2).exists()
            assert "the checkpoint of step 2 is not written" in caplog.text and "behind autograd" in caplog.text
            for step in (3, 4, 5, 6):
                train(model, opt)
                model[0].weight.data.mul_(0.99)  # and at every step from now on
                run.step()
                if step % 2 == 0:
                    live[step] = state_of(model, opt)
                run.wait_for_checkpoint(timeout=60)
            assert run.saves.buffer_nbytes >= sum(p.nbytes for p in model[0].parameters())  # the base is copied now
    finally:
        _testing.install("commit", None)
        release.set()
    for step, want in live.items():
        got = loaded_state(step_dir(tmp_path, step))
        assert [k for k in want if not torch.equal(got[k], want[k])] == [], step


def test_a_fused_optimizer_that_leaves_the_version_counters_is_seen_and_never_carried_stale(tmp_path):
    """AdamW(fused=True) on the CPU writes parameters and moments without bumping their version counters (the HF
    Trainer's default optimizer): the run's hook bumps them after such a step, so every checkpoint holds its own
    step's weights and moments, none linked from the step before."""
    from preempt import PreemptibleRun

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        model(torch.randn(2, 16)).sum().backward()
        before = model.weight._version
        opt.step()
    except RuntimeError as e:  # a torch without fused AdamW on the CPU
        pytest.skip(f"this torch has no fused AdamW on the CPU: {e}")
    if model.weight._version != before:
        pytest.skip("this torch's fused AdamW bumps the version counters itself: nothing to see here")
    with PreemptibleRun(
        tmp_path, model=model, optimizer=opt, checkpoint_interval=None, checkpoint_every_steps=1, async_save=False
    ) as run:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 16)).square().mean().backward()
            opt.step()
            run.step()
        live_model = {k: v.clone() for k, v in model.state_dict().items()}
        live_moments = {k: v.clone() for k, v in opt.state[model.weight].items()}
    assert not same_inode(step_dir(tmp_path, 2) / MODEL, step_dir(tmp_path, 3) / MODEL)
    _, loaded = CheckpointManager(tmp_path, owner=False).load(3)
    assert all(torch.equal(loaded.model[k], v) for k, v in live_model.items()), "the checkpoint holds stale weights"
    saved = loaded.tree["optimizer"]["state"][0]
    assert all(torch.equal(saved[k], v) for k, v in live_moments.items()), "the checkpoint holds stale moments"
