"""A seeded chaos campaign over training jobs: ``python bench/chaos.py --seed S --faults N [--jobs quickstart,...]``.

Runs the job again and again until it completes, with N faults drawn from seed S's schedule (SIGTERM and SIGKILL
at the script's fault points, the stop's own save killed or failing, Ctrl+C twice, a second process on the same
save_dir, an I/O error at a commit stage, a full disk, a flipped byte, the newest checkpoint deleted), and checks
the oracles after every process and at the end of each run (tests/helpers/chaos.py). Jobs: ``quickstart``, ``lora``
(a frozen base carried), ``ddp`` (two gloo ranks under torchrun: a rank killed or stopped, the launcher stopped),
``mirror`` (mirror= to a local moto S3 server, paused during stops; the local save_dir deleted between processes).
Prints the seed, each fault, and the figures; exit 0 only when every oracle held. A failure names its seed and fault:
the same command replays it.

The disk-full faults need root (a tmpfs is mounted for them); without it they are left out and the figures say why.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
# the processes import preempt from this checkout, as the suite's do (tests/conftest.py)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)

from helpers.chaos import CLASSES, JOBS, Campaign  # noqa: E402
from helpers.chaos_ddp import DDP_CLASSES, DdpCampaign  # noqa: E402
from helpers.chaos_mirror import MIRROR_CLASSES, MirrorCampaign  # noqa: E402

JOB_NAMES = (*JOBS, "ddp", "mirror")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: drawn, and printed)")
    p.add_argument("--faults", type=int, default=30, help="faults to inject, per job")
    p.add_argument("--jobs", default="quickstart", help=f"comma-separated, of: {', '.join(JOB_NAMES)}")
    p.add_argument("--classes", default=None, help="comma-separated fault classes to draw from (default: the job's)")
    p.add_argument("--work", default=None, help="a directory for the runs (default: a fresh temporary one)")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    asked = [c for c in (args.classes or "").split(",") if c]
    known = {*CLASSES, *DDP_CLASSES, *MIRROR_CLASSES}
    unknown = sorted(set(asked) - known) + sorted(set(args.jobs.split(",")) - set(JOB_NAMES))
    if unknown:
        p.error(f"unknown: {unknown}")
    print(
        f"seed {seed} (replay: python bench/chaos.py --seed {seed} --faults {args.faults} --jobs {args.jobs}"
        f"{' --classes ' + args.classes if args.classes else ''})",
        flush=True,
    )
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="preempt-chaos-"))
    failed = 0
    for name in args.jobs.split(","):
        t0 = time.monotonic()
        if name == "ddp":
            classes = [c for c in DDP_CLASSES if not asked or c in asked]
            result = DdpCampaign(seed, args.faults, work / name, classes=classes, log=_log).run()
        elif name == "mirror":  # a server of its own, which the campaign pauses
            import s3server
            from helpers.distributed import free_port

            classes = [c for c in MIRROR_CLASSES if not asked or c in asked]
            with s3server.start(free_port()) as server:
                result = MirrorCampaign(seed, args.faults, work / name, server, classes=classes, log=_log).run()
        else:
            classes = [c for c in CLASSES if not asked or c in asked]
            result = Campaign(JOBS[name], seed, args.faults, work / name, classes=classes, log=_log).run()
        print(f"\n== job {name}: {time.monotonic() - t0:.0f} s\n{result.table()}\n", flush=True)
        failed += not result.ok
    print(f"seed {seed}: {'every oracle held' if not failed else f'{failed} job(s) FAILED'} (work in {work})")
    return 1 if failed else 0


def _log(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
