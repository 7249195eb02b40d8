"""The ``preempt`` command line: look at a save_dir without changing it.

Exit codes: 0 all good; 1 a checkpoint is damaged (``verify``); 2 bad usage,
or no checkpoint where one was expected.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .checkpoint import CheckpointInfo, CheckpointManager
from .commit import COMPLETE

EXIT_OK, EXIT_DAMAGED, EXIT_USAGE = 0, 1, 2


def _size(info: CheckpointInfo) -> int:
    if info.manifest is None:
        return sum(p.stat().st_size for p in info.path.iterdir() if p.is_file()) if info.path.is_dir() else 0
    return sum(d.size for d in info.manifest.files.values())


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _row(info: CheckpointInfo, latest: int | None, best: int | None) -> dict[str, Any]:
    m = info.manifest
    return {
        "name": info.name,
        "step": info.step,
        "epoch": m.cursor.epoch if m else None,
        "batch": m.cursor.batch if m else None,
        "created": m.created if m else None,
        "reason": m.reason if m else None,
        "bytes": _size(info),
        "status": info.status,
        "latest": info.step == latest,
        "best": info.step == best,
        "problem": info.problem,
    }


def cmd_ls(args: argparse.Namespace) -> int:
    manager = CheckpointManager(args.dir, owner=False)
    infos = manager.list()
    latest = next((c.step for c in infos if c.status == "valid"), None)
    bests = manager.candidates("best", infos)
    best = bests[0].step if bests else None
    rows = [_row(c, latest, best) for c in infos]
    complete = (Path(args.dir) / COMPLETE).exists()
    if args.json:
        print(json.dumps({"dir": str(args.dir), "complete": complete, "checkpoints": rows}, indent=1))
        return EXIT_OK
    if not rows:
        print(f"{args.dir}: no checkpoints")
        return EXIT_OK
    print(f"{'checkpoint':<16} {'step':>9} {'epoch':>5} {'batch':>6}  {'saved (local time)':<19} {'size':>10}  status")
    for r in rows:
        when = datetime.datetime.fromtimestamp(r["created"]).strftime("%Y-%m-%d %H:%M:%S") if r["created"] else "-"
        marks = [m for m in ("latest", "best") if r[m]]
        status = r["status"] + (f" ({', '.join(marks)})" if marks else "")
        epoch = "-" if r["epoch"] is None else r["epoch"]
        batch = "-" if r["batch"] is None else r["batch"]
        print(f"{r['name']:<16} {r['step']:>9} {epoch:>5} {batch:>6}  {when:<19} {_human(r['bytes']):>10}  {status}")
        if r["problem"]:
            print(f"    {r['problem']}")
    if complete:
        print("run complete")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    manager = CheckpointManager(args.dir, owner=False)
    infos = manager.list()
    if args.step is not None:
        infos = [c for c in infos if c.step == args.step]
        if not infos:
            print(f"{args.dir}: no checkpoint at step {args.step}", file=sys.stderr)
            return EXIT_USAGE
    if not infos:
        print(f"{args.dir}: no checkpoints", file=sys.stderr)
        return EXIT_USAGE
    results = []
    for info in infos:
        problems = manager.verify(info)
        results.append({"name": info.name, "step": info.step, "ok": not problems, "problems": problems})
    if args.json:
        print(json.dumps({"dir": str(args.dir), "checkpoints": results}, indent=1))
    else:
        for r in results:
            print(f"{r['name']}: {'ok' if r['ok'] else 'DAMAGED'}")
            for p in r["problems"]:
                print(f"    {p}")
    return EXIT_OK if all(r["ok"] for r in results) else EXIT_DAMAGED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="preempt",
        description="Look inside a preempt save_dir.",
        epilog="exit codes: 0 ok; 1 a checkpoint is damaged (verify); 2 bad usage or no checkpoint",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="one row per checkpoint: step, epoch, batch, time, size, status")
    p.add_argument("dir", type=Path)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("verify", help="re-hash every file of every checkpoint (or of STEP)")
    p.add_argument("dir", type=Path)
    p.add_argument("step", type=int, nargs="?", help="only this step")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.dir.is_dir():
        print(f"{args.dir}: not a directory", file=sys.stderr)
        return EXIT_USAGE
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
