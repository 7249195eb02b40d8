"""The ``preempt`` command line: ls, verify, inspect, prune, export; exit codes, --json, entry points."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from helpers import cli, cli_json, small_run
from safetensors import safe_open
from safetensors.torch import load_file

from preempt import CheckpointManager
from preempt.checkpoint import state
from preempt.checkpoint.manifest import Cursor, Manifest
from preempt.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def objects(seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def saved(d: Path, steps=(1, 2, 3), **kw) -> tuple[torch.nn.Module, CheckpointManager]:
    model, opt = objects(**kw)
    # each checkpoint holds files of its own (the tests damage one): the optimizer's state, unchanged, would be carried
    m = CheckpointManager(d, keep_last=None, carry_unchanged=False)
    m.prepare()
    for s in steps:
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # every checkpoint holds different weights
        m.save_state(step=s, model=model, optimizer=opt)
    m.close(10)
    return model, m


def with_best(d: Path, values: dict[int, float], mode: str) -> None:
    """Checkpoints written "because the metric improved", as a run with best_metric writes them."""
    model, opt = objects()
    m = CheckpointManager(d, keep_last=None)
    m.prepare()
    for step, value in values.items():
        best = {"metric": "acc", "mode": mode, "value": value, "step": step}
        manifest = Manifest(step=step, cursor=Cursor(), reason="best", created=1.0e9, files={}, best=best, is_best=True)
        m.save(state.capture(state.Components(model, opt), {"user": {}}), manifest)
    m.close(10)


def flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x40
    path.write_bytes(bytes(data))


def manifest_of(ckpt: Path) -> dict:
    return json.loads((ckpt / "manifest.json").read_text())


def tree(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` with its content (the lock file aside): to prove that a command changed nothing."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.name != "lock"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """Checkpoints of a real PreemptibleRun (RNG states, sampler cursor, best metric, provenance, complete.json)."""
    return small_run(tmp_path_factory.mktemp("run") / "run")


# ---------------------------------------------------------------- help, usage


def test_help_documents_every_exit_code(capsys):
    for argv in (["--help"], *([c, "--help"] for c in ("ls", "verify", "inspect", "prune", "export"))):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
        out = capsys.readouterr().out
        for code in ("0  ok", "1  a checkpoint is damaged", "2  bad usage", "3  the save_dir is locked"):
            assert code in out, (argv, out)


def test_bad_usage_exits_2(tmp_path, capsys):
    saved(tmp_path, steps=(1,))
    with pytest.raises(SystemExit) as e:
        main(["verify", str(tmp_path), "soon"])
    assert e.value.code == 2
    assert "expected a step number, 'latest' or 'best', found 'soon'" in capsys.readouterr().err
    rc, _, err = cli(capsys, "ls", tmp_path / "nope")
    assert rc == 2 and f"{tmp_path / 'nope'}: no such directory" in err
    (tmp_path / "file").write_text("x")
    rc, _, err = cli(capsys, "verify", tmp_path / "file")
    assert rc == 2 and "is a file; expected a preempt save_dir" in err
    rc, _, err = cli(capsys, "inspect", tmp_path, "7")
    assert rc == 2 and f"{tmp_path}: no checkpoint at step 7 (steps here: 1)" in err
    rc, doc = cli_json(capsys, "export", tmp_path, "7", "--out", tmp_path.parent / f"{tmp_path.name}-w.safetensors")
    assert rc == 2 and doc["exit_code"] == 2 and "no checkpoint at step 7" in doc["error"]
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = cli(capsys, "verify", empty)
    assert rc == 2 and "no checkpoints" in err
    rc, _, err = cli(capsys, "inspect", empty, "best")
    assert rc == 2 and "no valid checkpoint is marked best" in err


# ------------------------------------------------------------------------- ls


def test_ls_rows_statuses_and_marks(run_dir, tmp_path, capsys):
    d = tmp_path / "run"
    shutil.copytree(run_dir, d)
    (d / "step_000000099").mkdir()  # a step dir without manifest.json: incomplete
    (d / "step_000000099" / "model.safetensors").write_bytes(b"partial")
    (d / "step_000000098").mkdir()
    (d / "step_000000098" / "manifest.json").write_text("{not json")
    rc, doc = cli_json(capsys, "ls", d)
    assert rc == 0 and doc["complete"] and doc["best_metric"] == "loss" and doc["best_mode"] == "min"
    rows = {r["step"]: r for r in doc["checkpoints"]}
    assert rows[99]["status"] == "incomplete" and "manifest.json: missing" in rows[99]["problem"]
    assert rows[98]["status"] == "corrupt" and "not valid JSON" in rows[98]["problem"]
    valid = [s for s, r in rows.items() if r["status"] == "valid"]
    assert [s for s, r in rows.items() if r["latest"]] == [max(valid)]
    assert [r["name"] for r in rows.values() if r["complete"]] == [
        json.loads((d / "complete.json").read_text())["checkpoint"]
    ]
    bests = {s: manifest_of(d / r["name"]) for s, r in rows.items() if r["status"] == "valid"}
    best_step = min((m["best"]["value"], s) for s, m in bests.items() if m["is_best"])[1]
    assert [s for s, r in rows.items() if r["best"]] == [best_step]
    for s in valid:
        m = bests[s]
        assert (rows[s]["epoch"], rows[s]["batch"]) == (m["cursor"]["epoch"], m["cursor"]["batch"])
        assert rows[s]["bytes"] == sum(f["size"] for f in m["files"].values())

    rc, out, _ = cli(capsys, "ls", d)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "checkpoint",
        "step",
        "epoch",
        "batch",
        "saved",
        "(local",
        "time)",
        "size",
        "written",  # what the checkpoint wrote, and what it hard-linked from an earlier one (preempt.checkpoint.carry)
        "carried",
        "reason",
        "status",
    ]
    latest_line = next(ln for ln in lines if ln.startswith(f"step_{max(valid):09d}"))
    marks = "latest, best" if max(valid) == best_step else "latest"  # (which step is best depends on torch's numerics)
    assert f"valid ({marks})" in latest_line
    assert f"run complete: {latest_line.split()[0]}" in out
    assert "incomplete" in next(ln for ln in lines if ln.startswith("step_000000099"))
    # aligned: every row's status column starts where the header's does
    col = lines[0].index("status")
    assert all(ln[col:].startswith(("valid", "corrupt", "incomplete")) for ln in lines[1:] if ln.startswith("step_"))


def test_ls_best_follows_the_mode_the_manifests_record(tmp_path, capsys):
    with_best(tmp_path, {1: 0.2, 2: 0.9, 3: 0.5}, mode="max")
    rc, doc = cli_json(capsys, "ls", tmp_path)
    assert rc == 0 and doc["best_mode"] == "max"
    assert [r["step"] for r in doc["checkpoints"] if r["best"]] == [2]


def test_ls_checks_sizes_and_says_that_it_does_not_hash(tmp_path, capsys):
    """ls stats every listed file (a truncated one is corrupt, never latest) and says a changed byte is verify's."""
    saved(tmp_path)
    short = tmp_path / "step_000000003" / "model.safetensors"
    size = short.stat().st_size
    short.write_bytes(short.read_bytes()[:-5])
    flip(tmp_path / "step_000000002" / "model.safetensors")  # same size: only hashing sees it
    rc, doc = cli_json(capsys, "ls", tmp_path)
    assert rc == 0 and doc["checked"] == {"manifest": True, "sizes": True, "digests": False}
    rows = {r["step"]: r for r in doc["checkpoints"]}
    assert rows[3]["status"] == "corrupt" and not rows[3]["latest"]
    assert rows[3]["problem"] == f"{short}: size {size - 5} bytes, manifest says {size}"
    assert rows[2]["status"] == "valid" and rows[2]["latest"]
    rc, out, _ = cli(capsys, "ls", tmp_path)
    assert rc == 0
    assert "valid (latest)" in next(ln for ln in out.splitlines() if ln.startswith("step_000000002"))
    assert "corrupt" in next(ln for ln in out.splitlines() if ln.startswith("step_000000003"))
    assert "the data is not hashed: preempt verify DIR hashes every file" in out
    assert cli(capsys, "verify", tmp_path, "2")[0] == 1  # what ls called valid, verify calls damaged


# --------------------------------------------------------------------- verify


def test_verify_all_good(run_dir, capsys):
    rc, out, _ = cli(capsys, "verify", run_dir)
    assert rc == 0 and "all ok" in out
    rc, doc = cli_json(capsys, "verify", run_dir)
    assert rc == 0 and doc["ok"]
    assert {c["step"] for c in doc["checkpoints"]} == {int(p.name[5:]) for p in run_dir.glob("step_*")}
    for c in doc["checkpoints"]:
        assert {f["name"] for f in c["files"]} == {"model.safetensors", "state.safetensors", "state.json"}
        for f in c["files"]:  # (a file carried from an earlier checkpoint says from which: not a property of the file)
            expected = {k: v for k, v in f["expected"].items() if k != "carried_from"}
            assert f["status"] == "ok" and f["found"] == expected, f
    assert doc["bytes"] == sum(f["expected"]["size"] for c in doc["checkpoints"] for f in c["files"])


def test_verify_bit_flip_names_the_file_and_both_full_digests(tmp_path, capsys):
    saved(tmp_path)
    bad = tmp_path / "step_000000002" / "state.safetensors"
    flip(bad)
    expected = manifest_of(bad.parent)["files"]["state.safetensors"]["xxh3_128"]
    found = xxhash.xxh3_128_hexdigest(bad.read_bytes())
    rc, out, _ = cli(capsys, "verify", tmp_path)
    assert rc == 1
    assert f"{bad}: xxh3 mismatch (manifest {expected}, file {found}" in out
    assert "1 of 3 damaged" in out
    rc, doc = cli_json(capsys, "verify", tmp_path, "2")
    assert rc == 1 and not doc["ok"] and len(doc["checkpoints"]) == 1
    (entry,) = [f for f in doc["checkpoints"][0]["files"] if f["status"] != "ok"]
    assert entry["name"] == "state.safetensors" and entry["status"] == "digest"
    assert entry["expected"]["xxh3_128"] == expected and entry["found"]["xxh3_128"] == found
    assert cli(capsys, "verify", tmp_path, "3")[0] == 0  # the others are fine


def test_verify_truncated_missing_and_incomplete(tmp_path, capsys):
    saved(tmp_path)
    model = tmp_path / "step_000000003" / "model.safetensors"
    size = model.stat().st_size
    model.write_bytes(model.read_bytes()[:-5])
    gone = tmp_path / "step_000000002" / "state.json"
    gone.unlink()
    (tmp_path / "step_000000004").mkdir()
    rc, out, _ = cli(capsys, "verify", tmp_path)
    assert rc == 1
    assert f"{model}: size {size - 5} bytes, manifest says {size}" in out
    assert f"{gone}: missing" in out
    assert f"{tmp_path / 'step_000000004' / 'manifest.json'}: missing" in out
    rc, doc = cli_json(capsys, "verify", tmp_path)
    status = {(c["step"], f["name"]): f["status"] for c in doc["checkpoints"] for f in c["files"]}
    assert status[(3, "model.safetensors")] == "size" and status[(2, "state.json")] == "missing"
    by_step = {c["step"]: c for c in doc["checkpoints"]}
    assert by_step[4]["status"] == "incomplete" and not by_step[4]["ok"] and by_step[1]["ok"]


def test_verify_latest_and_best(tmp_path, capsys):
    with_best(tmp_path, {1: 0.2, 2: 0.9, 3: 0.5}, mode="max")
    flip(tmp_path / "step_000000001" / "model.safetensors")
    rc, doc = cli_json(capsys, "verify", tmp_path, "latest")
    assert rc == 0 and [c["step"] for c in doc["checkpoints"]] == [3]
    rc, doc = cli_json(capsys, "verify", tmp_path, "best")
    assert rc == 0 and [c["step"] for c in doc["checkpoints"]] == [2]
    assert cli(capsys, "verify", tmp_path, "1")[0] == 1


# -------------------------------------------------------------------- inspect


def test_inspect_run_checkpoint(run_dir, capsys):
    rc, doc = cli_json(capsys, "inspect", run_dir)  # default: latest valid
    assert rc == 0 and not doc["problems"]
    latest = max(run_dir.glob("step_*"))
    assert doc["checkpoint"] == latest.name
    raw = manifest_of(latest)
    m = doc["manifest"]
    assert (m["step"], m["epoch"], m["batch"], m["sample"], m["point"], m["reason"]) == (
        raw["step"], raw["cursor"]["epoch"], raw["cursor"]["batch"], raw["cursor"]["sample"],
        raw["cursor"]["point"], raw["reason"],
    )  # fmt: skip
    assert m["files"] == raw["files"] and m["metrics"] == raw["metrics"] and m["best"] == raw["best"]
    assert m["provenance"]["torch"] == torch.__version__ and m["provenance"]["host"]
    info, loaded = CheckpointManager(run_dir, owner=False).load(raw["step"])
    model_file = doc["tensor_files"]["model.safetensors"]
    shapes = {t["name"]: (t["dtype"], t["shape"]) for t in model_file["tensors"]}
    assert shapes == {k: ("F32", list(v.shape)) for k, v in loaded.model.items()}
    assert model_file["metadata"] == {"format": "pt"}
    groups = doc["optimizer"]["param_groups"]
    assert [g["lr"] for g in groups] == [g["lr"] for g in loaded.tree["optimizer"]["param_groups"]]
    assert groups[0]["params"] == 4 and groups[0]["momentum"] == 0.9
    assert doc["optimizer"]["state_keys"] == ["momentum_buffer"]
    assert doc["optimizer"]["class"] == "torch.optim.sgd.SGD"
    rng = loaded.tree["rng"]
    for snap in ("now", "epoch_start"):
        got = doc["rng"][snap]
        assert got["torch_cpu"]["xxh3_64"] == xxhash.xxh3_64_hexdigest(rng[snap]["torch"].numpy().tobytes())
        assert got["python"]["xxh3_64"] == xxhash.xxh3_64_hexdigest(rng[snap]["python"]["state"].numpy().tobytes())
        assert got["numpy"]["xxh3_64"] == xxhash.xxh3_64_hexdigest(rng[snap]["numpy"]["key"].numpy().tobytes())
        assert got["numpy"]["kind"] == "MT19937"
        # one entry per CUDA device whose generator the run saved: none unless CUDA was in use in this process
        cuda = [xxhash.xxh3_64_hexdigest(t.numpy().tobytes()) for t in rng[snap]["cuda"]]
        assert [(c["device"], c["xxh3_64"]) for c in got["cuda"]] == list(enumerate(cuda))
    assert doc["rng"]["now"]["torch_cpu"] != doc["rng"]["epoch_start"]["torch_cpu"]  # dropout drew in between

    rc, out, _ = cli(capsys, "inspect", run_dir, str(raw["step"]))
    assert rc == 0
    c = raw["cursor"]
    assert f"step {raw['step']}, epoch {c['epoch']}, batch {c['batch']}" in out
    assert "0.weight  F32  8x4" in out and "group 0: 4 params, lr=0.1" in out
    assert "optimizer: class torch.optim.sgd.SGD; state for 4 parameter(s): momentum_buffer" in out
    assert f"torch_cpu {doc['rng']['now']['torch_cpu']['xxh3_64']}" in out
    assert f"torch {torch.__version__}" in out and raw["files"]["model.safetensors"]["xxh3_128"] in out


@pytest.mark.parametrize(
    ("lineage", "said"),
    [
        ({"request": None, "started": 1.7e9}, "lineage: started fresh on "),
        (
            {"request": {"resume": "/r/step_000000005", "weights_only": True}, "source": "/r/step_000000005"},
            "lineage: started from /r/step_000000005 (its weights only), on the request resume='/r/step_000000005'",
        ),
    ],
    ids=["fresh", "request"],
)
def test_inspect_says_what_is_unknown_in_words(tmp_path, capsys, lineage, said):
    """No placeholders: an unknown sample count (-1) is left out, a lineage is said in words, not as None and -."""
    model, opt = objects()
    m = CheckpointManager(tmp_path, keep_last=None)
    m.prepare()
    cursor = Cursor(epoch=0, batch=2, sample=-1, point="step", batches_per_epoch=-1)
    manifest = Manifest(step=2, cursor=cursor, reason="interval", created=1.7e9, files={}, lineage=lineage)
    m.save(state.capture(state.Components(model, opt), {"user": {}}), manifest)
    m.close(10)
    rc, out, _ = cli(capsys, "inspect", tmp_path)
    assert rc == 0
    assert "  step 2, epoch 0, batch 2, taken at the step boundary\n" in out
    assert said in out
    for placeholder in ("sample -1", "None", " -,", "source -", "of -1"):
        assert placeholder not in out, (placeholder, out)


def test_inspect_reads_headers_only_and_limits_tensor_rows(tmp_path, capsys):
    saved(tmp_path, steps=(1,), layers=15)  # 30 model tensors
    model = tmp_path / "step_000000001" / "model.safetensors"
    flip(model, at=model.stat().st_size - 3)  # tensor data, not the header: inspect does not see it
    rc, out, _ = cli(capsys, "inspect", tmp_path)
    assert rc == 0
    assert "model.safetensors: 30 tensors" in out and "... 10 more" in out
    assert sum(1 for ln in out.splitlines() if "  F32  " in ln and ln.strip()[0].isdigit()) == 20
    rc, out, _ = cli(capsys, "inspect", tmp_path, "--tensors", "all")
    assert "more (" not in out and "14.weight" in out
    rc, doc = cli_json(capsys, "inspect", tmp_path, "--tensors", "3")
    assert len(doc["tensor_files"]["model.safetensors"]["tensors"]) == 30  # --json lists every tensor
    assert doc["rng"] is None  # save_state records no RNG
    assert cli(capsys, "verify", tmp_path)[0] == 1  # the data is damaged all the same


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.write_bytes((1 << 40).to_bytes(8, "little") + p.read_bytes()[8:]), "header length 1099511627776"),
        (lambda p: p.write_bytes(b"\x03" + b"\x00" * 7 + b"{x}"), "header is not valid JSON"),
        (lambda p: p.write_bytes(b"\x01\x00"), "2 bytes; a safetensors file has at least an 8-byte header length"),
    ],
    ids=["absurd-length", "bad-json", "too-short"],
)
def test_inspect_corrupt_header_names_the_file(tmp_path, capsys, damage, message):
    saved(tmp_path, steps=(1,))
    model = tmp_path / "step_000000001" / "model.safetensors"
    damage(model)
    rc, _, err = cli(capsys, "inspect", tmp_path, "1")
    assert rc == 1 and f"{model}: " in err and message in err


def test_inspect_corrupt_manifest_and_incomplete(tmp_path, capsys):
    saved(tmp_path, steps=(1, 2))
    mpath = tmp_path / "step_000000002" / "manifest.json"
    flip(mpath)
    rc, _, err = cli(capsys, "inspect", tmp_path, "2")
    assert rc == 1 and str(mpath) in err
    rc, doc = cli_json(capsys, "inspect", tmp_path)  # latest valid skips the corrupt one
    assert rc == 0 and doc["manifest"]["step"] == 1
    (tmp_path / "step_000000003").mkdir()
    rc, _, err = cli(capsys, "inspect", tmp_path, "3")
    assert rc == 1 and f"{tmp_path / 'step_000000003' / 'manifest.json'}: missing" in err


# ---------------------------------------------------------------------- prune


def test_prune_dry_run_then_yes(tmp_path, capsys):
    _, m = saved(tmp_path, steps=(1, 2, 3, 4, 5, 6))
    m.mark_complete(m.list()[4])  # complete.json names step 2: always kept
    for where in ("quarantine", "superseded"):
        (tmp_path / where / "step_000000001").mkdir(parents=True)
        (tmp_path / where / "step_000000001" / "model.safetensors").write_bytes(b"old")
    (tmp_path / "step_000000007").mkdir()  # incomplete (no manifest), newer than every valid one
    (tmp_path / "step_000000007" / "model.safetensors").write_bytes(b"partial")
    shutil.copytree(tmp_path / "step_000000005", tmp_path / "step_000000008")  # corrupt: manifest says step 5
    before = tree(tmp_path)

    rc, out, _ = cli(capsys, "prune", tmp_path, "--keep-last", "2")
    assert rc == 0 and tree(tmp_path) == before  # a dry run changes nothing
    assert "dry run: would delete 3 checkpoint(s)" in out
    for s in (1, 3, 4):
        assert f"delete  step_{s:09d}" in out
    for s in (7, 8):
        assert f"skip    step_{s:09d}" in out
    rc, doc = cli_json(capsys, "prune", tmp_path, "--keep-last", "2")
    assert doc["dry_run"] and [r["step"] for r in doc["delete"]] == [4, 3, 1]
    assert {r["step"]: r["why"] for r in doc["keep"]} == {6: ["latest"], 5: ["last 2"], 2: ["complete.json"]}

    rc, doc = cli_json(capsys, "prune", tmp_path, "--keep-last", "2", "--yes")
    assert rc == 0 and not doc["dry_run"] and doc["deleted"] == ["step_000000004", "step_000000003", "step_000000001"]
    after = tree(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("step_", ".trash"))) == [
        "step_000000002", "step_000000005", "step_000000006", "step_000000007", "step_000000008",
    ]  # fmt: skip
    untouched = ("quarantine/", "superseded/", "step_000000007/", "step_000000008/", "step_000000002/", "complete.json")
    assert {k: v for k, v in after.items() if k.startswith(untouched)} == {
        k: v for k, v in before.items() if k.startswith(untouched)
    }


def test_prune_keep_best_uses_the_manifests_mode(tmp_path, capsys):
    with_best(tmp_path, {1: 0.2, 2: 0.9, 3: 0.5, 4: 0.8, 5: 0.1}, mode="max")
    rc, doc = cli_json(capsys, "prune", tmp_path, "--keep-last", "1", "--keep-best", "2", "--yes")
    assert rc == 0
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000000002", "step_000000004", "step_000000005"]
    assert "best #1 by acc (max)" in {r["step"]: r for r in doc["keep"]}[2]["why"]


def test_prune_refuses_while_a_run_holds_the_directory(tmp_path, capsys):
    saved(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from preempt.checkpoint.lock import DirLock\n"
         "with DirLock(sys.argv[1], purpose='training'):\n print('held', flush=True); sys.stdin.read()", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        before = tree(tmp_path)
        rc, _, err = cli(capsys, "prune", tmp_path, "--keep-last", "1", "--yes")
        assert rc == 3 and f"pid {holder.pid}" in err and "Nothing deleted" in err
        assert tree(tmp_path) == before
    finally:
        holder.communicate("", timeout=60)
    rc, _, _ = cli(capsys, "prune", tmp_path, "--keep-last", "1", "--yes")
    assert rc == 0 and [p.name for p in tmp_path.glob("step_*")] == ["step_000000003"]


def test_prune_deletes_nothing_when_a_kept_checkpoint_is_damaged(tmp_path, capsys):
    saved(tmp_path)
    bad = tmp_path / "step_000000003" / "model.safetensors"
    flip(bad)
    before = tree(tmp_path)
    rc, _, err = cli(capsys, "prune", tmp_path, "--keep-last", "1", "--yes")
    assert rc == 1 and f"{bad}: xxh3 mismatch" in err and "nothing deleted" in err
    assert tree(tmp_path) == before


# --------------------------------------------------------------------- export


def test_export_writes_plain_safetensors(tmp_path, capsys):
    model, _ = saved(tmp_path / "run")
    out = tmp_path / "model.safetensors"
    rc, doc = cli_json(capsys, "export", tmp_path / "run", "--out", out)
    assert rc == 0 and doc["step"] == 3
    weights = load_file(str(out))
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["preempt.step"] == "3" and meta["preempt.source"].endswith("step_000000003")
    assert doc["xxh3_128"] == xxhash.xxh3_128_hexdigest(out.read_bytes())

    older = load_file(str(tmp_path / "run" / "step_000000001" / "model.safetensors"))
    rc, _, err = cli(capsys, "export", tmp_path / "run", "1", "--out", out)
    assert rc == 2 and f"{out}: exists; pass --force" in err
    assert all(torch.equal(load_file(str(out))[k], v) for k, v in model.state_dict().items())  # untouched
    rc, _, _ = cli(capsys, "export", tmp_path / "run", "1", "--out", out, "--force")
    assert rc == 0 and all(torch.equal(load_file(str(out))[k], v) for k, v in older.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "run"]  # no temporary left


def test_export_from_a_damaged_checkpoint_writes_nothing(tmp_path, capsys):
    saved(tmp_path / "run")
    src = tmp_path / "run" / "step_000000003" / "model.safetensors"
    flip(src)
    expected = manifest_of(src.parent)["files"]["model.safetensors"]["xxh3_128"]
    found = xxhash.xxh3_128_hexdigest(src.read_bytes())
    out = tmp_path / "out" / "w.safetensors"
    out.parent.mkdir()
    rc, _, err = cli(capsys, "export", tmp_path / "run", "latest", "--out", out)
    assert rc == 1 and f"{src}: xxh3 mismatch (manifest {expected}, file {found}" in err
    assert list(out.parent.iterdir()) == []


# --------------------------------------------------------------- entry points


def test_console_script_and_python_m(tmp_path):
    script = shutil.which("preempt")
    if script is None:
        pytest.skip("the `preempt` console script is not on PATH (pip install -e .)")
    saved(tmp_path, steps=(1, 2))
    bad = tmp_path / "step_000000001" / "state.json"
    flip(bad)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this tree, whatever the installed copy points at
    ls = subprocess.run([script, "ls", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert ls.returncode == 0, ls.stderr
    assert "valid (latest)" in ls.stdout and "step_000000001" in ls.stdout
    verify = subprocess.run(
        [sys.executable, "-m", "preempt", "verify", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert verify.returncode == 1, verify.stderr
    found = xxhash.xxh3_128_hexdigest(bad.read_bytes())
    assert (
        f"{bad}: xxh3 mismatch (manifest {manifest_of(bad.parent)['files']['state.json']['xxh3_128']}, file {found}"
        in verify.stdout
    )


def test_dir_may_name_one_checkpoint(tmp_path, capsys):
    saved(tmp_path, steps=(1, 2))
    ckpt = tmp_path / "step_000000001"
    rc, doc = cli_json(capsys, "verify", ckpt)
    assert rc == 0 and [c["step"] for c in doc["checkpoints"]] == [1]
    rc, doc = cli_json(capsys, "inspect", ckpt)
    assert rc == 0 and doc["manifest"]["step"] == 1
    rc, _, err = cli(capsys, "inspect", ckpt, "2")
    assert rc == 2 and "is the checkpoint of step 1, but STEP says 2" in err
    rc, _, err = cli(capsys, "prune", ckpt, "--keep-last", "1")
    assert rc == 2 and f"is one checkpoint; expected its save_dir ({tmp_path})" in err


def test_verify_a_checkpoint_pruned_meanwhile_is_not_damage(tmp_path, capsys, monkeypatch):
    from preempt.checkpoint import commit, hashed_io

    saved(tmp_path)
    read_file = hashed_io.read_file

    def pruned_by_a_run(path, *a):
        victim = tmp_path / "step_000000002"
        if Path(path).parent == victim:
            commit.trash(tmp_path, victim)  # what a training's prune does
        return read_file(path, *a)

    monkeypatch.setattr(hashed_io, "read_file", pruned_by_a_run)
    rc, doc = cli_json(capsys, "verify", tmp_path)
    assert rc == 0 and doc["ok"]
    assert {c["step"]: c["status"] for c in doc["checkpoints"]} == {3: "valid", 2: "gone", 1: "valid"}
    flip(tmp_path / "step_000000001" / "model.safetensors")
    assert cli(capsys, "verify", tmp_path)[0] == 1  # real damage still counts


@pytest.mark.parametrize("name", ["model.safetensors", "state.json"])
@pytest.mark.parametrize("kind", ["fifo", "directory", "missing"])
def test_no_command_blocks_or_crashes_on_odd_files(tmp_path, capsys, name, kind):
    saved(tmp_path, steps=(1,))
    path = tmp_path / "step_000000001" / name
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)  # opening it for reading would block until a writer comes
    elif kind == "directory":
        path.mkdir()
    commands = [["verify", tmp_path], ["inspect", tmp_path]]
    out_file = tmp_path.parent / f"{tmp_path.name}-w.safetensors"  # outside the save_dir
    if name == "model.safetensors":  # export reads only the weights
        commands.append(["export", tmp_path, "--out", out_file])
    for argv in commands:
        rc, out, err = cli(capsys, *argv)
        assert rc == 1 and str(path) in out + err, (argv, out, err)
    assert not out_file.exists()


@pytest.mark.parametrize(
    "args",
    [
        ["ls"],
        ["ls", "--json"],
        ["verify"],
        ["inspect"],
        ["export", "--out", "EXPORT"],
        ["prune", "--keep-last", "1"],
        ["prune", "--keep-last", "1", "--yes"],
        ["prefetch"],
    ],
    ids=lambda a: " ".join(a).replace("EXPORT", "out"),
)
def test_the_checkpoint_commands_never_import_torch(tmp_path, args):
    """Reading headers and JSON needs no torch: these commands start in a fraction of a second."""
    model, _ = saved(tmp_path / "run")
    script = (
        "import sys\nfrom preempt.cli.main import main\n"
        "code = main(sys.argv[1:])\n"
        "sys.stderr.write(f'\\ntorch imported: {\"torch\" in sys.modules}\\n')\n"
        "sys.stderr.write(f'numpy imported: {\"numpy\" in sys.modules}\\n')\nsys.exit(code)\n"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            args[0],
            str(tmp_path / "run"),
            *[str(tmp_path / "w.safetensors") if a == "EXPORT" else a for a in args[1:]],
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "torch imported: False" in r.stderr, r.stderr
    if args[0] == "ls":  # the manifests alone: not even numpy (90 ms of a command that takes 0.2 s)
        assert "numpy imported: False" in r.stderr, r.stderr
    if args[0] == "prune" and "--yes" in args:
        assert [p.name for p in (tmp_path / "run").glob("step_*")] == ["step_000000003"]
    if args[0] == "export":  # the latest weights, bit for bit, with the export's metadata
        exported, weights = load_file(str(tmp_path / "w.safetensors")), model.state_dict()
        assert set(exported) == set(weights) and all(torch.equal(exported[k], weights[k]) for k in weights)
        with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
            assert f.metadata()["preempt.step"] == "3"


def test_inspect_and_export_still_read_tensors(tmp_path, capsys):
    saved(tmp_path / "run")
    code, out, _ = cli(capsys, "inspect", str(tmp_path / "run"))
    assert code == 0 and "model.safetensors" in out
    code, _, _ = cli(capsys, "export", str(tmp_path / "run"), "--out", str(tmp_path / "w.safetensors"))
    assert code == 0 and set(load_file(str(tmp_path / "w.safetensors")))


def test_prefetch_names_the_newest_valid_checkpoint_and_every_file_its_manifest_lists(tmp_path, capsys):
    """The checkpoint a restore would read (a newer directory without a manifest is not one), every file its
    manifest lists with their bytes, none failed; a save_dir without a valid checkpoint is no error. (That the bytes
    end up in the page cache is not observable here without timing: bench_restore.py measures it.)"""
    from preempt.cli.main import main

    saved(tmp_path / "run")
    newest = sorted((tmp_path / "run").glob("step_*"))[-1]
    (tmp_path / "run" / "step_000000009").mkdir()  # newer, but no manifest: not a checkpoint to read
    listed = json.loads((newest / "manifest.json").read_text())["files"]
    assert main(["prefetch", str(tmp_path / "run"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["checkpoint"] == str(newest) and doc["files"] == len(listed) and doc["failed"] == []
    assert doc["bytes"] == sum(f["size"] for f in listed.values())
    assert main(["prefetch", str(tmp_path / "missing")]) == 2  # no such directory: a usage error
    capsys.readouterr()
    (tmp_path / "empty").mkdir()
    assert main(["prefetch", str(tmp_path / "empty"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"] is None


def test_supervise_reads_the_newest_checkpoint_ahead_as_each_attempt_starts(tmp_path):
    """With --save-dir, the newest valid checkpoint is read into memory beside the child's start (said in the
    supervisor's log); a save_dir without one is read nothing."""
    saved(tmp_path / "run")
    newest = sorted((tmp_path / "run").glob("step_*"))[-1]
    cmd = [sys.executable, "-m", "preempt", "supervise", "--max-retries", "0"]
    r = subprocess.run([*cmd, "--save-dir", str(tmp_path / "run"), "--", "true"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    log = (tmp_path / "run" / "supervise.log").read_text()
    assert f"attempt 1: reading {newest} ahead of its restore" in log, log
    (tmp_path / "fresh").mkdir()
    r = subprocess.run([*cmd, "--save-dir", str(tmp_path / "fresh"), "--", "true"], capture_output=True, text=True)
    assert r.returncode == 0 and "ahead" not in (tmp_path / "fresh" / "supervise.log").read_text(), r.stderr
