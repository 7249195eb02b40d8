"""run.step() with nothing due: ns per call of this tree against another revision, in the same run.

    python bench/bench_step.py                         # against the revision before issue 14's redesign
    python bench/bench_step.py --against HEAD~3 --calls 500000 --rounds 7
    python bench/bench_step.py --against HEAD --time_limit 86400   # a far deadline: the same hot path?

Each round times ``--calls`` calls of ``run.step()`` (``checkpoint_interval=None``, a small model and AdamW,
no optimizer step: the call alone) in a fresh process per revision, the two revisions alternating so that
load on a shared machine falls on both alike. The other revision is checked out with ``git worktree`` into a
temporary directory and imported from there. Prints the median ns per call of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE_REDESIGN = "7a6db33"  # main just before PreemptibleRun was split into parts (issue 14)

CHILD = r"""
import json, logging, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
import torch
import preempt
from preempt import PreemptibleRun
assert preempt.__file__.startswith(sys.argv[1]), preempt.__file__
logging.getLogger("preempt").setLevel(logging.WARNING)
n = int(sys.argv[2])
limit = json.loads(sys.argv[3])  # time_limit: None, or seconds (a deadline far away)
model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters())
with tempfile.TemporaryDirectory() as d:
    with PreemptibleRun(d, model=model, optimizer=opt, checkpoint_interval=None, log_file=False,
                        time_limit=limit) as run:
        for _ in range(1000):
            run.step()
        t0 = time.perf_counter()
        for _ in range(n):
            run.step()
        t1 = time.perf_counter()
        run.request_stop()
        try:
            run.step()
        except SystemExit:
            pass
print(json.dumps({"ns_per_call": (t1 - t0) / n * 1e9}))
"""


def measure(tree: Path, calls: int, time_limit: float | None = None) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree), str(calls), json.dumps(time_limit)],
        check=True,
        capture_output=True,
        text=True,
        cwd=tree,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["ns_per_call"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default=BEFORE_REDESIGN, help=f"revision to compare with (default {BEFORE_REDESIGN})")
    ap.add_argument("--calls", type=int, default=300_000, help="run.step() calls per timing (default 300000)")
    ap.add_argument("--rounds", type=int, default=5, help="timings per revision, alternated (default 5)")
    ap.add_argument("--json", help="also write every timing to this file")
    ap.add_argument(
        "--time_limit", type=float, default=None, help="PreemptibleRun(time_limit=...) in both: a deadline far away"
    )
    args = ap.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        ap.error("--calls and --rounds must be >= 1")
    rev = subprocess.run(
        ["git", "rev-parse", "--short", args.against], check=True, capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        other = Path(tmp) / rev
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(other), rev], check=True, capture_output=True, cwd=ROOT
        )
        try:
            here, there = [], []
            for i in range(args.rounds):
                here.append(measure(ROOT, args.calls, args.time_limit))
                there.append(measure(other, args.calls, args.time_limit))
                print(f"round {i + 1}: this tree {here[-1]:.0f} ns, {rev} {there[-1]:.0f} ns", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], capture_output=True, cwd=ROOT)
    a, b = statistics.median(here), statistics.median(there)
    print(f"run.step() with nothing due: this tree {a:.0f} ns/call, {rev} {b:.0f} ns/call, ratio {a / b:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"against": rev, "this_tree_ns": here, "against_ns": there}, indent=1))


if __name__ == "__main__":
    main()
