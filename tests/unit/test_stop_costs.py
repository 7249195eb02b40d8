"""What a stop does between its signal and its durable checkpoint, counted: the peers' collectives, the syncs, the
work done once rather than at every save. No timing: each test counts or compares what a stop does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import two_gloo_ranks

from preempt import Preempted, PreemptibleRun
from preempt.run.due import Reason
from preempt.run.peers import Agreement, Alone


class CountingPeers(Alone):
    """A process alone that counts what the run asks of its peers."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def agree(self, stop: bool, save: Reason | None, *, walltime_stop: bool = False) -> Agreement:
        self.calls.append("agree")
        return super().agree(stop, save, walltime_stop=walltime_stop)

    def broadcast(self, obj: Any) -> Any:
        self.calls.append("broadcast")
        return obj

    def all(self, flag: bool) -> bool:
        self.calls.append("all")
        return flag

    def gather(self, obj: Any) -> list[Any] | None:
        self.calls.append("gather")
        return [obj]

    def barrier(self) -> None:
        self.calls.append("barrier")


@pytest.mark.parametrize("async_save", [False, True])
def test_a_stop_is_one_agreement_when_its_save_is_taken_there(tmp_path, async_save):
    """The stop's save is synchronous: every rank learns its outcome in the commit, so the ranks need not ask rank 0
    again whether the state is saved (it was one agreement and one broadcast)."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(Preempted) as info:
        with PreemptibleRun(
            tmp_path, model=model, optimizer=opt, checkpoint_interval=None, async_save=async_save
        ) as run:
            for _ in range(2):
                opt.step()
                run.step()
            peers = run.peers = CountingPeers()  # the stop's safe point asks these
            opt.step()
            run.request_stop()
            run.step()
    assert info.value.checkpoint is not None and info.value.checkpoint.endswith("step_000000003")
    assert peers.calls == ["agree"]


EXCHANGES = """
import json, sys, torch.distributed as dist
from preempt.cluster.distributed import HEAD, Coordinator
rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
coord = Coordinator()
seen = []

def rounds(f):
    before = coord.rounds
    got = f()
    seen.append(coord.rounds - before)
    return got

fits, over = "x" * (HEAD - 8 - 2), "y" * (HEAD - 8 - 1)  # JSON adds the quotes: exactly HEAD - 8 bytes, one more
big = {"files": {f"f{i}": "d" * 40 for i in range(300)}}
for obj in ("a name", fits, over, big):
    assert rounds(lambda: coord.broadcast(obj if rank == 0 else None)) == obj
for mine in ("small", fits, over, big):
    got = rounds(lambda: coord.gather(mine))
    assert got == ([mine, mine] if rank == 0 else None), got
got = rounds(lambda: coord.gather(big if rank == 0 else "small"))  # rank 0's own needs no exchange
assert got == ([big, "small"] if rank == 0 else None)
print(json.dumps(seen))
dist.destroy_process_group()
"""


def test_the_commit_s_exchanges_are_one_round_each_when_small(tmp_path):
    """A broadcast or a gather of a small object (what the commit exchanges: a directory's name, a rank's files and
    their digests, an outcome) is one exchange, not two (its size, then its bytes); a larger one arrives whole in
    two: a broadcast's rest to every rank, a gather's rest only from the rank it did not fit (2 real gloo ranks)."""
    out = two_gloo_ranks(tmp_path / "exchanges.py", EXCHANGES, tmp_path / "store")
    # broadcasts: small, fits, one byte over, big; gathers: the same from both ranks; then only rank 0's big
    assert [json.loads(line) for line in out] == [[1, 1, 2, 2, 1, 1, 2, 2, 1]] * 2


def test_a_save_s_carry_plan_looks_only_at_the_frozen_base(monkeypatch):
    """A save (a stop's among them) writes the trained tensors' file (a LoRA run's adapters and moments: hundreds of
    tensors) without fingerprinting or hashing it, and carries the unchanged base, fingerprinted and hashed."""
    from preempt.checkpoint import carry, state

    carrier = carry.Carrier()
    base = {f"w{i}": torch.zeros(4) for i in range(10)}
    trained = {f"a{i}": torch.zeros(4) for i in range(100)}
    payload = state.Payload({"base.safetensors": (base, {}), "model.safetensors": (trained, {})}, {})
    carrier.mark_carried(payload, 1)
    carrier.durable(Path("/nowhere"), 1, {"base.safetensors": carry.digest_of(base, {})})
    trained["a0"].add_(1.0)  # the step: the trained tensors changed
    counted, hashed = [], []
    monkeypatch.setattr(carry, "fingerprint", lambda t, real=carry.fingerprint: counted.append(t) or real(t))
    monkeypatch.setattr(carry, "digest_of", lambda ts, m, real=carry.digest_of: hashed.append(ts) or real(ts, m))
    monkeypatch.setattr(carry, "exists", lambda _path: True)  # (the sources are made up)
    planned = carrier.mark_carried(payload, 2)
    assert list(planned.carried) == ["base.safetensors"] and list(planned.tensor_files) == ["model.safetensors"]
    assert len(counted) == 10 and hashed == [base]


PIECES = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from preempt import _torch_compat
from preempt.cluster.sharded import pieces_apart
rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2,))
tensors = {f"model.l{i}": distribute_tensor(torch.full((5, 4), float(i)), mesh, [Shard(0)]) for i in range(50)}
tensors["model.other"] = distribute_tensor(torch.zeros(6, 2), mesh, [Shard(0)])
before = _torch_compat._local_layout.cache_info()
_, _, rest = pieces_apart(tensors, rank, set())
for _ in range(3):
    pieces_apart(tensors, rank, set())
after = _torch_compat._local_layout.cache_info()
pieces, meta = rest
assert all(torch.equal(pieces[f"model.l{i}"], torch.full((3 - rank, 4), float(i))) for i in range(50))
print(after.misses - before.misses, after.hits - before.hits)
dist.destroy_process_group()
"""


def test_each_rank_s_pieces_are_located_once_per_layout_not_per_dtensor(tmp_path):
    """A stop's snapshot of FSDP2 state: the place of this rank's piece is computed once for every DTensor of one
    shape, mesh and placements (a LoRA model's hundreds share a few), each piece still its own (2 real gloo ranks)."""
    out = two_gloo_ranks(tmp_path / "pieces.py", PIECES, tmp_path / "store")
    assert [line.split()[:2] for line in out] == [["2", str(4 * 51 - 2)]] * 2
