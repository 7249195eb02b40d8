"""PreemptibleRun in one process: stop at chosen points, resume, compare; options and errors."""

from __future__ import annotations

import json
import logging
import random
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from preempt import (
    CheckpointManager,
    IncompatibleStateError,
    Preempted,
    PreemptError,
    PreemptibleRun,
    RunComplete,
    UnsupportedStateError,
    _testing,
)

N, BATCH, EPOCHS = 40, 8, 3  # 5 batches per epoch, 15 steps


def build(seed: int = 0):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    g = torch.Generator().manual_seed(99)
    data = TensorDataset(torch.randn(N, 4, generator=g), torch.randint(0, 2, (N,), generator=g))
    return model, opt, sched, data


def train(
    save_dir: Path, stop_at_step: int | None = None, stop_at_epoch_end: int | None = None, wrap=None, **kwargs
):
    """The loop of the public contract; asks for a stop at a step or in end-of-epoch code. ``wrap``: what the
    DataLoader is wrapped in."""
    model, opt, sched, data = build()
    kwargs.setdefault("checkpoint_interval", None)
    trace = []
    with PreemptibleRun(save_dir, model=model, optimizer=opt, scheduler=sched, **kwargs) as run:
        loader = DataLoader(data, batch_size=BATCH, sampler=run.sampler(data, seed=3))
        loader = loader if wrap is None else wrap(loader)
        for epoch in run.epochs(EPOCHS):
            for x, y in run.batches(loader):
                loss = torch.nn.functional.cross_entropy(model(x), y) + torch.rand(()) * 1e-3
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                trace.append((run.global_step + 1, x[0, 0].item(), loss.item()))
                if run.global_step + 1 == stop_at_step:
                    run.request_stop()
                run.step()
            run.user_state["draw"] = float(torch.rand(()))  # end-of-epoch randomness
            if epoch == stop_at_epoch_end:
                run.request_stop()
    return model, opt, sched, trace


def final_state(model, opt, sched) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v for k, v in s.items()})
    out["sched"] = torch.tensor(sched.state_dict()["last_epoch"])
    out["rng"] = torch.get_rng_state()
    return out


def assert_equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    model, opt, sched, trace = train(tmp_path_factory.mktemp("ref") / "run")
    return final_state(model, opt, sched), trace


def resume_until_done(save_dir: Path, **kwargs):
    try:
        return train(save_dir, **kwargs)
    except Preempted as e:
        assert e.code == 75 and e.checkpoint is not None
        return None


# Step 5 is the last batch of epoch 0: the classic off-by-one at an epoch boundary.
@pytest.mark.parametrize("stop", [1, 3, 5, 6, 10, 15], ids=lambda s: f"step{s}")
def test_resume_after_stop_at_step_is_bit_exact(tmp_path, uninterrupted, stop):
    expected, expected_trace = uninterrupted
    with pytest.raises(Preempted):
        train(tmp_path, stop_at_step=stop)
    model, opt, sched, trace = train(tmp_path)
    assert_equal_states(expected, final_state(model, opt, sched))
    assert trace == expected_trace[stop:], "the resumed run must see the same batches and draws"


class PrefetchLoader:
    """timm's PrefetchLoader in shape: the DataLoader as ``.loader``, its ``.sampler`` shown, no ``batch_sampler``."""

    def __init__(self, loader):
        self.loader = loader

    @property
    def sampler(self):
        return self.loader.sampler

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        yield from self.loader


def test_a_wrapper_showing_the_sampler_but_not_its_batches_resumes_at_its_batch(tmp_path, uninterrupted):
    """Iterated as the DataLoader inside it (the same batches and draws as the plain loader's); taken for one sample
    per batch, the stop at step 3 recorded sample 3 for batch 3 (of 8 samples each) and the resume was off."""
    expected, _ = uninterrupted
    with pytest.raises(Preempted):
        train(tmp_path, stop_at_step=3, wrap=PrefetchLoader)
    info = CheckpointManager(tmp_path, owner=False).list()[0]
    assert (info.manifest.cursor.batch, info.manifest.cursor.sample) == (3, 3 * BATCH)
    model, opt, sched, _ = train(tmp_path, wrap=PrefetchLoader)
    assert_equal_states(final_state(model, opt, sched), expected)


@pytest.mark.parametrize("epoch", [0, 1, 2])
def test_resume_after_stop_in_end_of_epoch_code_is_bit_exact(tmp_path, uninterrupted, epoch):
    """A stop requested in end-of-epoch code saves at the boundary, after that code ran."""
    expected, expected_trace = uninterrupted
    with pytest.raises(Preempted):
        train(tmp_path, stop_at_epoch_end=epoch)
    manifest = json.loads(next(tmp_path.glob("step_*/manifest.json")).read_text())
    assert manifest["cursor"]["point"] == "epoch" and manifest["cursor"]["epoch"] == epoch + 1
    model, opt, sched, trace = train(tmp_path)
    assert_equal_states(expected, final_state(model, opt, sched))
    assert trace == expected_trace[(epoch + 1) * 5 :]


def test_many_stops_and_periodic_checkpoints(tmp_path, uninterrupted):
    expected, _ = uninterrupted
    for stop in (2, 7, 8, 12):
        with pytest.raises(Preempted):
            train(tmp_path, stop_at_step=stop, checkpoint_every_steps=3)
    model, opt, sched, _ = train(tmp_path, checkpoint_every_steps=3)
    assert_equal_states(expected, final_state(model, opt, sched))


@pytest.mark.usefixtures("sigint_handled")
def test_handlers_restored_after_normal_exit_and_after_preemption(tmp_path):
    def custom(signum, frame):
        pass

    old = signal.signal(signal.SIGUSR1, custom)
    try:
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        model, opt, _, _ = build()
        with PreemptibleRun(tmp_path / "a", model=model, optimizer=opt):
            assert callable(signal.getsignal(signal.SIGTERM))  # the run's handler, in place of SIG_DFL
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGUSR1) is custom
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(Preempted):
            train(tmp_path / "b", stop_at_step=2)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGUSR1) is custom
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_real_sigterm_inside_the_run_saves_at_the_next_step(tmp_path):
    model, opt, sched, data = build()
    with pytest.raises(Preempted) as info:
        with PreemptibleRun(tmp_path, model=model, optimizer=opt, checkpoint_interval=None) as run:
            for _ in run.epochs(1):
                for i, _batch in enumerate(run.batches(DataLoader(data, batch_size=4))):
                    if i == 2:
                        signal.raise_signal(signal.SIGTERM)
                        assert run.stop_requested  # recorded, nothing else happened yet
                    run.step()
    assert info.value.signum == signal.SIGTERM and info.value.code == 75
    assert Path(info.value.checkpoint).name == "step_000000003"


def test_completed_run_raises_run_complete_and_can_be_extended(tmp_path):
    train(tmp_path)
    assert json.loads((tmp_path / "complete.json").read_text())["step"] == 15
    with pytest.raises(RunComplete) as info:
        train(tmp_path)
    assert info.value.code == 0
    model, opt, _, data = build()
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, exit_if_complete=False) as run:
        assert run.global_step == 15 and run.epoch == 3
        assert not (tmp_path / "complete.json").exists()
        for _ in run.epochs(4):
            for _b in run.batches(DataLoader(data, batch_size=BATCH)):
                run.step()
    assert run.global_step == 20


def test_auto_resume_false_starts_over_even_when_the_run_is_complete(tmp_path):
    train(tmp_path)
    model, opt, sched, trace = train(tmp_path, auto_resume=False)
    assert len(trace) == 15  # trained again from step 0
    assert (tmp_path / "complete.json").is_file() and len(list((tmp_path / "superseded").iterdir())) >= 1


def test_completed_run_cleans_leftovers_before_it_exits(tmp_path):
    """A kill after complete.json can leave leftovers; the rerun that only says "complete" deletes them."""
    train(tmp_path)
    for name in (".tmp-step_000000015-vm-1-aa", ".replaced-step_000000015-vm-1-bb"):
        (tmp_path / name).mkdir()
        for i in range(2000):  # enough files that a deletion left to a background thread is still running
            (tmp_path / name / f"f{i}").write_bytes(b"x")
    with pytest.raises(RunComplete):
        train(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_weights_only_from_another_run_then_requeue_continues_own_timeline(tmp_path):
    source_model, *_ = train(tmp_path / "pretrain")
    model, opt, _, data = build(seed=1)
    with pytest.raises(Preempted):
        with PreemptibleRun(
            tmp_path / "ft",
            model=model,
            optimizer=opt,
            resume=tmp_path / "pretrain",
            weights_only=True,
            checkpoint_interval=None,
        ) as run:
            assert run.global_step == 0 and not opt.state  # fresh optimizer and counters
            for a, b in zip(model.parameters(), source_model.parameters(), strict=True):
                assert torch.equal(a, b)
            for _ in run.epochs(1):
                for i, _b in enumerate(run.batches(DataLoader(data, batch_size=BATCH))):
                    opt.step()
                    if i == 1:
                        run.request_stop()
                    run.step()
    # The requeued job runs the same code: it must continue its own checkpoints, not reload the source.
    model2, opt2, _, _ = build(seed=1)
    with PreemptibleRun(
        tmp_path / "ft", model=model2, optimizer=opt2, resume=tmp_path / "pretrain", weights_only=True
    ) as run:
        assert run.global_step == 2
        assert run.resumed_from.name == "step_000000002"
        for a, b in zip(model2.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b)


def test_weights_only_non_strict_fine_tunes_with_a_new_head(tmp_path, caplog):
    """strict=False loads the shared backbone and leaves a new head (other key names) as initialised."""
    source_model, *_ = train(tmp_path / "pretrain")
    torch.manual_seed(5)
    backbone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5))
    model = torch.nn.Sequential(*backbone, torch.nn.Identity(), torch.nn.Linear(8, 3))  # 3.* instead of 2.*
    head_before = model[3].weight.detach().clone()
    with pytest.raises(
        IncompatibleStateError, match=r"(?s)missing in checkpoint: 3.bias, 3.weight.*not in model: 2.bias"
    ):
        PreemptibleRun(tmp_path / "strict", model=model, resume=tmp_path / "pretrain", weights_only=True).__enter__()
    with caplog.at_level(logging.WARNING, logger="preempt"):
        with PreemptibleRun(
            tmp_path / "ft", model=model, resume=tmp_path / "pretrain", weights_only=True, strict=False
        ) as run:
            assert torch.equal(model[0].weight, source_model[0].weight)
            assert torch.equal(model[3].weight, head_before)
            run.request_stop()
    assert "2.weight" in caplog.text and "3.weight" in caplog.text


def test_resume_best_branches_once(tmp_path):
    model, opt, _, data = build()
    kwargs = dict(checkpoint_interval=None, best_metric="val", keep_best=1, checkpoint_every_steps=1, keep_last=2)
    # a checkpoint at every step exactly: asynchronous saves would postpone those due while a write runs
    kwargs["async_save"] = False
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, **kwargs) as run:
        for epoch in run.epochs(3):
            for _b in run.batches(DataLoader(data, batch_size=BATCH)):
                run.step()
            run.report({"val": [0.5, 0.1, 0.3][epoch]})  # best after epoch 1
    names = sorted(p.name for p in tmp_path.glob("step_*"))
    # best kept beyond keep_last; nothing more: a model with nothing frozen has no file to carry, so no checkpoint
    # shares a file with another (preempt.checkpoint.carry) and retention keeps none for that
    assert names == ["step_000000010", "step_000000014", "step_000000015"], names
    model, opt, _, _ = build()
    with pytest.raises(Preempted), PreemptibleRun(tmp_path, model=model, optimizer=opt, resume="best", **kwargs) as run:
        assert run.global_step == 10 and run.epoch == 2
        assert sorted(p.name for p in (tmp_path / "superseded").iterdir()) == ["step_000000014", "step_000000015"]
        run.request_stop()
        for _ in run.epochs(3):
            pass
    model, opt, _, _ = build()
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, resume="best", **kwargs) as run:
        assert run.global_step == 10  # the branch continues: not re-applied, nothing more moved aside
        assert len(list((tmp_path / "superseded").iterdir())) == 2


def test_best_set_by_the_last_step_survives_the_final_save(tmp_path):
    """The final save replaces the best checkpoint of the same step; it holds the same weights, so it stays best."""
    model, opt, _, data = build()
    kwargs = dict(checkpoint_interval=None, best_metric="val", keep_best=1, keep_last=1)
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, **kwargs) as run:
        for _ in run.epochs(3):
            for _b in run.batches(DataLoader(data, batch_size=BATCH)):
                run.step({"val": 1.0 / (run.global_step + 1)})  # every step is a new best, the last one too
    best = CheckpointManager(tmp_path, owner=False).candidates("best")
    assert [c.step for c in best][:1] == [15] and best[0].manifest.reason == "final"
    assert best[0].manifest.best_value == 1.0 / 15


def test_auto_resume_false_moves_old_checkpoints_aside(tmp_path, caplog):
    train(tmp_path, checkpoint_every_steps=5)
    model, opt, _, _ = build()
    with caplog.at_level(logging.WARNING, logger="preempt"):
        with PreemptibleRun(tmp_path, model=model, optimizer=opt, auto_resume=False, exit_if_complete=False) as run:
            assert run.global_step == 0
    assert "superseded" in caplog.text
    assert (tmp_path / "superseded" / "step_000000015").is_dir()


def test_batches_twice_in_one_epoch_is_an_error(tmp_path):
    model, opt, _, data = build()
    with pytest.raises(PreemptError, match="already used in epoch 0"):
        with PreemptibleRun(tmp_path, model=model, optimizer=opt) as run:
            loader = DataLoader(data, batch_size=BATCH)
            for _ in run.batches(loader):
                pass
            for _ in run.batches(loader):
                pass


def test_loop_methods_outside_the_with_block(tmp_path):
    run = PreemptibleRun(tmp_path)
    with pytest.raises(PreemptError, match="only available inside"):
        next(run.epochs(1))


def test_unsupported_state_fails_at_enter_naming_the_key(tmp_path):
    class Odd:
        def state_dict(self):
            return {"fn": print}

        def load_state_dict(self, s):
            pass

    with pytest.raises(UnsupportedStateError, match=r"tracked\.odd\.fn"):
        with PreemptibleRun(tmp_path, track={"odd": Odd()}):
            pass
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_user_state_must_be_json(tmp_path):
    model, opt, _, _ = build()
    with pytest.raises(UnsupportedStateError, match=r"run.user_state.when"):
        with PreemptibleRun(tmp_path, model=model, optimizer=opt) as run:
            run.user_state["when"] = {1, 2}


def test_tracked_object_restored_at_track_time(tmp_path):
    class Counter:
        def __init__(self):
            self.n = torch.zeros(3)

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, s):
            self.n = s["n"].clone()

    c = Counter()
    with pytest.raises(Preempted):
        with PreemptibleRun(tmp_path, model=torch.nn.Linear(2, 2)) as run:
            run.track("counter", c)
            c.n += 7
            run.step()
            run.request_stop()
            run.step()
    c2 = Counter()
    with PreemptibleRun(tmp_path, model=torch.nn.Linear(2, 2)) as run:
        run.track("counter", c2)
        assert torch.equal(c2.n, torch.full((3,), 7.0))


def test_dataset_length_change_is_an_error(tmp_path):
    with pytest.raises(Preempted):
        train(tmp_path, stop_at_step=3)
    model, opt, sched, _ = build()
    smaller = TensorDataset(torch.randn(N - 8, 4), torch.randint(0, 2, (N - 8,)))
    with pytest.raises(IncompatibleStateError, match="dataset_len was 40, now 32"):
        with PreemptibleRun(tmp_path, model=model, optimizer=opt, scheduler=sched) as run:
            for _ in run.epochs(EPOCHS):
                for _b in run.batches(DataLoader(smaller, batch_size=BATCH, sampler=run.sampler(smaller, seed=3))):
                    run.step()


def test_batch_size_change_continues_at_the_same_sample(tmp_path, caplog):
    with pytest.raises(Preempted):
        train(tmp_path, stop_at_step=2)  # 16 samples of epoch 0 consumed
    model, opt, sched, data = build()
    seen = []
    with caplog.at_level(logging.WARNING, logger="preempt"):
        with PreemptibleRun(tmp_path, model=model, optimizer=opt, scheduler=sched) as run:
            sampler = run.sampler(data, seed=3)
            for _ in run.epochs(1):
                for x, _y in run.batches(DataLoader(data, batch_size=4, sampler=sampler)):
                    seen.append(x)
                    run.step()
    assert "batch size changed (8 -> 4" in caplog.text
    order = sampler.order(0)
    assert torch.equal(torch.cat(seen), data.tensors[0][order[16:]])


def test_model_mismatch_lists_keys_and_shapes(tmp_path):
    with pytest.raises(Preempted):
        train(tmp_path, stop_at_step=1)
    other = torch.nn.Sequential(
        torch.nn.Linear(4, 9), torch.nn.Dropout(0.5), torch.nn.Linear(9, 2), torch.nn.Linear(2, 2)
    )
    with pytest.raises(IncompatibleStateError) as info:
        with PreemptibleRun(tmp_path, model=other):
            pass
    message = str(info.value)
    assert "step_000000001/model.safetensors" in message
    assert "missing in checkpoint: 3.bias, 3.weight" in message
    assert "0.weight: checkpoint (8, 4), model (9, 4)" in message


def test_optimizer_group_mismatch(tmp_path):
    with pytest.raises(Preempted):
        train(tmp_path, stop_at_step=1)
    model, _, _, _ = build()
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.1)
    with pytest.raises(IncompatibleStateError, match="2 parameter group"):
        with PreemptibleRun(tmp_path, model=model, optimizer=opt):
            pass


def test_checkpoints_per_epoch_and_milestones(tmp_path):
    train(tmp_path, checkpoints_per_epoch=2, keep_every_steps=4, keep_last=1)
    kept = sorted(int(p.name.split("_")[1]) for p in tmp_path.glob("step_*"))
    assert kept == [4, 8, 12, 15], kept  # milestones survive keep_last=1; 15 is the final one
    reasons = set()
    for p in tmp_path.glob("step_*/manifest.json"):
        reasons.add(json.loads(p.read_text())["reason"])
    assert "milestone" in reasons


def test_entered_from_a_thread_warns_and_still_saves(tmp_path, caplog):
    errors = []

    def body():
        try:
            model, opt, _, _ = build()
            with PreemptibleRun(tmp_path, model=model, optimizer=opt) as run:
                run.step()
        except Exception as e:  # noqa: BLE001 - reported to the main thread
            errors.append(e)

    with caplog.at_level(logging.WARNING, logger="preempt"):
        t = threading.Thread(target=body)
        t.start()
        t.join()
    assert not errors
    assert "outside the main thread" in caplog.text
    assert (tmp_path / "step_000000001").is_dir()


def test_invalid_arguments_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_interval"):
        PreemptibleRun(tmp_path, checkpoint_interval=-1)
    with pytest.raises(ValueError, match="keep_last"):
        PreemptibleRun(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="keep_best=1 needs best_metric"):
        PreemptibleRun(tmp_path, keep_best=1)
    with pytest.raises(TypeError, match="optimizer"):
        PreemptibleRun(tmp_path, optimizer=object())
    with pytest.raises(ValueError, match="resume"):
        PreemptibleRun(tmp_path, resume=-3)
    with pytest.raises(ValueError, match="signals"):
        PreemptibleRun(tmp_path, signals=[signal.SIGKILL])


def test_a_run_is_entered_once(tmp_path):
    run = PreemptibleRun(tmp_path)
    with run:
        pass
    with pytest.raises(PreemptError, match="already entered"):
        with run:
            pass


def test_every_checkpoint_corrupt_starts_fresh_loudly(tmp_path, uninterrupted, caplog):
    with pytest.raises(Preempted):
        train(tmp_path, stop_at_step=3)
    victim = tmp_path / "step_000000003" / "model.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="preempt"):
        model, opt, sched, trace = train(tmp_path)
    assert "xxh3 mismatch" in caplog.text and "starting fresh" in caplog.text
    assert (tmp_path / "quarantine" / "step_000000003").is_dir()
    assert len(trace) == 15  # trained from step 0
    assert_equal_states(uninterrupted[0], final_state(model, opt, sched))


def test_a_signal_during_a_checkpoint_write_stops_at_that_checkpoint(tmp_path):
    """The stop is decided again after a save: the signal that came during it needs no further step or save."""

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def hook(stage: str, cancel: object = None) -> None:
        if stage == "before_manifest":
            signal.raise_signal(signal.SIGTERM)  # a real signal, caught by the run, in the middle of the write

    run = PreemptibleRun(
        tmp_path, model=model, optimizer=opt, checkpoint_every_steps=2, checkpoint_interval=None, async_save=False
    )
    _testing.install("commit", hook)
    try:
        with pytest.raises(Preempted) as stop, run:
            for _ in run.epochs(1):
                for x in run.batches([torch.randn(3, 4) for _ in range(6)]):
                    model(x).sum().backward()
                    opt.step()
                    opt.zero_grad()
                    run.step()
    finally:
        _testing.install("commit", None)
    assert run.global_step == 2 and stop.value.checkpoint == str(tmp_path / "step_000000002")
    assert [c.manifest.reason for c in CheckpointManager(tmp_path, owner=False).list()] == ["steps"]


def test_the_run_keeps_few_enough_attributes_for_fast_reads(tmp_path):
    """run.step() reads several attributes of the run per call. CPython keeps an object's attribute values inline,
    read by specialised instructions, only while its class's instances share one table of at most 30 keys; a 31st
    attribute turns every instance into a plain dict and run.step() slower by about a tenth (bench/bench_step.py
    measured 1.10x with 32). Rare parts go into one attribute (StepHooks), not one each."""
    from preempt.run.preemptible import StepHooks

    model = torch.nn.Linear(2, 2)
    with PreemptibleRun(tmp_path / "run", model=model, checkpoint_interval=None, log_file=False) as run:
        for _ in run.epochs(1):
            run.step()
            names = sorted(vars(run))
            assert len(names) <= 30, (len(names), names)
            break
    # no Accelerate optimizer and no preempt check: no hooks, the hot path's one test is against None
    assert StepHooks.of(None, None) is None
    assert StepHooks.of(object(), None) is not None
