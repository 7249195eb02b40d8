"""Each private part of torch that preempt relies on, checked against the installed torch.

A failure here names the internal a torch version changed: fix :mod:`preempt._torch_compat` (and only it).
"""

from __future__ import annotations

import pytest
import torch
from helpers import two_gloo_ranks
from torch.utils.data import DataLoader, Dataset, get_worker_info

from preempt import _torch_compat as compat


def test_version_counter_moves_with_each_in_place_change_and_is_none_under_inference_mode():
    t = torch.zeros(3)
    before = compat.version_counter(t)
    assert isinstance(before, int), f"Tensor._version: expected an int, torch {torch.__version__} gave {before!r}"
    t.add_(1)
    assert compat.version_counter(t) == before + 1, "Tensor._version no longer moves on an in-place change"
    with torch.inference_mode():
        frozen = torch.zeros(3)
    assert compat.version_counter(frozen) is None, "an inference tensor's _version no longer raises RuntimeError"


def test_the_module_under_torch_compile_is_found():
    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(model)  # the wrapper only: nothing is compiled before a call
    assert compat.compiled_original(compiled) is model, "OptimizedModule._orig_mod is gone or no longer the module"
    assert compat.compiled_original(model) is None


def test_sharded_tensor_types_include_dtensor():
    from torch.distributed.tensor import DTensor

    assert DTensor in compat.sharded_tensor_types()


def test_dcp_storage_info_is_made_from_path_offset_and_length():
    info = compat.dcp_storage_info("__0_0.distcp", 8, 16)
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 8, 16), (
        "torch.distributed.checkpoint.filesystem._StorageInfo changed its fields"
    )


class _Ids(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        before = get_worker_info()
        compat.act_as_worker(7)
        after = get_worker_info()
        return before.id, after.id, after.seed - before.seed


def test_a_worker_can_act_as_another_worker_id():
    loader = DataLoader(_Ids(), batch_size=None, num_workers=1, multiprocessing_context="fork")
    first = next(iter(loader))
    assert [int(v) for v in first] == [0, 7, 7], (
        "torch.utils.data._utils.worker._worker_info or WorkerInfo changed: the replay of iterable datasets needs both"
    )


def test_a_loader_keeps_its_persistent_iterator_which_shuts_down_and_is_forgotten():
    loader = DataLoader(
        list(range(8)), batch_size=2, num_workers=1, persistent_workers=True, multiprocessing_context="fork"
    )
    assert compat.loader_iterator(loader) is None
    list(loader)
    it = compat.loader_iterator(loader)
    assert it is not None, "DataLoader._iterator no longer holds the persistent workers' iterator"
    assert compat.workers_running(it), "the iterator's _shutdown/_workers no longer say its workers run"
    assert compat.worker_init_of(it) is loader.worker_init_fn, "the iterator's _worker_init_fn is gone"
    assert compat.shutdown_iterator(it), "the iterator's _shutdown_workers is gone"
    assert not compat.workers_running(it)
    compat.forget_iterator(loader)
    assert compat.loader_iterator(loader) is None


def test_the_workers_of_a_live_iterator_can_be_released_without_a_join():
    loader = DataLoader(list(range(64)), batch_size=2, num_workers=1, multiprocessing_context="fork")
    it = iter(loader)
    next(it)
    assert compat.release_workers(it), "the iterator's _workers_done_event or _index_queues are gone"
    assert compat.shutdown_iterator(it)
    assert not compat.release_workers(object())


def test_the_worker_signal_hook_is_wrapped_once():
    from torch.utils.data._utils import signal_handling

    original = signal_handling._set_worker_signal_handlers
    assert callable(original), "signal_handling._set_worker_signal_handlers is gone"

    class Wrapped:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self):
            return self.inner()

    try:
        compat.wrap_worker_signal_handlers(Wrapped, Wrapped)
        compat.wrap_worker_signal_handlers(Wrapped, Wrapped)
        hook = signal_handling._set_worker_signal_handlers
        assert isinstance(hook, Wrapped) and hook.inner is original
    finally:
        signal_handling._set_worker_signal_handlers = original


def test_a_loader_s_dataset_can_be_swapped_after_construction():
    loader = DataLoader([1, 2, 3])
    with pytest.raises(ValueError):
        loader.dataset = [4]  # what DataLoader refuses, and why the swap goes around it
    compat.set_dataset(loader, [4, 5, 6])  # (the sampler was made for three items)
    assert loader.dataset == [4, 5, 6] and [int(b) for b in loader] == [4, 5, 6]


def test_a_loader_s_samplers_can_be_set_after_construction():
    from torch.utils.data import BatchSampler, SequentialSampler

    loader = DataLoader(list(range(6)), batch_size=2, shuffle=True)
    with pytest.raises(ValueError):
        loader.batch_sampler = None  # refused, as the dataset is
    order = SequentialSampler(range(6))
    compat.set_samplers(loader, order, BatchSampler(order, 3, False))
    assert loader.sampler is order and len(loader) == 2 and [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5]]


LOCAL_PIECE = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from preempt._torch_compat import local_piece, version_counter
rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
whole = torch.arange(20.0).reshape(5, 4)
d = distribute_tensor(whole, init_device_mesh("cpu", (2,)), [Shard(0)])
local, offset = local_piece(d)
assert torch.equal(local, whole[offset[0] : offset[0] + local.shape[0]]), (rank, local, offset)
before = version_counter(local)
with torch.no_grad():
    d.add_(1.0)  # on the local tensor below autograd: only the DTensor's counter moves, and the piece reports it
assert version_counter(local) == before + 1 == d._version and local._version == 0, (before, d._version)
print(offset, tuple(local.shape))
dist.destroy_process_group()
"""


def test_a_dtensor_s_local_piece_and_where_it_begins(tmp_path):
    """5 rows over 2 ranks: 3 rows at row 0, 2 at row 3 (2 real gloo processes), each piece's changes counted by its
    DTensor's version counter; any other tensor is its own piece."""
    out = two_gloo_ranks(tmp_path / "piece.py", LOCAL_PIECE, tmp_path / "store")
    assert [line.strip() for line in out] == ["(0, 0) (3, 4)", "(3, 0) (2, 4)"]
    t = torch.ones(2, 3)
    assert compat.local_piece(t)[0] is t and compat.local_piece(t)[1] == (0, 0)
