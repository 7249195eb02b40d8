#!/usr/bin/env python
"""How fast ``preempt verify`` re-hashes a checkpoint, against ``cat FILES > /dev/null`` on the same files.

Run from the repository root::

    python bench/bench_verify.py                    # ~1 GiB checkpoint, 3 timed rounds, warm and cold
    python bench/bench_verify.py --gib 0.25 --repeats 5 --json bench/results/verify.json

Builds one checkpoint with ``CheckpointManager.save_state`` (a stack of linear
layers and AdamW after one step: model.safetensors ~1/3 of the bytes,
state.safetensors ~2/3), then times, in interleaved rounds (every method once
per round, the order rotating, so that drift on a shared disk hits all alike):

* ``cat``: ``cat FILES > /dev/null``, the reading reference;
* ``verify (in-process)``: ``preempt.cli.main.main(["verify", DIR])``, output discarded;
* the ways a verify can hash the same files: ``hashed_io.read_file`` (the file's
  private mmap, hashed in place: what verify uses), ``readinto`` a 1 MiB buffer,
  and ``hashed_io.hash_file`` (``readinto`` a 64 MiB buffer);
* then, in rounds of their own, ``verify (subprocess)``: ``python -m preempt verify DIR``,
  interpreter start and imports included, and ``python -c "import preempt"``: that
  start-up cost alone. They run apart because, cold, the read right after a
  process start that pulled torch's libraries from disk was slower whatever
  it was, which skewed the method that came next in the rotation.

*warm*: the files are in the page cache (one untimed ``cat`` first). *cold*:
``sync; echo 3 > /proc/sys/vm/drop_caches`` before every timed call (needs
root; otherwise the cold table says it could not be measured, and why).
GB/s = checkpoint bytes / seconds, 1 GB = 10^9 bytes. The table goes to stdout,
progress to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_DIR = HERE / "results" / "tmp"
GB = 1e9
GIB = 1 << 30
LAYERS = 8

sys.path.insert(0, str(ROOT))  # this tree, whatever an installed copy points at


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def drop_caches() -> str | None:
    """Drops the page cache; None when done, else why it could not be."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        return f"cannot write /proc/sys/vm/drop_caches ({e.strerror or e}); run as root to measure cold reads"
    return None


def build_checkpoint(save_dir: Path, gib: float) -> Path:
    """One checkpoint of about ``gib`` GiB: LAYERS square float32 layers, AdamW moments after one step."""
    import torch

    from preempt import CheckpointManager

    d = max(8, int((gib * GIB / (3 * 4 * LAYERS)) ** 0.5))
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(LAYERS)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    manager = CheckpointManager(save_dir, keep_last=None)
    manager.prepare()
    info = manager.save_state(step=1, model=model, optimizer=opt)
    manager.close(60)
    return info.path


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def read_1mib(path: Path) -> str:
    """xxh3-128 of a file read with ``readinto`` a 1 MiB buffer (stays in the CPU cache)."""
    import xxhash

    digest = xxhash.xxh3_128()
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def methods(ckpt: Path, files: list[Path]) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[], Any]]]:
    """The in-process group and the process-start group (timed in separate rounds)."""
    from preempt.checkpoint import hashed_io
    from preempt.cli import main as cli

    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def cat() -> None:
        with open(os.devnull, "wb") as null:
            subprocess.run(["cat", *map(str, files)], stdout=null, check=True)

    def verify_in_process() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            rc = cli.main(["verify", str(ckpt.parent)])
        if rc != 0:
            raise RuntimeError(f"preempt verify {ckpt}: exit code {rc}")

    def verify_subprocess() -> None:
        subprocess.run(
            [sys.executable, "-m", "preempt", "verify", str(ckpt.parent)],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )

    def import_only() -> None:
        subprocess.run([sys.executable, "-c", "import preempt"], check=True, env=env)

    def loop(hasher: Callable[[Path], Any]) -> Callable[[], None]:
        return lambda: [hasher(p) for p in files] and None

    hashing = {
        "cat FILES > /dev/null": cat,
        "preempt verify, in-process": verify_in_process,
        "mmap + xxh3 (hashed_io.read_file)": loop(lambda p: hashed_io.read_file(p)[1]),
        "readinto 1 MiB + xxh3": loop(read_1mib),
        "readinto 64 MiB + xxh3 (hashed_io.hash_file)": loop(hashed_io.hash_file),
    }
    starting = {
        "cat FILES > /dev/null": cat,
        "preempt verify, subprocess": verify_subprocess,
        'python -c "import preempt"': import_only,
    }
    return hashing, starting


def measure(fns: dict[str, Callable[[], Any]], repeats: int, cold: bool) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            if cold:
                why = drop_caches()
                if why:
                    raise RuntimeError(why)
            times[name].append(timed(fns[name]))
        log(f"  {'cold' if cold else 'warm'} round {r + 1}/{repeats} done")
    return times


def table(times: dict[str, list[float]], nbytes: int) -> list[str]:
    ref = statistics.median(times["cat FILES > /dev/null"])
    rows = [["what", "median", "GB/s", "vs cat", "all calls (s)"]]
    for name, ts in times.items():
        med = statistics.median(ts)
        startup = name.startswith("python -c")
        rows.append(
            [
                name,
                f"{med * 1e3:.0f} ms",
                "" if startup else f"{nbytes / med / GB:.2f}",
                "" if startup else f"{ref / med:.2f}x",
                " ".join(f"{t:.3f}" for t in ts),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.ljust(w) if i in (0, 4) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB (default 1.0)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per temperature (default 3)")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"scratch directory (default {DEFAULT_DIR})")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    parser.add_argument("--json", type=Path, help="also write every timing to this file")
    args = parser.parse_args()
    if args.gib <= 0 or args.repeats < 1:
        parser.error("--gib must be > 0 and --repeats >= 1")
    args.dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    if free < 2 * args.gib * GIB:
        parser.error(f"{args.dir}: {free / GIB:.1f} GiB free; need {2 * args.gib:.1f} GiB")
    work = args.dir / f"verify-{os.getpid()}"
    try:
        log(f"building a {args.gib:g} GiB checkpoint in {work}")
        ckpt = build_checkpoint(work, args.gib)
        manifest = json.loads((ckpt / "manifest.json").read_text())
        files = [ckpt / name for name in sorted(manifest["files"])] + [ckpt / "manifest.json"]
        nbytes = sum(p.stat().st_size for p in files)
        hashing, starting = methods(ckpt, files)
        hashing["cat FILES > /dev/null"]()  # warm the page cache
        results: dict[str, Any] = {
            "bytes": nbytes,
            "files": {p.name: p.stat().st_size for p in files},
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
            "warm": measure(hashing, args.repeats, cold=False),
            "warm_start": measure(starting, args.repeats, cold=False),
        }
        why = drop_caches()
        results["cold"] = None if why else measure(hashing, args.repeats, cold=True)
        results["cold_start"] = None if why else measure(starting, args.repeats, cold=True)
        results["cold_not_measured"] = why
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"checkpoint: {nbytes / GIB:.2f} GiB in {len(files)} files; {args.repeats} rounds per temperature")
    print(f"machine: {results['machine']['platform']}, {results['machine']['cpus']} CPUs")
    for key in ("warm", "warm_start", "cold", "cold_start"):
        temp = key.split("_")[0]
        when = "page cache dropped before every call" if temp == "cold" else "files in the page cache"
        what = "process start" if key.endswith("start") else "hashing"
        print(f"\n{temp}, {what} ({when})")
        if results[key] is None:
            print(f"  not measured: {why}")
            continue
        for line in table(results[key], nbytes):
            print(f"  {line}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
