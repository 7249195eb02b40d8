"""What a forged or shared bucket can put in the mirror, through a real S3-compatible server (moto_server,
tests/s3server.py): objects the run itself never writes, with valid checksums where it matters. A valid checkpoint
is never lost to any of them."""

from __future__ import annotations

import json

import pytest
import torch
import xxhash
from s3server import put_checkpoint

from preempt.checkpoint.commit import MAX_STEP, checkpoint_name, dumps_json, parse_checkpoint_name
from preempt.checkpoint.manager import CheckpointManager
from preempt.checkpoint.manifest import Cursor, Manifest
from preempt.mirror.pull import pull
from preempt.mirror.store import MirrorStore


def saved(save_dir, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    manager = CheckpointManager(save_dir, keep_last=None)
    manager.prepare()
    for step in steps:
        with torch.no_grad():
            model[1].weight.add_(1)
        manager.save_state(step=step, model=model)
    return manager


def test_aliases_of_a_step_are_not_that_step_and_the_pull_works(tmp_path, mirror_url):
    """``step_4/`` and ``step_03/`` beside ``step_000000004/`` were merged into step 4 (and 3): the pull
    failed with a FileNotFoundError. Only the one name of each step is a step; the others are ignored."""
    local = tmp_path / "local"
    saved(local, [4])
    store = MirrorStore(mirror_url)
    store.check()
    put_checkpoint(store, local, 4)
    ckpt = local / checkpoint_name(4)
    for alias in ("step_4", "step_03", "step_0000000004"):
        for f in ckpt.iterdir():
            store.fs.pipe(f"{store.root}/{alias}/{f.name}", f.read_bytes())
    assert sorted(store.steps()) == [4]
    got = pull(store, tmp_path / "new")
    assert got == tmp_path / "new" / checkpoint_name(4)
    assert CheckpointManager(tmp_path / "new", owner=False).verify(CheckpointManager(tmp_path / "new").list()[0]) == []


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step_000000004", 4),
        ("step_4", None),
        ("step_03", None),
        ("step_0000000004", None),
        ("step_123456789012345", 123456789012345),
        ("step_1234567890123456", None),
        (f"step_{1 << 62}", None),
        ("step_-00000001", None),
    ],
)
def test_one_name_per_step_and_the_largest_step_is_one_constant(name, step):
    """a run resumed from a (re-signed) step 2^62 wrote steps its own parser rejected. Names, manifests and
    the writer now share MAX_STEP: the writer refuses a step no reader would accept."""
    assert parse_checkpoint_name(name) == step
    if step is not None:
        assert checkpoint_name(step) == name


def test_the_writer_refuses_a_step_no_reader_accepts_and_a_manifest_beyond_it_is_refused():
    with pytest.raises(ValueError, match=r"step 1000000000000000: a checkpoint's step is in \[0, 999999999999999\]"):
        checkpoint_name(MAX_STEP + 1)
    raw = json.loads(Manifest(step=MAX_STEP, cursor=Cursor(), reason="x", created=1.0, files={}).to_json())
    assert Manifest.from_json(json.dumps(raw).encode(), "m").step == MAX_STEP
    raw.pop("checksum")
    raw["step"] = 1 << 62
    raw["checksum"] = xxhash.xxh3_128_hexdigest(dumps_json(raw))
    with pytest.raises(ValueError, match=r"field 'step': expected an integer in \[0, 999999999999999\]"):
        Manifest.from_json(json.dumps(raw).encode(), "m")


SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"  # the form of an AWS secret key: a '/' in it


@pytest.mark.parametrize("command", ["ls", "verify", "pull"])
def test_a_secret_with_a_slash_in_the_url_is_never_printed(tmp_path, mirror_url, capsys, command):
    """``s3://KEY:SECRET@bucket/...`` where SECRET holds a '/': redaction read ``urlsplit().netloc``, which
    ends at that '/', and the commands printed the secret. Every piece of it stays out of what they print."""
    from preempt.cli.main import main
    from preempt.mirror.store import redact

    bucket_prefix = mirror_url.split("://", 1)[1]
    url = f"s3://AKIAIOSFODNN7EXAMPLE:{SECRET}@{bucket_prefix}"
    assert redact(url) == f"s3://{bucket_prefix}"
    args = {"ls": ["ls", url], "verify": ["verify", url], "pull": ["pull", url, str(tmp_path / "new")]}[command]
    main(args)
    said = "".join(capsys.readouterr())
    assert said, "the command said nothing"
    for piece in (SECRET, *SECRET.split("/")):
        assert piece not in said, said
