"""run.epochs(n, steps_per_epoch=...) gives the progress line a total and an ETA where the loader has no length (an
IterableDataset's): the pure computation, the argument's checks, and a run's progress line with a clock held by the
test."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from helpers import FakeClock
from torch.utils.data import DataLoader, IterableDataset

from preempt import PreemptibleRun
from preempt.health.progress import Progress, check_epochs, planned_total


def test_the_total_is_epochs_times_steps_per_epoch_when_given_else_the_measured_one():
    assert planned_total(3, 10) == 30
    assert planned_total(3, 10, measured=17) == 30  # the loop's own count wins over an estimate
    assert planned_total(3, None, measured=17) == 17
    assert planned_total(3, None) is None and planned_total(None, 10) is None


def test_max_steps_is_the_total_when_it_comes_first():
    assert planned_total(8, 8, max_steps=40) == 40  # "step 33/64" was shown for a run that ends at 40
    assert planned_total(2, 8, max_steps=40) == 16  # the epochs end first
    assert planned_total(None, None, max_steps=40) == 40  # max_epochs=-1: the steps alone
    assert planned_total(3, None, measured=17, max_steps=12) == 12
    with pytest.raises(ValueError, match=re.escape("epochs: max_steps: expected None or an integer >= 0")):
        check_epochs(2, None, -1)


def test_an_unsized_loader_gets_a_total_and_an_eta():
    clock = FakeClock()
    progress = Progress(planned_total(2, 10), every_s=0, clock=clock)
    assert progress.update(0, 0, 0, None) == "step 0/20 | epoch 0 batch 0"
    clock.t += 10.0
    assert progress.update(5, 0, 5, None) == "step 5/20 | epoch 0 batch 5 | 2.00 s/step | ETA 30 s"
    no_total = Progress(planned_total(2, None), every_s=0, clock=clock)
    no_total.update(0, 0, 0, None)
    clock.t += 10.0
    assert no_total.update(5, 0, 5, None) == "step 5 | epoch 0 batch 5 | 2.00 s/step"


@pytest.mark.parametrize(
    "n, per_epoch, message",
    [
        (-1, None, "epochs: expected an integer >= 0, got -1"),
        (2.0, None, "epochs: expected an integer >= 0, got 2.0"),
        (2, 0, "epochs: steps_per_epoch: expected None or an integer >= 1 (the run.step() calls of one epoch), got 0"),
        (2, -5, "got -5"),
        (2, 2.5, "got 2.5"),
        (2, True, "got True"),
        (2, "100", "got '100'"),
    ],
)
def test_bad_arguments_are_refused_with_what_was_expected(n, per_epoch, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_epochs(n, per_epoch)


class Stream(IterableDataset):
    def __iter__(self):
        yield from (torch.zeros(1) for _ in range(8))


def test_a_run_over_an_iterable_dataset_shows_its_total_and_eta(tmp_path, caplog):
    clock = FakeClock()
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        with PreemptibleRun(tmp_path / "bad", model=model, checkpoint_interval=None, clock=clock) as run:
            next(run.epochs(2, steps_per_epoch=0))
    caplog.set_level(logging.INFO, logger="preempt")
    options = dict(checkpoint_interval=None, progress_every_s=1.0, log_file=False, clock=clock)
    with PreemptibleRun(tmp_path / "run", model=model, optimizer=opt, **options) as run:
        loader = DataLoader(Stream(), batch_size=2)  # 4 steps per epoch, no len()
        for _ in run.epochs(2, steps_per_epoch=4):
            for x in run.batches(loader):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
                clock.t += 2.0  # 2 s per step
                run.step()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines and all(re.match(r"step \d/8 \| epoch \d batch \d\b", line) for line in lines), lines
    assert any(re.search(r"\| 2.00 s/step \| ETA [\d.]+ s$", line) for line in lines), lines
    caplog.clear()
    with PreemptibleRun(tmp_path / "capped", model=model, optimizer=opt, **options) as run:
        for _ in run.epochs(2, steps_per_epoch=4, max_steps=5):
            for _x in run.batches(DataLoader(Stream(), batch_size=2)):
                clock.t += 2.0
                run.step()
                if run.global_step == 5:
                    break
            if run.global_step == 5:
                break
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines and all(re.match(r"step \d/5 \|", line) for line in lines), lines
