"""Nodes that share no save_dir, joined by a mirror: two torchrun agents (``--nnodes=2``, one gloo rank each, one per
"node"), each rank given a save_dir of its own, and the mirror on a real S3-compatible server (tests/s3server.py).

Each node writes its part of every checkpoint into its own save_dir and uploads it; rank 0 uploads the whole
checkpoint's manifest once the mirror lists every node's files. A stop waits for that; with both save_dirs wiped, a
new pair of nodes pulls the whole checkpoint from the mirror and ends ``torch.equal`` on every tensor against an
uninterrupted run on a shared save_dir.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import DDP_ARGS as ARGS
from helpers import PREEMPTED, assert_equal_finals, ddp_finals, torchrun, torchrun_nodes
from safetensors.torch import load_file

from preempt.checkpoint.manager import CheckpointManager
from preempt.checkpoint.names import checkpoint_name
from preempt.cli.main import main
from preempt.mirror.store import MirrorStore
from preempt.mirror.survey import Surveyor

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def uninterrupted(reference) -> list[dict[str, torch.Tensor]]:
    """Each rank's final state of the uninterrupted run (on one node: the same as test_ddp's)."""
    return ddp_finals(reference.torchrun(ARGS))


def finish_all(nodes: list, timeout: float = 240) -> list[int]:
    return [p.finish(timeout=timeout) for p in nodes]


def test_nodes_without_a_shared_save_dir_stop_wipe_and_resume_from_the_mirror_bit_exact(
    tmp_path, uninterrupted, mirror_url, capsys
):
    dirs, final = [tmp_path / "node0", tmp_path / "node1"], tmp_path / "final.safetensors"
    args = [*ARGS, "--every_steps", "4", "--mirror", mirror_url]
    nodes = torchrun_nodes(dirs, final, [*args, "--self_signal", "1:7"])
    codes = finish_all(nodes)
    output = "\n".join(p.output for p in nodes)
    assert all(c != 0 for c in codes), output  # (torchrun's agent exits 1 when its rank exits 75)
    # both ranks stopped at one step (rank 1's own SIGTERM, agreed), exit code 75
    stops = [e for p in nodes for e in p.events_of("stopped", code=PREEMPTED)]
    assert sorted(e["rank"] for e in stops) == [0, 1] and stops[0]["step"] == stops[1]["step"], output
    step = stops[0]["step"]
    # the stop's line tells the user that the mirror holds the stop's checkpoint (the mirror is checked below)
    assert re.search(rf"mirror holds step {step} \(the stop's checkpoint\)", nodes[0].output), nodes[0].output

    # Each node's save_dir holds its part of the stop's checkpoint: node 1's lists only node 1's files.
    parts = [CheckpointManager(d, owner=False).list()[0] for d in dirs]
    assert [p.step for p in parts] == [step, step], parts
    assert [p.valid.part.node for p in parts] == [0, 1]
    node1 = set(parts[1].valid.files)
    assert "rank_00001.json" in node1 and "model.safetensors" not in node1, node1
    assert set(parts[0].valid.part.elsewhere) == node1 and "model.safetensors" in parts[0].valid.files
    # The mirror holds the whole checkpoint: every node's files under one manifest, which verifies.
    whole = Surveyor(MirrorStore(mirror_url)).survey().manifests[step]
    assert whole.part is None and set(whole.files) == set(parts[0].valid.files) | node1
    # (an older periodic step may be left incomplete: node 0 does not wait for a part older than a whole step)
    assert main(["verify", mirror_url, str(step)]) == 0
    capsys.readouterr()
    assert main(["ls", str(dirs[1])]) == 0 and main(["verify", str(dirs[1])]) == 0  # a part checks as it is
    listed = capsys.readouterr().out
    assert "node 1's part of 2" in listed and "latest" not in listed, listed  # never loaded by itself

    for d in dirs:  # new machines: nothing on either disk
        shutil.rmtree(d)
    nodes = torchrun_nodes(dirs, final, args)
    codes = finish_all(nodes)
    output = "\n".join(p.output for p in nodes)
    assert codes == [0, 0], output
    # each rank loads its own node's copy, pulled from the mirror into its wiped save_dir (the nodes' save_dirs have
    # other paths here, as they may on a cluster)
    resumed = [(e["rank"], e["step"], e["resumed_from"]) for p in nodes for e in p.events_of("entered")]
    assert resumed == [(node, step, str(d / checkpoint_name(step))) for node, d in enumerate(dirs)], resumed
    assert_equal_finals(uninterrupted, ddp_finals(final))
    assert "mirror holds node 1's part of step 24 (the final checkpoint)" in nodes[1].output, nodes[1].output

    # Run again: node 0's part of the final checkpoint verifies, so the job is complete at once on every rank.
    again = torchrun_nodes(dirs, None, args)
    assert finish_all(again) == [0, 0]
    output = "\n".join(p.output for p in again)
    assert "is complete (step 24, epoch 2); nothing to do" in output and "not believed" not in output, output


def test_ranks_apart_without_a_mirror_are_refused_with_what_they_need(tmp_path):
    """The same two nodes without ``mirror=``: every rank leaves at the start, saying that the nodes need a mirror,
    with nothing written in either save_dir."""
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    nodes = torchrun_nodes(dirs, None, ARGS)
    codes = finish_all(nodes)
    output = "\n".join(p.output for p in nodes)
    assert all(c != 0 for c in codes), output
    assert output.count("does not see the save_dir as rank 0 does") >= 2, output
    assert "need a mirror (mirror=...)" in output and "NoCheckpointError" not in output, output
    assert not list(dirs[0].glob("step_*")) and not list(dirs[1].glob("step_*"))


FSDP = Path(__file__).resolve().parent.parent / "scripts" / "train_fsdp.py"
LORA = ["--lora", "--keep_last", "1000"]  # FSDP2 over a frozen base of ~4 MiB with trained adapters


def test_sharded_lora_on_nodes_apart_carries_each_node_base_and_resumes_from_the_mirror_bit_exact(tmp_path, mirror_url):
    """FSDP2 on two nodes that share no save_dir: each node's part holds its rank's files of pieces, its piece of the
    frozen base written once and carried after (a hard link in its own save_dir, a server-side copy in the mirror);
    both save_dirs wiped, the pair resumes from the mirror and ends ``torch.equal`` on every tensor."""
    ref = torchrun(tmp_path / "ref", None, [*LORA, "--final_out", str(tmp_path / "ref.safetensors")], script=FSDP)
    assert ref.finish(timeout=180) == 0, ref.output
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    args = [*LORA, "--mirror", mirror_url]
    nodes = torchrun_nodes(dirs, None, [*args, "--self_signal", "1:7"], script=FSDP)
    assert all(c != 0 for c in finish_all(nodes)), "\n".join(p.output for p in nodes)
    stops = [(e["rank"], e["step"]) for p in nodes for e in p.events_of("stopped", code=PREEMPTED)]
    assert stops == [(0, 7), (1, 7)], "\n".join(p.output for p in nodes)

    parts = CheckpointManager(dirs[1], owner=False).list()
    assert [p.step for p in parts] == [7, 4], parts
    rank1 = {"base_00001.safetensors", "pieces_00001.safetensors", "rank_00001.json", "rank_00001.safetensors"}
    assert set(parts[0].valid.files) == rank1  # rank 1's files, and nothing of rank 0's
    assert parts[0].valid.files["base_00001.safetensors"].carried_from == 4  # written once, at step 4
    whole = Surveyor(MirrorStore(mirror_url)).survey().manifests[7]
    assert whole.files["base_00001.safetensors"].carried_from == 4 and "pieces_00000.safetensors" in whole.files

    for d in dirs:
        shutil.rmtree(d)
    final = tmp_path / "final.safetensors"
    nodes = torchrun_nodes(dirs, None, [*args, "--final_out", str(final)], script=FSDP)
    assert finish_all(nodes) == [0, 0], "\n".join(p.output for p in nodes)
    want, got = load_file(str(tmp_path / "ref.safetensors")), load_file(str(final))
    assert want.keys() == got.keys() and [k for k in want if not torch.equal(want[k], got[k])] == []
