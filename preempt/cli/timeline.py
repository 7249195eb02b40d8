"""A run's story across its processes, and its goodput: what ``preempt report`` shows.

Pure: :func:`build` reads the lines of ``history.jsonl`` (parsed, every line as
written: ``read_history(..., timeline=False)``) and returns a :class:`Report`;
no torch, no disk, no clock. What each process left there:

* ``restoring`` (``pid``, ``proc_start``, ``made_at``): the process holds the lock and is about to read a
  checkpoint; a process killed in its restore left only this line, and counts as a process that never reached its
  run (no step of its own: it ran none);
* ``start`` / ``resume`` (``step``, ``pid``, ``proc_start``: when the process
  started, ``crashed``: the previous process died holding the lock, and the
  step it had reached, ``died_at``);
* metric points (``step``, ``metrics``; see :func:`preempt.run.reporting.point_interval`);
* ``checkpoint`` (``step``, ``reason``, ``stall_s``, ``write_s``, ``bytes``,
  ``at``: when its state was taken);
* ``rollback`` (``step`` rolled back to, ``from_step``);
* at the end ``stop`` (``cause``: a signal's name, ``walltime``, ``request``, a cloud's notice; ``durable_s``:
  from the signal or notice to the stop's checkpoint durable, ``grace_s``: to the kill, ``margin_s``: the grace
  less that), ``complete`` or ``error``, written when the run leaves its ``with`` block; nothing when it was
  killed; before a stop's save ``stopping`` (``cause``, ``grace_s``, ``stop_s``: what a stop was measured to
  cost), the last line of a process killed during its stop;
* ``exit``: written at the process's exit (an ``atexit`` handler), after the
  code that follows the ``with`` block; not written when it was killed.

The accounting, per process (its wall time runs from ``proc_start``, or its
first line when that is unknown, to its last line):

* start-up and restore: from the process's start to the run's ``start`` /
  ``resume`` line (imports, building the model, the lock, the restore);
* checkpoint stalls: the loop's wait for each checkpoint (the copy of a
  background save; the whole of a synchronous one, the stop's included);
* recomputed: the steps after the checkpoint the next process resumed from
  (a crash), or after the one a NaN rollback went back to, and the time they
  took (from the moment that checkpoint's state was taken to the process's
  last line, or to the rollback);
* teardown: from the run's end line (``stop``, ``complete``, ``error``) to
  the process's last line, its ``exit``: the code after the ``with`` block
  and the exit handlers (none before these lines were written: 0);
* productive: the rest. Goodput is productive time over the processes' wall
  time.

Between processes (not in anyone's wall time): from one process's last line
to the next one's start. After an ``exit`` line that is the interpreter's own
exit (freeing torch and its libraries, which no process can time itself,
since nothing runs after it to write a line) and then
whatever came before the next start (a queue, a requeue, a person); after a
killed process, from its estimated end. :meth:`Report.gaps` says which.

A killed process leaves no end line: its end is its last line (a progress
record or a checkpoint), so a few seconds after it may be missing; the text
says so. Old history files (before these fields) still give a timeline, with
less in it.

A hand-edited or hostile history still gives a report, and what it sets aside
is said, value included (:attr:`Report.notes`, at most :data:`MAX_NOTES`): a
time that is not a date between 1970 and 2200 (the line is left out), a
duration that is negative, not finite or over :data:`MAX_DURATION_S` (counted
as 0), a step or byte count that is negative or over :data:`MAX_COUNT`. So
every sum stays finite. A metric's non-finite values (``"nan"``, ``"inf"``,
``"-inf"`` as :class:`preempt.health.history.History` writes them, or bare
``NaN``/``Infinity``) are kept apart (:attr:`Report.nonfinite`) and shown as
such.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping
from typing import Any

from ..checkpoint.safe_io import plausible_time, printable

STARTS = ("start", "resume")
RESTORING = "restoring"  # a process about to read its checkpoint (before its start or resume line)
ENDS = ("stop", "complete", "error")
MAX_COUNT = 2**63 - 1  # a step or a byte count past int64 is no count a run writes
MAX_DURATION_S = 1e9  # about 31 years: a longer stall or write is no duration a run measures
MAX_NOTES = 20  # notes kept; the rest are counted
NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}  # how History writes a non-finite number


@dataclasses.dataclass
class Checkpoint:
    step: int
    t: float
    at: float  # when its state was taken
    reason: str
    stall_s: float
    write_s: float
    nbytes: int


@dataclasses.dataclass
class Process:
    """One process of the run, from its ``start``/``resume`` line to its end."""

    index: int
    resumed: bool
    start_step: int
    entered: float  # the t of its start/resume line
    started: float  # when the process started (proc_start), else ``entered``
    pid: int | None = None
    end: float = 0.0  # its last line
    end_step: int = 0  # the furthest step it is known to have reached
    how: str = "killed"  # "stop", "complete", "error", or "killed" (no end line)
    cause: str | None = None  # of a stop: "SIGTERM", "walltime", ...; of an error: its message, else its repr
    checkpoints: list[Checkpoint] = dataclasses.field(default_factory=list)
    steps_seen: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (t, step) of its lines
    lost_steps: int = 0
    lost_s: float = 0.0
    rollbacks: int = 0
    end_estimated: bool = False  # a killed process's end, from the step it reached and its pace
    ended: float | None = None  # the t of its end line (stop, complete, error): the run left its with block
    exited: float | None = None  # the t of its exit line: the process exited (its interpreter's teardown follows)
    recomputed: list[tuple[float, int, float, int]] = dataclasses.field(default_factory=list)  # (t, step) -> (t, step)
    mirror: dict[str, Any] | None = None  # its mirror_end line: what the mirror held at its end, and its worst lag
    mirror_outages: int = 0  # mirror_down lines: the mirror stopped answering
    made: float | None = None  # when its run was made (made_at): start-up before, restore after
    first_step: tuple[float, int] | None = None  # (t, step) of its first safe point after a step (first_step)
    stop_timing: dict[str, float] = dataclasses.field(default_factory=dict)  # durable_s, grace_s, margin_s of a stop
    stopping: dict[str, Any] | None = None  # its stop under way (cause, grace_s, stop_s); kept if it was killed then
    reached_run: bool = True  # False: only its restoring line (killed or failed before its run began)

    @property
    def wall_s(self) -> float:
        return max(0.0, self.end - self.started)

    @property
    def startup_s(self) -> float:
        return max(0.0, self.entered - self.started)

    def split(self) -> dict[str, Any]:
        """Its start-up split: ``before_run_s`` (process start to the run made: imports, building the model),
        ``restore_s`` (the run made to its start line: the lock, choosing and loading a checkpoint), ``first_steps``
        and ``first_steps_s`` (its start line to the first safe point after a step), ``step_s`` (a steady step:
        the pace of its lines after that) and ``warmup_s`` (what the first steps took beyond steady ones). Each is
        None where its lines do not say (a history from before these fields)."""
        made = self.made if self.made is not None and self.started <= self.made <= self.entered else None
        out: dict[str, Any] = {
            "before_run_s": None if made is None else made - self.started,
            "restore_s": None if made is None else self.entered - made,
            "first_steps": None,
            "first_steps_s": None,
            "step_s": None,
            "warmup_s": None,
        }
        if self.first_step is None or self.first_step[1] <= self.start_step or self.first_step[0] < self.entered:
            return out
        t1, s1 = self.first_step
        out["first_steps"], out["first_steps_s"] = s1 - self.start_step, t1 - self.entered
        later = [(t, s) for t, s in self.steps_seen if s > s1 and t > t1]
        if later:
            t2, s2 = max(later, key=lambda x: x[1])
            out["step_s"] = (t2 - t1) / (s2 - s1)
            out["warmup_s"] = max(0.0, out["first_steps_s"] - out["first_steps"] * out["step_s"])
        return out

    @property
    def stall_s(self) -> float:
        return sum(c.stall_s for c in self.checkpoints)

    @property
    def teardown_s(self) -> float:
        """From the run's end line to the process's last line (its exit line): 0 without an end line."""
        return 0.0 if self.ended is None else max(0.0, self.end - max(self.ended, self.entered))

    @property
    def work_end(self) -> float:
        """When the run's work ended: its end line, else its last line (or the estimated end of a killed one)."""
        return self.end if self.ended is None else min(self.ended, self.end)

    @property
    def productive_s(self) -> float:
        return max(0.0, self.wall_s - self.startup_s - self.stall_s - self.lost_s - self.teardown_s)

    def lose(self, step: int, reached: int, until: float) -> None:
        """The steps from ``step`` to ``reached`` were done again (a crash or a rollback), the last at ``until``."""
        self.lost_steps += reached - step
        self.lost_s += self.spent_since(step, until)
        self.recomputed.append((self.reached_at(step), step, until, reached))

    def reached_at(self, step: int) -> float:
        """When this process had the state of ``step`` (the moment a checkpoint of it was taken), or its entry."""
        for c in self.checkpoints:
            if c.step == step:
                return c.at
        if step == self.start_step:
            return self.entered
        before = [t for t, s in self.steps_seen if s <= step]
        return max(before) if before else self.entered

    def extrapolate_end(self, step: int, before: float) -> None:
        """A killed process reached ``step`` after its last line (the next process read it from the lock's beacon):
        its end is estimated at its own pace, not left at its last line, and not after ``before`` (when the next
        process started: the lock was free by then)."""
        seen = sorted(self.steps_seen)
        if len(seen) >= 2 and seen[-1][1] > seen[0][1]:
            (t0, s0), (t1, s1) = seen[0], seen[-1]
            pace = (t1 - t0) / (s1 - s0)  # seconds per step; steps are below MAX_COUNT: every product is finite
            self.end = max(self.end, min(t1 + (step - s1) * pace, max(before, self.end)))
            self.end_estimated = True
        self.end_step = step

    def spent_since(self, step: int, until: float) -> float:
        """Seconds of training from having the state of ``step`` to ``until``, its checkpoint stalls left out."""
        since = self.reached_at(step)
        stalls = sum(c.stall_s for c in self.checkpoints if since < c.at <= until)
        return max(0.0, until - since - stalls)

    def stop_text(self) -> str:
        from .._log import duration

        if self.how == "stop":
            margin = self.stop_timing.get("margin_s")
            return f"stopped: {self.cause or 'signal'}" + ("" if margin is None else f" (margin {duration(margin)})")
        if self.how == "error":
            return f"error: {self.cause or '?'}"
        if self.how == "complete":
            return "complete"
        if self.stopping is not None:
            grace = self.stopping.get("grace_s")
            within = "" if grace is None else f", grace {duration(grace)}"
            return f"killed during its stop on {self.stopping.get('cause')} (its checkpoint not durable{within})"
        if not self.reached_run:
            return "killed in its restore, before its first step (SIGKILL, out of memory, node failure)"
        return "killed (no clean stop: SIGKILL, out of memory, node failure)"


@dataclasses.dataclass
class Report:
    processes: list[Process]
    gaps_s: list[float]  # between process i's last line (its end, estimated when killed) and process i+1's start
    metrics: dict[str, list[tuple[float, int, float, int]]]  # name -> (t, step, value, process index)
    nonfinite: dict[str, list[tuple[float, int, str, int]]] = dataclasses.field(default_factory=dict)  # "nan", ...
    notes: list[str] = dataclasses.field(default_factory=list)  # what was set aside, and why

    @property
    def wall_s(self) -> float:
        return sum(p.wall_s for p in self.processes)

    @property
    def productive_s(self) -> float:
        return sum(p.productive_s for p in self.processes)

    @property
    def goodput(self) -> float | None:
        return self.productive_s / self.wall_s if self.wall_s > 0 else None

    def gaps(self) -> list[dict[str, Any]]:
        """Each time between processes and what it starts from: ``"exit line"`` (so the interpreter's own exit is
        in it), ``"end line"`` (a history without exit lines, or a process killed after its run ended),
        ``"estimated end"`` (killed; the end from its pace) or ``"last line"`` (killed, its end unknown)."""
        out = []
        for prev, gap in zip(self.processes, self.gaps_s, strict=False):  # a gap after each process but the last
            since = (
                "exit line"
                if prev.exited is not None and prev.exited >= prev.end
                else "end line"
                if prev.ended is not None
                else "estimated end"
                if prev.end_estimated
                else "last line"
            )
            out.append({"after_process": prev.index, "s": gap, "from": since})
        return out

    def mirror(self) -> dict[str, Any] | None:
        """How far behind the mirror was: the most steps and seconds over the processes, where the last
        process that said stood at its end (``held``, ``behind_steps``, ``behind_s``), the outages; None: no mirror."""
        ends = [p.mirror for p in self.processes if p.mirror is not None]
        if not ends:
            return None
        worst = {k: max((e[k] or 0 for e in ends), default=0) for k in ("max_behind_steps", "max_behind_s")}
        last = {k: ends[-1][k] for k in ("held", "behind_steps", "behind_s")}
        return {**worst, "end": last, "outages": sum(p.mirror_outages for p in self.processes)}

    def to_json(self) -> dict[str, Any]:
        ps = self.processes
        return {
            "goodput": self.goodput,
            "wall_s": self.wall_s,
            "productive_s": self.productive_s,
            "startup_s": sum(p.startup_s for p in ps),
            "checkpoint_stall_s": sum(p.stall_s for p in ps),
            "lost_s": sum(p.lost_s for p in ps),
            "lost_steps": sum(p.lost_steps for p in ps),
            "teardown_s": sum(p.teardown_s for p in ps),
            "between_processes_s": sum(self.gaps_s),
            "between_processes": self.gaps(),
            "span_s": (ps[-1].end - ps[0].started) if ps else 0.0,
            "processes": len(ps),
            "restarts": max(0, len(ps) - 1),
            "rollbacks": sum(p.rollbacks for p in ps),
            "checkpoints": sum(len(p.checkpoints) for p in ps),
            "checkpoint_bytes": sum(c.nbytes for p in ps for c in p.checkpoints),
            "final_step": ps[-1].end_step if ps else None,
            "complete": bool(ps) and ps[-1].how == "complete",
            "nonfinite_metrics": {
                name: {
                    "count": len(bad),
                    "steps": [step for _, step, _, _ in bad[:MAX_NOTES]],
                    "values": sorted({text for *_, text, _ in bad}),
                }
                for name, bad in self.nonfinite.items()
            },
            "notes": list(self.notes),
            "mirror": self.mirror(),
            "stops": [
                {
                    "process": p.index,
                    "cause": p.cause if p.how in ("stop", "error") else p.how,
                    "how": p.how,
                    "t": p.end,
                    "step": p.end_step,
                    **{k: p.stop_timing.get(k) for k in ("durable_s", "grace_s", "margin_s")},
                    "killed_during_stop": p.how == "killed" and p.stopping is not None,
                }
                for p in ps
                if p.how != "complete"
            ],
            "timeline": [
                {
                    "process": p.index,
                    "pid": p.pid,
                    "resumed": p.resumed,
                    "started": p.started,
                    "entered": p.entered,
                    "ended": p.end,
                    "start_step": p.start_step,
                    "end_step": p.end_step,
                    "end": p.how,
                    "end_estimated": p.end_estimated,
                    "reached_run": p.reached_run,
                    "cause": p.cause,
                    "wall_s": p.wall_s,
                    "startup_s": p.startup_s,
                    "startup": p.split(),
                    "checkpoint_stall_s": p.stall_s,
                    "lost_steps": p.lost_steps,
                    "lost_s": p.lost_s,
                    "run_ended": p.ended,
                    "exited": p.exited,
                    "teardown_s": p.teardown_s,
                    "productive_s": p.productive_s,
                    "recomputed": [
                        {"from_t": t0, "from_step": s0, "to_t": t1, "to_step": s1} for t0, s0, t1, s1 in p.recomputed
                    ],
                    "checkpoints": [dataclasses.asdict(c) for c in p.checkpoints],
                }
                for p in ps
            ],
        }


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT else None


def _shown(v: Any) -> str:
    """A value from the file as a note shows it: ``1e+308``, ``inf``, ``1000000000000... (401 digits)``."""
    if isinstance(v, float):
        return f"{v:g}"
    text = printable(repr(v) if isinstance(v, str) else v)
    if isinstance(v, int) and len(text) > 24:
        return f"{text[:12]}... ({len(text.lstrip('-'))} digits)"
    return text if len(text) <= 60 else f"{text[:57]}..."


class _Facts:
    """Reads the fields of one line; what it cannot use is noted (with the value) and comes back as None."""

    def __init__(self, notes: _Notes, doc: Mapping[str, Any]) -> None:
        self._notes, self._doc = notes, doc
        event, step = doc.get("event"), _int(doc.get("step"))
        self.what = f"a {printable(event[:40])} line" if isinstance(event, str) else "a metric line"
        if step is not None:
            self.what += f" (step {step})"

    def _bad(self, name: str, v: Any, expected: str, then: str) -> None:
        self._notes.add(f"{self.what}: {name}={_shown(v)} is not {expected}; {then}")

    def time(self, name: str, then: str, doc: Mapping[str, Any] | None = None) -> float | None:
        v = (self._doc if doc is None else doc).get(name)
        t = plausible_time(v)
        if t is None and v is not None and (isinstance(v, (int, float)) and not isinstance(v, bool)):
            self._bad(name, v, "a time between 1970 and 2200", then)
        return t

    def duration(self, name: str) -> float | None:
        v = self._doc.get(name)
        d = _num(v)
        if d is not None and 0.0 <= d <= MAX_DURATION_S:
            return d
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            self._bad(name, v, f"a duration between 0 and {MAX_DURATION_S:g} s", "counted as 0")
        return None

    def count(self, name: str, doc: Mapping[str, Any] | None = None) -> int | None:
        v = (self._doc if doc is None else doc).get(name)
        if not isinstance(v, int) or isinstance(v, bool):
            return None
        if 0 <= v <= MAX_COUNT:
            return v
        self._bad(name, v, "a count between 0 and 2**63-1", "taken as unknown")
        return None


class _Notes:
    """The notes of a report: the first :data:`MAX_NOTES`, then a count of the rest."""

    def __init__(self) -> None:
        self.kept: list[str] = []
        self.more = 0

    def add(self, text: str) -> None:
        if len(self.kept) < MAX_NOTES:
            self.kept.append(text)
        else:
            self.more += 1

    def done(self) -> list[str]:
        return self.kept + ([f"... and {self.more} more values set aside"] if self.more else [])


def build(lines: Iterable[Mapping[str, Any]]) -> Report:
    """The report of a run from its history lines (every line, in file order; see the module docstring).

    Lines of the wrong shape (a hand-edited or hostile file) are skipped, never a traceback; absurd values are
    set aside and noted (see the module docstring).
    """
    procs: list[Process] = []
    metrics: dict[str, list[tuple[float, int, float, int]]] = {}
    nonfinite: dict[str, list[tuple[float, int, str, int]]] = {}
    notes = _Notes()
    crashes: dict[int, int | None] = {}  # process index -> the step its predecessor died at
    for doc in lines:
        if not isinstance(doc, Mapping):
            continue
        facts = _Facts(notes, doc)
        t = facts.time("t", "line left out")
        if t is None:
            continue
        event, step = doc.get("event"), facts.count("step")
        if event in STARTS or event == RESTORING:
            started = facts.time("proc_start", "its start taken as this line's time")
            pid = _int(doc.get("pid"))
            restoring = procs[-1] if procs and not procs[-1].reached_run and procs[-1].pid == pid else None
            if event in STARTS and restoring is not None:  # the same process, past its restore
                p = restoring
                p.resumed, p.start_step, p.entered, p.reached_run = event == "resume", step or 0, t, True
                p.end, p.end_step, p.steps_seen = t, step or 0, [(t, step or 0)]
            else:
                p = Process(
                    index=len(procs) + 1,
                    resumed=event == "resume",
                    start_step=step or 0,
                    entered=t,
                    started=started if started is not None and started <= t else t,
                    pid=pid,
                    end=t,
                    end_step=step or 0,
                    steps_seen=[] if event == RESTORING else [(t, step or 0)],
                    reached_run=event != RESTORING,
                )
                procs.append(p)
            p.made = facts.time("made_at", "the start-up left unsplit")
            crashed = doc.get("crashed")
            if isinstance(crashed, Mapping):
                crashes[p.index] = facts.count("died_at", crashed)
            continue
        if not procs:  # lines before any start line (an old file, a torn head): no process to give them to
            continue
        p = procs[-1]
        p.end = max(p.end, t)
        if step is not None:
            p.end_step = max(p.end_step, step) if event != "rollback" else p.end_step
            p.steps_seen.append((t, step))
        if event is None and step is not None and isinstance(doc.get("metrics"), Mapping):
            for name, v in doc["metrics"].items():
                if not isinstance(name, str):
                    continue
                if (x := _num(v)) is not None:
                    metrics.setdefault(name, []).append((t, step, x, p.index))
                elif isinstance(v, float) or (isinstance(v, str) and v in NONFINITE):  # NaN, Infinity, "nan", ...
                    text = v if isinstance(v, str) else ("nan" if math.isnan(v) else "inf" if v > 0 else "-inf")
                    nonfinite.setdefault(name, []).append((t, step, text, p.index))
        elif event == "checkpoint" and step is not None:
            stall, write = facts.duration("stall_s") or 0.0, facts.duration("write_s") or 0.0
            at = facts.time("at", "taken as the line's time less the write")
            p.checkpoints.append(
                Checkpoint(
                    step,
                    t,
                    at if at is not None else t - write,
                    str(doc.get("reason"))[:40],
                    stall,
                    write,
                    facts.count("bytes") or 0,
                )
            )
        elif event == "rollback" and step is not None:
            reached = facts.count("from_step")
            p.rollbacks += 1
            if reached is not None and reached > step:
                p.lose(step, reached, t)
        elif event == "first_step" and step is not None and p.first_step is None:
            p.first_step = (t, step)
        elif event == "exit":  # the process's exit, after the code that follows its run
            p.exited = t
        elif event == "mirror_down":
            p.mirror_outages += 1
        elif event == "mirror_end":
            counts = {k: facts.count(k) for k in ("held", "behind_steps", "max_behind_steps")}
            p.mirror = {**counts, **{k: facts.duration(k) for k in ("behind_s", "max_behind_s")}}
        elif event == "stopping":
            p.stopping = {"cause": printable(str(doc.get("cause")))[:200], "grace_s": facts.duration("grace_s")}
            p.stopping["stop_s"] = facts.duration("stop_s")
        elif event in ENDS:
            p.how, p.ended = event, t
            cause = doc.get("cause") if event == "stop" else doc.get("error")
            p.cause = str(cause)[:200] if cause is not None else None
            if event == "stop":
                p.stopping = None
                for k in ("durable_s", "grace_s"):
                    if (d := facts.duration(k)) is not None:
                        p.stop_timing[k] = d
                margin = _num(doc.get("margin_s"))  # negative: the stop took longer than its grace
                if margin is not None and abs(margin) <= MAX_DURATION_S:
                    p.stop_timing["margin_s"] = margin
    # A process that never reached its run trained nothing: it stands at the step its successor starts from.
    ran = [p for p in procs if p.reached_run]
    for p in procs:
        if not p.reached_run:
            after = next((q for q in ran if q.index > p.index), None)
            before = next((q for q in reversed(ran) if q.index < p.index), None)
            p.start_step = p.end_step = after.start_step if after else before.end_step if before else 0
    # What a crash cost: the steps the next process did again, and the time the dead one spent on them.
    for prev, nxt in itertools.pairwise(ran):
        died_at = crashes.get(nxt.index)
        if died_at is not None and died_at > prev.end_step:
            prev.extrapolate_end(died_at, before=nxt.started)
        if prev.end_step > nxt.start_step:  # a clean stop saves where it stops: only a crash or an error gets here
            prev.lose(nxt.start_step, prev.end_step, prev.work_end)
    gaps = [max(0.0, nxt.started - prev.end) for prev, nxt in itertools.pairwise(procs)]
    return Report(procs, gaps, metrics, nonfinite, notes.done())


def _split_text(index: int, x: dict[str, Any]) -> str:
    """``#2 before the run 2.10 s, restore 0.52 s, first step 0.31 s (0.25 s beyond steady ones)``."""
    from .._log import duration

    parts = []
    if x["restore_s"] is not None:
        parts += [f"before the run {duration(x['before_run_s'])}", f"restore {duration(x['restore_s'])}"]
    if x["first_steps_s"] is not None:
        n = x["first_steps"]
        first = f"first {'step' if n == 1 else f'{n} steps'} {duration(x['first_steps_s'])}"
        if x["warmup_s"] is not None:
            first += f" ({duration(x['warmup_s'])} beyond steady ones)"
        parts.append(first)
    return f"#{index} " + ", ".join(parts)


def _gaps_text(report: Report) -> str:
    """What the time between processes holds, from what each one starts at."""
    froms = {g["from"] for g in report.gaps()}
    parts = []
    if "exit line" in froms:
        parts.append("the interpreter's exit after an exit line (torch's teardown, 0.4-2 s, which no process can time)")
    if froms - {"exit line"}:
        parts.append("from the last line of a process that left no exit line (killed, or a history from before them)")
    return ", ".join([*parts, "then any wait for the next start (a queue, a requeue)"])


def _clock(t: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def render(report: Report, where: str) -> list[str]:
    """The report for people: one row per process, then the goodput and where the rest went."""
    from .._log import duration, size

    ps = report.processes
    if not ps:
        return [f"{where}: no process of this run wrote a history (history.jsonl has no start line)"] + [
            f"  note: {n}" for n in report.notes
        ]
    doc = report.to_json()
    out = [
        f"{where}: {len(ps)} process(es), {doc['restarts']} restart(s), steps {ps[0].start_step} -> {ps[-1].end_step}"
        + (", complete" if doc["complete"] else "")
    ]
    rows = [["#", "started", "wall", "steps", "start-up", "ckpt stall", "recomputed", "teardown", "ended"]]
    for p in ps:
        lost = f"{p.lost_steps} ({duration(p.lost_s)})" if p.lost_steps else "-"
        rows.append(
            [
                str(p.index),
                _clock(p.started),
                duration(p.wall_s),
                f"{p.start_step} -> {p.end_step}",
                duration(p.startup_s),
                f"{duration(p.stall_s)} ({len(p.checkpoints)})",
                lost,
                duration(p.teardown_s) if p.ended is not None else "-",
                p.stop_text(),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    g = doc["goodput"]
    out.append(
        f"goodput {'-' if g is None else f'{g:.1%}'}: productive {duration(doc['productive_s'])} of"
        f" {duration(doc['wall_s'])} of process wall time"
    )
    out.append(
        f"  lost: start-up and restore {duration(doc['startup_s'])}, checkpoint stalls"
        f" {duration(doc['checkpoint_stall_s'])} ({doc['checkpoints']} checkpoints, {size(doc['checkpoint_bytes'])}),"
        f" recomputed {duration(doc['lost_s'])} ({doc['lost_steps']} steps), teardown {duration(doc['teardown_s'])}"
    )
    split = [(p.index, p.split()) for p in ps]
    said = [_split_text(i, x) for i, x in split if x["restore_s"] is not None or x["first_steps_s"] is not None]
    if said:
        out.append("  start-up of each process: " + "; ".join(said))
    if report.gaps_s:
        out.append(f"  between processes (not in the wall time): {duration(sum(report.gaps_s))}: {_gaps_text(report)}")
    killed = [p for p in ps if p.how == "killed" and p is not ps[-1]]
    if killed:
        out.append(
            f"  note: process(es) {', '.join(str(p.index) for p in killed)} ended without a line; each is counted"
            " to the step it reached at its own pace when the next process knew that step, else to its last line"
        )
    if ps[-1].how == "killed":
        out.append("  note: the last process has no end line: still running, or killed")
    if (m := doc["mirror"]) is not None:
        end = m["end"]
        out.append(
            f"mirror: at most {m['max_behind_steps']} steps and {duration(m['max_behind_s'])} behind the newest"
            f" durable checkpoint; at the end it held step {end['held'] if end['held'] is not None else '-'},"
            f" {end['behind_steps'] or 0} steps and {duration(end['behind_s'] or 0.0)} behind;"
            f" {m['outages']} outage(s)"
        )
    for name, bad in report.nonfinite.items():
        first = ", ".join(f"{text} at step {step}" for _, step, text, _ in bad[:3])
        out.append(f"  non-finite values of {name}: {len(bad)} ({first}{', ...' if len(bad) > 3 else ''})")
    out.extend(f"  note: {n}" for n in report.notes)
    return out
