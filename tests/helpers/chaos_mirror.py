"""The chaos campaign's mirror job: the quick-start loop with ``mirror=`` to a local S3 server (moto,
``tests/s3server.py``), each run of the job under a prefix of its own.

Its faults: SIGTERM and SIGKILL at the script's fault points and a flipped byte (as the quick-start job's), the
server paused (SIGSTOP) while a process stops, so that the stop's wait for its upload runs into ``mirror_deadline``
(SIGCONT once the process has exited), and the local save_dir deleted between processes (a new machine: the next
process pulls from the mirror). Killing the server is left out: moto keeps its buckets in memory, so a restarted
server has lost every object, which no real object store does.

Its oracles, beside the quick-start job's: a process resumes from the newer of the newest whole local checkpoint and
the mirror's newest complete one (a pull, bit for bit: the kept checkpoints are compared with the live state after
it); the newest checkpoint a process logged as uploaded (the event ``mirror``) is in the mirror, complete, unless the
run's retention removed it there for newer ones.
"""

from __future__ import annotations

import random
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import s3server

from .chaos import QUICKSTART, Campaign, Fault, Job, Proc, fault_at

MIRROR_CLASSES = ("sigterm", "sigkill", "pause_server", "delete_local", "flip_byte")
MIRROR = Job("mirror", QUICKSTART.args, QUICKSTART.total_steps)
DEADLINE_S = 3.0  # the stop's wait for its upload (mirror_deadline): what a paused server costs a process


def mirror_fault_at(seed: int, index: int, classes: Sequence[str] = MIRROR_CLASSES) -> Fault:
    """The ``index``-th fault of ``seed``'s schedule for the mirror job: a pure function of its arguments."""
    rng = random.Random(f"preempt-chaos-mirror:{seed}:{index}")
    kind = rng.choice(list(classes))
    if kind in ("sigterm", "sigkill", "flip_byte"):  # drawn as the quick-start job draws them
        return fault_at(seed, index, (kind,))
    if kind == "pause_server":
        return Fault(index, kind, step=rng.randint(1, 12))
    return Fault(index, kind)  # delete_local


class MirrorCampaign(Campaign):
    """:class:`Campaign` over the mirror job, against ``server`` (an :class:`s3server.Server` this campaign may
    pause)."""

    def __init__(self, seed: int, faults: int, work: Path, server: Any, **kwargs: Any) -> None:
        kwargs.setdefault("classes", MIRROR_CLASSES)
        super().__init__(MIRROR, seed, faults, work, **kwargs)
        self.server = server
        self.env = s3server.env(server.endpoint)
        self.bucket = s3server.new_bucket(server.endpoint)
        self.runs_started = 0
        self.paused = False

    def fault_at(self, index: int) -> Fault:
        return mirror_fault_at(self.seed, index, self.classes)

    @property
    def prefix(self) -> str:
        return f"{self.bucket}/run{self.runs_started}"

    def _new_run(self) -> None:
        super()._new_run()
        self.runs_started += 1  # a fresh prefix: a run never resumes from an earlier run's mirror

    def _job_args(self) -> list[str]:
        return [*self.job.args, "--mirror", f"s3://{self.prefix}", "--mirror_deadline", str(DEADLINE_S)]

    def _store(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(
            endpoint_url=self.server.endpoint, key="testing-key", secret="testing-secret", skip_instance_cache=True
        )

    def _mirrored(self) -> list[int]:
        """The steps with a manifest in the mirror (a manifest goes up last: the step is complete)."""
        found = self._store().glob(f"{self.prefix}/step_*/manifest.json")
        return sorted(int(m.group(1)) for f in found if (m := re.search(r"step_(\d+)/manifest\.json$", f)))

    # ------------------------------------------------------------------------------------------------ faults

    def _before_stop(self, fault: Fault) -> None:
        if fault.kind == "pause_server":
            self.server.pause()
            self.paused = True

    def _after_process(self, fault: Fault | None) -> None:
        if self.paused:
            self.server.resume()
            self.paused = False

    def _between(self, fault: Fault) -> bool:
        if fault.kind != "delete_local":
            return super()._between(fault)
        if not self.run_procs or not self.save_dir.is_dir():
            return False
        shutil.rmtree(self.save_dir)
        self.damaged.clear()
        self.history_whole = False
        self.log("chaos:   deleted the local save_dir")
        return True

    # ------------------------------------------------------------------------------------------------ oracles

    def _expected_resume(self) -> int | None:
        local = super()._expected_resume()
        mirrored = self._mirrored()
        return max([*([local] if local is not None else []), *mirrored[-1:]], default=None)

    def _check_process(self, proc: Proc, expected: int | None) -> None:
        super()._check_process(proc, expected)
        uploaded = [e.get("uploaded") for p in self.run_procs for e in p.of("mirror")]
        uploaded = [s for s in uploaded if isinstance(s, int)]
        if uploaded:
            mirrored = self._mirrored()
            newest = max(uploaded)
            newer = [s for s in mirrored if s > newest]
            if newest not in mirrored and len(newer) < self.job.keep_last:
                self.fail(f"step {newest}, logged uploaded, is not complete in the mirror: {mirrored}", proc)
