#!/usr/bin/env python
"""The mirror in object storage (issue 32): upload and download throughput against s3fs's own ``put``/``get`` of
the same files, and the training loop's stall with a mirror against without, in one run against one server.

Run from the repository root::

    python bench/bench_mirror.py                      # 1.5 GiB checkpoint, 3 rounds, then the loop (~10 min here)
    python bench/bench_mirror.py --gib 0.25 --repeats 5 --json bench/results/mirror.json

It starts its own S3-compatible server, moto's standalone ``moto_server`` on the loopback address (in memory; the
AWS variables point s3fs at it), builds one checkpoint with ``CheckpointManager.save_state`` (8 square float32
layers and AdamW's moments: model.safetensors ~1/3 of the bytes, state.safetensors ~2/3), then times, in
interleaved rounds (every method once per round, the order rotating, each to a fresh prefix deleted after it):

* upload, preempt: ``Uploader.run_once`` (:mod:`preempt.mirror.uploader`): each local file's xxh3-128 checked
  against the manifest, uploaded (``MirrorStore.put``: s3fs ``put_file``), the manifest last;
* upload, s3fs: ``S3FileSystem.put`` of the same files (a list: s3fs uploads them concurrently);
* download, preempt: ``preempt.mirror.pull.pull`` into an empty save_dir: the manifest read and parsed, each object
  downloaded into a temporary directory, its size and xxh3-128 checked, fdatasync, the manifest, the rename;
* download, s3fs: ``S3FileSystem.get`` of the same objects into an empty directory (no check, no fsync);
* and s3fs doing the same work as preempt: xxh3-128 of each file then ``put``; ``get`` then xxh3-128 and
  fdatasync of each file.

Ratios are s3fs's time / preempt's (>= 0.9x against plain s3fs is the issue's target; the "same work" column
says how much of the gap is the checks and the durability rather than the transfer). Then the loop: a model trained for
``--loop-steps`` steps with an asynchronous checkpoint every ``--every`` steps, once without a mirror and once with
``mirror=`` (a fresh prefix each time), alternating, ``--loop-repeats`` times: the median total time of each and the
ratio (within 2 % is the target). MB/s = checkpoint bytes / seconds, 1 MB = 10^6 bytes. The table goes to stdout,
progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_DIR = HERE / "results" / "tmp"
GIB = 1 << 30
MB = 1e6
LAYERS = 8

sys.path.insert(0, str(ROOT))  # this tree, whatever an installed copy points at


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- the server


class Server:
    """``moto_server -H 127.0.0.1 -p PORT`` (in memory), its AWS variables set in this process; stopped by close."""

    def __init__(self) -> None:
        exe = shutil.which("moto_server")
        if exe is None:
            raise SystemExit("moto_server is not installed: pip install 'moto[server]'")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [exe, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise SystemExit(f"moto_server on port {self.port} did not start")
            time.sleep(0.1)
        os.environ.update(
            AWS_ENDPOINT_URL=self.endpoint,
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_EC2_METADATA_DISABLED="true",
        )

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                return s.recv(12).startswith(b"HTTP/")
        except OSError:
            return False

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


# ------------------------------------------------------------------------------------------ the checkpoint


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


# ------------------------------------------------------------------------------------------ the transfers


def transfers(ckpt: Path, bucket: str, scratch: Path) -> dict[str, Callable[[int], Callable[[], None]]]:
    """Each method as ``prepare(round) -> timed()``: prepare (untimed) readies a fresh prefix or directory."""
    import s3fs

    from preempt.checkpoint import hashed_io
    from preempt.checkpoint.names import MANIFEST
    from preempt.checkpoint.retention import RetentionPolicy
    from preempt.mirror import pull as pulling
    from preempt.mirror.store import MirrorStore
    from preempt.mirror.uploader import Uploader

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    files = sorted(p for p in ckpt.iterdir() if p.name != MANIFEST) + [ckpt / MANIFEST]  # the manifest last
    save_dir, step = ckpt.parent, int(ckpt.name[5:])
    source = f"s3://{bucket}/source"
    MirrorStore(source).steps()  # the bucket answers
    fs.put([str(p) for p in files], [f"{bucket}/source/{ckpt.name}/{p.name}" for p in files])  # what is downloaded

    def fresh(path: Path) -> Path:
        shutil.rmtree(path, ignore_errors=True)
        return path

    def upload_ours(r: int) -> Callable[[], None]:
        prefix = f"{bucket}/up-ours-{r}"
        store = MirrorStore(f"s3://{prefix}")
        uploader = Uploader(store, save_dir, RetentionPolicy(keep_last=None))

        def run() -> None:
            if not uploader.run_once(step) or step not in store.steps():
                raise RuntimeError(f"the uploader did not complete step {step} in s3://{prefix}")

        return run

    def upload_s3fs(r: int) -> Callable[[], None]:
        prefix = f"{bucket}/up-s3fs-{r}/{ckpt.name}"
        return lambda: fs.put([str(p) for p in files], [f"{prefix}/{p.name}" for p in files])

    def download_ours(r: int) -> Callable[[], None]:
        target = fresh(scratch / f"down-ours-{r}")
        store = MirrorStore(source)
        return lambda: pulling.pull(store, target) and None

    def upload_s3fs_checked(r: int) -> Callable[[], None]:
        prefix = f"{bucket}/up-s3fs-{r}/{ckpt.name}"

        def run() -> None:
            for p in files:
                hashed_io.hash_file(p)
            fs.put([str(p) for p in files], [f"{prefix}/{p.name}" for p in files])

        return run

    def download_s3fs_checked(r: int) -> Callable[[], None]:
        target = fresh(scratch / f"down-s3fs-{r}")
        target.mkdir(parents=True)

        def run() -> None:
            fs.get([f"{bucket}/source/{ckpt.name}/{p.name}" for p in files], [str(target / p.name) for p in files])
            for p in files:
                hashed_io.hash_file(target / p.name)
                fd = os.open(target / p.name, os.O_RDONLY)
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)

        return run

    def download_s3fs(r: int) -> Callable[[], None]:
        target = fresh(scratch / f"down-s3fs-{r}")
        target.mkdir(parents=True)
        return lambda: fs.get(
            [f"{bucket}/source/{ckpt.name}/{p.name}" for p in files], [str(target / p.name) for p in files]
        )

    def cleanup(r: int) -> None:
        for prefix in (f"{bucket}/up-ours-{r}", f"{bucket}/up-s3fs-{r}"):
            if fs.exists(prefix):
                fs.rm(prefix, recursive=True)
        for name in (f"down-ours-{r}", f"down-s3fs-{r}"):
            shutil.rmtree(scratch / name, ignore_errors=True)

    return {
        "upload: preempt Uploader (xxh3 checked, manifest last)": upload_ours,
        "upload: s3fs put, same files": upload_s3fs,
        "upload: xxh3 of each file + s3fs put (the same work)": upload_s3fs_checked,
        "download: preempt pull (xxh3 checked, fdatasync, commit)": download_ours,
        "download: s3fs get, same files": download_s3fs,
        "download: s3fs get + xxh3 + fdatasync (the same work)": download_s3fs_checked,
        "_cleanup": cleanup,  # type: ignore[dict-item]
    }


def measure(methods: dict[str, Any], repeats: int) -> dict[str, list[float]]:
    cleanup = methods.pop("_cleanup")
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            fn = methods[name](r)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            cleanup(r)
        log(f"  transfer round {r + 1}/{repeats}: " + ", ".join(f"{times[n][-1]:.2f} s" for n in names))
    return times


# ------------------------------------------------------------------------------------------------ the loop


LOOP_SCRIPT = r"""
import json, sys, time
import torch
from preempt import PreemptibleRun
save_dir, mirror, steps, every, width = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(64, width)
kw = dict(checkpoint_interval=None, checkpoint_every_steps=every, keep_last=2, log_file=False, progress_every_s=None)
if mirror != "-":
    kw["mirror"] = mirror
with PreemptibleRun(save_dir, model=model, optimizer=opt, **kw) as run:
    t0 = time.perf_counter()
    for _ in run.epochs(1):
        for _ in run.batches(range(steps)):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.step()
    loop = time.perf_counter() - t0
print(json.dumps({"loop_s": loop}))
"""


def loop_once(scratch: Path, mirror: str | None, steps: int, every: int, width: int) -> float:
    """The loop's seconds (from the first step to the last, the run's exit and final upload not included)."""
    save_dir = scratch / f"loop-{uuid.uuid4().hex[:8]}"
    try:
        r = subprocess.run(
            [sys.executable, "-c", LOOP_SCRIPT, str(save_dir), mirror or "-", str(steps), str(every), str(width)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=1800,
        )
        if r.returncode != 0:
            raise RuntimeError(f"the loop exited {r.returncode}: {r.stderr[-2000:]}")
        return float(json.loads(r.stdout.strip().splitlines()[-1])["loop_s"])
    finally:
        shutil.rmtree(save_dir, ignore_errors=True)


def loop_rows(scratch: Path, bucket: str, args: argparse.Namespace) -> dict[str, list[float]]:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    times: dict[str, list[float]] = {"without a mirror": [], "with mirror=s3://...": []}
    for r in range(args.loop_repeats):
        for name in list(times)[:: 1 if r % 2 == 0 else -1]:
            prefix = f"{bucket}/loop-{r}"
            times[name].append(
                loop_once(
                    scratch,
                    f"s3://{prefix}" if name.startswith("with") else None,
                    args.loop_steps,
                    args.every,
                    args.width,
                )
            )
            if fs.exists(prefix):
                fs.rm(prefix, recursive=True)
        log(f"  loop round {r + 1}/{args.loop_repeats}: " + ", ".join(f"{v[-1]:.2f} s" for v in times.values()))
    return times


# ---------------------------------------------------------------------------------------------- the tables


def fmt_rows(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            c.ljust(w) if i in (0, len(r) - 1) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]


def transfer_table(times: dict[str, list[float]], nbytes: int) -> list[str]:
    """Ratios: the s3fs row's median time / this row's (> 1: preempt faster), against plain s3fs and against s3fs
    doing the same checks (xxh3 of every byte; and for a download, fdatasync of every file)."""
    rows = [["what", "median", "MB/s", "vs s3fs", "vs same work", "all calls (s)"]]
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        kind = name.split(":")[0]
        plain = next(n for n in times if n.startswith(kind) and "same files" in n)
        same = next(n for n in times if n.startswith(kind) and "same work" in n)
        ours = "preempt" in name
        rows.append(
            [
                name,
                f"{med[name]:.2f} s",
                f"{nbytes / med[name] / MB:.0f}",
                f"{med[plain] / med[name]:.2f}x" if ours else "",
                f"{med[same] / med[name]:.2f}x" if ours else "",
                " ".join(f"{t:.2f}" for t in ts),
            ]
        )
    return fmt_rows(rows)


def loop_table(times: dict[str, list[float]], args: argparse.Namespace) -> list[str]:
    """Median and fastest run of each (the fastest: the run least disturbed by other work on the machine), and the
    ratio of each round's pair (with / without, run one after the other)."""
    rows = [["loop", "median", "fastest", "per step (median)", "vs without (median, fastest)", "all runs (s)"]]
    base = times["without a mirror"]
    for name, ts in times.items():
        m = statistics.median(ts)
        rows.append(
            [
                name,
                f"{m:.2f} s",
                f"{min(ts):.2f} s",
                f"{m / args.loop_steps * 1e3:.1f} ms",
                f"{m / statistics.median(base):.3f}x, {min(ts) / min(base):.3f}x",
                " ".join(f"{t:.2f}" for t in ts),
            ]
        )
    lines = fmt_rows(rows)
    pairs = [w / wo for w, wo in zip(times["with mirror=s3://..."], base, strict=True)]
    lines.append(f"paired ratios, with / without, round by round: {' '.join(f'{r:.3f}' for r in pairs)}")
    lines.append(f"median of the paired ratios: {statistics.median(pairs):.3f}x")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.5, help="checkpoint size in GiB (default 1.5)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds of the transfers (default 3)")
    parser.add_argument("--loop-steps", type=int, default=300, help="steps of each loop run (default 300)")
    parser.add_argument("--every", type=int, default=50, help="a checkpoint every N steps in the loop (default 50)")
    parser.add_argument("--width", type=int, default=1024, help="the loop model's layer width (default 1024)")
    parser.add_argument("--loop-repeats", type=int, default=3, help="loop runs with and without (default 3)")
    parser.add_argument("--no-loop", action="store_true", help="the transfers only")
    parser.add_argument("--no-transfers", action="store_true", help="the loop only")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"scratch directory (default {DEFAULT_DIR})")
    parser.add_argument("--json", type=Path, help="also write every timing to this file")
    args = parser.parse_args()
    if args.gib <= 0 or args.repeats < 1 or args.loop_repeats < 1 or args.every < 1 or args.loop_steps < 1:
        parser.error("--gib must be > 0; --repeats, --loop-repeats, --every and --loop-steps >= 1")
    args.dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    if free < 5 * args.gib * GIB:  # the checkpoint, two downloads, moto's spooled objects
        parser.error(f"{args.dir}: {free / GIB:.1f} GiB free; need {5 * args.gib:.1f} GiB")
    work = args.dir / f"mirror-{os.getpid()}"
    server = Server()
    log(f"moto_server on {server.endpoint}")
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "server": "moto_server (in memory) on 127.0.0.1",
    }
    try:
        import s3fs

        import preempt

        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
        results["versions"] = {"preempt": preempt.__version__, "s3fs": s3fs.__version__}
        if not args.no_transfers:
            log(f"building a {args.gib:g} GiB checkpoint in {work}")
            ckpt = build_checkpoint(work / "run", args.gib)
            files = sorted(ckpt.iterdir())
            results.update(bytes=sum(p.stat().st_size for p in files), files={p.name: p.stat().st_size for p in files})
            results["transfers"] = measure(transfers(ckpt, bucket, work), args.repeats)
        if not args.no_loop:
            results["loop"] = loop_rows(work, bucket, args)
    finally:
        server.close()
        shutil.rmtree(work, ignore_errors=True)
    m = results["machine"]
    print(f"server: {results['server']}")
    print(f"machine: {m['platform']}, {m['cpus']} CPUs, python {m['python']}; s3fs {results['versions']['s3fs']}")
    if "transfers" in results:
        nbytes = results["bytes"]
        print(f"\ntransfers of a {nbytes / GIB:.2f} GiB checkpoint ({len(results['files'])} files),")
        print(f"median of {args.repeats} rounds (interleaved)")
        for line in transfer_table(results["transfers"], nbytes):
            print(f"  {line}")
    if "loop" in results:
        ckpt_mb = 3 * 4 * 4 * (args.width * args.width + args.width) / MB  # params and AdamW's two moments
        print(
            f"\nthe loop: {args.loop_steps} steps, a 4-layer MLP of width {args.width} (AdamW, one thread), an"
            f" asynchronous checkpoint (~{ckpt_mb:.0f} MB) every {args.every} steps, keep_last=2;"
            f" {args.loop_repeats} runs each, with and without alternating"
        )
        for line in loop_table(results["loop"], args):
            print(f"  {line}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
