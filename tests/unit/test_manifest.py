"""Unit tests for preempt.checkpoint.manifest: the checksummed, strictly parsed manifest.json."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import xxhash

from preempt.checkpoint import manifest as mf
from preempt.checkpoint.hashed_io import FileDigest, dumps_json
from preempt.checkpoint.manifest import Cursor, Manifest

WHERE = "runs/x/step_000000120/manifest.json"


def make(**kw: Any) -> Manifest:
    base: dict[str, Any] = dict(
        step=120,
        cursor=Cursor(epoch=2, batch=5, sample=40, point="step", batches_per_epoch=10),
        reason="interval",
        created=1700000000.25,
        files={
            "model.safetensors": FileDigest(1234, "0123456789abcdef0123456789abcdef"),
            "state.json": FileDigest(0, "ab" * 16),
        },
        sampler={"dataset_len": 100, "seed": 3, "shuffle": True},
        metrics={"loss": 0.5, "acc": math.inf},
        best={"metric": "loss", "mode": "min", "value": 0.5, "step": 120},
        is_best=True,
        lineage={"request": None, "parent": "step_000000100"},
        provenance={"torch": "2.13.0", "git": {"commit": "abc", "dirty": False}},
    )
    base.update(kw)
    return Manifest(**base)


def body(m: Manifest | None = None) -> dict[str, Any]:
    return json.loads((m or make()).to_json())


def reseal(raw: dict[str, Any]) -> bytes:
    """JSON bytes of ``raw`` with a correct checksum (to reach the checks after the checksum)."""
    raw = {k: v for k, v in raw.items() if k != "checksum"}
    raw["checksum"] = xxhash.xxh3_128_hexdigest(dumps_json(raw))
    return json.dumps(raw).encode()


def test_round_trip():
    m = make()
    data = m.to_json()
    back = Manifest.from_json(data, WHERE)
    assert back == m
    assert back.files["model.safetensors"] == FileDigest(1234, "0123456789abcdef0123456789abcdef")
    assert back.cursor == Cursor(2, 5, 40, "step", 10)
    assert back.best_value == 0.5
    assert back.format_version == mf.FORMAT_VERSION == 1


def test_round_trip_minimal_and_defaults():
    m = Manifest(step=0, cursor=Cursor(), reason="final", created=0, files={})
    back = Manifest.from_json(m.to_json(), WHERE)
    assert back == m
    assert back.best_value is None and back.sampler is None and back.metrics == {}


def test_best_value_only_for_best_checkpoints():
    assert make(is_best=False).best_value is None
    assert make(best=None, is_best=True).best_value is None
    assert make().best_value == 0.5


def test_to_json_is_pretty_sorted_and_checksummed():
    data = make().to_json()
    assert data.endswith(b"}\n") and b"\n " in data
    raw = json.loads(data)
    assert list(raw) == sorted(raw)
    assert raw["format"] == "preempt-checkpoint"
    checksum = raw.pop("checksum")
    assert checksum == xxhash.xxh3_128_hexdigest(dumps_json(raw))
    assert len(checksum) == 32


@pytest.mark.parametrize(
    "old, new",
    [
        (b'"interval"', b'"intervbl"'),
        (b'\n "step": 120\n', b'\n "step": 121\n'),
        (b"0123456789abcdef0123456789abcdef", b"0123456789abcdef0123456789abcdee"),
        (b'"size": 1234', b'"size": 1235'),
        (b'"metric": "loss"', b'"metric": "lose"'),
        (b"1700000000.25", b"1700000000.26"),
        (b'"batch": 5', b'"batch": 6'),
    ],
)
def test_one_changed_character_fails_the_checksum(old, new):
    data = make().to_json()
    assert data.count(old) == 1
    bad = data.replace(old, new)
    assert len(bad) == len(data)
    with pytest.raises(ValueError, match="checksum") as e:
        Manifest.from_json(bad, WHERE)
    assert WHERE in str(e.value)


def test_every_single_digit_flip_in_values_is_detected():
    """Bumping any one digit anywhere in the file is either invalid JSON or a checksum failure, never accepted."""
    data = make().to_json()
    digits = [i for i, c in enumerate(data) if chr(c).isdigit()]
    assert len(digits) > 50
    for i in digits:
        bad = bytearray(data)
        bad[i] = ord("0") + (bad[i] - ord("0") + 1) % 10
        with pytest.raises(ValueError):
            Manifest.from_json(bytes(bad), WHERE)


def test_missing_checksum_is_rejected():
    raw = body()
    del raw["checksum"]
    with pytest.raises(ValueError, match="checksum mismatch"):
        Manifest.from_json(json.dumps(raw).encode(), WHERE)


@pytest.mark.parametrize("data", [b"", b"{", b"\x00\xff garbage", b"\xff\xfe{}", b"step: 1"])
def test_not_json(data):
    with pytest.raises(ValueError, match="not valid JSON") as e:
        Manifest.from_json(data, WHERE)
    assert str(e.value).startswith(WHERE)


@pytest.mark.parametrize("data", [b"[1, 2]", b'"x"', b"null", b"3"])
def test_not_an_object(data):
    with pytest.raises(ValueError, match="expected a JSON object"):
        Manifest.from_json(data, WHERE)


def test_wrong_format_name():
    raw = body()
    raw["format"] = "orbax"
    with pytest.raises(ValueError, match="expected format 'preempt-checkpoint', found 'orbax'"):
        Manifest.from_json(reseal(raw), WHERE)


def test_newer_format_version_says_newer():
    raw = body()
    raw["format_version"] = 2
    with pytest.raises(ValueError, match="format_version 2 is not supported") as e:
        Manifest.from_json(reseal(raw), WHERE)
    assert "newer" in str(e.value)


@pytest.mark.parametrize("version", [0, -1, "1", None, "2"])
def test_other_unknown_format_versions(version):
    raw = body()
    raw["format_version"] = version
    with pytest.raises(ValueError, match="is not supported") as e:
        Manifest.from_json(reseal(raw), WHERE)
    assert "newer" not in str(e.value)


@pytest.mark.parametrize(
    "field",
    ["step", "reason", "created", "files", "cursor", "metrics", "is_best", "lineage", "provenance", "sampler", "best"],
)
def test_missing_field(field):
    raw = body()
    del raw[field]
    with pytest.raises(ValueError, match=f"missing field '{field}'") as e:
        Manifest.from_json(reseal(raw), WHERE)
    assert str(e.value).startswith(WHERE)


@pytest.mark.parametrize("field", ["epoch", "batch", "sample", "point", "batches_per_epoch"])
def test_missing_cursor_field(field):
    raw = body()
    del raw["cursor"][field]
    with pytest.raises(ValueError, match=f"cursor: missing field '{field}'"):
        Manifest.from_json(reseal(raw), WHERE)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("step", -1, "field 'step': expected an integer"),
        ("step", 1.0, "field 'step': expected an integer"),
        ("step", True, "field 'step': expected an integer"),
        ("step", 1 << 63, "field 'step': expected an integer"),
        ("reason", 3, "field 'reason': expected a string"),
        ("created", "now", "field 'created': expected a number"),
        ("created", False, "field 'created': expected a number"),
        ("is_best", 1, "field 'is_best': expected true or false"),
        ("metrics", [], "field 'metrics': expected an object"),
        ("files", [], "field 'files': expected an object"),
        ("sampler", "s", "field 'sampler': expected an object"),
        ("best", {"metric": "loss"}, "best: missing field 'value'"),
        ("best", {"metric": 1, "value": 0.5}, "best: field 'metric': expected a string"),
    ],
)
def test_bad_field_types(field, value, message):
    raw = body()
    raw[field] = value
    with pytest.raises(ValueError, match=message):
        Manifest.from_json(reseal(raw), WHERE)


@pytest.mark.parametrize(
    "field, value",
    [("point", "middle"), ("point", None), ("epoch", -1), ("batch", 2.5), ("sample", -2), ("batches_per_epoch", -2)],
)
def test_bad_cursor(field, value):
    raw = body()
    raw["cursor"][field] = value
    with pytest.raises(ValueError, match=f"cursor.*{field}"):
        Manifest.from_json(reseal(raw), WHERE)


def test_cursor_minus_one_means_unknown():
    raw = body()
    raw["cursor"].update(sample=-1, batches_per_epoch=-1, point="epoch")
    m = Manifest.from_json(reseal(raw), WHERE)
    assert m.cursor == Cursor(epoch=2, batch=5, sample=-1, point="epoch", batches_per_epoch=-1)


def _with_file(name: Any = "model.safetensors", entry: Any = None) -> bytes:
    raw = body()
    raw["files"] = {name: entry if entry is not None else {"size": 10, "xxh3_128": "f" * 32}}
    return reseal(raw)


@pytest.mark.parametrize(
    "name",
    [
        "../x",
        "/etc/passwd",
        "a/b",
        "a\\b",
        "manifest.json",
        "",
        ".",
        "..",
        ".hidden",
        "-rf",
        "a..b",
        "a b",
        "x" * 129,
        "nul\x00byte",
        "ünïcode",
        "model.safetensors\n",  # '$' in a regex also matches before a final newline
    ],
)
def test_file_names_outside_or_odd_are_rejected(name):
    with pytest.raises(ValueError, match="is not a plain file name") as e:
        Manifest.from_json(_with_file(name), WHERE)
    assert repr(name)[:40] in str(e.value)


@pytest.mark.parametrize("name", ["model.safetensors", "x" * 128, "rng-state_1.json", "0", "_a.b-c"])
def test_plain_file_names_are_accepted(name):
    m = Manifest.from_json(_with_file(name), WHERE)
    assert m.files == {name: FileDigest(10, "f" * 32)}


@pytest.mark.parametrize("size", [mf.MAX_FILE_BYTES + 1, 1 << 62, -1, 1.5, True, "10", None])
def test_bad_sizes_are_rejected(size):
    with pytest.raises(ValueError, match=r"files\['model.safetensors'\].*'size'"):
        Manifest.from_json(_with_file(entry={"size": size, "xxh3_128": "f" * 32}), WHERE)


def test_largest_size_is_accepted():
    m = Manifest.from_json(_with_file(entry={"size": mf.MAX_FILE_BYTES, "xxh3_128": "0" * 32}), WHERE)
    assert m.files["model.safetensors"].size == 1 << 50


@pytest.mark.parametrize("digest", ["F" * 32, "f" * 31, "f" * 33, "g" * 32, "", " " + "f" * 31, "f" * 32 + "\n"])
def test_bad_digest_strings_are_rejected(digest):
    with pytest.raises(ValueError, match=r"xxh3_128: expected 32 hex digits"):
        Manifest.from_json(_with_file(entry={"size": 1, "xxh3_128": digest}), WHERE)


@pytest.mark.parametrize("entry", [{"size": 1}, {"xxh3_128": "f" * 32}, {"size": 1, "xxh3_128": 5}, [1, "f" * 32]])
def test_bad_file_entries_are_rejected(entry):
    with pytest.raises(ValueError, match=r"files\['model.safetensors'\]"):
        Manifest.from_json(_with_file(entry=entry), WHERE)


def test_oversized_manifest_is_rejected_before_parsing(monkeypatch):
    data = make().to_json()
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", len(data) - 1)
    with pytest.raises(ValueError, match=f"{len(data)} bytes; a manifest is at most {len(data) - 1}"):
        Manifest.from_json(data, WHERE)
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", len(data))
    assert Manifest.from_json(data, WHERE) == make()


def test_nan_metrics_round_trip():
    """Non-finite metrics are allowed and do not break the checksum."""
    m = make(metrics={"loss": math.nan, "x": -math.inf})
    back = Manifest.from_json(m.to_json(), WHERE)
    assert math.isnan(back.metrics["loss"]) and back.metrics["x"] == -math.inf


# ------------------------------------------------------------------ what Python itself cannot hold


@pytest.mark.parametrize(
    "data, found",
    [
        (b"[" * 100_000 + b"]" * 100_000, "RecursionError"),
        (b'{"step": ' + b"1" * 5000 + b"}", "ValueError: Exceeds the limit"),
    ],
    ids=["nested-100000-deep", "5000-digit-integer"],
)
def test_json_that_python_cannot_hold_is_not_valid_json(data, found):
    if found == "RecursionError":  # refused before parsing now, with its depth
        found_re = rf"^{WHERE}: JSON nested 100000 levels deep; at most 64 expected"
    else:
        found_re = rf"^{WHERE}: not valid JSON \({found}"
    with pytest.raises(ValueError, match=found_re):
        Manifest.from_json(data, WHERE)


@pytest.mark.parametrize("depth", [65, 990])
def test_a_manifest_nested_deeper_than_any_of_ours_is_refused_before_its_checksum_is_computed(depth):
    # json.loads alone takes ~990 levels; re-encoding it for the checksum then overflowed the stack
    data = b'{"format": "preempt", "x": ' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(ValueError, match=rf"JSON nested {depth + 1} levels deep"):
        Manifest.from_json(data, WHERE)


def test_a_manifest_listing_more_files_than_a_checkpoint_holds_is_refused():
    files = {f"f{i}": {"size": 1, "xxh3_128": "0" * 32} for i in range(70_000)}
    raw = {"format": mf.FORMAT, "format_version": mf.FORMAT_VERSION, "files": files}
    raw["checksum"] = xxhash.xxh3_128_hexdigest(dumps_json(raw))
    with pytest.raises(ValueError, match="lists 70000 files; a checkpoint holds at most 65536"):
        Manifest.from_json(json.dumps(raw).encode(), WHERE)


@pytest.mark.parametrize(
    "value, message",
    [
        (math.inf, r"expected a number in \[0, 1e\+11\], found inf"),
        (math.nan, r"expected a number in \[0, 1e\+11\], found nan"),
        (-1.0, r"expected a number in \[0, 1e\+11\], found -1.0"),
        (2e11, r"expected a number in \[0, 1e\+11\], found 200000000000.0"),
        (
            10**400,
            r"expected a number in \[0, 1e\+11\], found 10+\.\.\. \(401 characters\)",
        ),  # float() of it raises OverflowError
    ],
    ids=["inf", "nan", "negative", "year-8307", "beyond-floats"],
)
def test_created_must_be_a_time_datetime_can_show(value, message):
    raw = body()
    raw["created"] = value
    with pytest.raises(ValueError, match=rf"^{WHERE}: field 'created': {message}"):
        Manifest.from_json(reseal(raw), WHERE)


@pytest.mark.parametrize("value", ["low", True, None, [1], 10**400])
def test_metrics_must_be_numbers(value):
    raw = body()
    raw["metrics"] = {"loss": 0.5, "acc": value}
    with pytest.raises(ValueError, match=rf"^{WHERE}: metrics: field 'acc': expected a number"):
        Manifest.from_json(reseal(raw), WHERE)


def test_best_value_beyond_floats_is_a_value_error():
    raw = body()
    raw["best"]["value"] = 10**400
    with pytest.raises(ValueError, match=r"best: field 'value': expected a number, found 1000"):
        Manifest.from_json(reseal(raw), WHERE)


def test_infinite_best_value_is_accepted():
    """A first metric of inf can be "best" (better() accepts it), so the reader must too."""
    m = make(best={"metric": "loss", "mode": "min", "value": math.inf, "step": 120}, metrics={"loss": math.inf})
    assert Manifest.from_json(m.to_json(), WHERE).best_value == math.inf


@pytest.mark.parametrize(
    "sampler, sample, ok",
    [
        ({"dataset_len": 100, "num_replicas": 1, "drop_last": False}, 100, True),
        ({"dataset_len": 100, "num_replicas": 1, "drop_last": False}, 101, False),
        ({"dataset_len": 100, "num_replicas": 3, "drop_last": False}, 102, True),  # padded to 102
        ({"dataset_len": 100, "num_replicas": 3, "drop_last": False}, 103, False),
        ({"dataset_len": 100, "num_replicas": 3, "drop_last": True}, 100, False),  # 99 positions
        ({"dataset_len": 100}, 100, True),
        ({"dataset_len": 100}, 1 << 40, False),
        ({"seed": 3}, 1 << 40, True),  # not a ResumableSampler's state: not checked
        ({"dataset_len": "100"}, 1 << 40, True),
    ],
)
def test_cursor_past_the_end_of_its_epoch_is_refused(sampler, sample, ok):
    raw = body()
    raw["sampler"] = sampler
    raw["cursor"]["sample"] = sample
    if ok:
        assert Manifest.from_json(reseal(raw), WHERE).cursor.sample == sample
    else:
        with pytest.raises(ValueError, match=rf"^{WHERE}: cursor.sample {sample} is past the end of the epoch"):
            Manifest.from_json(reseal(raw), WHERE)


def test_huge_values_are_cut_in_messages():
    raw = body()
    raw["reason"] = ["x" * 1_000_000]
    with pytest.raises(ValueError, match=r"expected a string, found \['xxx.*\(1000004 characters\)") as e:
        Manifest.from_json(reseal(raw), WHERE)
    assert len(str(e.value)) < 400


# ---------------------------------------------------------------- a node's part (nodes without a shared save_dir)

ELSEWHERE = {
    "rank_00001.json": (1, FileDigest(10, "cd" * 16)),
    "pieces_00001.safetensors": (1, FileDigest(99, "ef" * 16, 4)),
}


def test_node_zero_part_round_trips_and_its_whole_lists_every_node_files():
    m = make(part=mf.Part(0, 2, ELSEWHERE))
    back = Manifest.from_json(m.to_json(), WHERE)
    assert back == m
    whole = back.whole
    assert whole.part is None and set(whole.files) == {*m.files, *ELSEWHERE}
    assert whole.files["pieces_00001.safetensors"].carried_from == 4
    assert "part" not in body(whole)  # the mirror's manifest reads as a whole checkpoint's
    assert make().whole == make()  # a whole checkpoint is its own whole


def test_another_node_part_has_no_whole():
    m = Manifest.from_json(make(part=mf.Part(1, 2)).to_json(), WHERE)
    assert m.part == mf.Part(1, 2)
    with pytest.raises(ValueError, match="node 1's part does not list the other nodes' files"):
        _ = m.whole


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"node": 2, "nodes": 2, "elsewhere": {}}, r"part: field 'node': expected an integer in \[0, 1\], found 2"),
        ({"node": 0, "nodes": 1, "elsewhere": {}}, r"part: field 'nodes': expected an integer in \[2, "),
        ({"node": 1, "nodes": 2, "elsewhere": {"x": {"size": 1, "xxh3_128": "ab" * 16, "node": 0}}}, "only node 0"),
        ({"node": 0, "nodes": 2, "elsewhere": {"../x": {"size": 1, "xxh3_128": "ab" * 16, "node": 1}}}, "plain file"),
        (
            {"node": 0, "nodes": 2, "elsewhere": {"state.json": {"size": 1, "xxh3_128": "ab" * 16, "node": 1}}},
            "also listed among this node's files",
        ),
        ({"node": 0, "nodes": 2, "elsewhere": {"x": {"size": 1, "xxh3_128": "ab" * 16, "node": 0}}}, "'node'"),
        ({"node": 0, "nodes": 2}, "missing field 'elsewhere'"),
        ([1], "part: expected an object|field 'part': expected an object"),
    ],
)
def test_a_forged_part_is_refused_by_name(part, message):
    raw = body()
    raw["part"] = part
    with pytest.raises(ValueError, match=message):
        Manifest.from_json(reseal(raw), WHERE)


def test_a_compact_document_of_many_empty_values_is_refused_before_it_is_parsed():
    """A manifest under the byte cap made of ``{}`` by the million cost ``ls`` 1.7 GB to parse (60 MiB): how many
    values a manifest holds is counted first, and more than a checkpoint's manifest could need is refused."""
    import tracemalloc

    data = b'{"files": [' + b"{}," * 4_000_000 + b'{}], "x": "a,b,[{"}'
    tracemalloc.start()
    with pytest.raises(ValueError, match=r"JSON of up to \d+ values; at most 1048576 expected"):
        Manifest.from_json(data, WHERE)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 6 * len(data), peak  # the scan's copies of the text, never the parsed objects (~80 bytes each)
    # (commas and brackets inside strings are not values: a real manifest with its strings is far below the bound)
    assert mf.safe_io._values(mf.safe_io._STRINGS.sub(b"", make().to_json())) < 100
