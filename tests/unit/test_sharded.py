"""preempt.cluster.sharded in one process: DCP's pieces with a JSON index instead of its pickle, and its checks."""

from __future__ import annotations

import json

import pytest
import torch

from preempt._torch_compat import dcp_no_dist
from preempt.cluster import sharded


def written(tmp_path):
    tensors = {"model.w": torch.arange(12.0).reshape(3, 4), "optim.w.step": torch.tensor(5.0)}
    names = sharded.save(tmp_path, tensors, rank=0)
    return tensors, names


def test_pieces_and_a_json_index_no_pickle(tmp_path):
    tensors, names = written(tmp_path)
    assert names == ["__0_0.distcp", "dcp_metadata.json"]
    assert not (tmp_path / ".metadata").exists()
    json.loads((tmp_path / "dcp_metadata.json").read_text())
    back = {k: torch.zeros_like(v) for k, v in tensors.items()}
    import torch.distributed.checkpoint as dcp

    with sharded._single_process_quiet():
        dcp.load(back, storage_reader=sharded._reader(tmp_path), **dcp_no_dist(dcp.load, True))
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(format="pickle"), "not a sharded-state index"),
        (lambda d: d["tensors"]["model.w"].update(dtype="object"), "unknown dtype 'object'"),
        (lambda d: d["storage"][0].update(file="../../etc/passwd"), "is not a .distcp file of this checkpoint"),
        (lambda d: d["storage"][0].update(file=".metadata"), "is not a .distcp file of this checkpoint"),
        (lambda d: d["storage"][0].update(fqn="nope"), "storage entry for an unknown tensor"),
        (lambda d: d["storage"][0].update(length=-1), "expected a list of integers >= 0"),
        (lambda d: d["tensors"]["model.w"].update(size="3x4"), "expected a list of integers >= 0"),
        (lambda d: d["tensors"]["model.w"].update(chunks=[5]), "a chunk is not an object"),
    ],
)
def test_a_bad_index_is_refused_naming_the_file(tmp_path, change, message):
    written(tmp_path)
    path = tmp_path / "dcp_metadata.json"
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message) as e:
        sharded._reader(tmp_path).read_metadata()
    assert str(path) in str(e.value)


def test_materialize_creates_the_moments_without_changing_the_parameters():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sharded._materialize(opt)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all("exp_avg" in s for s in opt.state.values())
    assert opt.param_groups[0]["lr"] == 0.1 and all(p.grad is None for p in model.parameters())


def test_split_state_does_not_step_a_fresh_optimizer():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), weight_decay=0.5)
    tensors, rest = sharded.split_state(model, opt)
    assert set(tensors) == {"model.weight", "model.bias"} and not opt.state
    assert rest["param_groups"][0]["params"] == ["weight", "bias"]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_save_reads_the_sharded_state_once(rank):
    """Snapshot.content() gives the files and the live tensors DCP writes from one state_dict() (FSDP2 builds
    hundreds of DTensors per read); the files hold the optimizer's other state from that same read on rank 0."""
    from preempt.checkpoint.components import Components
    from preempt.run.data_cursor import DataCursor
    from preempt.run.loop_state import LoopState
    from preempt.run.snapshot import Snapshot

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    reads = []
    model.register_state_dict_post_hook(lambda *_: reads.append(1))
    data = DataCursor(())
    data.seed = 1
    snapshot = Snapshot(Components(model, opt), LoopState(), data, rank=rank)
    snapshot.sharded = True  # what PreemptibleRun sets for a model of DTensors
    files, live = snapshot.content()
    assert len(reads) == 1
    assert live is not None and torch.equal(live["model.weight"], model.weight)
    assert live["optim.weight.exp_avg"] is opt.state[model.weight]["exp_avg"]
    from preempt.checkpoint import state

    assert (state.STATE_FILE if rank == 0 else state.rank_files(rank)[0]) in files.tensor_files
