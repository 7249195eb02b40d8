"""``preempt prune`` keeps what the run keeps: the retention each manifest records.

A run started with ``keep_best=1`` and ``keep_every_steps=N`` records that in
every manifest; ``preempt prune DIR --keep-last 1`` then keeps the run's best
checkpoint and its milestones besides the newest one, unless ``--keep-best 0``
or ``--keep-every-steps 0`` says otherwise. Manifests without the field (an
older preempt's) prune as before. The checkpoints come from real runs and the
command runs as a real subprocess (``python -m preempt prune``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from preempt import PreemptibleRun
from preempt.checkpoint.hashed_io import dumps_json
from preempt.checkpoint.manifest import Cursor, Manifest, retention_record
from preempt.checkpoint.retention import RetentionPolicy
from preempt.checkpoint.safe_io import MAX_DEPTH

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # this tree, whatever the installed copy points at
WHERE = "runs/x/step_000000120/manifest.json"

# val_loss per step 1..10: the best is step 2; milestones (keep_every_steps=4) are steps 4 and 8; 10 is the last.
VAL_LOSS = [5.0, 1.0, 3.0, 4.0, 6.0, 7.0, 8.0, 9.0, 9.5, 9.9]
RUN_RETENTION = {"keep_last": 1, "keep_best": 1, "keep_every_steps": 4, "metric": "val_loss", "mode": "min"}


def train(save_dir: Path, **kw: Any) -> None:
    """Ten steps of a real run, a checkpoint at each (synchronous, so that none is postponed)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = dict(checkpoint_interval=None, checkpoint_every_steps=1, async_save=False, log_file=False)
    options.update(kw)
    with PreemptibleRun(save_dir, model=model, optimizer=opt, **options) as run:
        for _ in run.epochs(1):
            for value in VAL_LOSS:
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                run.step(metrics={"val_loss": value})


@pytest.fixture(scope="module")
def kept_by_run(tmp_path_factory) -> Path:
    """A run with keep_last=1, keep_best=1, keep_every_steps=4: it pruned everything else itself."""
    d = tmp_path_factory.mktemp("kept") / "run"
    train(d, keep_last=1, keep_best=1, best_metric="val_loss", keep_every_steps=4)
    return d


@pytest.fixture(scope="module")
def all_kept(tmp_path_factory) -> Path:
    """The same run with keep_last=None: every step's checkpoint is on disk, retention recorded all the same."""
    d = tmp_path_factory.mktemp("all") / "run"
    train(d, keep_last=None, keep_best=1, best_metric="val_loss", keep_every_steps=4)
    return d


def copy(src: Path, tmp_path: Path) -> Path:
    d = tmp_path / "run"
    shutil.copytree(src, d)
    return d


def steps(d: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in d.glob("step_*"))


def run_prune(d: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """``python -m preempt prune DIR OPTIONS`` in a real process, from the save_dir's parent."""
    r = subprocess.run(
        [sys.executable, "-m", "preempt", "prune", str(d), *options],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=d.parent,
        timeout=120,
    )
    assert "Traceback" not in r.stderr, r.stderr
    return r


def prune(d: Path, *options: str) -> tuple[int, dict[str, Any], str]:
    """``prune ... --json``: exit code, document, stderr."""
    r = run_prune(d, *options, "--json")
    return r.returncode, json.loads(r.stdout), r.stderr


def prune_text(d: Path, *options: str) -> tuple[int, str, str]:
    r = run_prune(d, *options)
    return r.returncode, r.stdout, r.stderr


def why(doc: dict[str, Any]) -> dict[int, list[str]]:
    return {r["step"]: r["why"] for r in doc["keep"]}


def rewrite(manifest: Path, change) -> None:
    """Edits a manifest's JSON with ``change`` and re-signs it, as a writer with other rules would have."""
    raw = json.loads(manifest.read_text())
    change(raw)
    raw.pop("checksum", None)
    raw["checksum"] = xxhash.xxh3_128_hexdigest(dumps_json(raw))
    manifest.write_text(json.dumps(raw))


# ------------------------------------------------------------- what a run records


def test_a_run_records_its_retention_in_every_manifest(all_kept):
    for m in sorted(all_kept.glob("step_*/manifest.json")):
        assert json.loads(m.read_text())["retention"] == {**RUN_RETENTION, "keep_last": None}, m


def test_a_run_with_keep_last_1_pruned_everything_but_best_milestones_and_latest(kept_by_run):
    assert steps(kept_by_run) == [2, 4, 8, 10]
    manifest = json.loads((kept_by_run / "step_000000010" / "manifest.json").read_text())
    assert manifest["retention"] == RUN_RETENTION


# ------------------------------------------------------------------- prune


def test_prune_keep_last_1_keeps_the_runs_best_and_milestones(kept_by_run, tmp_path):
    d = copy(kept_by_run, tmp_path)
    rc, doc, _ = prune(d, "--keep-last", "1", "--yes")
    assert rc == 0 and doc["deleted"] == []
    assert steps(d) == [2, 4, 8, 10]
    reasons = why(doc)
    assert "best #1 by val_loss (min), the run's keep_best=1" in reasons[2]
    assert reasons[4] == ["milestone (the run's keep_every_steps=4)"]
    assert reasons[8] == ["milestone (the run's keep_every_steps=4)"]
    assert reasons[10][0] == "latest"
    assert doc["retention"]["recorded"] == RUN_RETENTION
    assert doc["retention"]["recorded_in"] == str(d / "step_000000010" / "manifest.json")


def test_keep_best_0_deletes_the_best(kept_by_run, tmp_path):
    d = copy(kept_by_run, tmp_path)
    rc, doc, _ = prune(d, "--keep-last", "1", "--keep-best", "0", "--yes")
    assert rc == 0 and doc["deleted"] == ["step_000000002"]
    assert steps(d) == [4, 8, 10]


def test_keep_every_steps_0_deletes_the_milestones(kept_by_run, tmp_path):
    d = copy(kept_by_run, tmp_path)
    rc, doc, _ = prune(d, "--keep-last", "1", "--keep-every-steps", "0", "--yes")
    assert rc == 0 and doc["deleted"] == ["step_000000008", "step_000000004"]
    assert steps(d) == [2, 10]


def test_dry_run_deletes_what_the_run_does_not_keep_and_says_why(all_kept, tmp_path):
    d = copy(all_kept, tmp_path)
    rc, out, _ = prune_text(d, "--keep-last", "1")
    assert rc == 0 and steps(d) == list(range(1, 11))  # a dry run
    assert "best #1 by val_loss (min), the run's keep_best=1" in out
    assert "milestone (the run's keep_every_steps=4)" in out
    assert f"the run's retention ({d / 'step_000000010' / 'manifest.json'}): keep_best=1 by val_loss (min)" in out
    assert "would delete 6 checkpoint(s)" in out
    rc, doc, _ = prune(d, "--keep-last", "1", "--yes")
    assert rc == 0 and steps(d) == [2, 4, 8, 10]


def test_options_replace_the_runs_values(all_kept, tmp_path):
    d = copy(all_kept, tmp_path)
    rc, doc, _ = prune(d, "--keep-last", "2", "--keep-best", "3", "--keep-every-steps", "5")
    assert rc == 0
    reasons = why(doc)
    # ranked by val_loss among the checkpoints that set a new best: 2 (1.0), 1 (5.0); milestones of 5: 5 and 10;
    # the last 2: 10 and 9
    assert sorted(reasons) == [1, 2, 5, 9, 10]
    assert "best #2 by val_loss (min)" in reasons[1] and "milestone (--keep-every-steps 5)" in reasons[5]
    assert not any("the run's" in r for rs in reasons.values() for r in rs)
    assert doc["retention"]["keep_best_from"] == doc["retention"]["keep_every_steps_from"] == "option"


def test_a_manifest_without_retention_prunes_as_before(kept_by_run, tmp_path):
    """An older preempt wrote no ``retention``: --keep-last 1 keeps the newest alone (and --keep-best still works)."""
    d = copy(kept_by_run, tmp_path)
    for m in d.glob("step_*/manifest.json"):
        rewrite(m, lambda raw: raw.pop("retention"))
    rc, doc, _ = prune(d, "--keep-last", "1")
    assert rc == 0 and doc["retention"]["recorded"] is None
    assert [r["step"] for r in doc["delete"]] == [8, 4, 2] and why(doc) == {10: ["latest", "complete.json"]}
    rc, out, _ = prune_text(d, "--keep-last", "1")
    assert "not recorded in the newest valid manifest" in out
    rc, doc, _ = prune(d, "--keep-last", "1", "--keep-best", "--yes")
    assert rc == 0 and steps(d) == [2, 10]


def test_the_newest_valid_manifest_decides(all_kept, tmp_path):
    """An older checkpoint's retention is not the run's any more: only the newest valid manifest's counts."""
    d = copy(all_kept, tmp_path)
    rewrite(d / "step_000000010" / "manifest.json", lambda raw: raw.pop("retention"))
    rc, doc, _ = prune(d, "--keep-last", "1")
    assert rc == 0 and why(doc) == {10: ["latest", "complete.json"]}


@pytest.mark.parametrize(
    "value, message",
    [
        ("keep everything", "retention': expected an object, found str"),
        ([1, 2], "retention': expected an object, found list"),
        ({**RUN_RETENTION, "keep_best": "1"}, "retention: field 'keep_best': expected an integer"),
        ({**RUN_RETENTION, "keep_best": -1}, "retention: field 'keep_best': expected an integer in [0,"),
        ({**RUN_RETENTION, "keep_best": True}, "retention: field 'keep_best': expected an integer"),
        ({**RUN_RETENTION, "keep_best": 1e308}, "retention: field 'keep_best': expected an integer"),
        ({**RUN_RETENTION, "keep_best": 10**30}, "retention: field 'keep_best': expected an integer in [0,"),
        ({**RUN_RETENTION, "keep_every_steps": 0}, "retention: field 'keep_every_steps': expected an integer in [1,"),
        ({**RUN_RETENTION, "keep_every_steps": 2**70}, "field 'keep_every_steps': expected an integer in [1,"),
        ({**RUN_RETENTION, "keep_last": [[[[1]]]]}, "retention: field 'keep_last': expected an integer"),
        ({**RUN_RETENTION, "metric": {"a": {"b": {}}}}, "retention: field 'metric': expected a string"),
        ({**RUN_RETENTION, "metric": ""}, "retention.metric: expected a metric name or null, found ''"),
        ({**RUN_RETENTION, "metric": None}, "retention.keep_best: 1 needs a metric to rank by"),
        ({**RUN_RETENTION, "mode": "median"}, "retention.mode: expected one of ('min', 'max'), found 'median'"),
        ({**RUN_RETENTION, "mode": "x" * 10**6}, "retention.mode: expected one of ('min', 'max'), found 'xxx"),
        ({k: v for k, v in RUN_RETENTION.items() if k != "mode"}, "retention: missing field 'mode'"),
    ],
    ids=lambda v: repr(v)[:40] if not isinstance(v, dict) else None,
)
def test_hostile_retention_values_are_a_clear_value_error(value, message):
    data = body(retention=value)
    with pytest.raises(ValueError) as e:
        Manifest.from_json(data, WHERE)
    text = str(e.value)
    assert text.startswith(WHERE) and message in text, text
    assert len(text) < 500  # a megabyte of hostile text is cut


def test_retention_nested_past_the_depth_limit_is_refused_before_parsing():
    nested: Any = 1
    for _ in range(MAX_DEPTH + 5):
        nested = [nested]
    with pytest.raises(ValueError, match=f"JSON nested {MAX_DEPTH + 7} levels deep; at most {MAX_DEPTH}"):
        Manifest.from_json(body(retention={**RUN_RETENTION, "keep_last": nested}), WHERE)


def test_a_hostile_retention_makes_the_checkpoint_corrupt_and_prune_skips_it(all_kept, tmp_path):
    """The newest manifest's retention is garbage: that checkpoint is corrupt (never touched by prune), and the
    newest valid one's retention applies; ls and verify name the field; nothing prints a traceback."""
    d = copy(all_kept, tmp_path)
    newest = d / "step_000000010" / "manifest.json"
    rewrite(newest, lambda raw: raw.__setitem__("retention", {**RUN_RETENTION, "keep_every_steps": 10**40}))
    rc, doc, _ = prune(d, "--keep-last", "1", "--yes")
    assert rc == 0
    assert [r["step"] for r in doc["skipped"]] == [10]
    assert doc["retention"]["recorded_in"] == str(d / "step_000000009" / "manifest.json")
    assert steps(d) == [2, 4, 8, 9, 10]
    for command in ("ls", "verify"):
        r = subprocess.run(
            [sys.executable, "-m", "preempt", command, str(d)], capture_output=True, text=True, env=ENV, timeout=120
        )
        assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
        assert "retention: field 'keep_every_steps': expected an integer in [1," in r.stdout, r.stdout


# ------------------------------------------------------------------ the field


def make(**kw: Any) -> Manifest:
    base: dict[str, Any] = dict(step=120, cursor=Cursor(), reason="interval", created=1.7e9, files={})
    base.update(kw)
    return Manifest(**base)


def body(**fields: Any) -> bytes:
    """A signed manifest with ``fields`` set to raw JSON values (to reach the checks after the checksum)."""
    raw = json.loads(make().to_json())
    raw.update(fields)
    raw.pop("checksum")
    raw["checksum"] = xxhash.xxh3_128_hexdigest(dumps_json(raw))
    return json.dumps(raw).encode()


def test_retention_round_trips_and_absent_means_unknown():
    policy = RetentionPolicy(keep_last=3, keep_best=2, keep_every_steps=100, metric="acc", mode="max")
    record = retention_record(policy)
    assert record == {"keep_last": 3, "keep_best": 2, "keep_every_steps": 100, "metric": "acc", "mode": "max"}
    m = make(retention=record)
    assert Manifest.from_json(m.to_json(), WHERE) == m
    old = make()
    assert "retention" not in json.loads(old.to_json())  # no key at all: the bytes an older preempt wrote
    assert Manifest.from_json(old.to_json(), WHERE).retention is None
    assert Manifest.from_json(body(retention=None), WHERE).retention is None


def test_unknown_retention_keys_from_a_newer_writer_are_ignored():
    back = Manifest.from_json(body(retention={**RUN_RETENTION, "keep_newer_thing": [1]}), WHERE)
    assert back.retention == RUN_RETENTION
