"""Loops written with Accelerate inside PreemptibleRun, everything through ``accelerator.prepare`` (real Accelerate, no
mock): the prepared loader is driven by the run (preempt's order, Accelerate's sharding, index for index), a stop
lands only where the gradients were synchronised, and the rerun is bit-exact; what cannot be exact is refused at once.

The processes and signals (SIGTERM, SIGKILL, workers, two processes) are in tests/process/test_accelerate.py and
tests/distributed/test_accelerate_ranks.py.
"""

from __future__ import annotations

import pytest

accelerate = pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install -e '.[hf]')")

import torch  # noqa: E402
from accelerate.data_loader import BatchSamplerShard, skip_first_batches  # noqa: E402
from accelerate.utils import DataLoaderConfiguration  # noqa: E402
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, TensorDataset  # noqa: E402

from preempt import PreemptibleRun  # noqa: E402
from preempt.data.prepared import ShardedBatches  # noqa: E402
from preempt.data.sampler import ResumableSampler  # noqa: E402
from preempt.errors import PreemptError  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerate():
    """Accelerate keeps one state per process (its mixed precision, its gradient state): each test makes its own."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_sharded_batches_are_accelerate_s_index_for_index_from_any_batch():
    """Every (samples, batch size, processes, split, even, drop_last) up to small sizes, every process, every start:
    the index lists of BatchSamplerShard over a BatchSampler (a BatchSampler alone for one process), and its len."""
    tried = 0
    for n in range(0, 23):
        sampler = ResumableSampler(n, shuffle=True, seed=3)
        sampler.set_epoch(2)
        for bs in (1, 2, 3, 4):
            for w in (1, 2, 3):
                for split in (False, True):
                    if split and bs % w:
                        continue
                    for even in (True, False):
                        for drop_last in (False, True):
                            for p in range(w):
                                inner = BatchSampler(sampler, bs, drop_last)
                                ref = inner if w == 1 else BatchSamplerShard(inner, w, p, split, even)
                                want = list(ref)
                                ours = ShardedBatches(
                                    sampler,
                                    bs,
                                    drop_last,
                                    num_processes=w,
                                    process_index=p,
                                    split_batches=split,
                                    even_batches=even,
                                )
                                assert list(ours) == want and len(ours) == len(ref), (n, bs, w, p, split, even)
                                for k in range(len(want) + 1):
                                    ours.start_at(k)
                                    iter(ours)  # made and dropped unused (a DataLoader with workers does)
                                    assert list(ours) == want[k:], (n, bs, w, p, split, even, drop_last, k)
                                tried += 1
    assert tried > 1000


class Noisy(Dataset):
    """Each sample with a random draw inside ``__getitem__`` (augmentation): it replays only with per-sample
    streams."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.arange(n) % 2

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return {"x": self.x[i] + 0.1 * torch.randn(4), "y": self.y[i]}


def train(
    save_dir,
    stop_at: int | None,
    *,
    accumulate: int = 2,
    precision: str = "bf16",
    dispatch: bool = False,
    save_state: bool = False,
):
    """The guide's Accelerate loop on a tiny model: everything through accelerator.prepare, dropout, a draw per step.
    ``stop_at``: a stop requested in the micro-batch before that step is counted (the run saves and leaves at that
    step). ``save_state``: Accelerate's own ``save_state`` at each epoch's end, into ``save_dir``/../accelerate."""
    config = DataLoaderConfiguration(dispatch_batches=dispatch) if dispatch else None
    accelerator = accelerate.Accelerator(
        cpu=True, gradient_accumulation_steps=accumulate, mixed_precision=precision, dataloader_config=config
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    train_loader = DataLoader(Noisy(26), batch_size=3, shuffle=True)
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    counted = []
    with PreemptibleRun(save_dir, model=model, optimizer=optimizer, scheduler=scheduler, log_file=False) as run:
        for _ in run.epochs(3):
            for batch in run.batches(train_loader):
                assert batch["x"].device == accelerator.device
                if stop_at is not None and run.global_step + 1 == stop_at:
                    run.request_stop()
                with accelerator.accumulate(model):
                    loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"]) + torch.randn(()) * 1e-3
                    accelerator.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                run.step()
                counted.append(run.global_step)
            if save_state:
                accelerator.save_state(str(save_dir.parent / "accelerate" / f"epoch_{run.epoch}"))
    out = {f"model.{k}": v for k, v in accelerator.unwrap_model(model).state_dict().items()}
    inner = optimizer.optimizer
    out.update({f"opt.{i}.{k}": v for i, s in inner.state.items() for k, v in s.items() if torch.is_tensor(v)})
    out["rng"] = torch.get_rng_state()
    return out, counted


@pytest.mark.parametrize(
    ("accumulate", "precision", "dispatch", "stop_at"),
    [(2, "bf16", False, 4), (1, "no", False, 11), (2, "no", True, 9), (2, "no", False, 5)],
    ids=["accumulate2-bf16", "plain", "dispatcher-accumulate2", "at-the-epoch-s-last-batch"],
)
def test_the_prepared_loop_resumes_bit_exact(tmp_path, accumulate, precision, dispatch, stop_at):
    """26 samples in batches of 3: 9 batches an epoch. With accumulation 2 a step every 2 batches and at the epoch's
    last one (Accelerate syncs there): 5 steps an epoch; stops mid-epoch 0 and mid-epoch 1."""
    want, counted = train(tmp_path / "whole", None, accumulate=accumulate, precision=precision, dispatch=dispatch)
    per_epoch = 9 if accumulate == 1 else 5
    assert counted[-1] == 3 * per_epoch
    if accumulate == 2:  # a micro-batch is not a step: the count moves at batches 2, 4, 6, 8 and 9 of each epoch
        assert counted[:9] == [0, 1, 1, 2, 2, 3, 3, 4, 5], counted[:9]
    with pytest.raises(SystemExit) as stopped:
        train(tmp_path / "run", stop_at, accumulate=accumulate, precision=precision, dispatch=dispatch)
    assert stopped.value.code == 75
    got, counted = train(tmp_path / "run", None, accumulate=accumulate, precision=precision, dispatch=dispatch)
    assert counted[0] == stop_at + (accumulate == 1 or stop_at % per_epoch != 0), counted[:3]
    assert want.keys() == got.keys()
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ: {differ}"


def test_a_stop_never_lands_between_micro_batches(tmp_path):
    """A stop requested in the first micro-batch of a step waits for the step's second: the checkpoint is at a step
    the optimizer took, its cursor after the batch that synchronised."""
    with pytest.raises(SystemExit):
        train(tmp_path / "run", 2)  # requested before batch 3 (the first micro-batch of step 2)
    manifests = sorted((tmp_path / "run").glob("step_*/manifest.json"))
    assert len(manifests) == 1
    import json

    m = json.loads(manifests[0].read_text())
    assert m["step"] == 2 and m["cursor"]["batch"] == 4, m["cursor"]


def parts(dataset, **loader_options):
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, accelerator.prepare(DataLoader(dataset, **loader_options))


class Stream(IterableDataset):
    def __iter__(self):
        yield from (torch.zeros(4) for _ in range(8))


class Pairs(BatchSampler):
    """A batch sampler of the user's (bucketing, say)."""


DATA = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: parts(Stream(), batch_size=4), "IterableDataset"),
        (lambda: parts(DATA, sampler=ResumableSampler(DATA, num_replicas=2), batch_size=4), "sharded"),
        (lambda: parts(DATA, batch_sampler=Pairs(range(16), 4, False)), "not torch's BatchSampler"),
        (lambda: parts(DATA, sampler=torch.utils.data.RandomSampler(DATA, replacement=True)), "replacement"),
        (lambda: parts(DATA, sampler=torch.utils.data.SubsetRandomSampler(range(8))), "SubsetRandomSampler"),
    ],
    ids=["iterable", "sharded-sampler", "batch-sampler", "replacement", "subset"],
)
def test_what_cannot_be_exact_is_refused_at_once_with_the_reason(tmp_path, make, why):
    model, optimizer, loader = make()
    with PreemptibleRun(tmp_path, model=model, optimizer=optimizer, log_file=False) as run:
        for _ in run.epochs(1):
            with pytest.raises(PreemptError, match=f"cannot resume exactly: .*{why}"):
                next(iter(run.batches(loader)))
            break


def test_a_loader_from_skip_first_batches_is_refused(tmp_path):
    model, optimizer, loader = parts(DATA, batch_size=4)
    with PreemptibleRun(tmp_path, model=model, optimizer=optimizer, log_file=False) as run:
        for _ in run.epochs(1):
            with pytest.raises(PreemptError, match="skip_first_batches"):
                next(iter(run.batches(skip_first_batches(loader, 1))))
            break


def test_the_order_is_preempt_s_and_the_user_s_sampler_is_kept(tmp_path):
    """shuffle=True becomes ResumableSampler(seed=0): epoch e's order is run.sampler()'s; a ResumableSampler given
    to the DataLoader is used as it is (its seed)."""
    for sampler, seed in ((None, 0), (ResumableSampler(DATA, seed=9), 9)):
        options = {"shuffle": True} if sampler is None else {"sampler": sampler}
        model, optimizer, loader = parts(DATA, batch_size=4, **options)
        seen = []
        with PreemptibleRun(tmp_path / str(seed), model=model, optimizer=optimizer, log_file=False) as run:
            for epoch in run.epochs(2):
                for _x, _y in run.batches(loader):
                    seen.append(epoch)
                    run.step()
                order = ResumableSampler(DATA, seed=seed).order(epoch)
                assert loader.base_dataloader.sampler.order(epoch).tolist() == order.tolist()
        assert seen == [0] * 4 + [1] * 4


def test_accelerate_s_save_state_and_load_state_keep_working_beside_the_run(tmp_path):
    """Accelerate's own milestone saves in the loop (save_state at each epoch's end) change nothing of the run's
    exactness, and load_state of the last one into a new Accelerator gives the final model and optimizer."""
    want, _ = train(tmp_path / "whole", None)
    with pytest.raises(SystemExit):
        train(tmp_path / "run", 7, save_state=True)
    got, _ = train(tmp_path / "run", None, save_state=True)
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2, mixed_precision="bf16")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.load_state(str(tmp_path / "accelerate" / "epoch_2"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[f"model.{k}"]), k
    inner = optimizer.optimizer.state
    assert all(
        torch.equal(inner[i][k], want[f"opt.{i}.{k}"]) for i in inner for k in inner[i] if torch.is_tensor(inner[i][k])
    )


def test_the_scaler_of_a_prepared_optimizer_is_saved_and_restored_without_being_passed(tmp_path):
    """Accelerate's fp16 GradScaler lives in its optimizer wrapper (on a GPU; tests/gpu/test_accelerate_fp16.py
    trains with it): a real AcceleratedOptimizer holding a real GradScaler, its scale saved and put back."""
    from accelerate.optimizer import AcceleratedOptimizer

    accelerate.Accelerator(cpu=True)  # (Accelerate's state, which its optimizer reads)

    def run_once(scale: float) -> torch.amp.GradScaler:
        model = torch.nn.Linear(4, 2)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
        with PreemptibleRun(tmp_path, model=model, optimizer=optimizer, log_file=False, exit_if_complete=False) as run:
            assert run.components.scaler is scaler
            for _ in run.epochs(run.epoch + 1):
                pass
        return scaler

    run_once(2.0**7)
    assert run_once(2.0**3).get_scale() == 2.0**7


def test_accelerate_s_data_seed_is_the_order_s_seed(tmp_path):
    """use_seedable_sampler with data_seed=7: the order is ResumableSampler(seed=7)'s."""
    accelerator = accelerate.Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=7)
    )
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(DATA, batch_size=4, shuffle=True))
    with PreemptibleRun(tmp_path, model=model, optimizer=optimizer, log_file=False) as run:
        seen = []
        for _ in run.epochs(1):
            for x, _y in run.batches(loader):
                seen.append(x)
                run.step()
    order = ResumableSampler(DATA, seed=7).order(0)
    assert torch.equal(torch.cat(seen), DATA.tensors[0][order])


def test_a_dispatcher_s_last_group_that_does_not_divide_is_refused():
    """Several processes, drop_last=False: a last group completed from the iteration's first samples cannot resume."""
    from preempt.data.prepared import _check_dispatched_tail

    _check_dispatched_tail("DataLoaderDispatcher", 70, 4, 2, split=False)  # 70 % 8 = 6: three each
    _check_dispatched_tail("DataLoaderDispatcher", 70, 4, 2, split=True)  # 70 % 4 = 2: one each
    with pytest.raises(PreemptError, match="last group of 5 samples .* drop_last=True"):
        _check_dispatched_tail("DataLoaderDispatcher", 69, 4, 2, split=False)
    with pytest.raises(PreemptError, match="last group of 3 samples"):
        _check_dispatched_tail("DataLoaderDispatcher", 71, 4, 2, split=True)
