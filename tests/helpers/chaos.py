"""A seeded chaos campaign: one training job run again and again until it completes, faults drawn from a schedule
that is a pure function of the seed, and the oracles checked after every process and at the end of every run.

The parts, in the order a reader needs them:

- :func:`fault_at` / :func:`schedule`: the i-th fault of a seed (a pure function: no clock, no disk, no process);
- :class:`Job`: the training a campaign runs (a script of the suite and its arguments);
- :class:`Campaign`: the loop "start a process with the next fault armed, inject it, wait, check the oracles, repeat
  until the job completes; start the job afresh while faults remain", and :class:`Result`, its figures.

Faults reach their moment through the script's fault points (``--hold_at``, ``--signal_at``, ``--wait_file_at`` of
``tests/scripts/train.py``, ``--chaos_*`` of ``tests/helpers/chaos_train.py``), never through a wall-clock sleep: a
seed replays the same faults at the same points. What it cannot replay exactly is which background write was in
flight when a fault came (the machine's speed decides that), so the oracles hold for every such outcome.

The oracles, after each process:

1. its exit status is one the fault allows, within a generous time (a hang is a failure, with the stacks dumped by
   SIGQUIT first: ``chaos_train.py`` registers ``faulthandler`` for it);
2. it resumed from the newest checkpoint that was whole and undamaged when it started (none: it started fresh), and
   said so (the event ``quarantined``) for every damaged one newer than that;
3. every kept checkpoint but those a fault damaged is valid, verifies, and equals, tensor for tensor, the live state
   an uninterrupted run recorded at its step (``helpers.kept``);
4. the newest checkpoint it logged as durable (the event ``checkpoint``) is there;

and at the end of each run of the job: the final state is ``torch.equal`` to the uninterrupted run's, and
``preempt report`` accounts for every second of the processes' wall time.

Imports no pytest: ``bench/chaos.py`` runs a campaign outside the suite.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from preempt import CheckpointManager
from preempt.checkpoint import commit

from .processes import PREEMPTED, ROOT, TESTS, Spawned

CHAOS_TRAIN = TESTS / "helpers" / "chaos_train.py"
TRAIN_RECORDED = TESTS / "scripts" / "train_recorded.py"
RECORD = "step_{step:09d}.safetensors"  # helpers.kept's records of the live state

# The stages of the commit before its rename: a write that fails there leaves the previous checkpoint the newest.
BEFORE_RENAME = commit.STAGES[: commit.STAGES.index("before_rename") + 1]
STAGES = tuple(s for s in commit.STAGES if s != "after_replace")  # after_replace: only when a step is saved twice

# Fault classes. "Between" faults act on the save_dir while no process runs; the others are armed in a process.
CLASSES = (
    "sigterm",  # SIGTERM inside a step, at a commit stage, right after a save, at an epoch's end, during a restore
    "sigkill",  # SIGKILL at the same points
    "kill_stop_save",  # SIGTERM, then SIGKILL inside the stop's own save (the grace ran out)
    "ctrl_c_twice",  # SIGINT twice, back to back
    "second_process",  # a second process on the same save_dir, while the first trains or while it exits
    "io_error",  # EIO at a commit stage of a periodic save, then SIGTERM
    "io_error_stop",  # EIO at a commit stage of the stop's own save
    "disk_full",  # the save_dir's filesystem filled during the run, then SIGTERM; freed after the process
    "flip_byte",  # one byte of a random file of a random kept checkpoint flipped, between processes
    "delete_newest",  # the newest checkpoint deleted, between processes
)
BETWEEN = frozenset({"flip_byte", "delete_newest", "delete_local"})  # delete_local: the mirror's job
# Where a process may be signalled (tests/scripts/train.py's points): "load" is a restore, "saved" just after a
# run.step() that took a checkpoint.
SIGNAL_POINTS = ("step", *STAGES, "saved", "epoch_end", "load")
KILLED = -signal.SIGKILL


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault of a schedule. ``point``/``n``: a fault point of the script and its count in the process (from 1);
    ``step``: the process's own step (from 1) where it holds; ``pick``: what a between fault picks (checkpoint,
    file, byte), as numbers reduced modulo what is there; ``variant``: a class's sub-kind."""

    index: int
    kind: str
    point: str = ""
    n: int = 0
    step: int = 0
    pick: tuple[int, ...] = ()
    variant: str = ""

    def describe(self) -> str:
        parts = [f"#{self.index} {self.kind}"]
        if self.variant:
            parts.append(self.variant)
        if self.point:
            parts.append(f"at {self.point}:{self.n}")
        if self.step:
            parts.append(f"step {self.step}")
        return " ".join(parts)


def fault_at(seed: int, index: int, classes: Sequence[str] = CLASSES) -> Fault:
    """The ``index``-th fault of ``seed``'s schedule over ``classes``: a pure function of its arguments."""
    rng = random.Random(f"preempt-chaos:{seed}:{index}")
    kind = rng.choice(list(classes))
    step = rng.randint(1, 12)
    if kind in ("sigterm", "sigkill"):
        points = SIGNAL_POINTS if kind == "sigkill" else tuple(p for p in SIGNAL_POINTS if p != "step")
        if kind == "sigterm" and rng.random() < 0.4:
            return Fault(index, kind, step=step, variant="in_step")
        point = rng.choice(points)
        n = {"step": step, "epoch_end": 1, "load": rng.randint(1, 2)}.get(point, rng.randint(1, 3))
        return Fault(index, kind, point=point, n=n)
    if kind == "kill_stop_save":
        return Fault(index, kind, point=rng.choice(STAGES), n=1, step=step)
    if kind == "io_error":
        return Fault(index, kind, point=rng.choice(BEFORE_RENAME), n=rng.randint(1, 3), step=16)
    if kind == "io_error_stop":
        return Fault(index, kind, point=rng.choice(BEFORE_RENAME), n=1, step=step)
    if kind == "second_process":
        return Fault(index, kind, step=step, variant=rng.choice(("while_training", "while_exiting")))
    if kind == "disk_full":
        return Fault(index, kind, step=rng.randint(1, 8), n=6)
    if kind == "flip_byte":
        return Fault(index, kind, pick=(rng.randrange(1 << 30), rng.randrange(1 << 30), rng.randrange(1 << 30)))
    if kind == "ctrl_c_twice":
        return Fault(index, kind, step=step)
    return Fault(index, kind)  # delete_newest


def schedule(seed: int, count: int, classes: Sequence[str] = CLASSES) -> list[Fault]:
    """The first ``count`` faults of ``seed``'s schedule (a fault that cannot fire where it comes is skipped by the
    campaign, which then takes the next)."""
    return [fault_at(seed, i, classes) for i in range(count)]


@dataclasses.dataclass(frozen=True)
class Job:
    """A training job: ``python SCRIPT --save_dir DIR ARGS [--final_out FILE]`` of ``total_steps`` steps."""

    name: str
    args: tuple[str, ...]
    total_steps: int
    timeout_s: float = 180.0  # one process, however slow the machine: beyond this it hangs

    @property
    def keep_last(self) -> int:
        return int(self.args[self.args.index("--keep_last") + 1]) if "--keep_last" in self.args else 2


# The quick-start loop: augmenting DataLoader workers, checkpoints every 4 steps in the background (async_save, the
# default), two kept; 48 steps of 16 samples.
QUICKSTART = Job(
    "quickstart",
    ("--epochs", "3", "--samples", "256", "--num_workers", "2", "--augment", "--every_steps", "4", "--keep_last", "2"),
    48,
)
# A LoRA-style fine-tuning: a frozen base (~1.1 MiB) with adapters inside it, the base carried from checkpoint to
# checkpoint (hard links, carry_unchanged's default) instead of written again; the same loader, saves and length.
LORA = Job("lora", ("--lora", "--width", "512", *QUICKSTART.args), 48)
JOBS = {job.name: job for job in (QUICKSTART, LORA)}


@dataclasses.dataclass
class Proc:
    """One process of a campaign: the fault armed in it, whether it fired, its exit status, time and events."""

    fault: Fault | None
    fired: bool
    rc: int
    wall_s: float
    events: list[dict[str, Any]]
    output: str
    role: str = "job"  # "job", or "second": the process a second_process fault started beside the job's
    before: tuple[str, ...] = ()  # the classes of the faults done to the save_dir before it started

    def of(self, kind: str, **fields: Any) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind and all(e.get(k) == v for k, v in fields.items())]

    @property
    def entered_step(self) -> int | None:
        entered = self.of("entered")
        return entered[0]["step"] if entered else None


class OracleFailure(AssertionError):
    """An oracle did not hold: the message names the seed, the fault and what the oracle saw."""


@dataclasses.dataclass
class Result:
    """A campaign's figures."""

    seed: int
    job: str
    injected: Counter = dataclasses.field(default_factory=Counter)
    survived: Counter = dataclasses.field(default_factory=Counter)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # class -> why it was left out
    not_fired: int = 0  # faults drawn that could not fire where they came (the next was taken)
    processes: int = 0
    runs: int = 0  # times the job ran to completion
    steps_run: int = 0
    steps_recomputed: int = 0
    # the steps a process made that the next had to make again, by what ended it (its fault's class; a fault done
    # to the save_dir before the next started, when the next resumed earlier than where it ended: that class too)
    recomputed_by: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    report_lost_steps: int = 0
    reported: int = 0  # runs whose accounting preempt report was asked for (their history whole)
    wall_s: float = 0.0  # the processes' wall time, all runs
    clean_wall_s: float = 0.0  # one uninterrupted process of the job, same machine
    productive_s: float = 0.0  # preempt report's, all runs
    report_wall_s: float = 0.0
    failure: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)  # what a lenient oracle saw and let pass

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def time_lost_s(self) -> float:
        return self.wall_s - self.runs * self.clean_wall_s

    @property
    def goodput(self) -> float:
        return self.productive_s / self.report_wall_s if self.report_wall_s else 0.0

    def table(self) -> str:
        rows = [f"{'fault class':<16} {'injected':>8} {'survived':>8}"]
        for kind in [*CLASSES, *sorted(set(self.injected) - set(CLASSES))]:
            if self.injected[kind] or kind in self.skipped:
                note = f"  (left out: {self.skipped[kind]})" if kind in self.skipped else ""
                rows.append(f"{kind:<16} {self.injected[kind]:>8} {self.survived[kind]:>8}{note}")
        rows.append(f"{'all':<16} {sum(self.injected.values()):>8} {sum(self.survived.values()):>8}")
        rows += ["", "steps a process made that the next made again, by what ended it (processes: mean, max):"]
        for key, lost in sorted(self.recomputed_by.items()):
            rows.append(f"  {key:<34} {len(lost):>4}: {sum(lost) / len(lost):5.1f}, {max(lost):>3}")
        rows += [
            "",
            f"seed {self.seed}, job {self.job}: {self.runs} runs to completion, {self.processes} processes,"
            f" {self.not_fired} drawn faults could not fire where they came (the next was taken)",
            f"steps run {self.steps_run}, {self.steps_recomputed} of them recomputed"
            f" (preempt report, over the {self.reported} runs whose history is whole: {self.report_lost_steps} lost)",
            f"wall {self.wall_s:.1f} s in processes; an uninterrupted process {self.clean_wall_s:.2f} s;"
            f" time lost {self.time_lost_s:.1f} s; goodput (preempt report) {self.goodput:.3f}"
            f" over {self.report_wall_s:.1f} s of processes' wall time",
            *(f"note: {n}" for n in self.notes),
            "every oracle held" if self.ok else f"FAILED: {self.failure}",
        ]
        return "\n".join(rows)


def mount_tmpfs(where: Path, size_mb: int) -> str | None:
    """Mounts a fresh tmpfs at ``where``; None when done, else why it could not (needs root / CAP_SYS_ADMIN)."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)], capture_output=True, text=True
        )
    except OSError as e:
        return f"cannot run mount: {e}"
    return None if r.returncode == 0 else f"cannot mount a tmpfs to fill: {r.stderr.strip() or r.returncode}"


def fill(fs: Path) -> Path:
    """Writes a file on ``fs`` until the filesystem is full (ENOSPC)."""
    filler = fs / "filler"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(chunk[:size])
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
    return filler


def _report(save_dir: Path) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-m", "preempt", "report", "--json", str(save_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    if r.returncode != 0:
        raise OracleFailure(f"preempt report --json {save_dir}: exit {r.returncode}: {r.stderr}")
    return json.loads(r.stdout)


class Campaign:
    """Runs ``job`` under ``faults`` faults of ``seed``'s schedule in ``work`` (a fresh directory)."""

    live_records = True  # the uninterrupted run records the live state of each step (train_recorded.py)

    def __init__(
        self,
        job: Job,
        seed: int,
        faults: int,
        work: Path,
        *,
        classes: Sequence[str] = CLASSES,
        log: Callable[[str], None] = print,
        disk_mb: int = 32,
        strict_report: bool = True,
    ) -> None:
        self.job, self.seed, self.faults, self.work, self.log = job, seed, faults, Path(work), log
        self.result = Result(seed, job.name)
        self.classes = list(classes)
        self.disk_mb = disk_mb
        # preempt report's lost steps against the steps the processes recomputed: an oracle (True), or a note
        self.strict_report = strict_report
        self.fs: Path | None = None
        self.save_dir = self.work / "run"
        self.final = self.work / "final.safetensors"
        self.reference = self.work / "reference"
        # the checkpoints a fault damaged that are still in save_dir: name -> its directory's inode (a checkpoint
        # written later under the same name, once the damaged one was quarantined, is another one)
        self.damaged: dict[str, int] = {}
        self.run_procs: list[Proc] = []  # the processes of the run in progress
        self.env: dict[str, str] | None = None  # added to the processes' environment
        self.history_whole = True  # history.jsonl holds every process of the run in progress
        self.fault: Fault | None = None  # the fault of the process whose oracles are being checked
        self.fault_fired = False
        self.between: list[Fault] = []  # faults done to the save_dir since the last process started
        self.between_checked: list[Fault] = []  # those, judged by the oracles of the process being checked

    # ------------------------------------------------------------------------------------------------ the loop

    def run(self) -> Result:
        self.work.mkdir(parents=True, exist_ok=True)
        if "disk_full" in self.classes:
            why = mount_tmpfs(self.work / "fs", self.disk_mb)
            if why is None:
                self.fs = self.work / "fs"
                self.save_dir = self.fs / "run"
            else:
                self.classes.remove("disk_full")
                self.result.skipped["disk_full"] = why
        self.log(f"chaos: seed {self.seed}, job {self.job.name}, {self.faults} faults over {', '.join(self.classes)}")
        for kind, why in self.result.skipped.items():
            self.log(f"chaos: {kind} left out: {why}")
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # the children get Ctrl+C handled
        try:
            self._make_reference()
            self._new_run()
            index = 0
            while sum(self.result.injected.values()) < self.faults:
                fault = self.fault_at(index)
                index += 1
                self.fault = fault
                if fault.kind in BETWEEN:
                    if self._between(fault):
                        self._count(fault)
                        self.between.append(fault)
                    else:
                        self.result.not_fired += 1
                    continue
                if not self._process(fault).fired:
                    self.result.not_fired += 1
            while self.run_procs:  # the run in progress, to its end, without faults
                self._process(None)
        except OracleFailure as e:
            self.result.failure = str(e)
            for fault in self.blamed:  # the faults whose oracles failed did not survive
                self.result.survived[fault.kind] -= 1
        finally:
            signal.signal(signal.SIGINT, previous)
            if self.fs is not None:
                subprocess.run(["umount", "-l", str(self.fs)], check=False, capture_output=True)
        return self.result

    def fault_at(self, index: int) -> Fault:
        return fault_at(self.seed, index, self.classes)

    def _count(self, fault: Fault) -> None:
        self.result.injected[fault.kind] += 1
        self.result.survived[fault.kind] += 1  # taken back by run() if its oracles fail
        self.log(f"chaos: {fault.describe()}")

    @property
    def blamed(self) -> list[Fault]:
        """The faults the oracles being checked judge: the process's own (where it fired) and those done to the
        save_dir before it started."""
        own = [self.fault] if self.fault is not None and self.fault_fired else []
        return [*self.between_checked, *own]

    def fail(self, what: str, proc: Proc | None = None) -> None:
        faults = self.blamed
        where = ", after ".join(f.describe() for f in reversed(faults)) if faults else "no fault (the run's end)"
        text = f"seed {self.seed}, {where}: {what}"
        if proc is not None:
            text += f"\n--- its output (exit {proc.rc}):\n" + "\n".join(proc.output.splitlines()[-60:])
        raise OracleFailure(text)

    # ------------------------------------------------------------------------------------------------ processes

    def _cmd(self, script: Path, extra: Sequence[str] = ()) -> list[str]:
        return [
            sys.executable,
            str(script),
            "--save_dir",
            str(self.save_dir),
            *self._job_args(),
            *extra,
            "--final_out",
            str(self.final),
        ]

    def _make_reference(self) -> None:
        """The uninterrupted run: its final state and the live state of each of its steps; then one more
        uninterrupted process, warm, for the time an undisturbed run takes."""
        ref = self.reference
        shutil.rmtree(ref, ignore_errors=True)
        cmd = [sys.executable, str(TRAIN_RECORDED), "--live_dir", str(ref / "live"), "--save_dir", str(ref / "run")]
        p = Spawned([*cmd, *self.job.args, "--final_out", str(ref / "final.safetensors")], self.env)
        rc = self._finish(p)
        if rc != 0:
            raise OracleFailure(f"the uninterrupted run failed (exit {rc}):\n{p.output}")
        walls = []
        for _ in range(2):  # the fastest of two: the first may start the second fork server (tests/forkserver.py)
            clean = ref / "clean"
            t0 = time.monotonic()
            p = Spawned([sys.executable, str(CHAOS_TRAIN), "--save_dir", str(clean), *self.job.args], self.env)
            if self._finish(p) != 0:
                raise OracleFailure(f"the uninterrupted timing run failed:\n{p.output}")
            walls.append(time.monotonic() - t0)
            shutil.rmtree(clean, ignore_errors=True)
        self.result.clean_wall_s = min(walls)

    def _finish(self, p: Spawned) -> int:
        """Waits for ``p`` at most the job's timeout; a hang dumps its stacks (SIGQUIT) and fails."""
        try:
            p.proc.wait(self.job.timeout_s)
        except subprocess.TimeoutExpired:
            with_stacks = self._dump_and_kill(p)
            self.fail(f"the process hung (still running after {self.job.timeout_s:g} s):\n{with_stacks}")
        return p.finish(30)  # ended: collects the rest of its output

    def _wait_event(self, p: Spawned, kind: str, **fields: Any) -> dict[str, Any] | None:
        try:
            return p.wait_event(kind, timeout=self.job.timeout_s, **fields)
        except TimeoutError:
            with_stacks = self._dump_and_kill(p)
            self.fail(f"no event {kind} {fields} within {self.job.timeout_s:g} s (a hang):\n{with_stacks}")
        return None

    def _dump_and_kill(self, p: Spawned) -> str:
        try:
            os.kill(p.proc.pid, signal.SIGQUIT)
            time.sleep(3)
            p.proc.kill()
            p.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        return p.output

    def _start(self, extra: Sequence[str]) -> tuple[Spawned, float]:
        return Spawned(self._cmd(CHAOS_TRAIN, extra), self.env), time.monotonic()

    def _before_stop(self, fault: Fault) -> None:
        """What a job does to the world just before its process is stopped (the mirror's: its server paused)."""

    def _after_process(self, fault: Fault | None) -> None:
        """What a job puts back once its process has exited."""

    def _job_args(self) -> list[str]:
        """The job's arguments for a process of the run in progress."""
        return list(self.job.args)

    def _process(self, fault: Fault | None) -> Proc:
        """Starts the job's next process with ``fault`` armed, injects it, waits, and checks the oracles."""
        expected = self._expected_resume()
        self.fault, self.fault_fired = fault, False
        self.between_checked, self.between = self.between, []
        kind = fault.kind if fault else None
        extra: list[str] = []
        others: list[Proc] = []
        if fault is None:
            pass
        elif kind in ("sigterm", "sigkill") and fault.variant != "in_step":
            sig = "TERM" if kind == "sigterm" else "KILL"
            extra = ["--signal_at", f"{fault.point}:{fault.n}:{sig}"]
        elif kind == "kill_stop_save":
            extra = ["--hold_at", f"step:{fault.step}", "--chaos_stop_save", f"{fault.point}:KILL"]
        elif kind == "io_error_stop":
            extra = ["--hold_at", f"step:{fault.step}", "--chaos_stop_save", f"{fault.point}:EIO"]
        elif kind == "io_error":
            extra = ["--hold_at", f"step:{fault.step}", "--chaos_io_error", f"{fault.point}:{fault.n}"]
        elif kind == "disk_full":
            gate = self.work / "disk_gate"
            gate.unlink(missing_ok=True)
            extra = ["--wait_file_at", f"step:{fault.step}:{gate}", "--hold_at", f"step:{fault.step + fault.n}"]
        else:  # sigterm in_step, ctrl_c_twice, second_process
            extra = ["--hold_at", f"step:{fault.step}"]
        p, t0 = self._start(extra)
        fired = False
        filler: Path | None = None
        try:
            if fault is None or (kind in ("sigterm", "sigkill") and fault.variant != "in_step"):
                pass
            elif kind == "disk_full":
                if self._wait_event(p, "waiting", point="step", n=fault.step):
                    assert self.fs is not None
                    filler = fill(self.fs)
                    fired = True
                    # history.jsonl lives on the full disk too: the lines it could not take are not there for
                    # preempt report to account (a process's start or stop, its steps), so its accounting is not judged
                    self.history_whole = False
                    (self.work / "disk_gate").touch()
                    if self._wait_event(p, "holding", point="step", n=fault.step + fault.n):
                        p.signal(signal.SIGTERM)
            elif self._wait_event(p, "holding", point="step", n=fault.step):
                fired = kind not in ("io_error",)
                if kind == "ctrl_c_twice":
                    p.signal(signal.SIGINT)
                    p.signal(signal.SIGINT)
                elif kind == "second_process":
                    self.fault_fired = True
                    others = self._second(fault, p)
                    if fault.variant == "while_training":
                        p.signal(signal.SIGTERM)
                else:
                    self._before_stop(fault)
                    p.signal(signal.SIGTERM)
            rc = self._finish(p)
        finally:
            if filler is not None:
                filler.unlink()
            self._after_process(fault)
        wall = time.monotonic() - t0
        proc = Proc(
            fault, fired, rc, wall, list(p.events), p.output, before=tuple(f.kind for f in self.between_checked)
        )
        if kind in ("sigterm", "sigkill") and fault is not None and fault.variant != "in_step":
            proc.fired = bool(proc.of("signal_at"))
        elif kind in ("io_error", "kill_stop_save", "io_error_stop"):
            proc.fired = bool(proc.of("chaos"))
        if fault is not None and proc.fired:
            self._count(fault)
            self.fault_fired = True
        self._account(proc)
        self._check_process(proc, expected)
        for other in others:  # a second process that got the lock after the first had left: a process of the run
            if other.role == "job":
                left, came = proc.of("exit"), other.of("start") + other.of("resume")
                if not left or not came or came[0]["t"] < left[-1]["t"]:
                    self.fail(f"a second process started ({came}) before the first left its run ({left})", other)
                self._account(other)
                self._check_process(other, self._stop_step(proc))
        if self.run_procs and (self.run_procs[-1].rc == 0 or self.run_procs[-1].of("complete")):
            self._end_run()  # (complete with another status: a launcher stopped as its ranks were finishing)
        return proc

    def _second(self, fault: Fault, first: Spawned) -> list[Proc]:
        """A second process on the save_dir: while the first trains (held in its step), it must be refused at once
        (exit 1, naming the first's pid); while the first exits after a SIGTERM, it is either refused or, once the
        first has left, the run's next process (held in its second step and stopped there)."""
        if fault.variant == "while_exiting":
            first.signal(signal.SIGTERM)
        second, t0 = self._start(["--hold_at", "step:2"])
        role = "second"
        if fault.variant == "while_exiting":
            held = self._wait_event(second, "holding", point="step", n=2)
            if held is not None:
                role = "job"
                second.signal(signal.SIGTERM)
        rc = self._finish(second)
        proc = Proc(fault, True, rc, time.monotonic() - t0, list(second.events), second.output, role)
        if role == "second":
            refused = f"is in use by pid {first.proc.pid} on host "
            if rc != 1 or refused not in second.output or proc.of("step"):
                self.fail(f"the second process was not refused cleanly (exit 1, {refused!r}, no step)", proc)
            self.result.processes += 1
            self.result.wall_s += proc.wall_s
        return [proc]

    # ------------------------------------------------------------------------------------------------ faults between

    def _between(self, fault: Fault) -> bool:
        infos = [c for c in CheckpointManager(self.save_dir, owner=False).list() if c.status == "valid"]
        infos = [c for c in infos if not self._is_damaged(c.path)]
        if not self.run_procs or not infos:
            return False
        if fault.kind == "delete_newest":
            newest = max(infos, key=lambda c: c.step)
            shutil.rmtree(newest.path)
            self.log(f"chaos:   deleted {newest.name}")
            return True
        ckpt = sorted(infos, key=lambda c: c.step)[fault.pick[0] % len(infos)]
        files = sorted(f for f in ckpt.path.iterdir() if f.is_file() and f.stat().st_size > 0)
        if not files:
            return False
        path = files[fault.pick[1] % len(files)]
        at = fault.pick[2] % path.stat().st_size
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ (1 << (fault.pick[2] % 8))]))
        inode = path.stat()
        # a file shared by several checkpoints (hard links) damages each of them
        for c in infos:
            for other in c.path.iterdir():
                st = other.stat()
                if (st.st_ino, st.st_dev) == (inode.st_ino, inode.st_dev):
                    self.damaged[c.name] = c.path.stat().st_ino
        self.log(f"chaos:   flipped a bit of byte {at} of {ckpt.name}/{path.name}")
        return True

    # ------------------------------------------------------------------------------------------------ oracles

    def _is_damaged(self, path: Path) -> bool:
        try:
            return self.damaged.get(path.name) == path.stat().st_ino
        except OSError:
            return False

    def _expected_resume(self) -> int | None:
        """The step the next process must resume from: the newest whole checkpoint no fault damaged (or one a kill
        left set aside mid-replacement, ``.replaced-step_N-``, which the next start puts back); None: fresh."""
        if not self.save_dir.is_dir():
            return None
        steps = [
            c.step
            for c in CheckpointManager(self.save_dir, owner=False).list()
            if c.status == "valid" and not self._is_damaged(c.path)
        ]
        steps += [int(m.group(1)) for e in os.listdir(self.save_dir) if (m := re.match(r"\.replaced-step_(\d+)-", e))]
        return max(steps, default=None)

    def _stop_step(self, proc: Proc) -> int | None:
        stops = proc.of("stop")
        return stops[-1]["step"] if stops else self._expected_resume()

    def _allowed(self, proc: Proc) -> set[int] | None:
        fault = proc.fault
        if fault is None:
            return {0}
        if not proc.fired:  # its point never came: the job's end, or the SIGTERM sent anyway
            return {0, PREEMPTED}
        kind = fault.kind
        return {
            # at a point of the final save, after the loop: the run may complete
            "sigterm": {PREEMPTED} if fault.variant == "in_step" else {PREEMPTED, 0},
            "sigkill": {KILLED},
            "kill_stop_save": {KILLED},
            # the second Ctrl+C, outside a save, raises KeyboardInterrupt; inside the stop's save it waits for it
            "ctrl_c_twice": {PREEMPTED, 1, 130, -signal.SIGINT},
            "second_process": {PREEMPTED},
            # the periodic write fails and training goes on (a stop later, or the end); the n-th write was the
            # stop's own (74) or the final one (1)
            "io_error": {PREEMPTED, 0, 1, 74},
            # the stop's save fails: 74 naming the last good one; a background write in flight failed instead: 75
            "io_error_stop": {74, PREEMPTED},
            # the stop's save fails for want of room (74) or finds room (75); the end reached on a full disk (1)
            "disk_full": {PREEMPTED, 74, 1, 0},
            # the stop waits for the mirror at most mirror_deadline, then exits as usual
            "pause_server": {PREEMPTED},
        }[kind]

    def _check_process(self, proc: Proc, expected: int | None) -> None:
        allowed = self._allowed(proc)
        if allowed is not None and proc.rc not in allowed:
            self.fail(f"exit {proc.rc}, expected one of {sorted(allowed)}", proc)
        if proc.rc in (1, 74) and proc.fault is not None and proc.fault.kind == "io_error" and proc.fired:
            failed = proc.of("checkpoint_failed")
            why = failed[-1].get("reason") if failed else None
            if (proc.rc, why) not in ((1, "final"), (74, "preempt")):
                self.fail(
                    f"exit {proc.rc} after a failed write ({failed}): only the final or the stop's may end it", proc
                )
        started = proc.entered_step
        if started is not None:
            if started != (expected or 0):
                self.fail(f"resumed from step {started}, expected {expected} (the newest whole checkpoint)", proc)
            quarantined = {e.get("name") for e in proc.of("quarantined")}
            for name in sorted(self.damaged):
                step = int(name.rsplit("_", 1)[1])
                if expected is None or step > expected:
                    if name not in quarantined:
                        self.fail(f"resumed past the damaged {name} without saying so (no quarantined event)", proc)
            for name in quarantined:
                self.damaged.pop(name, None)
        self._check_kept(proc)
        durable = [e["step"] for e in proc.of("checkpoint")]
        if durable:
            # there, unless a fault damaged it or a later process (a second one that took over) kept newer ones
            newest = f"step_{max(durable):09d}"
            newer = [c for c in CheckpointManager(self.save_dir, owner=False).list() if c.step > max(durable)]
            missing = not (self.save_dir / newest / "manifest.json").is_file()
            if missing and newest not in self.damaged and len(newer) < self.job.keep_last:
                self.fail(f"{newest}, logged durable, is missing: {sorted(os.listdir(self.save_dir))}", proc)

    def _check_kept(self, proc: Proc) -> None:
        """Every kept checkpoint that no fault damaged is valid, verifies and equals the live state at its step."""
        manager = CheckpointManager(self.save_dir, owner=False)
        for info in manager.list():
            if self._is_damaged(info.path):
                continue
            if info.status != "valid":
                self.fail(f"{info.name} is {info.status}: {info.problem}", proc)
            problems = manager.verify(info)
            if problems:
                self.fail(f"{info.name} does not verify: {problems}", proc)
            if not self.live_records:
                continue
            record = self.reference / "live" / RECORD.format(step=info.step)
            live = load_file(str(record))
            loaded = manager.read(info)
            held = {f"model.{k}": v for k, v in loaded.model.items()}
            for pid, per_param in (loaded.tree.get("optimizer") or {}).get("state", {}).items():
                held.update({f"optim.{pid}.{k}": v for k, v in per_param.items() if torch.is_tensor(v)})
            if held.keys() != live.keys():
                self.fail(f"{info.name}: tensors {sorted(held.keys() ^ live.keys())} in one of it and the live state")
            differ = [k for k in sorted(live) if not (held[k].dtype == live[k].dtype and torch.equal(held[k], live[k]))]
            if differ:
                self.fail(f"{info.name} differs from the live state at step {info.step}: {differ[:8]}", proc)
        self.damaged = {n: i for n, i in self.damaged.items() if self._is_damaged(self.save_dir / n)}  # else gone

    def _account(self, proc: Proc) -> None:
        self.run_procs.append(proc)
        self.result.processes += 1
        self.result.wall_s += proc.wall_s
        self.result.steps_run += self._steps(proc)

    @staticmethod
    def _steps(proc: Proc) -> int:
        """The steps the process made (rank 0's, of several)."""
        return sum(1 for e in proc.of("step") if e.get("rank", 0) == 0)

    def _end_run(self) -> None:
        """The job completed: its final state against the uninterrupted run's, the report's accounting."""
        last = self.run_procs[-1]
        if not last.of("complete"):
            self.fail("exit 0 without a complete event", last)
        self._compare_final()
        self._attribute()
        steps = sum(self._steps(p) for p in self.run_procs)
        self.result.steps_recomputed += steps - self.job.total_steps
        if not self.history_whole:  # a fault took history.jsonl, or lines of it: nothing whole to account against
            self.result.runs += 1
            self.log(f"chaos: run {self.result.runs} complete after {len(self.run_procs)} processes (no history)")
            self._new_run()
            return
        report = _report(self.save_dir)
        if int(report.get("lost_steps") or 0) != steps - self.job.total_steps:
            ours = [
                (p.fault.describe() if p.fault else None, p.entered_step, self._steps(p), p.rc) for p in self.run_procs
            ]
            theirs = [
                (t.get("start_step"), t.get("end_step"), t.get("lost_steps"), t.get("end")) for t in report["timeline"]
            ]
            what = (
                f"preempt report: {report.get('lost_steps')} steps lost, the processes recomputed"
                f" {steps - self.job.total_steps}; the processes (fault, entered at, steps made, exit): {ours};"
                f" the report's (start, end, lost, end): {theirs}"
            )
            if self.strict_report:
                self.fail(what)
            self.result.notes.append(f"seed {self.seed}, run {self.result.runs + 1}: {what}")
            self.log(f"chaos: note: {what}")
        parts = ("productive_s", "startup_s", "checkpoint_stall_s", "lost_s", "teardown_s")
        accounted = sum(float(report.get(k) or 0.0) for k in parts)
        if abs(accounted - report["wall_s"]) > 0.01 * report["wall_s"] + 0.05:
            self.fail(f"preempt report: {parts} sum to {accounted:.3f} s, wall {report['wall_s']:.3f} s")
        if report["processes"] != len(self.run_procs):
            what = f"preempt report counts {report['processes']} processes, the campaign ran {len(self.run_procs)}"
            if self.strict_report:
                self.fail(what)
            self.result.notes.append(f"seed {self.seed}, run {self.result.runs + 1}: {what}")
        self.result.report_lost_steps += int(report.get("lost_steps") or 0)
        self.result.reported += 1
        self.result.productive_s += float(report["productive_s"])
        self.result.report_wall_s += float(report["wall_s"])
        self.result.runs += 1
        self.log(
            f"chaos: run {self.result.runs} complete after {len(self.run_procs)} processes,"
            f" {steps - self.job.total_steps} steps recomputed, goodput {report['goodput']:.2f}"
        )
        self._new_run()

    def _attribute(self) -> None:
        """Each process's steps that the next made again, under what ended it (and what was done between)."""
        procs = [p for p in self.run_procs if p.entered_step is not None]
        for this, after in zip(procs, procs[1:], strict=False):
            lost = (this.entered_step or 0) + self._steps(this) - (after.entered_step or 0)
            kind = this.fault.kind if this.fault is not None and this.fired else "no fault"
            key = "+".join(dict.fromkeys([kind, *after.before]))
            self.result.recomputed_by.setdefault(key, []).append(lost)

    def _compare_final(self) -> None:
        if not self.final.is_file():
            last = self.run_procs[-1] if self.run_procs else None
            self.fail("the run completed and its last process wrote no final state (--final_out)", last)
        self._compare(load_file(str(self.reference / "final.safetensors")), load_file(str(self.final)), "final state")

    def _compare(self, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
        if a.keys() != b.keys():
            self.fail(f"{what}: keys differ from the uninterrupted run's: {sorted(a.keys() ^ b.keys())}")
        differ = [k for k in sorted(a) if not torch.equal(a[k], b[k])]
        if differ:
            self.fail(f"{what}: {len(differ)} of {len(a)} tensors differ from the uninterrupted run: {differ[:8]}")

    def _new_run(self) -> None:
        if self.save_dir.exists():
            shutil.rmtree(self.save_dir)
        for final in self.work.glob(f"{self.final.stem}*{self.final.suffix}"):  # every rank's
            final.unlink()
        self.damaged.clear()
        self.run_procs = []
        self.history_whole = True
