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
    """Snapshot.content() gives every file from one state_dict() (FSDP2 builds hundreds of DTensors per read): the
    optimizer's other state from that same read on rank 0, and the tensors in the ranks' files of pieces. Plain
    tensors (replicated: the same on every rank) are rank 0's to write; nothing is left for DCP."""
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
    assert len(reads) == 1 and live is None
    from preempt.checkpoint import state

    assert (state.STATE_FILE if rank == 0 else state.rank_files(rank)[0]) in files.tensor_files
    pieces = files.tensor_files.get(state.shard_files(rank)[1])
    if rank:
        assert pieces is None
        return
    assert pieces is not None and torch.equal(pieces[0]["model.weight"], model.weight)
    assert pieces[0]["optim.weight.exp_avg"] is opt.state[model.weight]["exp_avg"]
    assert json.loads(pieces[1][sharded.LAYOUT])["model.weight"] == {"size": [2, 3], "offset": [0, 0]}


# ---------------------------------------------------------------- the frozen base, apart


def test_overlap_of_two_boxes():
    from preempt.checkpoint.pieces import overlap

    assert overlap((0, 0), (4, 3), (2, 0), (4, 3)) == ((2, 2), (0, 3))
    assert overlap((0,), (4,), (4,), (4,)) is None  # touching is not meeting
    assert overlap((5, 0), (0, 3), (0, 0), (8, 3)) is None  # an empty piece meets nothing
    assert overlap((), (), (), ()) == ()  # a scalar: the one element


def pieces_of(whole: torch.Tensor, rows: list[int]) -> list[tuple[str, dict[str, torch.Tensor], dict[str, str]]]:
    """``whole`` cut into pieces of ``rows`` rows, one file per piece (as ranks write them)."""
    files, at = [], 0
    for r, n in enumerate(rows):
        layout = {"w": {"size": list(whole.shape), "offset": [at, 0]}}
        files.append((f"base_{r:05d}.safetensors", {"w": whole[at : at + n]}, {sharded.LAYOUT: json.dumps(layout)}))
        at += n
    return files


def load(target: dict[str, torch.Tensor], files: list) -> None:
    sharded.load_pieces(target, sharded.read_pieces(files), "ckpt")


def test_the_pieces_of_two_ranks_load_whole_into_one_process():
    whole = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    target = {"w": torch.zeros(6, 4)}
    load(target, pieces_of(whole, [3, 3]))
    assert torch.equal(target["w"], whole)
    target["w"].zero_()
    load(target, pieces_of(whole, [4, 2, 0]))  # uneven, one rank's piece empty
    assert torch.equal(target["w"], whole)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda files: files[1][2].clear(), "does not list exactly the tensors"),
        (lambda files: files[1][2].update({sharded.LAYOUT: "{"}), "does not list exactly the tensors"),
        (lambda files: files[1][2].update({sharded.LAYOUT: '{"w": {"size": [6, 4], "offset": [5, 0]}}'}), "not fit"),
        (lambda files: files[1][2].update({sharded.LAYOUT: '{"w": {"size": [7, 4], "offset": [3, 0]}}'}), "another"),
        (lambda files: files[1][2].update({sharded.LAYOUT: '{"w": {"size": [6, 4], "offset": [-3, 0]}}'}), "not fit"),
        (lambda files: files[1][2].update({sharded.LAYOUT: '{"w": {"size": [6, 4], "offset": [true, 0]}}'}), "fit"),
        (lambda files: files[1][2].update({sharded.LAYOUT: '{"w": {"size": [6, 4], "offset": [2, 0]}}'}), "overlaps"),
    ],
    ids=["no_layout", "not_json", "past_the_end", "shapes_disagree", "negative", "not_an_integer", "overlapping"],
)
def test_a_base_file_whose_layout_does_not_describe_it_is_refused_naming_it(damage, message):
    files = pieces_of(torch.ones(6, 4), [3, 3])
    files = [(where, tensors, dict(meta)) for where, tensors, meta in files]
    damage(files)
    with pytest.raises(ValueError, match=message) as e:
        sharded.read_pieces(files)
    assert "base_00001.safetensors" in str(e.value)


def test_pieces_that_do_not_fit_the_model_are_refused_naming_the_tensor():
    ones = torch.ones(6, 4)
    with pytest.raises(ValueError, match=r"'w' cover 12 of this rank's 24"):
        load({"w": torch.zeros(6, 4)}, pieces_of(ones, [3, 3])[:1])  # one rank's file lost
    with pytest.raises(ValueError, match=r"'w' is \[6, 4\] there and \[5, 4\] here"):
        load({"w": torch.zeros(5, 4)}, pieces_of(ones, [3, 3]))
    with pytest.raises(ValueError, match=r"'w' is torch.float32 there and torch.float64 here"):
        load({"w": torch.zeros(6, 4, dtype=torch.float64)}, pieces_of(ones, [3, 3]))
    with pytest.raises(ValueError, match="holds 'w', which the model and optimizer have not"):
        load({"v": torch.zeros(6, 4)}, pieces_of(ones, [6]))


def files_in_memory(tmp_path, files) -> list:
    """``pieces_of``'s files written and read back as ``preempt export`` reads them (no torch)."""
    import numpy as np
    from safetensors.torch import save_file

    from preempt.checkpoint import tensorfile

    out = []
    for name, tensors, meta in files:
        path = tmp_path / name
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)
        buf = np.fromfile(path, dtype=np.uint8)
        out.append((str(path), buf, tensorfile.validate(buf, str(path))))
    return out


def test_export_puts_whole_tensors_together_from_the_pieces_and_refuses_a_hole(tmp_path):
    from safetensors.torch import load

    from preempt.checkpoint.pieces import assembled

    whole = torch.arange(24, dtype=torch.bfloat16).reshape(6, 4)
    renamed = [(n, {f"model.{k}": v for k, v in t.items()}, m) for n, t, m in pieces_of(whole, [4, 2])]
    renamed = [(n, t, {sharded.LAYOUT: m[sharded.LAYOUT].replace('"w"', '"model.w"')}) for n, t, m in renamed]
    count, pieces = assembled(files_in_memory(tmp_path, renamed), "model.", {"source": "test"})
    got = load(b"".join(bytes(p) for p in pieces))
    assert count == 1 and torch.equal(got["w"], whole)
    with pytest.raises(ValueError, match=r"'model.w': the files of pieces hold 16 of its 24 values"):
        assembled(files_in_memory(tmp_path, renamed[:1]), "model.", {})
