"""How fast the ``preempt`` command line starts: ls, verify, prune, inspect, export against importing torch.

    python bench/bench_cli.py                 # a 3-checkpoint save_dir of a small model, 7 rounds

Each command runs as its own process (``python -m preempt ...``), as a user types it; the rounds alternate the
commands so that load on a shared machine falls on all alike. ``python -c "import torch"`` is measured in the
same rounds: the floor a command that imports torch cannot go below. Prints the median seconds of each and its
ratio to the torch import.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build(save_dir: Path) -> None:
    import torch

    from preempt import CheckpointManager

    manager = CheckpointManager(save_dir, keep_last=None)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())
    for step in (1, 2, 3):
        model(torch.randn(8, 256)).sum().backward()
        opt.step()
        manager.save_state(step=step, model=model, optimizer=opt)


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="timings per command, alternated (default 7)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        d = Path(tmp) / "run"
        build(d)
        py = [sys.executable]
        commands = {
            "import torch": [*py, "-c", "import torch"],
            "preempt ls": [*py, "-m", "preempt", "ls", str(d)],
            "preempt verify": [*py, "-m", "preempt", "verify", str(d)],
            "preempt prune (dry run)": [*py, "-m", "preempt", "prune", str(d), "--keep-last", "1"],
            "preempt inspect": [*py, "-m", "preempt", "inspect", str(d)],
            "preempt export": [
                *py,
                "-m",
                "preempt",
                "export",
                str(d),
                "--out",
                str(Path(tmp) / "w.safetensors"),
                "--force",
            ],
        }
        times: dict[str, list[float]] = {k: [] for k in commands}
        for _ in range(args.rounds):
            for name, cmd in commands.items():
                times[name].append(timed(cmd))
    floor = statistics.median(times["import torch"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:26s} {m:6.3f} s   {m / floor:5.2f}x the torch import")


if __name__ == "__main__":
    main()
