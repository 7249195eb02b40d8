"""The chaos campaign's second job: two gloo ranks under torchrun (``tests/scripts/train_ddp.py``).

The loop, the schedule's between-process faults and the oracles are :class:`helpers.chaos.Campaign`'s; what differs
is the process (torchrun and its ranks), the faults aimed at it (one rank SIGKILLed before a step or at a commit
stage, one rank SIGTERMed, one rank SIGSTOPped past the collective timeout, the launcher SIGTERMed as a scheduler
stops a job) and the oracle on kept checkpoints: the
ranks' live state is not recorded, so each kept checkpoint must be valid and verify, and the final state of every
rank must equal an uninterrupted torchrun's, tensor for tensor.

Steps of these faults are counted from the step the process resumes at (the campaign knows it before the start), so
that a seed aims them at the same moments of every process.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from safetensors.torch import load_file

from .chaos import BETWEEN, STAGES, Campaign, Fault, Job, Proc
from .distributed import torchrun
from .processes import DDP_ARGS, Spawned

DDP_CLASSES = (
    "kill_rank",  # one rank SIGKILLs itself before a step's forward (torchrun's agent then ends the other)
    "kill_rank_commit",  # one rank SIGKILLed at a stage of the distributed commit
    "term_rank",  # one rank SIGTERMed before a step: both ranks stop at one step
    "term_launcher",  # the launcher SIGTERMed once rank 0 made a step: it forwards the signal to the ranks
    "pause_rank",  # one rank SIGSTOPped before a step for longer than the collective timeout, then continued
    "flip_byte",
    "delete_newest",
)
# The ranks' collectives time out after COLLECTIVE_TIMEOUT_S (gloo's default is 30 minutes); a paused rank stays
# stopped for PAUSE_S, longer than that.
COLLECTIVE_TIMEOUT_S, PAUSE_S = 20, 30
DDP = Job("ddp", (*DDP_ARGS, "--keep_last", "2", "--collective_timeout_s", str(COLLECTIVE_TIMEOUT_S)), 24, 240.0)


def ddp_fault_at(seed: int, index: int, classes: Sequence[str] = DDP_CLASSES) -> Fault:
    """The ``index``-th fault of ``seed``'s schedule for the DDP job: a pure function of its arguments."""
    rng = random.Random(f"preempt-chaos-ddp:{seed}:{index}")
    kind = rng.choice(list(classes))
    rank, step = rng.randint(0, 1), rng.randint(1, 8)
    if kind == "kill_rank_commit":
        return Fault(index, kind, point=rng.choice(STAGES), n=rng.randint(1, 2), pick=(rank,))
    if kind in ("kill_rank", "term_rank", "pause_rank"):
        return Fault(index, kind, step=step, pick=(rank,))
    if kind == "term_launcher":
        return Fault(index, kind, step=step)
    if kind == "flip_byte":
        return Fault(index, kind, pick=(rng.randrange(1 << 30), rng.randrange(1 << 30), rng.randrange(1 << 30)))
    return Fault(index, kind)


class DdpCampaign(Campaign):
    """:class:`Campaign` over the 2-rank torchrun job."""

    live_records = False

    def __init__(self, seed: int, faults: int, work: Path, **kwargs) -> None:
        kwargs.setdefault("classes", DDP_CLASSES)
        super().__init__(DDP, seed, faults, work, **kwargs)

    def fault_at(self, index: int) -> Fault:
        return ddp_fault_at(self.seed, index, self.classes)

    def _make_reference(self) -> None:
        ref = self.reference
        walls = []
        for run in ("run", "clean"):  # the second, warm, for the time an undisturbed run takes
            t0 = time.monotonic()
            p = torchrun(ref / run, ref / "final.safetensors" if run == "run" else None, self.job.args)
            if self._finish(p) != 0:
                self.fail(f"the uninterrupted torchrun failed:\n{p.output}")
            walls.append(time.monotonic() - t0)
        self.result.clean_wall_s = min(walls)

    def _finals(self, final: Path) -> list[dict]:
        return [load_file(str(final.with_suffix(f".rank{r}{final.suffix}"))) for r in (0, 1)]

    def _compare_final(self) -> None:
        missing = [r for r in (0, 1) if not self.final.with_suffix(f".rank{r}{self.final.suffix}").is_file()]
        if missing:  # the ranks were ended after their run completed, before they wrote --final_out
            self.result.notes.append(f"seed {self.seed}, run {self.result.runs + 1}: no final state of ranks {missing}")
            return
        for rank, (a, b) in enumerate(
            zip(self._finals(self.reference / "final.safetensors"), self._finals(self.final), strict=True)
        ):
            self._compare(a, b, f"rank {rank}'s final state")

    def _process(self, fault: Fault | None) -> Proc:
        expected = self._expected_resume()
        self.fault, self.fault_fired = fault, False
        self.between_checked, self.between = self.between, []
        at = (expected or 0) + (fault.step if fault else 0)
        extra: list[str] = []
        kind = fault.kind if fault else None
        if kind == "kill_rank":
            extra = ["--die_at", f"{fault.pick[0]}:{at}"]
        elif kind == "term_rank":
            extra = ["--self_signal", f"{fault.pick[0]}:{at}"]
        elif kind == "pause_rank":
            extra = ["--pause_at", f"{fault.pick[0]}:{at}:{PAUSE_S}"]
        elif kind == "kill_rank_commit":
            extra = ["--signal_at", f"{fault.point}:{fault.n}:KILL", "--signal_rank", str(fault.pick[0])]
        t0 = time.monotonic()
        p: Spawned = torchrun(self.save_dir, self.final, [*self.job.args, *extra])
        if kind == "term_launcher" and self._wait_event(p, "step", rank=0, step=at):
            p.signal(signal.SIGTERM)
        rc = self._finish(p)
        proc = Proc(fault, False, rc, time.monotonic() - t0, list(p.events), p.output)
        if kind == "kill_rank_commit":
            proc.fired = bool(proc.of("signal_at"))
        elif kind == "pause_rank":
            # counted only when it outlasted the collective timeout (the other rank left): a peer that reached its
            # all-reduce late, on a slow machine, may see the paused rank come back in time, and the pause was no fault
            proc.fired = bool(proc.of("paused")) and rc != 0
        elif fault is not None:
            proc.fired = rc != 0 or kind == "term_launcher" and bool(proc.of("step", rank=0, step=at))
        if fault is not None and proc.fired:
            self._count(fault)
            self.fault_fired = True
        self._account(proc)
        self._check_process(proc, expected)
        if rc == 0 or proc.of("complete"):  # the launcher's SIGTERM may come as the ranks finish the run
            self._end_run()
        return proc

    def _allowed(self, proc: Proc) -> set[int] | None:
        if proc.fault is None or not proc.fired:
            return {0}
        return None  # torchrun ends with 1 when a rank failed or stopped; any status but a hang


assert not (set(DDP_CLASSES) - BETWEEN - {"kill_rank", "kill_rank_commit", "term_rank", "term_launcher", "pause_rank"})
