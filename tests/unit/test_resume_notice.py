"""What a resumed epoch says about its loader (preempt/data/resume_notice.py): which loader, what was replayed, and
whether the result is still exact; first the pure decision, then what a real resume with another num_workers logs."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from preempt import PreemptibleRun
from preempt.data.resume_notice import ResumeFacts, describe, resume_notice, saved_workers

STREAM = describe("iterable", "Shards", 3)
MAP = describe("seeded", "Images", 3)


def facts(kind: str, saved: int | None, now: int, batch: int, *, stateful=True, positions=True, loader=STREAM):
    return ResumeFacts(loader, kind, stateful, saved, now, epoch=1, batch=batch, positions=positions)


def test_the_loader_is_named_with_its_dataset_kind_and_workers():
    assert STREAM == "the loader of run.batches() (a DataLoader over Shards, an IterableDataset, 3 worker(s))"
    assert MAP == "the loader of run.batches() (a DataLoader over Images, a map-style dataset, 3 worker(s))"
    assert describe("plain", "list", 0, is_loader=False) == "the iterable of run.batches() (list)"


def test_an_iterable_dataset_with_other_workers_is_replayed_and_said_not_exact():
    level, text = resume_notice(facts("iterable", 2, 3, 14))
    assert level == logging.WARNING
    assert text.startswith(f"{STREAM}: num_workers was 2 when the checkpoint was taken, now 3: replaying 14 batch(es)")
    assert "of epoch 1 from its start" in text and "NOT exact" in text and "depend on the worker" in text
    assert "may repeat or skip samples" in text
    level, text = resume_notice(facts("iterable", 2, 3, 0))  # at the epoch's start: nothing replayed, still not exact
    assert level == logging.WARNING and "epoch 1 starts with 3 worker(s); NOT exact" in text and "replaying" not in text


def test_a_map_style_dataset_with_the_runs_sampler_stays_exact_with_other_workers():
    level, text = resume_notice(facts("seeded", 2, 3, 14, loader=MAP))
    assert level == logging.INFO
    assert text.startswith(f"{MAP}: num_workers was 2 when the checkpoint was taken, now 3; still exact")
    assert "no batch replayed" in text
    assert resume_notice(facts("seeded", 3, 3, 14, loader=MAP)) is None  # nothing changed: nothing to say
    assert resume_notice(facts("seeded", None, 3, 14, loader=MAP)) is None  # an older checkpoint: not recorded


def test_an_iterable_dataset_with_the_same_workers():
    level, text = resume_notice(facts("iterable", 3, 3, 14))
    assert (
        level == logging.INFO and "worker(s) continue where each stood at batch 14 (no batch replayed); exact" in text
    )
    level, text = resume_notice(facts("iterable", 3, 3, 14, stateful=False, positions=False))
    assert level == logging.WARNING and "has no state_dict()/load_state_dict(): replaying 14 batch(es)" in text
    assert "exact when the stream yields the same samples" in text
    level, text = resume_notice(facts("iterable", None, 3, 14, positions=False))
    assert "the checkpoint holds no worker positions: replaying 14" in text
    assert resume_notice(facts("iterable", 3, 3, 0)) is None


def test_a_loader_without_the_runs_sampler_is_replayed():
    level, text = resume_notice(facts("plain", 3, 3, 5, loader=MAP))
    assert level == logging.WARNING and "do not come from a ResumableSampler" in text and "replaying 5" in text
    assert "its workers draw the same random numbers" in text
    _, text = resume_notice(facts("plain", 2, 3, 5, loader=MAP))
    assert "num_workers was 2 when the checkpoint was taken, now 3: random draws in its workers are not" in text
    assert resume_notice(facts("plain", 2, 3, 0, loader=MAP)) is None


@pytest.mark.parametrize("value", [None, True, -1, "2", 2.0, [2]])
def test_a_recorded_worker_count_is_read_only_when_it_is_one(value):
    assert saved_workers({"num_workers": value}) is None
    assert saved_workers({"num_workers": 2}) == 2 and saved_workers(None) is None and saved_workers([2]) is None


class Counting(IterableDataset):
    def __init__(self) -> None:
        self.pos, self._start = 0, 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, k = (info.id, info.num_workers) if info else (0, 1)
        shard = range(w, 48, k)
        start, self._start = self._start, 0
        for j in range(start, len(shard)):
            self.pos = j + 1
            yield torch.tensor([float(shard[j])])

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self._start = state["pos"]


def stop_at_step_3_then_resume(tmp_path, make, before: int, after: int) -> None:
    """Stopped at step 3 with ``before`` workers, finished with ``after``."""

    def once(workers: int, stop: bool) -> None:
        with PreemptibleRun(tmp_path, model=torch.nn.Linear(1, 1), checkpoint_interval=None) as run:
            loader = make(run, workers)
            for _ in run.epochs(1):
                for _ in run.batches(loader):
                    if stop and run.global_step == 2:
                        run.request_stop()
                    run.step()

    with pytest.raises(SystemExit):
        once(before, stop=True)
    once(after, stop=False)


def test_a_resume_with_other_workers_says_which_loader_what_was_replayed_and_whether_exact(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="preempt")
    stream = Counting()
    stop_at_step_3_then_resume(
        tmp_path / "iterable", lambda run, n: DataLoader(stream, batch_size=4, num_workers=n), before=2, after=1
    )
    assert (
        "the loader of run.batches() (a DataLoader over Counting, an IterableDataset, 1 worker(s)): num_workers was 2"
        " when the checkpoint was taken, now 1: replaying 3 batch(es) of epoch 0 from its start to reach the resume"
        " point; NOT exact" in caplog.text
    ), caplog.text

    data = TensorDataset(torch.arange(48.0))

    def seeded(run, n):
        return DataLoader(data, batch_size=4, sampler=run.sampler(data), num_workers=n)

    stop_at_step_3_then_resume(tmp_path / "map", seeded, before=2, after=0)
    assert (
        "the loader of run.batches() (a DataLoader over TensorDataset, a map-style dataset, 0 worker(s)): num_workers"
        " was 2 when the checkpoint was taken, now 0; still exact" in caplog.text
    ), caplog.text


def test_a_resume_at_an_epoch_boundary_with_other_workers_says_so_too(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="preempt")
    stream = Counting()

    def once(workers: int, stop: bool) -> None:
        with PreemptibleRun(tmp_path, model=torch.nn.Linear(1, 1), checkpoint_interval=None) as run:
            loader = DataLoader(stream, batch_size=4, num_workers=workers)
            for _ in run.epochs(2):
                for _ in run.batches(loader):
                    run.step()
                if stop:
                    run.request_stop()  # end-of-epoch code: the stop comes at the boundary

    with pytest.raises(SystemExit):
        once(2, stop=True)
    assert "epoch 1 starts" not in caplog.text
    once(1, stop=False)
    assert (
        "(a DataLoader over Counting, an IterableDataset, 1 worker(s)): num_workers was 2 when the checkpoint was"
        " taken, now 1: epoch 1 starts with 1 worker(s); NOT exact" in caplog.text
    ), caplog.text
