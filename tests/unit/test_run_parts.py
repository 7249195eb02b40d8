"""The run's smaller parts, pure: loop state, the single process as peers, the start plan, the config."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal

import pytest
import torch

from preempt import Preempted, PreemptibleRun
from preempt.checkpoint.manifest import Cursor
from preempt.checkpoint.retention import RetentionPolicy
from preempt.cluster.environment import Environment
from preempt.errors import NoCheckpointError
from preempt.run.config import RunConfig
from preempt.run.due import Reason
from preempt.run.loop_state import LoopState
from preempt.run.peers import Alone
from preempt.run.resume_plan import NO_CHECKPOINT, is_new_request, plan_start, request_of, request_source
from preempt.run.stopping import Stopper

# ---------------------------------------------------------------------------- LoopState


def test_a_step_counts_and_marks_the_state_changed_and_whole_again():
    loop = LoopState()
    loop.took_batch()
    loop.took_batch()
    loop.optimizer_stepping()
    assert loop.stepping and loop.batches_since_step == 2 and not loop.dirty
    beacon = [0]
    loop.publish(beacon)
    assert loop.stepped() is False  # nothing due: run.step() looks no further
    assert beacon == [1]
    assert (loop.global_step, loop.batch, loop.batches_since_step, loop.stepping, loop.dirty) == (1, 2, 0, False, True)


def test_stepped_says_when_a_threshold_or_a_best_is_reached():
    loop = LoopState()
    loop.wake_at(3, math.inf)
    assert [loop.stepped() for _ in range(4)] == [False, False, True, True]
    loop.wake_at(math.inf, 2)
    loop.took_batch()
    assert not loop.stepped()
    loop.took_batch()
    assert loop.stepped()
    loop.wake_at(math.inf, math.inf)
    loop.best_pending = True
    assert loop.stepped()


def test_a_skipped_batch_is_a_step_boundary_and_an_emergency_save_unwinds_the_unstepped_batches():
    loop = LoopState()
    loop.took_batch()
    loop.optimizer_stepping()
    loop.batch_skipped()
    assert not loop.stepping and loop.batches_since_step == 0 and loop.batch == 1
    loop.took_batch()
    loop.took_batch()
    loop.unwind_batches()
    assert loop.batch == 1 and loop.batches_since_step == 0


def test_metrics_take_numbers_and_one_element_tensors_and_a_better_value_makes_best_due():
    loop = LoopState()
    retention = RetentionPolicy(keep_last=2, keep_best=1, metric="loss", mode="min")
    loop.record({"loss": torch.tensor(2.0), "acc": 1}, retention)
    assert loop.metrics == {"loss": 2.0, "acc": 1.0} and loop.best_pending and loop.best["value"] == 2.0
    loop.taken(0, Cursor(), now=5.0)
    assert not loop.best_pending and not loop.dirty and loop.last_save_time == 5.0
    loop.record({"loss": 3.0}, retention)
    assert not loop.best_pending and loop.best["value"] == 2.0
    loop.record({"loss": float("nan")}, retention)
    assert not loop.best_pending
    with pytest.raises(ValueError, match=r"metrics\['loss'\]: expected one number, got a tensor of shape \(2,\)"):
        loop.record({"loss": torch.zeros(2)}, retention)
    with pytest.raises(TypeError, match=r"metrics\['ok'\]: expected a number, got True"):
        loop.record({"ok": True}, retention)
    with pytest.raises(TypeError, match="expected a mapping"):
        loop.record([1.0], retention)  # type: ignore[arg-type]


def test_the_facts_for_the_save_policy_come_from_the_counters():
    loop = LoopState(global_step=7, epoch=2, batch=3)
    loop.taken(5, Cursor(epoch=2, batch=1), now=10.0)
    loop.epoch_ended()
    f = loop.facts(12.0, batches_per_epoch=4, stop_requested=True)
    assert (f.step, f.epoch, f.batch, f.last_save_step, f.last_save_epoch, f.last_save_batch) == (7, 3, 0, 5, 2, 1)
    assert f.dirty and f.stop_requested and f.stop_at == math.inf and f.now == 12.0


# ---------------------------------------------------------------------------- one process as peers


def test_a_process_alone_agrees_with_itself():
    alone = Alone()
    assert alone.leader and alone.alone and (alone.rank, alone.world_size) == (0, 1)
    assert alone.every == 0  # no fixed meeting steps: the safe point runs when something is due
    a = alone.agree(False, Reason.PER_EPOCH)
    assert (a.stop, a.save, a.signal_rank) == (False, Reason.PER_EPOCH, -1)
    a = alone.agree(True, None)
    assert (a.stop, a.save, a.signal_rank) == (True, None, 0)
    assert alone.agree(False, None, walltime_stop=True).stop
    assert alone.broadcast(("x", 1)) == ("x", 1)


# ---------------------------------------------------------------------------- the start plan


def test_the_start_plan():
    assert plan_start(fresh=True, request=None).kind == "fresh"
    assert plan_start(fresh=True, request=None).supersede
    assert plan_start(fresh=False, request=None, latest_request=NO_CHECKPOINT).kind == "latest"
    best = request_of("best", False)
    assert best == {"resume": "best", "weights_only": False}
    assert plan_start(fresh=False, request=best, latest_request=None).kind == "branch"  # not applied yet
    assert plan_start(fresh=False, request=best, latest_request=best).kind == "latest"  # its timeline exists
    assert plan_start(fresh=False, request=best).kind == "branch"
    assert request_of("latest", False) is None and request_of("latest", True) is not None
    assert not is_new_request(None, None) and is_new_request(best) and not is_new_request(best, best)


def test_a_request_names_its_source_or_says_what_it_found(tmp_path):
    assert request_source("best", tmp_path) == (tmp_path.resolve(), "best")
    assert request_source(4, tmp_path) == (tmp_path.resolve(), 4)
    other = tmp_path / "other"
    other.mkdir()
    assert request_source(str(other), tmp_path) == (other.resolve(), "latest")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "manifest.json").write_text("{}")
    with pytest.raises(NoCheckpointError, match="holds a manifest but is not named step_<N>"):
        request_source(str(tmp_path / "odd"), tmp_path)
    with pytest.raises(NoCheckpointError, match="neither a save_dir nor a checkpoint directory"):
        request_source(os.fspath(tmp_path / "missing"), tmp_path)


# ---------------------------------------------------------------------------- the config


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("exit_code", 300, r"exit_code: expected an integer in \[0, 255\], got 300"),
        ("resume", True, "resume: expected 'latest', 'best', a step, a path or None, got True"),
        ("resume", -1, "resume: a step number must be >= 0, got -1"),
        ("time_limit", "soon", "time_limit: expected a positive number of seconds or"),
        ("max_restarts", -1, "max_restarts: expected an integer >= 0 or None, got -1"),
        ("sync_every_steps", 0, "sync_every_steps: expected an integer >= 1, got 0"),
        ("max_oom", 0, "max_oom: expected an integer >= 1, got 0"),
        ("nonfinite_lr_factor", 1, "nonfinite_lr_factor: expected a number > 1, got 1"),
        ("progress_every_s", 0, "progress_every_s: expected a number of seconds > 0 or None, got 0"),
        ("keep_best", 1, r"keep_best=1 needs best_metric="),
        ("checkpoint_interval", -5, "checkpoint_interval"),
    ],
)
def test_every_option_is_checked_once_by_the_config_and_named(tmp_path, option, value, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(**{option: value})
    with pytest.raises(ValueError, match=message):
        PreemptibleRun(tmp_path, **{option: value})


def test_the_config_normalises_and_hands_the_retention_to_the_manager(tmp_path):
    cfg = RunConfig(monitor_gpu=True, time_limit="01:00:00", keep_best=2, best_metric="loss", best_mode="max")
    assert cfg.monitor_gpu == 10.0 and cfg.time_limit == 3600.0
    run = PreemptibleRun(tmp_path, keep_best=2, best_metric="loss", best_mode="max", keep_last=3)
    assert run.manager.retention == RetentionPolicy(keep_last=3, keep_best=2, metric="loss", mode="max")


def test_each_part_is_given_its_group_built_from_the_same_flat_keywords(tmp_path):
    from preempt.checkpoint.carry import CarryOptions
    from preempt.run.config import HealthOptions, ReportOptions, SaveOptions, StopOptions

    cfg = RunConfig(time_limit="00:10:00", monitor_gpu=True, carry_unchanged=False, max_oom=2, keep_last=4)
    assert cfg.stop == StopOptions(time_limit="00:10:00") and cfg.stop.time_limit_s == 600.0
    assert cfg.report == ReportOptions(monitor_gpu=True) and cfg.report.gpu_every_s == 10.0
    assert cfg.save == SaveOptions(carry_unchanged=False, keep_last=4) and cfg.save.carry == CarryOptions(enabled=False)
    assert cfg.health == HealthOptions(max_oom=2)
    # a config made again from another (preempt check's) builds its groups again
    assert dataclasses.replace(cfg, keep_last=None).save.keep_last is None
    run = PreemptibleRun(tmp_path, config=cfg)
    assert run.stopper.config is cfg.stop and run.health.config is cfg.health and run.reporter.config is cfg.report


def test_each_option_is_declared_once_with_its_documentation_and_named_for_type_checkers():
    import ast
    import dataclasses
    import inspect
    import typing

    from preempt.run import config

    declared: dict[str, str] = {}
    tree = ast.parse(inspect.getsource(config))
    groups = {g.__name__ for g in config.GROUPS}
    made = {f.name for f in dataclasses.fields(RunConfig) if not f.init}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in groups):
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                name = node.target.id  # type: ignore[attr-defined]
                if name in made:  # a value made from an option (its true type), documented too but not a keyword
                    doc = body[i + 1] if i + 1 < len(body) else None
                    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), f"{name}: no doc"
                    continue
                assert name not in declared, f"{name} declared in two groups"
                declared[name] = ast.unparse(node.annotation)
                doc = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), f"{cls.name}.{name}: no doc"
    assert [f.name for f in dataclasses.fields(RunConfig) if f.init] == list(declared)  # the groups' order, once
    # The TypedDict for **options names exactly the same keywords with the same types.
    hints = typing.get_type_hints(config.RunOptions)
    assert list(hints) == list(declared)
    fields = typing.get_type_hints(RunConfig)
    assert all(hints[name] == fields[name] for name in declared)
    # Nothing attached at import time: the run has no attribute per option, the docstrings are the source's.
    assert not any(hasattr(PreemptibleRun, name) for name in declared)
    assert "checkpoint_interval" in (PreemptibleRun.__init__.__doc__ or PreemptibleRun.__doc__ or "")


def test_a_config_is_given_whole_or_as_options_never_both(tmp_path):
    cfg = RunConfig(keep_last=5, log_file=False)
    assert PreemptibleRun(tmp_path, config=cfg).config is cfg
    with pytest.raises(TypeError, match="config= and options \\(keep_last\\) given"):
        PreemptibleRun(tmp_path, config=cfg, keep_last=3)
    with pytest.raises(TypeError, match="config: expected a RunConfig, got dict"):
        PreemptibleRun(tmp_path, config={"keep_last": 3})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_lsat'"):
        PreemptibleRun(tmp_path, keep_lsat=3)  # type: ignore[call-arg]


# ---------------------------------------------------------------------------- the stop's cause


def test_a_signal_after_the_agreed_stop_does_not_change_its_cause(tmp_path, caplog):
    """A rank without a walltime keeper stops because rank 0's keeper did (it told the peers no signal); the
    scheduler's SIGTERM for the requeue that rank 0 asked for arrives while it is still saving. Its log and its
    Preempted say the keeper, as the other ranks' do (seen in the two-node SLURM trial on a loaded machine)."""
    env = Environment.from_env({"RANK": "1", "WORLD_SIZE": "2"})
    stopper = Stopper(RunConfig(log_file=False), env, tmp_path, clock=lambda: 100.0)
    stopper.flag.request(signal.SIGTERM)  # after the agreement
    caplog.set_level(logging.INFO, logger="preempt")
    with pytest.raises(Preempted) as e:
        stopper.stop(LoopState(global_step=141), checkpoint=tmp_path / "step_000000141", requested=False)
    assert "stopping on rank 0's walltime keeper at step 141" in caplog.text, caplog.text
    assert e.value.cause == "walltime"
    # read now (no agreement: a stop between run.step() and the epoch's end), the same flag is the cause
    caplog.clear()
    with pytest.raises(Preempted) as e:
        stopper.stop(LoopState(global_step=141), checkpoint=tmp_path / "step_000000141")
    assert "stopping on SIGTERM 0.00 s after it arrived at step 141" in caplog.text, caplog.text
    assert e.value.cause == "SIGTERM"


def test_the_run_s_properties_are_typed_for_an_ide_and_mypy():
    """Each property a user reads on the run declares its type (what mypy and an IDE show: ``run.global_step`` is
    an ``int``, not ``Any``)."""
    import typing

    from preempt.run.write_decisions import SaveRecord

    props = {n: p for n, p in vars(PreemptibleRun).items() if isinstance(p, property) and not n.startswith("_")}
    hints = {n: typing.get_type_hints(p.fget).get("return") for n, p in props.items()}
    assert all(h is not None and h is not typing.Any for h in hints.values()), hints
    assert hints["global_step"] is int and hints["epoch"] is int and hints["batch"] is int
    assert hints["last_save"] == SaveRecord | None
