r"""``preempt check``: prove that a training command resumes exactly, before a cluster tests it for you.

::

    preempt check [--stop-at STEP ...] [--signal TERM|KILL] [--steps N] [--keep] [--json] -- COMMAND [ARG ...]

COMMAND is run two or three times, each in a scratch save_dir of its own (``PREEMPT_CHECK`` tells the run, whatever
save_dir the script names: :class:`~preempt.cluster.environment.CheckSpec`), up to step N:

1. the first reference, uninterrupted, with one checkpoint at N; it tells how long an epoch is, in run.step() calls
   (optimizer steps, whatever the gradient accumulation: :func:`preempt.checkpoint.live_record.steps_per_epoch`);
2. the trial: stopped at each stop and run again, until N. ``TERM`` is the run's normal stop at that step (exit 75);
   ``KILL``: the process kills itself (SIGKILL) once that step's checkpoint is durable, so the rerun resumes from a
   dead process's save_dir;
3. only when the trial's state at N differs from the first reference's: the second reference, uninterrupted, to
   tell a resume that is not exact from nondeterminism. An exact resume costs two runs.

Each run records, beside its checkpoints, the digests of its live tensors at each checkpoint step
(:mod:`preempt.checkpoint.live_record`); every checkpoint the check reads is held to that record first. One that
holds a tensor from an older step (carried while something wrote it behind autograd, or handed out by a
``state_dict()`` that keeps an older copy) is the verdict, "stale checkpoint", named with its step and tensors
(:class:`Stale`): it explains whatever differs after it, in the trial or in a reference.

The trial and the second reference write a checkpoint at each compared step (:func:`compared_steps`: every step
from the first stop on, or, past :data:`WINDOW`, those right after each stop and some spread up to N). When the
second reference runs, their states are compared at each (every tensor with ``torch.equal``, every JSON value
exactly, every rank of a torchrun job), and the first step at which they differ is named with what differs first
(:func:`label`) and why it may (:func:`hint`: the data order reset at an epoch's start, a sampler whose epoch is not
the run's, state carried between steps). What differs between the two references at N is nondeterminism: reported
apart, and left out of judging the resume, which it can neither hide (a difference the references agree on is the
resume's) nor fake. Nondeterminism in the model's tensors makes a resume impossible to show exact: the verdict is
then "nondeterministic", said only of what two uninterrupted runs disagree on.

Inside a check the run keeps every checkpoint, writes synchronously, and mirrors, logs to W&B/TensorBoard, samples
GPUs and requeues nothing (:func:`preempt.run.config.checked_config`): the user's save_dir, mirror and logs are never
touched. The scratch space is deleted at the end unless ``--keep``.

Exit codes: 0 exact; 1 not exact (a stale checkpoint, or nondeterministic); 2 the check could not be made (COMMAND
never entered a preempt run, failed, or ended before step N), with one line saying why. The run itself leaves the
check's last step with exit code 81 (:data:`~preempt.errors.CHECK_ENDED_EXIT_CODE`).

The choices (stops, compared steps, the first divergence, labels, hints, the verdict) are pure functions here, and
so are the record's (:mod:`preempt.checkpoint.live_record`);
the comparison imports torch when it runs (``preempt --help`` does not).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..checkpoint import live_record
from ..checkpoint.live_record import flatten
from ..checkpoint.manager import CheckpointInfo, CheckpointManager
from ..checkpoint.names import BASE_FILE, MODEL_FILE, STATE_FILE
from ..cluster.environment import CHECK_VARIABLE, CheckSpec
from ..errors import PreemptError
from .output import emit

EXACT, NOT_EXACT, CANNOT = 0, 1, 2
DEFAULT_STEPS = 30
"""N when neither ``--steps`` nor ``--stop-at`` is given."""
AFTER_LAST_STOP = 10
"""N is this many steps past the last ``--stop-at`` when ``--steps`` is not given."""
WINDOW = 24
"""At most about this many compared steps (each a checkpoint of the trial's and of the second reference's, read
back and compared); past it, each stop and the :data:`AFTER_STOP` steps after it (where a resume's divergence shows
first), and steps spread evenly up to N."""
AFTER_STOP = 4
GUIDE = "README_PREEMPTION.md, 'Check that your loop resumes exactly'"
SUMMARY = "prove that COMMAND resumes exactly: run it straight and stopped, compare every tensor"
EXIT_CODES = """\
exit codes:
  0  exact: the stopped and resumed run's state equals the uninterrupted run's at every compared step
  1  not exact (the first diverging step and what differs are named), a stale checkpoint (one holds a
     tensor from an older step than its own), or nondeterministic: two uninterrupted runs differ in the
     model's tensors, so no resume can be shown exact
  2  the check could not be made: COMMAND never entered a preempt run, failed, or ended before step N"""

# Bookkeeping that differs between a run made of one process and one of several, or between any two runs, by design:
# clocks and process counts, not state (the epoch so far; the Trainer's seconds of training, its train_runtime).
_NOT_STATE = ("epoch.seconds", "epoch.processes", "tracked.transformers.counters.seconds")


class CannotCheck(Exception):
    """The check could not be made; the message is the one line that says why."""


# ---------------------------------------------------------------------------------------------- pure decisions


def choose_stops(last: int, steps_per_epoch: int | None) -> list[int]:
    """The stops of a trial when none is asked: mid-epoch, the step right after that stop's resume (state carried
    between steps shows there), and the end of the first epoch when the run has epochs shorter than ``last``.

    ``steps_per_epoch`` counts run.step() calls, the optimizer steps (under gradient accumulation several batches
    make one), as ``last`` and every stop do (:func:`preempt.checkpoint.live_record.steps_per_epoch`)."""
    per = steps_per_epoch if steps_per_epoch is not None and steps_per_epoch > 0 else None
    mid = max(1, per // 2) if per is not None and per < last else max(1, last // 3)
    stops = {mid, mid + 1}
    if per is not None and per not in stops and per < last:
        stops.add(per)
    return sorted(s for s in stops if s < last)


def default_last(stops: Sequence[int]) -> int:
    """N when ``--steps`` is not given."""
    return max(stops) + AFTER_LAST_STOP if stops else DEFAULT_STEPS


def compared_steps(stops: Sequence[int], last: int, window: int = WINDOW) -> list[int]:
    """The steps at which the trial and the reference are compared (and both write a checkpoint): every step from
    the first stop to ``last`` when there are at most ``window`` of them; else each stop and the
    :data:`AFTER_STOP` steps after it, and steps spread evenly up to ``last``."""
    first = min(stops)
    if last - first + 1 <= window:
        return list(range(first, last + 1))
    steps = {last}
    for s in stops:
        steps.update(range(s, min(s + AFTER_STOP, last) + 1))
    spare = max(1, window - len(steps))
    stride = max(1, math.ceil((last - first) / spare))
    steps.update(range(first, last + 1, stride))
    return sorted(steps)


def generator(path: str) -> str | None:
    """The global generator a flattened path of rank 0's state belongs to (``rng.now.python.state``: ``python``)."""
    parts = path.split(".")
    return parts[2] if len(parts) > 2 and parts[0] == "rng" else None


def apart_from_the_start(paths: Sequence[str], unseeded: Iterable[str]) -> list[str]:
    """Of ``paths`` (what differs between the trial and the first reference at N), those of a generator that two
    uninterrupted runs already held apart at step 1 (:func:`preempt.checkpoint.live_record.unseeded`): their
    nondeterminism is known without a second reference."""
    gens = set(unseeded)
    return [p for p in paths if generator(p) in gens]


def first_divergence(
    diffs: Sequence[tuple[int, Sequence[str]]], nondeterministic: Iterable[str]
) -> tuple[int, list[str]] | None:
    """The first compared step whose differences are not all nondeterministic, and those differences in order.

    ``diffs``: (step, paths that differ between the trial and the reference), steps ascending. A path the two
    references also disagree on says nothing about the resume; any other one is the resume's."""
    noise = set(nondeterministic)
    for step, paths in diffs:
        own = [p for p in paths if p not in noise]
        if own:
            return step, own
    return None


def label(path: str) -> str:
    """What a flattened state path is, in a user's words: ``model.fc.weight``, "optimizer state", "the global torch
    RNG", ``tracked.x``. A path of another rank than 0 starts with ``rank R:``."""
    rank = ""
    if path.startswith("rank "):
        head, _, path = path.partition(": ")
        rank = f"{head}: "
    head, _, rest = path.partition(".")
    first = rest.split(".")[0]
    if head == "model":
        what = path
    elif head == "pieces":
        what = f"sharded state {rest}"
    elif head == "optimizer":
        what = "optimizer state" if first == "state" else "optimizer settings (param_groups)"
    elif head == "rng":
        gen = rest.split(".")[1] if "." in rest else ""
        names = {
            "torch": "the global torch RNG",
            "python": "Python's global random",
            "numpy": "NumPy's global RNG",
            "cuda": "the CUDA RNG",
        }
        what = names.get(gen, f"the RNG ({rest})")
        if first == "epoch_start":
            what += " at the epoch's start"
    elif head in ("tracked", "user"):
        what = f"{'user_state' if head == 'user' else head}.{first}"
    else:
        what = {
            "scheduler": "the LR scheduler",
            "scaler": "the gradient scaler",
            "data": "the data cursor",
            "epoch": "the epoch's metric sums",
            "model_extra": "the model's non-tensor state",
            "lr_scale": "the learning-rate scale",
        }.get(head, path)
    return rank + what


def labels(paths: Iterable[str], most: int = 4) -> str:
    """The distinct labels of ``paths`` in order, at most ``most`` of them and how many more; the model's tensors
    after its first are counted, not listed (``model.fc.weight and 3 more of the model's tensors``)."""
    seen: list[str] = []
    tensors = 0
    for p in paths:
        name = label(p)
        if name.split(": ")[-1].startswith("model."):
            tensors += 1
            if tensors > 1:
                continue
        if name not in seen:
            seen.append(name)
    if tensors > 1:
        first = next(i for i, n in enumerate(seen) if n.split(": ")[-1].startswith("model."))
        seen[first] += f" and {tensors - 1} more of the model's tensors"
    shown = ", ".join(seen[:most])
    return shown + (f" and {len(seen) - most} more" if len(seen) > most else "")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataFacts:
    """What the trial's data showed at one compared step (from its checkpoint's manifest and the runs' records)."""

    batch_differs: bool | None = None  # its batches are not the reference's at that step (None: not recorded)
    epoch: int = 0  # the run's epoch there
    sampler_epoch: int | None = None  # the epoch of preempt's sampler there, when it is not the run's
    epoch_start: bool = False  # the step is its epoch's first (the previous compared step is in an earlier epoch)


_RESET = (
    "something other than the run sets the sampler's epoch: a loader wrapper calling set_epoch with a count of its"
    " own (Lightning Fabric's does), which starts again at 0 in every process"
)


def hint(step: int, stops: Sequence[int], data: DataFacts | None = None) -> str:
    """Why the state may first differ at ``step``, given the stops of the trial and what its data showed there."""
    before = [s for s in stops if s < step]
    if not before:
        return "it differs before any resume: the run does not reproduce itself there"
    k = max(before)
    if data is not None and data.sampler_epoch is not None:
        return (
            f"at step {step} the sampler is at epoch {data.sampler_epoch} while the run is in epoch {data.epoch}:"
            f" {_RESET}; after the resume at step {k} the data comes in epoch {data.sampler_epoch}'s order. Let the"
            f" run set the epoch (run.batches over the DataLoader itself, or a wrapper that leaves set_epoch alone);"
            f" see {GUIDE}"
        )
    if data is not None and data.batch_differs:
        if data.epoch_start:
            return (
                f"the data order of epoch {data.epoch} after the resume at step {k} is not the uninterrupted run's:"
                f" its first batch differs. The order is reset at the epoch's start: {_RESET}, or the order is drawn"
                f" from state outside the checkpoint; use run.sampler(...) and let the run set the epoch; see {GUIDE}"
            )
        return (
            f"the batches of step {step} are not the uninterrupted run's: after the resume at step {k} the data does"
            " not continue where it stopped (a sampler or iterator of the loop's own outside the checkpoint, a"
            f" sampler whose epoch something other than the run sets); see {GUIDE}"
        )
    if step == k + 1:
        return (
            f"the first step after the resume at step {k} already differs: state carried between steps outside the"
            " checkpoint (a batch drawn before run.step(), a private random.Random or NumPy Generator, a counter"
            f" outside any state_dict); see {GUIDE}"
        )
    return (
        f"{step - k} steps after the resume at step {k}: state used only now and then (at an epoch's end, every"
        f" few steps) is outside the checkpoint; see {GUIDE}"
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stale:
    """A checkpoint whose tensors are not the live ones of its step (:mod:`preempt.checkpoint.live_record`)."""

    run: str  # which of the check's runs wrote it
    step: int
    paths: tuple[str, ...]
    of_step: int | None = None  # the recorded step whose live values it holds, when it is one of them
    carried: bool = False  # its file holding the first of them is a hard link to an earlier checkpoint's

    def says(self) -> str:
        """``step 9's checkpoint holds model.0.weight from an older step (step 8's): carried ...``."""
        older = "from an older step" + (f" (step {self.of_step}'s)" if self.of_step is not None else "")
        if self.carried:
            why = (
                "carried unchanged from an earlier checkpoint while something wrote it behind autograd (an in-place"
                " write through .data or a NumPy view, which autograd's version counter does not see)"
            )
        else:
            why = (
                "the run wrote what the state_dict() it read handed out, an older copy (a state_dict hook or"
                " override, a cache)"
            )
        return (
            f"step {self.step}'s checkpoint ({self.run} run) holds {labels(self.paths)} {older}, not the live"
            f" value at step {self.step}: {why}; a resume from it starts from that older state"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
    """What the comparison concluded."""

    code: int
    verdict: str  # "exact", "not exact", "stale checkpoint" or "nondeterministic"
    step: int | None = None  # the first diverging step
    since: int | None = None  # the compared step before it (the divergence lies after it when not step - 1)
    differs: tuple[str, ...] = ()
    nondeterministic: tuple[str, ...] = ()
    hint: str | None = None


def judge(
    diffs: Sequence[tuple[int, Sequence[str]]],
    nondeterministic: Sequence[str],
    stops: Sequence[int],
    *,
    stale: Stale | None = None,
    data: Mapping[int, DataFacts] | None = None,
) -> Verdict:
    """The verdict from the per-step differences (trial against reference), the references' own, a checkpoint found
    not to hold its step's live state (it comes first: it explains what differs after it, in any run) and what the
    trial's data showed at each step."""
    nd = tuple(nondeterministic)
    if stale is not None:
        return Verdict(
            code=NOT_EXACT,
            verdict="stale checkpoint",
            step=stale.step,
            differs=stale.paths,
            nondeterministic=nd,
            hint=stale.says(),
        )
    found = first_divergence(diffs, nd)
    if found is not None:
        step, paths = found
        steps = [s for s, _ in diffs]
        at = steps.index(step)
        since = steps[at - 1] if at else None
        return Verdict(
            code=NOT_EXACT,
            verdict="not exact",
            step=step,
            since=since,
            differs=tuple(paths),
            nondeterministic=nd,
            hint=hint(step, stops, (data or {}).get(step)),
        )
    if any(p.split(": ")[-1].startswith(("model.", "pieces.")) for p in nd):
        return Verdict(
            code=NOT_EXACT,
            verdict="nondeterministic",
            nondeterministic=nd,
            hint="two uninterrupted runs differ in the model: seed every generator (torch, Python's random, NumPy)"
            " and use deterministic algorithms, then check again",
        )
    return Verdict(code=EXACT, verdict="exact", nondeterministic=nd)


# ----------------------------------------------------------------------------------------- states and their diff


def same(a: Any, b: Any) -> bool:
    """Exactly equal: tensors by ``torch.equal`` (and dtype), numbers and strings by value (NaN equals NaN)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype:
            return False
        if torch.equal(a, b):
            return True
        # NaN equals NaN here (a NaN metric, or an optimizer moment gone NaN in both runs alike)
        if not a.is_floating_point() or a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
            return False
        return torch.equal(a.masked_fill(a.isnan(), 0), b.masked_fill(b.isnan(), 0))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def differing(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """The paths whose values differ, or that one side lacks, in ``a``'s order then ``b``'s."""
    out = [p for p, v in a.items() if p not in b or not same(v, b[p])]
    return out + [p for p in b if p not in a]


def read_state(save_dir: Path, step: int) -> dict[str, Any]:
    """Every rank's state in the checkpoint of ``step``, flat: rank 0's whole state, and each other rank's own
    (its generators, its loader's position) under ``rank R: ``. Verified by the manager's own read (no pickle)."""
    manager = CheckpointManager(save_dir, owner=False)
    info = _valid(manager.list(), save_dir, step)
    ranks = sorted({0} | {int(f[5:10]) for f in info.valid.files if f.startswith("rank_") and f.endswith(".json")})
    out: dict[str, Any] = {}
    for r in ranks:
        loaded = manager.read(info, rank=r, direct=False)
        flat: dict[str, Any] = {}
        if r == 0:
            flatten(loaded.model, "model", flat)
            for path, tensors, _ in loaded.pieces:
                flatten(tensors, f"pieces.{Path(path).name}", flat)
            flatten(loaded.tree, "", flat)
        else:
            flatten({k: loaded.tree.get(k) for k in ("rng", "data")}, "", flat)
        for p, v in flat.items():
            if not p.startswith(_NOT_STATE):
                out[p if r == 0 else f"rank {r}: {p}"] = v
    return out


def _valid(infos: Iterable[CheckpointInfo], save_dir: Path, step: int) -> CheckpointInfo:
    found = [c for c in infos if c.step == step and c.status == "valid"]
    if not found:
        raise CannotCheck(f"{save_dir}: no valid checkpoint of step {step} to compare")
    return found[0]


def held(flat: Mapping[str, Any], record: live_record.LiveRecord) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """The digests of a checkpoint's tensors (``flat``: :func:`read_state`'s) at the paths ``record`` has."""
    import torch

    return {p: live_record.tensor_digest(flat[p]) for p in record.tensors if isinstance(flat.get(p), torch.Tensor)}


def stale_in(
    run: Run, records: Mapping[int, live_record.LiveRecord], step: int, flat: Mapping[str, Any]
) -> Stale | None:
    """The run's checkpoint of ``step`` (``flat``) against the live state the run recorded at that step."""
    record = records.get(step)
    if record is None:
        return None
    digests = held(flat, record)
    paths = live_record.stale(record, digests)
    if not paths:
        return None
    first = paths[0]
    of_step = live_record.live_at(records, step, first, digests[first][2])
    return Stale(run=run.name, step=step, paths=tuple(paths), of_step=of_step, carried=_carried(run, step, first))


def _carried(run: Run, step: int, path: str) -> bool:
    """The file of the checkpoint of ``step`` that holds ``path`` is a hard link to the one an earlier checkpoint of
    the run holds (:mod:`preempt.checkpoint.carry`)."""
    infos = [c for c in CheckpointManager(run.save_dir, owner=False).list() if c.status == "valid"]
    here = _valid(infos, run.save_dir, step).path
    names = (MODEL_FILE, BASE_FILE) if path.startswith("model.") else (STATE_FILE,)
    for name in names:
        f = here / name
        for c in infos:
            other = c.path / name
            if c.step < step and f.exists() and other.exists() and os.path.samefile(f, other):
                return True
    return False


def data_facts(trial: Run, reference: Run, steps: Sequence[int]) -> dict[int, DataFacts]:
    """What the trial's data showed at each compared step: its sampler's epoch and its batches against the
    reference's (both runs' records), and whether the step is its epoch's first."""
    infos = {c.step: c for c in CheckpointManager(trial.save_dir, owner=False).list() if c.manifest is not None}
    mine, theirs = live_record.read_all(trial.live_dir), live_record.read_all(reference.live_dir)
    out = {}
    for s in steps:
        info, before = infos.get(s), infos.get(s - 1)
        if info is None or info.manifest is None:
            continue
        cursor = info.manifest.cursor
        earlier = before.manifest.cursor.epoch if before is not None and before.manifest is not None else cursor.epoch
        sampler_epoch = (info.manifest.sampler or {}).get("epoch")
        a, b = mine.get(s), theirs.get(s)
        batches = None if a is None or b is None or a.batch is None or b.batch is None else a.batch != b.batch
        out[s] = DataFacts(
            batch_differs=batches,
            epoch=cursor.epoch,
            sampler_epoch=sampler_epoch if isinstance(sampler_epoch, int) and sampler_epoch != cursor.epoch else None,
            epoch_start=earlier < cursor.epoch,
        )
    return out


# ------------------------------------------------------------------------------------------------ the runs


@dataclasses.dataclass
class Run:
    """One run of COMMAND in its scratch save_dir: its processes' exit codes and seconds, and where it records its
    live state (:attr:`~preempt.cluster.environment.CheckSpec.live_dir`)."""

    name: str
    save_dir: Path
    live_dir: Path
    codes: list[int] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def _steps_in(save_dir: Path) -> set[int]:
    if not save_dir.is_dir():
        return set()
    return {c.step for c in CheckpointManager(save_dir, owner=False).list() if c.status == "valid"}


def _last_line(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def run_to(command: Sequence[str], spec: CheckSpec, targets: Sequence[int], run: Run, scratch: Path) -> None:
    """Runs COMMAND once per target (each stop, then the last step), each time until that step's checkpoint exists.

    Raises:
        CannotCheck: A process ended without reaching its target: COMMAND never entered a run, failed, or ended.
    """
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_END_TIME"}  # no walltime keeper inside a check
    env[CHECK_VARIABLE] = spec.to_env()
    save_dir = Path(spec.save_dir)
    for i, target in enumerate(targets):
        log = scratch / f"{run.name}.{i}.log"
        t0 = time.monotonic()
        with open(log, "wb") as out:
            try:
                code = subprocess.call(list(command), env=env, stdout=out, stderr=subprocess.STDOUT)
            except OSError as e:
                raise CannotCheck(f"cannot start {command[0]}: {e.strerror or e}") from None
        run.seconds += time.monotonic() - t0
        run.codes.append(code)
        steps = _steps_in(save_dir)
        if target in steps and max(steps) > target:
            raise CannotCheck(f"the {run.name} run did not stop at step {target}: it went on to step {max(steps)}")
        if target in steps:
            continue
        shown = "killed by a signal" if code < 0 else f"exit code {code}"
        said = _last_line(log)
        if not save_dir.exists() and code == 0:
            raise CannotCheck(
                f"{' '.join(command)} never entered a preempt run (PreemptibleRun, PreemptCallback or"
                " preempt.hf.install): it ended (exit code 0) without a checkpoint"
            )
        if not save_dir.exists():
            raise CannotCheck(
                f"the {run.name} run failed ({shown}) before entering a preempt run" + (f": {said}" if said else "")
            )
        done = CheckpointManager(save_dir, owner=False).completion()
        if done is not None:
            raise CannotCheck(f"the run ended at step {done.get('step')}, before step {target}: ask for fewer --steps")
        raise CannotCheck(f"the {run.name} run failed before step {target} ({shown})" + (f": {said}" if said else ""))


def _steps_per_epoch(run: Run, last: int) -> int | None:
    """The first epoch's run.step() calls, from the uninterrupted run's checkpoint and record at ``last``."""
    cursor = _valid(CheckpointManager(run.save_dir, owner=False).list(), run.save_dir, last).valid.cursor
    record = live_record.read_all(run.live_dir).get(last)
    return live_record.steps_per_epoch(record, cursor.epoch, cursor.batch, cursor.batches_per_epoch, last)


# ------------------------------------------------------------------------------------------------ the command


def build_parser(commands: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser:
    texts: dict[str, Any] = dict(
        usage="preempt check [--stop-at STEP ...] [--signal TERM|KILL] [--steps N] [--keep] [--json]"
        " -- COMMAND [ARG ...]",
        description=(
            "Run COMMAND straight to step N and once stopped at each --stop-at and rerun until N, each in a scratch\n"
            "save_dir (the script's own save_dir, mirror and loggers are never touched), then compare their states\n"
            "at N: every tensor with torch.equal, every RNG, scheduler, tracked object and data cursor exactly, on\n"
            "every rank; each checkpoint is also held to the live state of its step. When they differ, a second\n"
            "straight run tells nondeterminism apart and the first step at which the resumed run differs is named\n"
            "with what differs.\n"
            "Details: pydoc preempt.cli.check"
        ),
        epilog=EXIT_CODES + "\n\nexample:\n  preempt check --stop-at 7 --steps 20 -- python train.py --save_dir runs/x",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if commands is None:
        parser = argparse.ArgumentParser(prog="preempt check", **texts)
    else:
        parser = commands.add_parser("check", help=SUMMARY, **texts)
    parser.add_argument(
        "--stop-at",
        type=_step,
        action="append",
        default=None,
        metavar="STEP",
        help="stop the trial at this step (repeat for several stops in one trial); default, in optimizer steps"
        " (run.step() calls): mid-epoch, the step after it, and the first epoch's end",
    )
    parser.add_argument(
        "--signal",
        choices=("TERM", "KILL"),
        default="TERM",
        help="TERM: the run's normal stop at that step (exit 75); KILL: SIGKILL once that step's checkpoint is"
        " durable (default TERM)",
    )
    parser.add_argument(
        "--steps",
        type=_step,
        default=None,
        metavar="N",
        help=f"compare up to step N (default: {AFTER_LAST_STOP} past the last stop, or {DEFAULT_STEPS})",
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch save_dirs and logs (path printed)")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARG ...]")
    return parser


def _step(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number >= 1, found {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a step number >= 1, found {n}")
    return n


def main(argv: Sequence[str]) -> int:
    """``preempt check ...``: returns the exit code (argparse exits 2 itself on bad usage)."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.error("expected -- COMMAND [ARG ...]")
    scratch = Path(tempfile.mkdtemp(prefix="preempt-check-"))
    try:
        doc = check(command, args.stop_at, args.signal == "KILL", args.steps, scratch)
    except (CannotCheck, PreemptError) as e:  # PreemptError: a checkpoint of the check's that cannot be read
        if args.json:
            emit({"error": str(e), "exit_code": CANNOT})
        print(f"preempt check: {e}", file=sys.stderr)
        return CANNOT
    except KeyboardInterrupt:
        print("preempt check: interrupted", file=sys.stderr)
        return 130
    finally:
        if args.keep:
            print(f"preempt check: scratch kept in {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.keep:
        doc["scratch"] = str(scratch)
    if args.json:
        emit(doc)
    else:
        print(render(doc))
    return int(doc["exit_code"])


def check(command: Sequence[str], stops: Sequence[int] | None, kill: bool, last: int | None, scratch: Path) -> dict:
    """The runs and their comparison; the document ``--json`` prints.

    The first reference and the trial; the second reference only when the trial differs from the first at N (to
    tell a resume that is not exact from nondeterminism), or nothing is compared with it. Every checkpoint read is
    held to the live state its run recorded at its step."""
    asked = sorted(set(stops or ()))
    n = last if last is not None else default_last(asked)
    if asked and max(asked) >= n:
        raise CannotCheck(f"--stop-at {max(asked)} is not before step {n} (--steps)")

    def spec(name: str, saves: Iterable[int], stop_at: Iterable[int]) -> CheckSpec:
        return CheckSpec(
            save_dir=str(scratch / name), saves=frozenset(saves), stops=frozenset(stop_at), kill=kill, last=n
        )

    def made(name: str, saves: Iterable[int], stop_at: Iterable[int], targets: Sequence[int]) -> Run:
        at = spec(name, saves, stop_at)
        run = Run(name, Path(at.save_dir), Path(at.live_dir))
        runs.append(run)
        run_to(command, at, targets, run, scratch)
        return run

    runs: list[Run] = []
    first = made("reference", (), (), [n])
    per = _steps_per_epoch(first, n)
    chosen = asked or choose_stops(n, per)
    if not chosen:
        raise CannotCheck(f"no step before step {n} to stop at: ask for more --steps")
    steps = compared_steps(chosen, n)
    trial = made("trial", steps, chosen, [*chosen, n])

    reference_n = read_state(first.save_dir, n)
    trial_records = live_record.read_all(trial.live_dir)
    trial_n: dict[str, Any] = {}
    stale = None
    for s in steps:  # every checkpoint of the trial holds its step's live state (the stops' are what it resumed from)
        state = read_state(trial.save_dir, s)
        stale = stale or stale_in(trial, trial_records, s, state)
        if s == n:
            trial_n = state
    stale = stale or stale_in(first, live_record.read_all(first.live_dir), n, reference_n)
    # The trial's first process ran uninterrupted from step 0 to the first stop: generators it held apart from the
    # first reference at step 1 were never seeded alike, and differ at N whatever the resume does.
    apart = live_record.unseeded(live_record.read_all(first.live_dir).get(n), trial_records.get(steps[0]))
    differ = differing(reference_n, trial_n)
    nondeterministic = apart_from_the_start(differ, apart)
    diffs: list[tuple[int, list[str]]] = [(n, [])]
    data: dict[int, DataFacts] = {}
    if stale is None and len(nondeterministic) < len(differ):
        second = made("reference-2", steps, (), [n])
        second_records = live_record.read_all(second.live_dir)
        diffs = []
        for s in steps:
            theirs = read_state(second.save_dir, s)
            stale = stale or stale_in(second, second_records, s, theirs)
            if s == n:
                nondeterministic = differing(reference_n, theirs)
            diffs.append((s, differing(theirs, read_state(trial.save_dir, s))))
        data = data_facts(trial, second, steps)
    v = judge(diffs, nondeterministic, chosen, stale=stale, data=data)
    return {
        "verdict": v.verdict,
        "exit_code": v.code,
        "command": list(command),
        "steps": n,
        "steps_per_epoch": per,
        "stops": chosen,
        "signal": "KILL" if kill else "TERM",
        "compared_steps": steps,
        "runs": [r.name for r in runs],
        "first_diverging_step": v.step if v.verdict == "not exact" else None,
        "equal_until": v.since,
        "differs": [label(p) for p in v.differs] if v.verdict == "not exact" else [],
        "differs_paths": list(v.differs) if v.verdict == "not exact" else [],
        "stale_checkpoint": None if stale is None else {**dataclasses.asdict(stale), "labels": labels(stale.paths)},
        "nondeterministic": [label(p) for p in v.nondeterministic],
        "nondeterministic_paths": list(v.nondeterministic),
        "hint": v.hint,
        "seconds": {r.name: round(r.seconds, 3) for r in runs},
        "processes": {r.name: r.codes for r in runs},
    }


def render(doc: Mapping[str, Any]) -> str:
    """The table (one row per run) and the last line: exact or not."""
    n, stops, sig = doc["steps"], doc["stops"], doc["signal"]
    at = ", ".join(str(s) for s in stops)
    nd = labels(doc["nondeterministic_paths"]) or "-"
    first = doc["first_diverging_step"]
    made = doc.get("runs", ["reference", "trial", "reference-2"])
    second = ("reference 2", "-", f"to step {n}", "-", f"nondeterministic: {nd}" if nd != "-" else "-")
    if "reference-2" not in made:
        why = "-"
        if doc["verdict"] == "exact":
            why = f"(the trial equals the reference at step {n}"
            why += ", but for generators two uninterrupted runs held apart from step 1)" if nd != "-" else ")"
        second = ("reference 2", "-", "not run", "-", why)
    rows = [
        ("run", "stops", "verdict", "first diverging step", "what differs"),
        ("reference", "-", f"to step {n}", "-", "-"),
        second,
        (
            "trial",
            f"{sig} at {at}",
            doc["verdict"],
            "-" if first is None else str(first),
            labels(doc["differs_paths"]) or "-",
        ),
    ]
    stale = doc.get("stale_checkpoint")
    if stale is not None:
        rows[-1] = (*rows[-1][:4], f"step {stale['step']}'s checkpoint ({stale['run']} run): {stale['labels']}")
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[4] for r in rows]
    lines = [ln.rstrip() for ln in lines]
    compared = doc["compared_steps"]
    span = f"steps {compared[0]} to {compared[-1]}" if len(compared) > 1 else f"step {compared[0]}"
    if doc["verdict"] == "exact":
        if "reference-2" in made:
            how = f"equals an uninterrupted run's at every compared step ({span}; every tensor torch.equal)"
        else:
            how = (
                f"equals an uninterrupted run's at step {n} (every tensor torch.equal), and each of its checkpoints"
                f" ({span}) holds the live state of its step"
            )
        last = f"exact: stopped ({sig}) at step {at} and resumed, the run's state {how}"
        if nd != "-":
            last += f"; nondeterministic between two uninterrupted runs: {nd}"
    elif doc["verdict"] == "nondeterministic":
        last = f"nondeterministic: two uninterrupted runs differ at step {n} ({nd}); {doc['hint']}"
    elif doc["verdict"] == "stale checkpoint":
        last = f"stale checkpoint: {doc['hint']}"
    else:
        since = doc["equal_until"]
        where = f"step {first}" if since in (None, first - 1) else f"a step after {since}, by step {first},"
        last = f"not exact: the resumed run first differs at {where}: {labels(doc['differs_paths'])}"
        lines.append(f"hint: {doc['hint']}")
    return "\n".join([*lines, last])
