#!/usr/bin/env python
"""Asynchronous checkpoint benchmark for preempt: loop stall and time to durable, against DCP and the disk's limits.

Run from the repository root::

    python bench/bench_async.py                       # 1.5 and 3 GiB, 1 warm-up + 3 timed per method (~15-18 min)
    python bench/bench_async.py --quick               # 0.25 GiB, 1 timed call, short end-to-end rows (~3 min)
    python bench/bench_async.py --gib 0.5 --repeats 5 --json bench/results/async.json
    python bench/bench_async.py --rows first_stop --gib 1.5 --repeats 1   # row 8 alone: a process's first stop

Every method runs in a fresh Python process (this script re-invoked with the
hidden ``--only`` flag); the first call in a process is reported on its own
("first call") and the median of the later calls is the steady state. The
parent prints one table per state size with ratios measured in the same run,
then the loop-slowdown, end-to-end, SIGTERM, peak-RSS and first-stop rows and
every target next to the measured value. See bench/README.md.

The state helpers, the dd reference, the raw write loop, the synchronous
writers and the peak-RSS probe come from ``bench_checkpoint`` (same folder).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_checkpoint import (  # noqa: E402  (the path above makes the sibling importable)
    DEFAULT_DIR,
    GB,
    GIB,
    PeakRss,
    build_model,
    build_state,
    carried_files,
    change_every_tensor,
    dd_once,
    describe_state,
    dir_bytes,
    flat_tensors,
    machine_facts,
    make_writer,
    require_written,
)

QUIET_EVERY = 100_000  # checkpoint_every_steps of the async rows: between checkpoints run.step() only counts
SYNC_METHODS = ("python_write", "save_torch", "save_safetensors", "save_preempt")  # bench_checkpoint.make_writer
DCP_METHODS = ("dcp_save", "dcp_async", "dcp_async_stager", "dcp_async_stager_bg")
METHODS = (
    "python_write",
    "copy_floor",
    "save_torch",
    "save_safetensors",
    *DCP_METHODS,
    "save_preempt",
    "preempt_async",
)
CHILD_PHASES = ("method", "e2e", "sigterm", "fresh", "first_stop")
SLOWDOWN_ROUNDS = 2  # row 4: (write in flight, then none) twice
E2E_VARIANTS = ("none", "async", "sync", "none2")  # "none" twice (first and last): their gap is the noise floor


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def perf() -> float:
    return time.perf_counter()


def leave(run: Any) -> None:
    """Exits ``run`` once its write in flight and its deletions are done, without a final checkpoint.

    As on a SystemExit: no final save, no completion marker, and no emergency save (which any other
    exception leaving the run would write).
    """
    run.wait_for_checkpoint()
    run.manager.wait(timeout=120)
    run.__exit__(SystemExit, SystemExit(0), None)


# --------------------------------------------------------------- workload


def make_workload() -> Callable[[], None]:
    """One training step of a small MLP with AdamW (~1.6 GFLOP): the CPU work of the loop-slowdown and e2e rows."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(1)
    mlp = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
    opt = torch.optim.AdamW(mlp.parameters(), lr=1e-4)
    x = torch.randn(128, 512, generator=g)
    y = torch.randn(128, 512, generator=g)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(mlp(x), y)
        loss.backward()
        opt.step()

    for _ in range(5):  # allocator and kernel warm-up
        step()
    return step


def calibrate(work: Callable[[], None], seconds: float = 0.5) -> float:
    """Median seconds per call of ``work`` over about ``seconds``."""
    times: list[float] = []
    end = perf() + seconds
    while perf() < end or len(times) < 5:
        t0 = perf()
        work()
        times.append(perf() - t0)
    return median(times)


# ------------------------------------------------------------ the methods
#
# make_method returns (save(i) -> dict | None, after(i), finish(), facts, slowdown() | None).
# save(i) is timed by the caller when it returns None (a synchronous save: stall = durable);
# asynchronous methods time themselves and return {"stall_s", "durable_s", ...}.


def make_method(method: str, args: argparse.Namespace, work: Path) -> tuple[Any, Any, Any, dict[str, Any], Any]:
    if method in SYNC_METHODS:
        save, after, finish, facts = make_writer(method, args, work)
        return save, after, finish, facts, None
    if method == "copy_floor":
        return make_copy_floor(args)
    if method in DCP_METHODS:
        return make_dcp(method, args, work)
    if method == "preempt_async":
        return make_preempt_async(args, work)
    raise ValueError(method)


def make_copy_floor(args: argparse.Namespace) -> tuple[Any, Any, Any, dict[str, Any], Any]:
    """``buf.copy_(t)`` for every tensor into buffers allocated and touched once: the floor of any snapshot."""
    import torch

    t0 = perf()
    model, opt = build_state(args.gib)
    facts: dict[str, Any] = {"build_s": perf() - t0}
    tensors = list(flat_tensors(model, opt).values())
    bufs = [torch.empty_like(t) for t in tensors]
    for b in bufs:
        b.reshape(-1).view(torch.uint8).fill_(0)  # touched: page faults are not part of the copy
    facts["bytes"] = sum(t.numel() * t.element_size() for t in tensors)
    facts["tensors"] = len(tensors)

    def save(i: int) -> None:
        with torch.no_grad():
            for b, t in zip(bufs, tensors, strict=True):
                b.copy_(t)

    return save, lambda i: None, lambda: None, facts, None


def make_dcp(method: str, args: argparse.Namespace, work: Path) -> tuple[Any, Any, Any, dict[str, Any], Any]:
    """torch.distributed.checkpoint save / async_save of {"model", "optim"} state dicts, one directory per call."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    t0 = perf()
    model, opt = build_state(args.gib)
    facts: dict[str, Any] = {"build_s": perf() - t0, "bytes": describe_state(args.gib)["state_bytes"]}
    out = work / method
    out.mkdir()
    sizes: list[int] = []
    stager = None
    if method in ("dcp_async_stager", "dcp_async_stager_bg"):
        # No accelerator here: pinning needs CUDA (StateDictStager warns and ignores it), non-blocking copies
        # need an accelerator (DefaultStager raises AssertionError), and shared memory only serves the
        # process-based checkpointer. Async staging (a thread copies while async_save returns) is the _bg row.
        options = StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=method == "dcp_async_stager_bg",
            use_non_blocking_copy=False,
        )
        stager = DefaultStager(options)
        facts["staging_options"] = repr(options)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def submit(path: Path) -> Any:
        kw = {} if stager is None else {"async_stager": stager}
        return dcp.async_save(state_dict(), checkpoint_id=path, **kw)

    def save(i: int) -> dict[str, Any] | None:
        path = out / f"ckpt_{i}"
        if method == "dcp_save":
            dcp.save(state_dict(), checkpoint_id=path)
            return None
        t0 = perf()
        h = submit(path)
        t1 = perf()
        if hasattr(h, "staging_completion"):  # AsyncSaveResponse: staging runs in DCP's thread
            h.staging_completion.result()  # the loop may not change the state before this
            t_staged = perf()
            h.upload_completion.result()
        else:
            t_staged = t1
            h.result()
        t2 = perf()
        return {"stall_s": t_staged - t0, "returned_s": t1 - t0, "durable_s": t2 - t0}

    def after(i: int) -> None:
        path = out / f"ckpt_{i}"
        sizes.append(dir_bytes(path))
        for p in out.iterdir():
            if p != path:
                shutil.rmtree(p)
        os.sync()

    def finish() -> None:
        if stager is not None:
            stager.close()
        facts["file_bytes"] = sizes[-1]
        facts["files"] = sorted(p.name for p in (out / f"ckpt_{len(sizes) - 1}").iterdir())
        shutil.rmtree(out)

    slowdown = None
    if method == "dcp_async_stager":

        def slowdown() -> dict[str, Any]:
            work_step = make_workload()

            def in_flight(r: int) -> tuple[list[float], float]:
                path = out / f"slow_{r}"
                t0 = perf()
                fut = submit(path)  # blocks for the copy (synchronous staging); excluded from the steps
                steps = []
                while not fut.done():
                    s0 = perf()
                    work_step()
                    dt = perf() - s0
                    if fut.done():
                        break  # the write ended during this step: partly in flight, left out
                    steps.append(dt)
                fut.result()
                write_s = perf() - t0
                shutil.rmtree(path)
                os.sync()
                return steps, write_s

            return measure_slowdown(work_step, in_flight, lambda: None)

    return save, after, finish, facts, slowdown


def make_preempt_async(args: argparse.Namespace, work: Path) -> tuple[Any, Any, Any, dict[str, Any], Any]:
    """PreemptibleRun(async_save=True): the stall is the run.step() that takes the checkpoint."""
    from preempt_options import takes

    from preempt import PreemptibleRun

    if not takes("async_save"):
        raise SystemExit("bench: this preempt has no PreemptibleRun(async_save=...); nothing to measure")
    t0 = perf()
    model, opt = build_state(args.gib)
    facts: dict[str, Any] = {"build_s": perf() - t0, "bytes": describe_state(args.gib)["state_bytes"]}
    out = work / "preempt_async"
    run = PreemptibleRun(
        out,
        model=model,
        optimizer=opt,
        async_save=True,
        checkpoint_every_steps=QUIET_EVERY,
        checkpoint_interval=None,
        keep_last=1,
    )
    sizes: list[int] = []
    prepares: list[float] = []  # run.staging_prepare_s as it changes (the run prepares again after step 1)
    t_entered = 0.0

    def note_prepare() -> None:
        p = run.staging_prepare_s
        if p is not None and (not prepares or p != prepares[-1]):
            prepares.append(p)

    def take_checkpoint(work_step: Callable[[], None] | None = None) -> tuple[float, float]:
        """Steps until a step takes a checkpoint; (seconds of that run.step(), perf() before it).

        The steps before the one that is due only count (run.step() alone); ``work_step`` runs before the due one.
        """
        prev = run.last_save
        while True:
            if work_step is not None and (run.global_step + 1) % QUIET_EVERY == 0:
                work_step()
            t0 = perf()
            run.step()
            dt = perf() - t0
            note_prepare()
            rec = run.last_save
            if rec is not prev and rec is not None and rec.step == run.global_step:
                return dt, t0

    def save(i: int) -> dict[str, Any]:
        nonlocal t_entered
        if i == 0:  # entered here, after the peak-RSS reset: the staging buffers count in the peak
            t0 = perf()
            run.__enter__()
            t_entered = perf()
            facts["enter_s"] = t_entered - t0
            # A checkpoint due while the run still prepares its buffers waits for that; a real loop's first
            # checkpoint comes minutes in. So the loop goes on (steps with the GIL free, as in torch ops) first.
            while run.staging_prepare_s is None and perf() - t_entered < 60:
                run.step()
                note_prepare()
                time.sleep(0.002)
            facts["prepared_after_s"] = perf() - t_entered
        stall, t0 = take_checkpoint()
        if i == 0:
            facts["first_checkpoint_after_enter_s"] = t0 - t_entered
        path = run.wait_for_checkpoint()
        t2 = perf()
        rec = run.last_save
        assert rec is not None and rec.durable and path == rec.path, rec
        require_written(path)
        sizes.append(dir_bytes(path))
        return {
            "stall_s": stall,
            "durable_s": t2 - t0,
            "record_stall_s": rec.stall_s,
            "record_write_s": rec.write_s,
            "background": rec.background,
        }

    def after(i: int) -> None:
        if not run.manager.wait(timeout=120):
            raise RuntimeError("background deletion did not finish in 120 s")
        change_every_tensor(model, opt)  # as a training step would: the next checkpoint has everything to write
        os.sync()

    def finish() -> None:
        facts["staging_prepare_s"] = run.staging_prepare_s
        facts["staging_prepares_s"] = prepares
        facts["file_bytes"] = sizes[-1]
        leave(run)
        shutil.rmtree(out)

    def slowdown() -> dict[str, Any]:
        work_step = make_workload()

        def in_flight(r: int) -> tuple[list[float], float]:
            take_checkpoint(work_step)  # the step that stages: its stall is row 3, not counted here
            steps = []
            while True:
                s0 = perf()
                work_step()
                run.step()  # sees the write end and collects it
                dt = perf() - s0
                if run.last_save.durable:  # type: ignore[union-attr]
                    break  # the write ended during this step: partly in flight, left out
                steps.append(dt)
            write_s = run.last_save.write_s  # type: ignore[union-attr]
            after(r)
            return steps, write_s

        return measure_slowdown(work_step, in_flight, run.step)

    return save, after, finish, facts, slowdown


def measure_slowdown(
    work_step: Callable[[], None],
    in_flight: Callable[[int], tuple[list[float], float]],
    also: Callable[[], None],
) -> dict[str, Any]:
    """Per-step times of ``work_step`` (+ ``also``) while a write is in flight and with none, alternated in rounds."""
    step_s = calibrate(work_step)
    n_base = max(20, int(1.5 / step_s))
    flight: list[float] = []
    base: list[float] = []
    writes = []
    for r in range(SLOWDOWN_ROUNDS):
        steps, write_s = in_flight(r)
        flight += steps
        writes.append(write_s)
        for _ in range(n_base):
            t0 = perf()
            work_step()
            also()
            base.append(perf() - t0)
    return {
        "idle_step_median_s": median(base),
        "idle_step_mean_s": statistics.fmean(base),
        "flight_step_median_s": median(flight) if flight else None,
        "flight_step_mean_s": statistics.fmean(flight) if flight else None,
        "idle_steps": len(base),
        "flight_steps": len(flight),
        "write_while_training_s": writes,
    }


def phase_method(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """1 warm-up + ``repeats`` timed calls of one method in this fresh process, then its slowdown rows."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save, after, finish, facts, slowdown = make_method(args.method, args, work)
        mem = PeakRss()  # reset after the build (its temporaries are not a save's); the rest of the process counts
        mem.__enter__()
        calls = []
        for i in range(args.repeats + 1):
            t0 = perf()
            r = save(i)
            dt = perf() - t0
            calls.append({"stall_s": dt, "durable_s": dt} if r is None else r)
            after(i)
        mem.__exit__()
        if args.method == "copy_floor":
            for c in calls:
                c["durable_s"] = None
        slow = slowdown() if slowdown is not None and args.slowdown else None
        finish()
    msgs: dict[str, int] = {}
    for w in caught:
        key = f"{w.category.__name__}: {str(w.message)[:150]}"
        msgs[key] = msgs.get(key, 0) + 1
    return {
        **facts,
        "calls": calls,
        **mem.to_json(),
        # the state's own bytes plus the peak above the RSS the process had once the state was built
        "peak_x": (facts["bytes"] + mem.extra) / facts["bytes"],
        "slowdown": slow,
        "warnings": msgs,
    }


# ------------------------------------------------------------- end to end


def phase_e2e(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A loop of ``--steps`` fixed steps with checkpoints every ``--every`` seconds: async, sync or none."""
    import logging

    from preempt import PreemptibleRun

    logging.getLogger("preempt").setLevel(logging.WARNING)
    model, opt = build_state(args.gib)
    work_step = make_workload()
    variant = args.variant.rstrip("2")
    run = PreemptibleRun(
        work / f"e2e_{args.variant}",
        model=model,
        optimizer=opt,
        async_save=variant == "async",
        checkpoint_interval=None if variant == "none" else args.every,
        keep_last=1,
    )
    t0 = perf()
    run.__enter__()
    enter_s = perf() - t0
    stalls: list[float] = []
    step_calls = 0.0
    taken: set[int] = set()
    t0 = perf()
    for _ in range(args.steps):
        work_step()
        change_every_tensor(model, opt)  # one value per tensor, as training changes them: nothing is carried
        s0 = perf()
        run.step()
        dt = perf() - s0
        step_calls += dt
        rec = run.last_save
        if rec is not None and rec.step == run.global_step and rec.step not in taken:
            taken.add(rec.step)
            stalls.append(dt)
    loop_s = perf() - t0
    t1 = perf()
    run.wait_for_checkpoint()
    drain_s = perf() - t1
    leave(run)
    shutil.rmtree(work / f"e2e_{args.variant}", ignore_errors=True)
    return {
        "variant": args.variant,
        "steps": args.steps,
        "loop_s": loop_s,
        "checkpoints": len(stalls),
        "stalls_s": stalls,
        "run_step_total_s": step_calls,
        "drain_s": drain_s,
        "enter_s": enter_s,
        "staging_prepare_s": run.staging_prepare_s,
    }


# ----------------------------------------------------------------- a fresh process's first checkpoints


FRESH_SAVES = 5


def phase_fresh(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A new job: the model built, AdamW without state (its moments appear at the first optimizer step), the run
    entered and the loop started at once, ``checkpoint_interval=--every``; the loop's wait in ``run.step()`` at each
    of the first checkpoints, each write waited for before the loop goes on (so every save copies a whole state)."""
    import torch

    from preempt import PreemptibleRun

    torch.manual_seed(0)
    model = build_model(args.gib)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    work_step = make_workload()
    out = work / f"fresh_{os.getpid()}"
    run = PreemptibleRun(out, model=model, optimizer=opt, async_save=True, checkpoint_interval=args.every, keep_last=1)
    saves: list[dict[str, Any]] = []
    t0 = perf()
    with run:
        entered = perf()
        while len(saves) < FRESH_SAVES:
            work_step()
            if run.global_step == 0:  # the first optimizer step: AdamW's moments appear
                for p in model.parameters():
                    p.grad = torch.full_like(p, 1e-3)
                opt.step()
                for p in model.parameters():
                    p.grad = None
            else:
                change_every_tensor(model, opt)
            s0 = perf()
            run.step()
            dt = perf() - s0
            rec = run.last_save
            if rec is not None and rec.step == run.global_step and (not saves or saves[-1]["step"] != rec.step):
                saves.append({"step": rec.step, "stall_s": dt, "after_enter_s": s0 - entered})
                run.wait_for_checkpoint()
        prepare_s = run.staging_prepare_s
    shutil.rmtree(out, ignore_errors=True)
    return {"enter_s": entered - t0, "staging_prepare_s": prepare_s, "saves": saves, "every_s": args.every}


# ----------------------------------------------------------------- SIGTERM


def phase_sigterm(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A training child for the parent to SIGTERM: says "ready" (and "inflight" after a staged save) on stdout."""
    from preempt import PreemptibleRun
    from preempt.run import write_decisions

    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    model, opt = build_state(args.gib)
    work_step = make_workload()
    variant, _, how = args.variant.partition("+")
    if how == "live":  # the stop's save writes the live tensors through the page cache (before issue 27)
        write_decisions.STAGE_SYNCHRONOUS = False
    inflight = variant == "inflight"
    save_dir = Path(args.save_dir or work / f"sigterm_{os.getpid()}")
    run = PreemptibleRun(
        save_dir,
        model=model,
        optimizer=opt,
        async_save=True,
        checkpoint_interval=None,
        checkpoint_every_steps=args.steps if inflight else None,
        keep_last=1,
    )
    res: dict[str, Any] = {"variant": args.variant}
    t_enter = time.time()
    ready = announced = False
    durable: set[Path] = set()  # periodic checkpoints written: a requeued job's save_dir has pruned (recycled) ones
    with run:
        try:
            while True:
                work_step()
                change_every_tensor(model, opt)  # one value per tensor, as training changes them: nothing is carried
                run.step()
                # "reserved": ready once the pool the writer writes ahead is complete (renamed to .recycle-*)
                prepared = run.staging_prepare_s is not None
                if variant == "reserved":
                    prepared = prepared and any(save_dir.glob(".recycle-*"))
                if not ready and (prepared or time.time() - t_enter > (120 if variant == "reserved" else 30)):
                    ready = True
                    res["staging_prepare_s"] = run.staging_prepare_s
                    res["ready_step"] = run.global_step
                    proto.write(f"ready {time.time()!r}\n")
                    proto.flush()
                rec = run.last_save
                # Not rec.durable: a write that ends at a step where a postponed save is taken at once is never seen
                # durable (3 GiB, 2.4 s writes).
                if run.last_checkpoint is not None:
                    durable.add(run.last_checkpoint)
                if inflight and ready and not announced and len(durable) >= 2 and rec is not None and not rec.durable:
                    announced = True
                    res["staged_wall"] = time.time()
                    res["staged_step"] = rec.step
                    res["staged_stall_s"] = rec.stall_s
                    proto.write(f"inflight {res['staged_wall']!r}\n")
                    proto.flush()
        except SystemExit as e:  # Preempted: the stop's checkpoint is durable
            stopped(res, run, e)
            rec = run.last_save
            if rec is not None:
                res["last_save"] = {"step": rec.step, "reason": rec.reason, "stall_s": rec.stall_s}
            Path(args.result).write_text(json.dumps(res))
            raise
    return res  # not reached: the loop only ends by the signal


def stopped(res: dict[str, Any], run: Any, e: SystemExit) -> None:
    """What a SIGTERM child records when the stop ends its run: when, its exit code and step, the stop's checkpoint."""
    res["stopped_wall"] = time.time()
    res["exit_code"] = e.code
    res["stop_step"] = run.global_step
    path = run.last_checkpoint
    res["checkpoint"] = str(path)
    res["manifest_exists"] = path is not None and (Path(path) / "manifest.json").is_file()
    res["carried"] = carried_files(Path(path)) if res["manifest_exists"] else []


# ----------------------------------------------------------------- a process's first stop


def phase_first_stop(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A new job for the parent to SIGTERM at a moment after it entered the run: the stop's save is its first write.

    Says "entered WALL" on stdout once ``PreemptibleRun.__enter__`` returned and "ready WALL" once the staging buffers
    are sized (``run.staging_prepare_s`` set); notes when the pool written ahead is complete (a ``.recycle-*``
    directory), so that the parent can say what was under way when its signal came.
    """
    import preempt
    from preempt import PreemptibleRun

    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    model, opt = build_state(args.gib)
    work_step = make_workload()
    save_dir = Path(args.save_dir or work / f"first_stop_{os.getpid()}")
    # The defaults of a user's run but the interval: the stop's save is the process's first write.
    run = PreemptibleRun(save_dir, model=model, optimizer=opt, checkpoint_interval=None)
    res: dict[str, Any] = {"variant": args.variant, "preempt_file": preempt.__file__}
    print(f"first_stop child: preempt from {preempt.__file__}", file=sys.stderr, flush=True)
    t0 = time.time()
    with run:
        res["entered_wall"] = entered = time.time()
        res["enter_s"] = entered - t0
        proto.write(f"entered {entered!r}\n")
        proto.flush()
        try:
            while True:
                work_step()
                change_every_tensor(model, opt)  # one value per tensor, as training changes them: nothing is carried
                run.step()
                now = time.time()
                if "ready_wall" not in res and (run.staging_prepare_s is not None or now - entered > 60):
                    res["ready_wall"] = now
                    res["staging_prepare_s"] = run.staging_prepare_s
                    proto.write(f"ready {now!r}\n")
                    proto.flush()
                if "pool_wall" not in res and any(save_dir.glob(".recycle-*")):
                    res["pool_wall"] = now
        except SystemExit as e:  # Preempted: the stop's checkpoint is durable
            stopped(res, run, e)
            res["staging_prepare_s_at_exit"] = run.staging_prepare_s
            Path(args.result).write_text(json.dumps(res))
            raise
    return res  # not reached: the loop only ends by the signal


# ----------------------------------------------------------------- parent


def child_cmd(phase: str, args: argparse.Namespace, work: Path, result: Path, gib: float, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--only",
        phase,
        "--gib",
        repr(gib),
        "--repeats",
        str(args.repeats),
        "--dir",
        str(work),
        "--result",
        str(result),
        "--threads",
        str(args.threads),
        *extra,
    ]


def spawn(phase: str, args: argparse.Namespace, work: Path, gib: float, *extra: str, label: str = "") -> dict[str, Any]:
    """Runs one phase in a fresh Python process and returns its JSON result."""
    result = work / f"{phase}.json"
    t0 = perf()
    p = subprocess.run(child_cmd(phase, args, work, result, gib, *extra), capture_output=True, text=True)
    wall = perf() - t0
    if p.returncode != 0:
        sys.stderr.write(p.stdout + p.stderr)
        raise SystemExit(f"bench: {phase} {' '.join(extra)} failed (exit {p.returncode}); its output is above")
    res = json.loads(result.read_text())
    result.unlink()
    res["wall_s"] = wall
    print(f"  {gib:g} GiB {label or phase:<22} done in {wall:5.1f} s", file=sys.stderr, flush=True)
    return res


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """First call and medians of the timed calls of one method's result."""
    calls = res["calls"]
    timed = calls[1:]
    out = {"first_stall_s": calls[0]["stall_s"], "stall_s": median([c["stall_s"] for c in timed])}
    if calls[0].get("durable_s") is not None:
        out["first_durable_s"] = calls[0]["durable_s"]
        out["durable_s"] = median([c["durable_s"] for c in timed])
    if "returned_s" in calls[0]:
        out["returned_s"] = median([c["returned_s"] for c in timed])
    return out


def run_size(args: argparse.Namespace, work: Path, gib: float, slowdown: bool) -> dict[str, Any]:
    """Rows 1-3 and 7 (and 4 when ``slowdown``) at one state size: dd from here, the rest in fresh processes."""
    state = describe_state(gib)
    count = max(1, round(state["state_bytes"] / (16 << 20)))
    dd_times = []
    dd_bytes = 0
    for _ in range(args.repeats + 1):
        dd_bytes, secs = dd_once(work, count)
        dd_times.append(secs)
    out: dict[str, Any] = {
        "gib": gib,
        "state": state,
        "dd": {
            "command": f"dd if=/dev/zero of=FILE bs=16M count={count} conv=fdatasync",
            "bytes": dd_bytes,
            "times_s": dd_times,
            "first_stall_s": dd_times[0],
            "stall_s": median(dd_times[1:]),
            "durable_s": median(dd_times[1:]),
        },
        "methods": {},
    }
    print(f"  {gib:g} GiB {'dd':<22} done", file=sys.stderr, flush=True)
    ns = argparse.Namespace(**{**vars(args), "gib": gib})
    for m in METHODS:
        extra = ("--slowdown",) if slowdown and m in ("preempt_async", "dcp_async_stager") else ()
        res = spawn("method", ns, work, gib, "--method", m, *extra, label=m)
        res.update(summarize(res))
        out["methods"][m] = res
    return out


def run_e2e(args: argparse.Namespace, work: Path, gib: float, step_s: float) -> dict[str, Any]:
    steps = max(10, round(args.e2e_seconds / step_s))
    out: dict[str, Any] = {"gib": gib, "steps": steps, "every_s": args.e2e_every, "est_step_s": step_s}
    ns = argparse.Namespace(**{**vars(args), "gib": gib})
    for v in E2E_VARIANTS:
        extra = ("--variant", v, "--steps", str(steps), "--every", repr(args.e2e_every))
        out[v] = spawn("e2e", ns, work, gib, *extra, label=f"e2e {v}")
    return out


def sigterm_trial(
    args: argparse.Namespace,
    work: Path,
    gib: float,
    variant: str,
    steps: int,
    delay: Callable[[], float],
    save_dir: Path,
    *,
    phase: str = "sigterm",
    wanted: str | None = None,
) -> dict[str, Any]:
    """One child: waits for it to be ready (and for a save in flight), sleeps ``delay()``, SIGTERMs it.

    With ``wanted`` (the first-stop row), the child's line that starts the clock, and ``delay()`` counts from the
    wall time that line carries rather than from when it was read.
    """
    result = work / "sigterm.json"
    errpath = work / "sigterm.err"
    ns = argparse.Namespace(**{**vars(args), "gib": gib})
    extra = ("--variant", variant, "--steps", str(steps), "--save-dir", str(save_dir))
    cmd = child_cmd(phase, ns, work, result, gib, *extra)
    since_line = wanted is not None
    with open(errpath, "w") as err:
        # DEBUG: the lines on background writes (written, cancelled) that this parent reads are debug lines
        env = {**os.environ, "PREEMPT_LOG_LEVEL": "DEBUG"}
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    try:
        assert p.stdout is not None
        wanted = wanted or ("inflight" if variant.startswith("inflight") else "ready")
        while True:
            line = p.stdout.readline()
            if not line:
                p.wait()
                sys.stderr.write(errpath.read_text())
                raise SystemExit(f"bench: SIGTERM child ended before '{wanted}' (exit {p.returncode})")
            if line.split()[0] == wanted:
                break
        d = delay()
        time.sleep(max(0.0, float(line.split()[1]) + d - time.time()) if since_line else d)
        t_kill = time.time()
        p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=600)
        t_exit = time.time()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    log = errpath.read_text()
    if code != 75 or not result.exists():
        sys.stderr.write(log)
        raise SystemExit(f"bench: SIGTERM child exited {code}, expected 75 with a result; its log is above")
    res = json.loads(result.read_text())
    if res["carried"]:
        raise SystemExit(f"bench: the stop's checkpoint carried {res['carried']} instead of writing them")
    result.unlink()
    errpath.unlink()
    res.update(
        delay_s=d,
        kill_wall=t_kill,
        kill_to_durable_s=res["stopped_wall"] - t_kill,
        kill_to_exit_s=t_exit - t_kill,
        exit=code,
    )
    # The yardstick in the same disk state: this VM's disk writes at very different speeds depending on what was
    # written just before (bench/README.md), so a raw write measured minutes earlier says little about this trial.
    count = max(1, round(describe_state(gib)["state_bytes"] / (16 << 20)))
    res["raw_after_bytes"], res["raw_after_s"] = dd_once(work, count)
    m = re.search(r"checkpoint \S+ \(preempt\) written in ([0-9.]+) s", log)
    res["stop_save_s"] = float(m.group(1)) if m else None
    m = re.search(r"written in ([0-9.]+) s in the background", log)
    res["background_write_s"] = float(m.group(1)) if m else None
    # A stop cancels a periodic write in flight (issue 16): it never reports "written", it says "was cancelled".
    res["write_cancelled"] = bool(re.search(r"the background write of step \d+ \(\w+\) was cancelled", log))
    if variant.startswith("inflight") and res["write_cancelled"]:
        res["write_in_flight_at_kill"] = True
    elif variant.startswith("inflight") and res["background_write_s"] is not None:
        started = res["staged_wall"] - res["staged_stall_s"]
        res["write_in_flight_at_kill"] = t_kill < started + res["background_write_s"]
    res["log_tail"] = log.strip().splitlines()[-4:]
    return res


SIGTERM_VARIANTS = (
    ("idle", "nothing in flight, a new save_dir (the first write of the job), stopped 0.2-1 s after its buffers"),
    ("reserved", "nothing in flight, a new save_dir, stopped once the pool written ahead for it is complete"),
    ("inflight", "a periodic write in flight (cancelled by the stop)"),
    ("resumed", "nothing in flight, a requeued job resumed from that save_dir"),
)
# Each variant also with "+live": the stop's save writes the live tensors through the page cache instead of copying
# them into the staging buffers and writing those without it (issue 27); the trials of both alternate.
SIGTERM_VARIANTS = tuple((f"{v}{how}", f"{label}{note}") for v, label in SIGTERM_VARIANTS for how, note in (
    ("", "; the stop copies into the staging buffers, written O_DIRECT"),
    ("+live", "; the stop writes the live tensors through the page cache"),
))  # fmt: skip


def run_sigterm(args: argparse.Namespace, work: Path, gib: float, step_s: float, write_s: float) -> dict[str, Any]:
    """Each trial: a fresh job stopped idle, early and once its pool is written ahead; a fresh job stopped with a
    write in flight; that job resumed and stopped.

    The last is the common case of preemptible capacity (a requeued job preempted again): its save_dir holds
    the earlier process's checkpoint and the files it recycles.
    """
    rng = random.Random(6)
    every = max(3, round(1.0 / step_s))  # the in-flight child checkpoints every ~1 s; stopped during its third
    out: dict[str, Any] = {"gib": gib, "inflight_every_steps": every, **{v: [] for v, _ in SIGTERM_VARIANTS}}
    t0 = perf()
    for i in range(args.repeats):
        for how in ("",) if "live" in args.skip else ("", "+live"):
            fresh, job = work / f"sigterm_{gib:g}_fresh_{i}", work / f"sigterm_{gib:g}_job_{i}"
            for v, steps, delay, d in (
                ("idle", 0, lambda: rng.uniform(0.2, 1.0), fresh),
                ("reserved", 0, lambda: rng.uniform(0.2, 1.0), fresh),
                ("inflight", every, lambda: rng.uniform(0.0, 0.5) * write_s, job),
                ("resumed", 0, lambda: rng.uniform(0.2, 1.0), job),
            ):
                out[v + how].append(sigterm_trial(args, work, gib, v + how, steps, delay, d))
                if v in ("idle", "reserved", "resumed"):
                    shutil.rmtree(d)
    print(f"  {gib:g} GiB {'SIGTERM trials':<22} done in {perf() - t0:5.1f} s", file=sys.stderr, flush=True)
    return out


FIRST_STOP_AT = ("0.2", "1", "3", "10", "ready")  # seconds after the run is entered; "ready": its buffers just sized
FIRST_STOP_TARGET = 0.7  # a process's first stop within 0.7x copy floor + raw write of the same bytes


def run_first_stop(args: argparse.Namespace, work: Path, gib: float, copy_floor_s: float | None) -> dict[str, Any]:
    """Row 8: a new job's first stop at each of ``--first-stop-at``, each a fresh process, ``--repeats`` rounds.

    Each trial is followed by a ``dd`` of the same bytes (the disk's state moves a write's cost more than anything
    else here); the copy floor comes from row 1 of the same run, or from a process of its own when row 1 was not run.
    """
    out: dict[str, Any] = {"gib": gib, "moments": list(args.first_stop_at)}
    if copy_floor_s is None:
        ns = argparse.Namespace(**{**vars(args), "gib": gib})
        floor = spawn("method", ns, work, gib, "--method", "copy_floor", label="copy_floor")
        copy_floor_s = summarize(floor)["stall_s"]
    out["copy_floor_s"] = copy_floor_s
    out["trials"] = {m: [] for m in args.first_stop_at}
    t0 = perf()
    for i in range(args.repeats):
        for m in args.first_stop_at:
            d = work / f"first_stop_{gib:g}_{m}_{i}"
            at = 0.0 if m == "ready" else float(m)
            wanted = "ready" if m == "ready" else "entered"
            t = sigterm_trial(args, work, gib, f"at_{m}", 0, lambda at=at: at, d, phase="first_stop", wanted=wanted)
            t["kill_after_enter_s"] = t["kill_wall"] - t["entered_wall"]
            t["under_way"] = under_way(t)
            t["ratio"] = t["kill_to_durable_s"] / (copy_floor_s + t["raw_after_s"])
            out["trials"][m].append(t)
            shutil.rmtree(d, ignore_errors=True)
    print(f"  {gib:g} GiB {'first-stop trials':<22} done in {perf() - t0:5.1f} s", file=sys.stderr, flush=True)
    return out


def under_way(t: dict[str, Any]) -> str:
    """What the run was doing ahead when the signal came, from the child's first sight of each stage (at a step)."""
    kill = t["kill_wall"]
    if t.get("ready_wall") is None or t["ready_wall"] > kill:
        return "buffers being sized"
    if t.get("pool_wall") is None or t["pool_wall"] > kill:
        return "pool being written"
    return "pool complete"


# ----------------------------------------------------------------- report


def _yardstick(s: dict[str, Any]) -> Any:
    """kill->durable as a ratio to the copy floor + a raw write (steady; first write of a process), when known."""

    def ratios(t: float) -> str:
        if "raw_write_s" not in s:
            return ""
        steady, first = s["copy_floor_s"] + s["raw_write_s"], s["copy_floor_s"] + s["raw_first_write_s"]
        return f"; {t / steady:.2f}x copy+raw write steady, {t / first:.2f}x copy+first raw write"

    return ratios


def fmt_s(t: float | None) -> str:
    if t is None:
        return ""
    return f"{t * 1e3:.0f} ms" if t < 1 else f"{t:.2f} s"


def verdict(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def report(facts: dict[str, Any], args: argparse.Namespace, r: dict[str, Any]) -> str:
    lines: list[str] = []
    w = lines.append
    w(f"preempt async checkpoint benchmark  {facts['date']}  host {facts['host']}")
    w(
        f"machine: {facts['cpu_count']} CPUs ({facts['cpu']}), {facts['mem_total_gib']:.0f} GiB RAM, "
        f"Linux {facts['kernel']}, scratch fs {facts['scratch_fs']}; load average {facts['load_start']:.2f} at the"
        f" start, {facts.get('load_end', float('nan')):.2f} at the end (shared cores: figures are noisy)"
    )
    w(
        f"software: Python {facts['python']}, torch {facts['torch']} ({facts['torch_threads']} threads), "
        f"numpy {facts['numpy']}, safetensors {facts['safetensors']}, preempt {facts['preempt']}"
        f" (git {facts['preempt_commit']})"
    )
    w(
        f"method: each row in a fresh process; 'first' = the first call in the process, 'stall'/'durable' = median"
        f" of the {args.repeats} later calls; GB/s = state bytes / durable time (1 GB = 1e9 B);"
        " peak = (state bytes + peak RSS above the RSS once the state was built) / state bytes"
    )
    targets: list[tuple[str, str, bool]] = []
    for size in r["sizes"]:
        st = size["state"]
        sb = st["state_bytes"]
        m = size["methods"]
        w("")
        w(
            f"== state {sb / GIB:.2f} GiB ({sb:,} B): GPT-like, {st['layers']} layers, d={st['d_model']},"
            f" vocab={st['vocab']:,}, {st['params'] / 1e6:.1f}M float32 params + AdamW moments,"
            f" {st['param_tensors'] + st['optimizer_tensors']} tensors"
        )
        hdr = f"{'row':<52}{'first':>9}{'stall':>9}{'durable':>9}{'GB/s':>7}{'peak':>7}  note"
        w(hdr)
        w("-" * (len(hdr) + 24))

        def row(label: str, d: dict[str, Any], note: str = "", sb: int = sb) -> None:
            dur = d.get("durable_s")
            gbs = f"{sb / dur / GB:.2f}" if dur else ""
            peak = f"{d['peak_x']:.2f}x" if "peak_x" in d else ""
            first = d.get("first_stall_s")
            w(f"{label:<52}{fmt_s(first):>9}{fmt_s(d['stall_s']):>9}{fmt_s(dur):>9}{gbs:>7}{peak:>7}  {note}")

        raw = m["python_write"]
        floor = m["copy_floor"]
        w("1. physical reference (same bytes)")
        row("   dd bs=16M conv=fdatasync", size["dd"], "stall = durable")
        row("   os.write 64 MiB chunks + fdatasync, touched buffer", raw, "stall = durable")
        row("   copy_ into preallocated, touched buffers", floor, "the floor of a stall")
        w("2. peers (stall = the caller is blocked; durable = until the checkpoint is on disk)")
        row("   torch.save + fsync", m["save_torch"], "")
        row("   safetensors.torch.save_file + fsync", m["save_safetensors"], "")
        d = m["dcp_save"]
        row("   DCP save, no process group", d, f"{d['file_bytes'] / sb:.3f}x bytes on disk")
        d = m["dcp_async"]
        row("   DCP async_save, default options", d, "new stager + fresh copy per call")
        d = m["dcp_async_stager"]
        row("   DCP async_save, reused DefaultStager, sync staging", d, "buffers reused")
        d = m["dcp_async_stager_bg"]
        row(
            "   DCP async_save, reused DefaultStager, async staging",
            d,
            f"returns in {fmt_s(d['returned_s'])}; stall = until staged",
        )
        w("3. preempt")
        sp = m["save_preempt"]
        row("   CheckpointManager.save_state (synchronous)", sp, "")
        pa = m["preempt_async"]
        calls = pa["calls"]
        rec_write = median([c["record_write_s"] for c in calls[1:]])
        row(
            "   PreemptibleRun(async_save=True): run.step()",
            pa,
            f"last_save.write_s {fmt_s(rec_write)}; first = first checkpoint",
        )
        w(
            f"   (entering the run: {fmt_s(pa['enter_s'])}; staging buffers allocated + touched in the background:"
            f" {fmt_s(pa['staging_prepare_s']) or 'not reported'} (run.staging_prepare_s; first seen"
            f" {fmt_s(pa['prepared_after_s'])} after entering); first checkpoint"
            f" {fmt_s(pa['first_checkpoint_after_enter_s'])} after entering)"
        )
        fresh = size.get("fresh")
        if fresh is not None:
            stalls = [x["stall_s"] for x in fresh["saves"]]
            steady = median(stalls[2:])
            first = max(stalls[:2])
            x = first / steady
            targets.append((f"{sb / GIB:.2f} GiB: a new job's first stall <= 1.2x its later", f"{x:.2f}x", x <= 1.2))
            w(
                f"   a new job (AdamW without state; entered and trained at once; checkpoint_interval=1 s): the loop's"
                f" wait at its first checkpoints {', '.join(fmt_s(x) for x in stalls)}"
                f" (at {', '.join(format(x['after_enter_s'], '.1f') for x in fresh['saves'])} s after entering;"
                f" buffers sized in {fmt_s(fresh['staging_prepare_s'])}); worst of the first two / median of the"
                f" later ones {first / steady:.2f}x"
            )
        dcp_files = ", ".join(m["dcp_save"]["files"])
        w(
            f"   (bytes on disk: preempt {pa['file_bytes']:,}, DCP {m['dcp_save']['file_bytes']:,} in {dcp_files};"
            f" torch.save {m['save_torch']['file_bytes']:,}, safetensors {m['save_safetensors']['file_bytes']:,})"
        )
        ws = sorted({k for mm in m.values() for k in mm.get("warnings", {})})
        for k in ws:
            where = [n for n, mm in m.items() if k in mm.get("warnings", {})]
            w(f"   warning recorded ({', '.join(where)}): {k}")

        if m["preempt_async"]["slowdown"] is not None:
            slowdown_lines(w, m)

        tag = f"{sb / GIB:.2f} GiB"
        dcp_stall = m["dcp_async_stager"]["stall_s"]
        dcp_bg_stall = m["dcp_async_stager_bg"]["stall_s"]
        targets.append(
            (
                f"{tag}: steady stall <= DCP async_save, reused stager",
                f"{fmt_s(pa['stall_s'])} vs {fmt_s(dcp_stall)} ({pa['stall_s'] / dcp_stall:.2f}x;"
                f" vs async staging until staged {fmt_s(dcp_bg_stall)})",
                pa["stall_s"] <= dcp_stall,
            )
        )
        x = pa["stall_s"] / floor["stall_s"]
        targets.append(
            (f"{tag}: steady stall within 1.3x the copy floor", f"{x:.2f}x ({fmt_s(floor['stall_s'])})", x <= 1.3)
        )
        x = pa["first_stall_s"] / m["save_torch"]["stall_s"]
        targets.append((f"{tag}: first stall <= 0.10x torch.save", f"{x:.3f}x", x <= 0.10))
        x = pa["durable_s"] / raw["durable_s"]
        targets.append((f"{tag}: durable within 1.1x raw write+fsync", f"{x:.2f}x", x <= 1.1))
        x = pa["durable_s"] / m["dcp_async_stager"]["durable_s"]
        targets.append((f"{tag}: durable <= DCP's (reused stager)", f"{x:.2f}x", x <= 1.0))
        x = sp["peak_x"]
        targets.append((f"{tag}: peak RSS, synchronous save <= 1.1x state", f"{x:.2f}x", x <= 1.1))
        x = pa["peak_x"]
        targets.append((f"{tag}: peak RSS, async save <= 2.1x state", f"{x:.2f}x", x <= 2.1))

    e = r.get("e2e")
    if e:
        w("")
        gib = e["gib"]
        base = [e[v]["loop_s"] for v in ("none", "none2")]
        ref = statistics.fmean(base)
        w(
            f"5. end to end, {gib:g} GiB state (GPT state checkpointed, one value of each tensor changed per step;"
            f" the work is {e['steps']} MLP steps), checkpoint_interval={e['every_s']:g} s"
        )
        gap = abs(base[0] / base[1] - 1)
        w(f"   no checkpoints: {base[0]:.2f} s and {base[1]:.2f} s (first and last run; gap {gap:.1%}: the noise)")
        floor = e["copy_floor_s"] * e["async"]["checkpoints"] / ref
        w(f"   (lower bound of any snapshot: {e['async']['checkpoints']} x the copy floor = {floor:.1%} of the loop)")
        for v in ("async", "sync"):
            d = e[v]
            over = d["loop_s"] / ref - 1
            w(
                f"   {v:<5} checkpoints: {d['loop_s']:.2f} s = {over:+.1%} vs none; {d['checkpoints']} checkpoints,"
                f" stalls {', '.join(fmt_s(s) for s in d['stalls_s'])} ({sum(d['stalls_s']) / ref:.1%} of the loop);"
                f" drain at the end {fmt_s(d['drain_s'])}"
            )
        over = e["async"]["loop_s"] / ref - 1
        targets.append((f"{gib:g} GiB: end-to-end overhead of async checkpoints <= 3%", f"{over:+.1%}", over <= 0.03))

    for s in r.get("sigterm", []):
        w("")
        gib = s["gib"]
        ref = s["ref_step_plus_save_s"]
        yard = _yardstick(s)
        w(
            f"6. SIGTERM -> durable checkpoint, {gib:g} GiB state, async_save=True: kill() to the stop's checkpoint"
            " durable (the child's clock when Preempted is raised, after the save's last fsync)"
        )
        w(
            f"   reference: one step + one synchronous save (row 3) = {fmt_s(ref)} steady,"
            f" {fmt_s(s['ref_step_plus_first_save_s'])} with the first save of a process"
        )
        if "raw_write_s" in s:
            w(
                f"   yardstick: copy floor + raw write of the bytes = {fmt_s(s['copy_floor_s'] + s['raw_write_s'])}"
                f" steady, {fmt_s(s['copy_floor_s'] + s['raw_first_write_s'])} as a process's first write"
            )
        for v, label in SIGTERM_VARIANTS:
            w(f"   {v}: {label}")
        for v, _ in SIGTERM_VARIANTS:
            ts = s[v]
            if not ts:  # --skip live
                continue
            k2d = [t["kill_to_durable_s"] for t in ts]
            k2e = [t["kill_to_exit_s"] for t in ts]
            save = [t["stop_save_s"] for t in ts if t["stop_save_s"] is not None]
            extra = ""
            if v.startswith("inflight"):
                inf = [t.get("write_in_flight_at_kill") for t in ts]
                cancelled = sum(bool(t.get("write_cancelled")) for t in ts)
                extra = f"; in flight at kill: {sum(bool(x) for x in inf)}/{len(inf)}, cancelled {cancelled}"
            same = [t["kill_to_durable_s"] / (s["copy_floor_s"] + t["raw_after_s"]) for t in ts if "raw_after_s" in t]
            if same:
                extra += (
                    f"; {median(same):.2f}x (trials {', '.join(f'{x:.2f}' for x in same)}) copy floor + a raw write"
                    " (dd, fdatasync) of the bytes right after the trial"
                )
            w(
                f"   {v:<14} kill->durable median {fmt_s(median(k2d))} ({median(k2d) / ref:.2f}x the reference;"
                f" trials {', '.join(fmt_s(x) for x in k2d)}); kill->exit {fmt_s(median(k2e))};"
                f" the stop's save {fmt_s(median(save) if save else None)}{extra}{yard(median(k2d))}"
            )
        ok = all(t["manifest_exists"] for v, _ in SIGTERM_VARIANTS for t in s[v])
        w(f"   every child exited with code 75 and its stop's manifest on disk: {ok}")

    fs = r.get("first_stop")
    if fs:
        first_stop_lines(w, fs, targets)

    w("")
    w("targets")
    for name, value, ok in targets:
        w(f"   {name:<58} {value:<44} {verdict(ok)}")
    return "\n".join(lines)


def first_stop_lines(w: Callable[[str], None], fs: dict[str, Any], targets: list[tuple[str, str, bool]]) -> None:
    """Row 8 of the table and its targets (the worst trial of each moment)."""
    floor = fs["copy_floor_s"]
    w("")
    w(
        f"8. a process's first stop, {fs['gib']:g} GiB state, PreemptibleRun(checkpoint_interval=None), a fresh process"
        " per trial: SIGTERM at a moment after the run is entered -> the stop's checkpoint durable; against the copy"
        f" floor ({fmt_s(floor)}) + a raw write (dd, fdatasync) of the same bytes right after each trial"
    )
    files = sorted({t["preempt_file"] for ts in fs["trials"].values() for t in ts})
    w(f"   the children imported preempt from {', '.join(files)}")
    w(f"   {'moment':<10}{'SIGTERM at':>11}{'->durable':>11}{'copy+raw':>10}{'ratio':>7}  under way at the signal")
    for m, ts in fs["trials"].items():
        for t in ts:
            w(
                f"   {m:<10}{t['kill_after_enter_s']:>10.2f}s{fmt_s(t['kill_to_durable_s']):>11}"
                f"{fmt_s(floor + t['raw_after_s']):>10}{t['ratio']:>6.2f}x  {t['under_way']}"
                f"; the stop's save {fmt_s(t['stop_save_s'])}, exit {fmt_s(t['kill_to_exit_s'])} after the signal"
            )
        worst = max(t["ratio"] for t in ts)
        at = "at buffers ready" if m == "ready" else f"{m} s in"
        targets.append(
            (
                f"{fs['gib']:g} GiB: first stop {at} <= {FIRST_STOP_TARGET}x copy+raw",
                f"{worst:.2f}x (worst of {len(ts)}; {fmt_s(max(t['kill_to_durable_s'] for t in ts))})",
                worst <= FIRST_STOP_TARGET,
            )
        )
    ok = all(t["manifest_exists"] and t["exit"] == 75 for ts in fs["trials"].values() for t in ts)
    w(f"   every child exited with code 75 and its stop's manifest on disk: {ok}")


def slowdown_lines(w: Callable[[str], None], m: dict[str, Any]) -> None:
    """Row 4 of the table."""
    w("4. loop slowdown: a small MLP + AdamW step, ms per step (median / mean), with no write vs one in flight")
    for key, label in (("preempt_async", "preempt background write"), ("dcp_async_stager", "DCP async_save, reused")):
        s = m[key]["slowdown"]
        if not s["flight_steps"]:
            w(f"   {label}: the write ended within one step; nothing measured")
            continue
        rm = s["flight_step_median_s"] / s["idle_step_median_s"]
        ra = s["flight_step_mean_s"] / s["idle_step_mean_s"]
        w(
            f"   {label:<26} idle {s['idle_step_median_s'] * 1e3:5.1f} / {s['idle_step_mean_s'] * 1e3:5.1f};"
            f" in flight {s['flight_step_median_s'] * 1e3:5.1f} / {s['flight_step_mean_s'] * 1e3:5.1f}"
            f"  => {rm:.2f}x / {ra:.2f}x  ({s['flight_steps']} steps in flight; the write took"
            f" {fmt_s(median(s['write_while_training_s']))} while training, {fmt_s(m[key]['durable_s'])} alone)"
        )


# ------------------------------------------------------------------- main


def git_commit() -> str:
    """The commit of the checkout preempt is imported from, "+changes" when its preempt/ differs: the code measured."""
    try:
        import preempt

        root = Path(preempt.__file__).resolve().parent.parent  # PYTHONPATH may point at another checkout
    except ImportError:
        root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "preempt"], cwd=root, capture_output=True, text=True)
    except OSError:
        return "?"
    return (head.stdout.strip() or "?") + ("+changes" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gib", type=float, nargs="+", help="state sizes in GiB (params + 2 AdamW moments); default 1.5 3")
    ap.add_argument("--repeats", type=int, help="timed calls per method after 1 warm-up; default 3 (--quick: 1)")
    ap.add_argument("--quick", action="store_true", help="0.25 GiB, 1 timed call, 12 s end-to-end runs (~3 min)")
    ap.add_argument("--dir", default=str(DEFAULT_DIR), help=f"scratch directory (default {DEFAULT_DIR})")
    ap.add_argument("--json", help="also write every timing to this JSON file")
    ap.add_argument("--e2e-gib", type=float, help="state size of rows 4-6 (default: the smallest --gib)")
    ap.add_argument("--e2e-seconds", type=float, help="work per end-to-end run, seconds (default 30; --quick 12)")
    ap.add_argument("--e2e-every", type=float, help="checkpoint_interval of row 5, seconds (default 10; --quick 3)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process (default 1; 0 = torch's own, one per core; see bench/README.md)",
    )
    ap.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=("e2e", "sigterm", "live", "fresh", "first_stop"),
        help="leave out rows 5 and/or 6, row 6's +live trials (half its time), row 3's new job, or row 8",
    )
    ap.add_argument(
        "--rows",
        choices=("all", "first_stop"),
        default="all",
        help="first_stop: row 8 alone (a process's first stop, with its own copy floor), at --e2e-gib (~2 min a round)",
    )
    ap.add_argument(
        "--first-stop-at",
        nargs="+",
        default=list(FIRST_STOP_AT),
        help=f"row 8's moments: seconds after the run is entered, or 'ready' (default {' '.join(FIRST_STOP_AT)})",
    )
    ap.add_argument("--only", choices=CHILD_PHASES, help=argparse.SUPPRESS)
    ap.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--every", type=float, default=10.0, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--save-dir", help=argparse.SUPPRESS)
    ap.add_argument("--slowdown", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.only:
        args.gib = args.gib[0]
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        phases = {
            "method": phase_method,
            "e2e": phase_e2e,
            "sigterm": phase_sigterm,
            "fresh": phase_fresh,
            "first_stop": phase_first_stop,
        }
        res = phases[args.only](args, Path(args.dir))
        Path(args.result).write_text(json.dumps(res))
        return

    args.gib = args.gib or ([0.25] if args.quick else [1.5, 3.0])
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.e2e_seconds = args.e2e_seconds or (12.0 if args.quick else 30.0)
    args.e2e_every = args.e2e_every or (3.0 if args.quick else 10.0)
    if min(args.gib) <= 0 or args.repeats < 1:
        ap.error("--gib must be > 0 and --repeats >= 1")
    for m in args.first_stop_at:
        if m != "ready" and not re.fullmatch(r"[0-9]+(\.[0-9]+)?", m):
            ap.error(f"--first-stop-at: {m!r} is neither seconds (e.g. 0.2, 3) nor 'ready'")
    e2e_gib = args.e2e_gib or min(args.gib)
    scratch = Path(args.dir).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    biggest = max(describe_state(g)["state_bytes"] for g in [*args.gib, e2e_gib])
    free = shutil.disk_usage(scratch).free
    if free < 4 * biggest:
        raise SystemExit(
            f"bench: {scratch} has {free / GIB:.1f} GiB free; this run needs at least 4x the largest state,"
            f" {4 * biggest / GIB:.1f} GiB. Free space, pass a smaller --gib or another --dir."
        )
    facts = machine_facts(scratch)
    facts["load_start"] = os.getloadavg()[0]
    facts["preempt_commit"] = git_commit()
    if args.threads:
        facts["torch_threads"] = args.threads  # what the children run with
    work = Path(tempfile.mkdtemp(prefix="bench-async-", dir=scratch))
    print(f"bench: sizes {args.gib} GiB, scratch {work}", file=sys.stderr, flush=True)
    results: dict[str, Any] = {"sizes": []}
    t0 = perf()
    try:
        if args.rows == "first_stop":
            results["first_stop"] = run_first_stop(args, work, e2e_gib, None)
        for gib in args.gib if args.rows == "all" else ():
            results["sizes"].append(run_size(args, work, gib, slowdown=gib == e2e_gib))
            if "fresh" not in args.skip:  # a new job's first checkpoints, due by the clock every second
                ns = argparse.Namespace(**{**vars(args), "gib": gib})
                results["sizes"][-1]["fresh"] = spawn("fresh", ns, work, gib, "--every", "1.0", label="fresh process")
        at = next((s for s in results["sizes"] if s["state"] == describe_state(e2e_gib)), None)
        if at is None and args.rows == "all":
            at = run_size(args, work, e2e_gib, slowdown=True)
            results["sizes"].append(at)
        if at is not None:
            m = at["methods"]
            step_s = m["preempt_async"]["slowdown"]["idle_step_median_s"]
        if at is not None and "first_stop" not in args.skip:  # a regression of a process's first stop shows here
            results["first_stop"] = run_first_stop(args, work, e2e_gib, m["copy_floor"]["stall_s"])
        if at is not None and "e2e" not in args.skip:
            results["e2e"] = run_e2e(args, work, e2e_gib, step_s)
            results["e2e"]["copy_floor_s"] = m["copy_floor"]["stall_s"]
        if at is not None and "sigterm" not in args.skip:
            results["sigterm"] = []
            for size in results["sizes"]:  # row 6 at every size (issue 16), the step time of the e2e size
                m = size["methods"]
                s = run_sigterm(args, work, size["gib"], step_s, m["preempt_async"]["durable_s"])
                s["ref_step_plus_save_s"] = step_s + m["save_preempt"]["stall_s"]
                s["ref_step_plus_first_save_s"] = step_s + m["save_preempt"]["first_stall_s"]
                # issue 16's yardstick: the copy floor + a raw write of the same bytes, steady and a process's first
                raw = m["python_write"]
                s["raw_write_s"], s["raw_first_write_s"] = raw["stall_s"], raw["first_stall_s"]
                s["copy_floor_s"] = m["copy_floor"]["stall_s"]
                results["sigterm"].append(s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = perf() - t0
    facts["load_end"] = os.getloadavg()[0]
    text = report(facts, args, results)
    print(text)
    print(f"\ntotal wall time {total:.0f} s", flush=True)
    if args.json:
        out = {"facts": facts, "args": vars(args), "results": results, "total_wall_s": total, "table": text}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"results written to {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
