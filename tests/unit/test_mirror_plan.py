"""The mirror's pure decisions (preempt.mirror.plan) and the uploader's backoff, with made-up listings: no server,
no thread, no clock."""

from __future__ import annotations

import pytest

from preempt.checkpoint.hashed_io import FileDigest
from preempt.checkpoint.manifest import Cursor, Manifest
from preempt.checkpoint.names import MANIFEST
from preempt.checkpoint.retention import RetentionPolicy
from preempt.mirror import plan
from preempt.mirror.store import check_name, redact


def digest(size: int, tag: str = "a", carried_from: int | None = None) -> FileDigest:
    return FileDigest(size, (tag * 32)[:32], carried_from)


def manifest(step: int, created: float = 1.0, best: float | None = None, **files: FileDigest) -> Manifest:
    files = files or {"model.safetensors": digest(100), "state.json": digest(10, "b")}
    extra = {"best": {"metric": "loss", "value": best}, "is_best": True} if best is not None else {}
    return Manifest(step=step, cursor=Cursor(), reason="steps", created=created, files=files, **extra)


def objects(m: Manifest, with_manifest: bool = True) -> dict[str, int]:
    out = {n: d.size for n, d in m.files.items()}
    if with_manifest:
        out[MANIFEST] = 500
    return out


def test_complete_needs_the_manifest_and_every_listed_file_with_its_size():
    m = manifest(10)
    assert plan.is_complete(objects(m), m)
    assert not plan.is_complete(objects(m, with_manifest=False), m)  # an upload cut before its manifest
    assert not plan.is_complete(objects(m), None)  # a manifest that did not parse
    short = {**objects(m), "model.safetensors": 99}
    assert not plan.is_complete(short, m)
    missing = {k: v for k, v in objects(m).items() if k != "state.json"}
    assert not plan.is_complete(missing, m)
    assert plan.is_complete({**objects(m), "stray.bin": 1}, m)  # more objects than listed: still complete


def test_to_upload_what_the_mirror_lacks_or_holds_another_save_of_oldest_first():
    local = {2: manifest(2), 4: manifest(4), 6: manifest(6)}
    assert plan.to_upload(local, {}) == [2, 4, 6]
    assert plan.to_upload(local, {2: manifest(2), 4: manifest(4)}) == [6]
    assert plan.to_upload(local, dict(local)) == []
    assert plan.to_upload(local, {2: manifest(2), 4: manifest(4, created=9.0), 6: manifest(6)}) == [4]
    assert plan.to_upload({}, {2: manifest(2)}) == []


def test_upload_order_data_first_largest_first_manifest_last():
    m = manifest(8, **{"a.bin": digest(5), "big.bin": digest(500), "mid.bin": digest(50)})
    acts = plan.upload_actions(m, None, {})
    assert [(a.kind, a.name) for a in acts] == [
        ("put", "big.bin"),
        ("put", "mid.bin"),
        ("put", "a.bin"),
        ("manifest", MANIFEST),
    ]


def test_a_replaced_step_loses_its_old_manifest_before_any_new_data():
    m = manifest(8)
    present = {MANIFEST: 400, "model.safetensors": 100, "old.bin": 7}
    acts = plan.upload_actions(m, present, {})
    assert acts[0] == plan.Action("delete", MANIFEST)
    assert plan.Action("delete", "old.bin") in acts[:2]
    assert acts[-1] == plan.Action("manifest", MANIFEST)
    assert [a.kind for a in acts].count("manifest") == 1
    # without an old manifest there (an upload cut off earlier): nothing to delete first
    assert plan.upload_actions(m, {"model.safetensors": 3}, {})[0].kind == "put"


def test_carried_files_are_copied_server_side_from_a_complete_step_with_the_same_bytes():
    base = digest(1000, "c")
    first = manifest(2, **{"base.safetensors": base, "model.safetensors": digest(10, "d")})
    later = manifest(4, **{"base.safetensors": digest(1000, "c", carried_from=2), "model.safetensors": digest(10, "e")})
    acts = plan.upload_actions(later, None, {2: first})
    assert plan.Action("copy", "base.safetensors", 2) in acts
    assert plan.Action("put", "model.safetensors") in acts
    # not complete in the mirror (not in ``mirrored``): uploaded
    assert plan.Action("put", "base.safetensors") in plan.upload_actions(later, None, {})
    # other bytes under the same name: uploaded
    other = manifest(2, **{"base.safetensors": digest(1000, "f")})
    assert plan.Action("put", "base.safetensors") in plan.upload_actions(later, None, {2: other})
    # a file with the same bytes in the newest step, not the step it was carried from: copied from there
    m6 = manifest(6, **{"base.safetensors": digest(1000, "c", carried_from=4)})
    assert plan.copy_source("base.safetensors", base, 8, {4: later, 6: m6}) == 6
    assert plan.copy_source("base.safetensors", digest(1000, "c", carried_from=4), 8, {4: later, 6: m6}) == 4
    assert plan.copy_source("base.safetensors", base, 4, {4: later}) is None  # never from itself


def test_pull_candidates_newest_first_and_only_newer_than_save_dir():
    assert plan.pull_candidates([2, 6, 4], None) == [6, 4, 2]
    assert plan.pull_candidates([2, 6, 4], 4) == [6]
    assert plan.pull_candidates([2, 4], 4) == []
    assert plan.pull_candidates([2, 4], 9) == []
    assert plan.pull_candidates([], None) == []


def test_deletions_apply_the_runs_retention_and_clear_debris():
    keep2 = RetentionPolicy(keep_last=2)
    ms = {s: manifest(s) for s in (2, 4, 6, 8)}
    listing = {s: objects(m) for s, m in ms.items()}
    assert plan.deletions(keep2, listing, ms) == [2, 4]
    assert plan.deletions(RetentionPolicy(keep_last=None), listing, ms) == []
    # an incomplete step older than the newest complete is debris; a newer one may be an upload under way
    listing |= {5: {"model.safetensors": 3}, 10: {"model.safetensors": 3}}
    assert plan.deletions(keep2, listing, ms) == [2, 4, 5]
    assert plan.deletions(keep2, listing, ms, busy=[4]) == [2, 5]
    assert plan.deletions(keep2, listing, ms, pull_pending=True) == []
    # nothing complete: nothing is deleted, not even debris (there is no newest complete to be older than)
    assert plan.deletions(keep2, {3: {"x": 1}}, {}) == []
    # the newest complete one is never deleted, whatever the policy keeps
    best = RetentionPolicy(keep_last=1, keep_best=1, metric="loss")
    ms = {2: manifest(2, best=0.1), 4: manifest(4), 6: manifest(6)}
    assert plan.deletions(best, {s: objects(m) for s, m in ms.items()}, ms) == [4]
    ms = {2: manifest(2, best=0.1), 4: manifest(4)}
    keep_every = RetentionPolicy(keep_last=1, keep_every_steps=2)
    assert plan.deletions(keep_every, {s: objects(m) for s, m in ms.items()}, ms) == []


def test_deletions_never_count_or_delete_steps_newer_than_the_newest_the_run_trusts():
    """Forged complete-looking steps 1000 and 1001 in a shared bucket, keep_last=2: retention deleted the genuine
    steps 6 and 8, and a new machine could not resume. Only the steps up to the newest trusted one count."""
    keep2 = RetentionPolicy(keep_last=2)
    ms = {s: manifest(s) for s in (2, 4, 6, 8, 1000, 1001)}
    listing = {s: objects(m) for s, m in ms.items()} | {1002: {"model.safetensors": 3}}
    assert plan.deletions(keep2, listing, ms) == [2, 4, 6, 8]  # all trusted: the forged steps displace 6 and 8
    assert plan.deletions(keep2, listing, ms, trusted={6, 8}) == [2, 4]
    assert plan.deletions(keep2, listing, ms, trusted=set()) == []  # nothing verified: nothing deleted
    assert plan.deletions(keep2, listing, ms, trusted={999}) == []  # (a trusted step the mirror lacks counts not)


def test_undecided_names_only_the_unread_manifests_retention_needs():
    """Retention read every manifest of the mirror (10,000 junk steps: 10,000 GETs a pass). Under keep_last=K it needs
    an unread step only while fewer than K complete steps are known above it (and milestones); below those a step goes
    whether complete or not. A policy keeping all, or ranking by a metric, needs them all; newer than the newest
    trusted step, none. Deleting what was read, with the undecided ones kept, never deletes what reading all would
    keep."""
    keep2 = RetentionPolicy(keep_last=2)
    ms = {s: manifest(s) for s in (100, 90)}
    unread = [*range(80), 95, 200]
    assert plan.undecided(keep2, ms, unread, trusted={100}) == [95]  # 200: newer than the trusted; below 90: decided
    assert plan.undecided(keep2, {100: ms[100]}, unread, trusted={100}) == [95, *range(79, -1, -1)]
    assert plan.undecided(keep2, ms, unread, trusted=set()) == []
    every = RetentionPolicy(keep_last=2, keep_every_steps=25)
    assert plan.undecided(every, ms, unread, trusted={100}) == [95, 75, 50, 25, 0]
    assert plan.undecided(RetentionPolicy(keep_last=None), ms, [3, 1], trusted={100}) == [3, 1]
    best = RetentionPolicy(keep_last=1, keep_best=1, metric="loss")
    assert plan.undecided(best, ms, [3, 1], trusted={100}) == [3, 1]
    # the steps left undecided kept (busy), the rest of the listing judged on what was read: junk below goes
    listing = {s: objects(m) for s, m in ms.items()} | {s: {MANIFEST: 64} for s in unread}
    doomed = plan.deletions(keep2, listing, ms, busy=[95], trusted={100})
    assert doomed == list(range(80)), doomed
    # were 95 read and complete, it would displace 90: with 95 undecided, 90 is kept too
    assert plan.deletions(keep2, listing, ms | {95: manifest(95)}, trusted={100}) == [*range(80), 90]


@pytest.mark.parametrize(
    ("deadline", "left", "expected"),
    [(60.0, None, 60.0), (60.0, 40.0, 20.0), (10.0, 100.0, 10.0), (60.0, -5.0, 0.0), (0.0, None, 0.0)],
)
def test_stop_deadline_capped_by_part_of_the_time_left(deadline, left, expected):
    assert plan.stop_deadline(deadline, left) == expected


def test_urls_lose_their_credentials_and_names_stay_plain():
    assert redact("s3://AKIA:secret@bucket/runs/a") == "s3://bucket/runs/a"
    assert redact("az://container/p?sig=SECRET&se=1") == "az://container/p"
    assert redact("s3://bucket/p") == "s3://bucket/p"
    assert check_name("model.safetensors") == "model.safetensors"
    for bad in ("../x", "a/b", "", ".hidden", "x" * 200):
        with pytest.raises(ValueError, match="not a plain name"):
            check_name(bad)


def test_config_checks_the_mirror_options():
    from preempt.run.config import RunConfig

    assert RunConfig(mirror="s3://b/p", mirror_options={"key": "k"}).mirror == "s3://b/p"
    with pytest.raises(ValueError, match="mirror: expected a URL") as e:
        RunConfig(mirror="user:pw@bucket/p")
    assert "pw" not in str(e.value)
    with pytest.raises(ValueError, match="mirror_options: given without mirror="):
        RunConfig(mirror_options={"key": "k"})
    with pytest.raises(ValueError, match="mirror_options: expected a mapping"):
        RunConfig(mirror="s3://b/p", mirror_options=[("key", "k")])
    for bad in (-1, float("nan"), "60", True):
        with pytest.raises(ValueError, match="mirror_deadline: expected a number of seconds >= 0"):
            RunConfig(mirror="s3://b/p", mirror_deadline=bad)


def test_without_the_extra_a_mirror_says_what_to_install(monkeypatch):
    import sys

    from preempt.errors import MirrorError
    from preempt.mirror.store import MirrorStore

    monkeypatch.setitem(sys.modules, "fsspec", None)  # as if not installed: `import fsspec` raises ImportError
    with pytest.raises(MirrorError, match=r"fsspec is not installed; pip install 'preempt-torch\[mirror\]'"):
        MirrorStore("s3://bucket/prefix")


def test_report_says_how_far_behind_the_mirror_was():
    from preempt.cli import timeline

    lines = [
        {"t": 100.0, "event": "start", "step": 0},
        {"t": 101.0, "event": "mirror_down", "error": "x"},
        {"t": 105.0, "event": "mirror_up", "down_s": 4.0, "behind": 2, "held": 6},
        {
            "t": 109.0,
            "event": "mirror_end",
            "step": 10,
            "held": 8,
            "behind_steps": 2,
            "behind_s": 3.0,
            "max_behind_steps": 6,
            "max_behind_s": 4.5,
        },  # fmt: skip
        {"t": 110.0, "event": "stop", "step": 10, "cause": "SIGTERM"},
        {"t": 120.0, "event": "resume", "step": 10},
        {
            "t": 125.0,
            "event": "mirror_end",
            "step": 12,
            "held": 12,
            "behind_steps": 0,
            "behind_s": 0.0,
            "max_behind_steps": 2,
            "max_behind_s": -1,
        },  # fmt: skip
        {"t": 126.0, "event": "complete", "step": 12},
    ]
    report = timeline.build(lines)
    assert report.mirror() == {
        "max_behind_steps": 6,
        "max_behind_s": 4.5,
        "end": {"held": 12, "behind_steps": 0, "behind_s": 0.0},
        "outages": 1,
    }
    assert any("max_behind_s=-1" in n for n in report.notes)  # an absurd value is set aside and said
    text = "\n".join(timeline.render(report, "run"))
    assert "mirror: at most 6 steps and 4.50 s behind the newest durable checkpoint; at the end it held step 12" in text
    assert timeline.build(lines[:1]).mirror() is None  # no mirror: no line
