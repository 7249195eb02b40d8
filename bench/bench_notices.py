"""The loop's cost of ``notices=`` when the metadata service does not answer: a thread that fails and retries.

Alternates runs of ``--steps`` steps of a small linear model without notices and with ``notices="aws"`` pointed at a
port of 127.0.0.1 that nothing listens on (connection refused: the watcher warns once and retries every 5 s), and
prints the median seconds of each. Nothing but 127.0.0.1 is contacted.

    python bench/bench_notices.py --steps 3000 --rounds 5
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import tempfile
import time

import torch

from preempt import PreemptibleRun


def once(notices: bool, steps: int) -> float:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64)
    options = {"notices": "aws"} if notices else {}
    with PreemptibleRun(
        tempfile.mkdtemp(), model=model, optimizer=opt, checkpoint_interval=None, log_file=False, **options
    ) as run:
        t0 = time.perf_counter()
        for _ in run.epochs(1):
            for _ in run.batches(range(steps)):
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
                run.step()
        return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = f"http://127.0.0.1:{port}"
    torch.set_num_threads(1)
    logging.getLogger("preempt").setLevel(logging.ERROR)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for notices in (False, True):
            times[notices].append(once(notices, args.steps))
    for notices in (False, True):
        what = "notices=aws, service unreachable" if notices else "no notices"
        runs = ", ".join(f"{t:.3f}" for t in times[notices])
        print(f"{what:34s} median {statistics.median(times[notices]):.3f} s per {args.steps} steps ({runs})")


if __name__ == "__main__":
    main()
