"""The mirror's store and pull against a real S3 server (moto_server, tests/s3server.py): what a listing shows,
errors that name the object and never the credentials, a pull that commits like a local save, a corrupt object
detected and the older checkpoint used, a partial step never pulled."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from s3server import put_checkpoint

from preempt.checkpoint.manager import CheckpointManager
from preempt.checkpoint.names import MANIFEST, checkpoint_name
from preempt.errors import MirrorError, NoCheckpointError
from preempt.mirror.pull import pull, pull_newest
from preempt.mirror.store import MirrorStore


def saved(save_dir: Path, steps: list[int]) -> CheckpointManager:
    """Checkpoints of a small model with a frozen base (carried unchanged from the first)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    manager = CheckpointManager(save_dir, keep_last=None)
    manager.prepare()
    for step in steps:
        with torch.no_grad():
            model[1].weight.add_(1)
        manager.save_state(step=step, model=model, optimizer=opt)
    return manager


def same_tree(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def test_store_pull_fallback_and_partial(tmp_path, mirror_url):
    local = tmp_path / "local"
    saved(local, [2, 4, 6])
    store = MirrorStore(mirror_url)
    store.check()
    put_checkpoint(store, local, 2)
    put_checkpoint(store, local, 4)
    put_checkpoint(store, local, 6, manifest=False)  # an upload cut off before its manifest

    listing = store.steps()
    assert sorted(listing) == [2, 4, 6] and MANIFEST not in listing[6]
    assert listing[2] == {p.name: p.stat().st_size for p in (local / checkpoint_name(2)).iterdir()}

    # The newest complete step is pulled, never the partial one, and committed as a local save.
    new = tmp_path / "new"
    got = pull(store, new)
    assert got == new / checkpoint_name(4)
    same_tree(local / checkpoint_name(4), got)
    assert not [p for p in new.iterdir() if p.name.startswith(".tmp-")]
    assert [i.step for i in CheckpointManager(new).list() if i.status == "valid"] == [4]
    with pytest.raises(NoCheckpointError, match="step 6 is incomplete"):
        pull(store, tmp_path / "other", step=6)

    # One object overwritten through the S3 API with bytes of the same size: the pull names it and uses step 2.
    size = listing[4]["model.safetensors"]
    store.put_bytes(4, "model.safetensors", b"\0" * size)
    again = tmp_path / "again"
    pulled = pull_newest(store, again)
    assert pulled is not None and pulled.step == 2 and pulled.bytes > 0
    assert len(pulled.failed) == 1 and "step_000000004/model.safetensors: xxh3 mismatch" in pulled.failed[0]
    same_tree(local / checkpoint_name(2), pulled.path)
    assert sorted(p.name for p in again.iterdir()) == [checkpoint_name(2)]  # the failed try left nothing behind
    assert pull_newest(store, again, newer_than=4) is None  # nothing newer than what save_dir holds

    # Errors name the mirror and the object, and say ENOENT for what is not there.
    with pytest.raises(MirrorError, match=r"cannot read s3://.*/run/step_000000009/manifest.json") as e:
        store.read(9, MANIFEST, 100)
    assert e.value.errno == errno.ENOENT


def test_missing_bucket_and_credentials_kept_out(tmp_path, mirror_url):
    bucket = mirror_url.split("/")[2]
    with pytest.raises(MirrorError, match="does not exist") as e:
        MirrorStore(f"s3://{bucket}-missing/x").check()
    assert e.value.errno == errno.ENOENT
    made = MirrorStore(f"s3://{bucket}-made/x", {"create_bucket": True})
    made.check()
    assert made.steps() == {}

    # A server that does not answer: an error in seconds, naming the URL without its userinfo and no option value.
    endpoint = os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[0] + ":9"  # the discard port: nothing listens
    secret = "s3cr3t-value-never-logged"
    store = MirrorStore(f"s3://user:{secret}@{bucket}/x", {"endpoint_url": endpoint, "secret": secret, "key": "k"})
    assert secret not in store.display and "user" not in store.display
    with pytest.raises(MirrorError) as e:
        store.steps()
    assert "cannot list" in str(e.value) and secret not in str(e.value)


def test_a_pull_hashes_each_object_as_it_is_written_and_never_reads_it_again(tmp_path, mirror_url, monkeypatch):
    from preempt.checkpoint import hashed_io
    from preempt.mirror import pull as pull_module

    local = tmp_path / "local"
    saved(local, [2])
    store = MirrorStore(mirror_url)
    store.check()
    put_checkpoint(store, local, 2)

    def read_again(path):
        raise AssertionError(f"{path} was read again after its download")

    monkeypatch.setattr(pull_module.hashed_io, "hash_file", read_again)
    got = pull(store, tmp_path / "new")
    same_tree(local / checkpoint_name(2), got)

    # The digest is of what was written: a forged object is still refused, by the digest computed on the way.
    monkeypatch.setattr(pull_module.hashed_io, "hash_file", hashed_io.hash_file)
    size = store.steps()[2]["state.safetensors"]
    store.put_bytes(2, "state.safetensors", b"\1" * size)
    with pytest.raises(NoCheckpointError, match="state.safetensors: xxh3 mismatch"):
        pull(store, tmp_path / "forged")
