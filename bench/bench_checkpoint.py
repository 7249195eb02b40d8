#!/usr/bin/env python
"""Checkpoint benchmark for preempt: save, load+verify, run.step() and hashing, against the disk's own limits.

Run from the repository root::

    python bench/bench_checkpoint.py                 # ~1 GiB state, 3 timed repeats (+1 warm-up) per method
    python bench/bench_checkpoint.py --gib 0.25 --repeats 5 --json bench/results/run.json

Every method runs in a fresh Python process (this script re-invoked with the
hidden ``--only METHOD`` flag), so methods share no allocator state and each
reports its own peak RSS; the parent prints one table of medians and ratios
measured in the same run. See bench/README.md for what each row means.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_DIR = HERE / "results" / "tmp"
GB = 1e9  # throughputs are in decimal GB/s, like dd prints them
GIB = 1 << 30
CHUNK = 64 << 20  # write/read chunk of the raw reference loops (the same as preempt.checkpoint.commit)

N_LAYERS = 12
CONTEXT = 1024

PHASES = ("writes", "load", "step", "xxh3")  # run by the parent, each in one or more fresh processes
CHILD_PHASES = ("write_server", "load_prepare", "load_call", "step", "xxh3")


# --------------------------------------------------------------- helpers


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def fsync_path(path: Path, *, data_only: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        (os.fdatasync if data_only else os.fsync)(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def proc_status() -> dict[str, int]:
    """VmRSS/VmHWM/RssAnon/RssFile of this process in bytes (empty where /proc is missing)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def reset_peak_rss() -> bool:
    """Resets VmHWM (the peak RSS) to the current RSS; False when the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """Peak RSS over a section: VmHWM after a reset when possible, else ru_maxrss (whole-process peak)."""

    def __enter__(self) -> PeakRss:
        self.before = proc_status().get("VmRSS", 0)
        self.exact = reset_peak_rss()
        return self

    def __exit__(self, *exc: Any) -> None:
        st = proc_status()
        if self.exact and "VmHWM" in st:
            self.peak = st["VmHWM"]
        else:
            self.peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.extra = max(0, self.peak - self.before)

    def to_json(self) -> dict[str, Any]:
        return {"rss_before": self.before, "peak_rss": self.peak, "peak_extra": self.extra, "peak_exact": self.exact}


def drop_caches() -> bool:
    """sync + echo 3 > /proc/sys/vm/drop_caches; False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def timed_runs(fn: Any, repeats: int, *, before: Any = None, after: Any = None) -> list[float]:
    """1 untimed-in-the-median warm-up, then ``repeats`` timed calls; returns all times (warm-up first).

    ``before``/``after`` run outside the timed region around every call.
    """
    times = []
    for i in range(repeats + 1):
        if before is not None:
            before(i)
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
        if after is not None:
            after(i)
    return times


def result_row(times: list[float], nbytes: int | None, **extra: Any) -> dict[str, Any]:
    timed = times[1:]
    med = median(timed)
    row = {"warmup_s": times[0], "times_s": timed, "median_s": med, **extra}
    if nbytes is not None:
        row["bytes"] = nbytes
        row["gb_per_s"] = nbytes / med / GB
    return row


# ------------------------------------------------------------------ model


def model_dims(gib: float) -> tuple[int, int]:
    """(d_model, vocab) of a GPT-like stack whose float32 params + 2 AdamW moments come to ``gib`` GiB."""
    target = gib * GIB / 12  # parameters: 4 bytes each, times 3 (param, exp_avg, exp_avg_sq)
    d = max(64, int(round(math.sqrt(target / 200) / 64)) * 64)
    per_layer = 12 * d * d + 13 * d  # qkv, proj, fc1, fc2 weights + biases + 2 LayerNorms
    fixed = N_LAYERS * per_layer + CONTEXT * d + 2 * d  # blocks, position embedding, final LayerNorm
    vocab = max(256, int((target - fixed) // (2 * d)))  # token embedding + untied LM head
    return d, vocab


def build_model(gib: float, device: str = "cpu") -> Any:
    import torch
    from torch import nn

    d, vocab = model_dims(gib)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)

    class TinyGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(CONTEXT, d)
            self.blocks = nn.ModuleList(Block() for _ in range(N_LAYERS))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

    with torch.device(device):
        return TinyGPT()


def describe_state(gib: float) -> dict[str, Any]:
    """Shape facts of the benchmark state, computed on the meta device (no memory)."""
    model = build_model(gib, device="meta")
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    d, vocab = model_dims(gib)
    big = sum(1 for p in params if p.numel() * 4 >= 1 << 20)
    return {
        "d_model": d,
        "vocab": vocab,
        "layers": N_LAYERS,
        "params": numel,
        "param_tensors": len(params),
        "param_tensors_ge_1MiB": big,
        "optimizer_tensors": 3 * len(params),  # exp_avg, exp_avg_sq, step
        "state_bytes": 12 * numel + 4 * len(params),
    }


def build_state(gib: float) -> tuple[Any, Any]:
    """The model and an AdamW that has taken one step (so both moments exist), gradients freed."""
    import torch

    torch.manual_seed(0)
    model = build_model(gib)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p).mul_(1e-3)
    opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt


def flat_tensors(model: Any, opt: Any) -> dict[str, Any]:
    """Model state dict + optimizer state tensors under flat names (what safetensors.save_file needs)."""
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optimizer.state.{pid}.{k}"] = v
    return out


def change_every_tensor(model: Any, opt: Any) -> None:
    """Changes every tensor of the state in place, as a training step would: one value each (untimed or cheap).

    A save writes a changed tensor's bytes whatever number of its values changed; what matters is that each one
    changed. Without it preempt's later saves would find the state as it was at the save before and carry its
    files by hard link (``carry_unchanged``, issue 29): a save of nothing, timed as if it were a write.
    """
    import torch

    with torch.no_grad():
        for t in flat_tensors(model, opt).values():
            t.view(-1)[:1].add_(1)


def carried_files(checkpoint: Path) -> list[str]:
    """The files of a preempt checkpoint that were hard-linked from an earlier one (its manifest's ``carried``): a
    benchmark of writes wants none."""
    from preempt.checkpoint.manifest import Manifest

    path = checkpoint / "manifest.json"
    return sorted(Manifest.from_json(path.read_bytes(), str(path)).carried)


def require_written(checkpoint: Path) -> None:
    """Raises when a preempt checkpoint carried a file instead of writing it (the state did not change)."""
    carried = carried_files(checkpoint)
    if carried:
        raise RuntimeError(f"bench: {checkpoint} carried {carried} from an earlier checkpoint instead of writing them")


def tensors_nbytes(tensors: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------- phases


WRITE_METHODS = ("python_write", "save_preempt", "save_safetensors", "save_torch")


def make_writer(method: str, args: argparse.Namespace, work: Path) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(save(i), after(i), finish(), facts) of one write method; save is timed, after and finish are not.

    ``after`` leaves exactly the newest copy on disk (the previous one is deleted, for preempt by
    its own background pruning, waited for) and calls sync(), so that no method's deletion or journal
    commit spills into the next timed call of any method.
    """
    out = work / method
    out.mkdir()
    facts: dict[str, Any] = {}
    sizes: list[int] = []

    def drop_older(i: int, current: Path) -> None:
        sizes.append(current.stat().st_size)
        for p in out.iterdir():
            if p != current:
                p.unlink()
        os.sync()

    if method == "python_write":
        import numpy as np

        nbytes = describe_state(args.gib)["state_bytes"]
        buf = np.ones(nbytes, dtype=np.uint8)  # touched: page faults are not part of the write
        view = memoryview(buf)
        facts["bytes"] = nbytes

        def save(i: int) -> None:
            fd = os.open(out / f"raw_{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                pos = 0
                while pos < nbytes:
                    pos += os.write(fd, view[pos : pos + CHUNK])
                os.fdatasync(fd)
            finally:
                os.close(fd)
            fsync_dir(out)

        def after(i: int) -> None:
            drop_older(i, out / f"raw_{i}.bin")

        return save, after, lambda: shutil.rmtree(out), facts

    import safetensors.torch
    import torch

    from preempt import CheckpointManager

    t0 = time.perf_counter()
    model, opt = build_state(args.gib)
    facts["build_s"] = time.perf_counter() - t0
    facts["bytes"] = tensors_nbytes(flat_tensors(model, opt))

    if method == "save_preempt":
        manager = CheckpointManager(out, keep_last=1)
        manager.prepare()

        def save(i: int) -> None:
            manager.save_state(step=i + 1, model=model, optimizer=opt)

        def after(i: int) -> None:
            sizes.append(dir_bytes(out / f"step_{i + 1:09d}"))
            if not manager.wait(timeout=120):
                raise RuntimeError("background deletion did not finish in 120 s")
            require_written(out / f"step_{i + 1:09d}")
            change_every_tensor(model, opt)
            os.sync()

        def finish() -> None:
            manager.wait()
            facts["file_bytes"] = sizes[-1]
            shutil.rmtree(out)

        return save, after, finish, facts

    if method == "save_safetensors":

        def save(i: int) -> None:
            path = out / f"ckpt_{i}.safetensors"
            safetensors.torch.save_file(flat_tensors(model, opt), path)
            fsync_path(path)
            fsync_dir(out)

        def after(i: int) -> None:
            drop_older(i, out / f"ckpt_{i}.safetensors")

    elif method == "save_torch":

        def save(i: int) -> None:
            path = out / f"ckpt_{i}.pt"
            with open(path, "wb") as f:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(out)

        def after(i: int) -> None:
            drop_older(i, out / f"ckpt_{i}.pt")

    else:
        raise ValueError(method)

    def finish() -> None:
        facts["file_bytes"] = sizes[-1]
        shutil.rmtree(out)

    return save, after, finish, facts


def phase_write_server(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Serves timed writes of one method: reads "run I" / "end" lines on stdin, answers JSON lines.

    The parent keeps one such fresh process per method alive and interleaves their calls in rounds,
    so that the drift of a shared disk falls on every method alike.
    """
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed goes to stderr, not into the protocol

    save, after, finish, facts = make_writer(args.method, args, work)
    proto.write(json.dumps({"ready": True}) + "\n")
    proto.flush()
    mem = PeakRss()
    mem.__enter__()
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "end":
            break
        i = int(cmd[1])
        t0 = time.perf_counter()
        save(i)
        elapsed = time.perf_counter() - t0
        after(i)
        proto.write(json.dumps({"time_s": elapsed}) + "\n")
        proto.flush()
    mem.__exit__()
    finish()
    return {**facts, **mem.to_json()}


LOAD_VARIANTS = (
    "preempt_load",
    "st_load_file_mmap",
    "st_load_file_mmap_hash",
    "st_load_file_pread",
    "raw_read_hash",
    "first_touch",
)


def load_paths(work: Path) -> tuple[Path, Path]:
    return work / "load" / "preempt", work / "load" / "state.safetensors"


def phase_load_prepare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Writes the files the load rows read: a preempt checkpoint and one safetensors file of the same state."""
    import safetensors.torch

    from preempt import CheckpointManager

    model, opt = build_state(args.gib)
    flat = flat_tensors(model, opt)
    ckpt_dir, st_path = load_paths(work)
    manager = CheckpointManager(ckpt_dir, keep_last=1)
    manager.prepare()
    manager.save_state(step=1, model=model, optimizer=opt)
    safetensors.torch.save_file(flat, st_path)
    fsync_path(st_path)
    return {
        "bytes": tensors_nbytes(flat),
        "preempt_file_bytes": dir_bytes(ckpt_dir),
        "st_file_bytes": st_path.stat().st_size,
        "cold_measurable": drop_caches(),
    }


def phase_load_call(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One timed load in this fresh process (as a resume is: a new process that loads once)."""
    import numpy as np
    import safetensors.torch
    import torch
    import xxhash

    from preempt import CheckpointManager

    ckpt_dir, st_path = load_paths(work)
    manager = CheckpointManager(ckpt_dir, keep_last=1)

    def preempt_load() -> Any:
        return manager.load("latest")

    def st_mmap() -> Any:
        return safetensors.torch.load_file(st_path)

    def st_mmap_hash() -> Any:
        d = safetensors.torch.load_file(st_path)
        h = xxhash.xxh3_128()
        for t in d.values():
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy())
        return d, h.hexdigest()

    def st_pread() -> Any:
        return safetensors.torch.load_file(st_path, backend="pread")

    def raw_read_hash() -> Any:
        with open(st_path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            buf = np.empty(size, dtype=np.uint8)
            view = memoryview(buf)
            got = 0
            while got < size:
                got += f.readinto(view[got : got + CHUNK])
        return buf, xxhash.xxh3_128_hexdigest(buf)

    def first_touch() -> Any:
        size = st_path.stat().st_size
        buf = np.empty(size, dtype=np.uint8)
        buf.fill(1)
        return buf

    fn = {
        "first_touch": first_touch,
        "preempt_load": preempt_load,
        "st_load_file_mmap": st_mmap,
        "st_load_file_mmap_hash": st_mmap_hash,
        "st_load_file_pread": st_pread,
        "raw_read_hash": raw_read_hash,
    }[args.variant]
    if args.mode == "cold" and not drop_caches():
        raise RuntimeError("cannot drop the page cache")
    with PeakRss() as mem:
        t0 = time.perf_counter()
        loaded = fn()
        elapsed = time.perf_counter() - t0
    del loaded
    return {"time_s": elapsed, **mem.to_json()}


def phase_step(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import logging

    import torch

    from preempt import PreemptibleRun

    logging.getLogger("preempt").setLevel(logging.WARNING)
    n = args.step_calls
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    run_dir = work / "step_run"

    def pass_loop(i: int) -> None:
        for _ in range(n):
            pass

    with PreemptibleRun(run_dir, model=model, optimizer=opt, checkpoint_interval=None) as run:

        def step_loop(i: int) -> None:
            for _ in range(n):
                run.step()

        step_times = timed_runs(step_loop, args.repeats)
        pass_times = timed_runs(pass_loop, args.repeats)
        steps = run.global_step
    shutil.rmtree(run_dir)
    return {
        "calls": n,
        "global_step_at_exit": steps,
        "step": result_row(step_times, None, ns_per_call=median(step_times[1:]) / n * 1e9),
        "pass": result_row(pass_times, None, ns_per_call=median(pass_times[1:]) / n * 1e9),
    }


def phase_xxh3(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import numpy as np
    import xxhash

    nbytes = int(args.gib * GIB)
    buf = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    times = timed_runs(lambda i: xxhash.xxh3_128_hexdigest(buf), args.repeats)
    return {"xxh3_128": result_row(times, nbytes)}


def run_phase(args: argparse.Namespace) -> None:
    work = Path(args.dir)
    fn = {
        "write_server": phase_write_server,
        "load_prepare": phase_load_prepare,
        "load_call": phase_load_call,
        "step": phase_step,
        "xxh3": phase_xxh3,
    }.get(args.only)
    res = fn(args, work)
    res["process_peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(args.result).write_text(json.dumps(res))


# ----------------------------------------------------------------- parent


def machine_facts(scratch: Path) -> dict[str, Any]:
    import numpy
    import safetensors
    import torch
    import xxhash

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    fs = "?"
    try:
        p = subprocess.run(["df", "-T", str(scratch)], capture_output=True, text=True)
        fs = p.stdout.splitlines()[1].split()[1]
    except (OSError, IndexError):
        pass
    try:
        import preempt

        preempt_version = getattr(preempt, "__version__", "?")
    except ImportError:
        preempt_version = "not importable"
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "sched_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu": cpu,
        "mem_total_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": numpy.__version__,
        "safetensors": safetensors.__version__,
        "xxhash": xxhash.VERSION,
        "preempt": preempt_version,
        "scratch_fs": fs,
    }


def spawn(phase: str, args: argparse.Namespace, work: Path, *extra: str, quiet: bool = False) -> dict[str, Any]:
    """Runs one phase in a fresh Python process (this script with --only) and returns its JSON result."""
    result = work / f"{phase}.json"
    cmd = child_cmd(phase, args, work, result, *extra)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.stderr.write(p.stdout + p.stderr)
        raise SystemExit(f"bench: phase {phase} {' '.join(extra)} failed (exit {p.returncode}); its output is above")
    res = json.loads(result.read_text())
    result.unlink()
    res["wall_s"] = wall
    if not quiet:
        print(f"  {phase:<17} done in {wall:5.1f} s", file=sys.stderr, flush=True)
    return res


def child_cmd(phase: str, args: argparse.Namespace, work: Path, result: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--only",
        phase,
        "--gib",
        repr(args.gib),
        "--repeats",
        str(args.repeats),
        "--step-calls",
        str(args.step_calls),
        "--dir",
        str(work),
        "--result",
        str(result),
        *extra,
    ]


class WriteServer:
    """A fresh process that performs timed writes of one method on request (see phase_write_server)."""

    def __init__(self, method: str, args: argparse.Namespace, work: Path) -> None:
        self.method = method
        self.result = work / f"{method}.json"
        self.errpath = work / f"{method}.err"
        self.t0 = time.perf_counter()
        with open(self.errpath, "w") as err:
            self.p = subprocess.Popen(
                child_cmd("write_server", args, work, self.result, "--method", method),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self._read()
        print(f"  {method:<17} ready in {time.perf_counter() - self.t0:5.1f} s", file=sys.stderr, flush=True)

    def _read(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            self.p.wait()
            sys.stderr.write(self.errpath.read_text())
            raise SystemExit(f"bench: {self.method} process failed (exit {self.p.returncode}); its output is above")
        return json.loads(line)

    def run(self, i: int) -> float:
        assert self.p.stdin is not None
        self.p.stdin.write(f"run {i}\n")
        self.p.stdin.flush()
        return float(self._read()["time_s"])

    def end(self) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write("end\n")
        self.p.stdin.close()
        if self.p.wait() != 0:
            sys.stderr.write(self.errpath.read_text())
            raise SystemExit(f"bench: {self.method} process failed (exit {self.p.returncode}); its output is above")
        res = json.loads(self.result.read_text())
        self.result.unlink()
        self.errpath.unlink()
        return res

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def dd_once(work: Path, count: int) -> tuple[int, float]:
    """One ``dd ... conv=fdatasync`` of count x 16 MiB; (bytes, seconds) as dd reports them."""
    path = work / "dd.bin"
    p = subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "conv=fdatasync"],
        capture_output=True,
        text=True,
    )
    path.unlink(missing_ok=True)
    os.sync()
    if p.returncode != 0:
        raise SystemExit(f"bench: dd failed: {p.stderr.strip()}")
    # "1073741824 bytes (1.1 GB, 1.0 GiB) copied, 0.77 s, 1.4 GB/s": GB/s recomputed from bytes and seconds
    m = re.search(r"^(\d+) bytes.*copied, ([0-9.,]+) s", p.stderr, re.M)
    if not m:
        raise SystemExit(f"bench: cannot parse dd output: {p.stderr.strip()}")
    return int(m.group(1)), float(m.group(2).replace(",", "."))


def run_writes(args: argparse.Namespace, work: Path, state_bytes: int) -> dict[str, Any]:
    """Rows 1 and 2: dd, raw write and the three saves, one fresh process per method, interleaved in rounds."""
    t0 = time.perf_counter()
    count = max(1, round(state_bytes / (16 << 20)))
    servers: dict[str, WriteServer] = {}
    rows = ("dd", *WRITE_METHODS)
    times: dict[str, list[float]] = {r: [] for r in rows}
    dd_bytes = 0
    try:
        for m in WRITE_METHODS:  # started one after the other: building a 1 GiB state takes both cores
            servers[m] = WriteServer(m, args, work)
        for rnd in range(args.repeats + 1):  # round 0 is the warm-up
            k = rnd % len(rows)
            for r in rows[k:] + rows[:k]:  # rotated, so no method always follows the same one
                if r == "dd":
                    dd_bytes, secs = dd_once(work, count)
                    times["dd"].append(secs)
                else:
                    times[r].append(servers[r].run(rnd))
        finals = {m: s.end() for m, s in servers.items()}
    finally:
        for s in servers.values():
            s.kill()
    cmd = f"dd if=/dev/zero of=FILE bs=16M count={count} conv=fdatasync"
    out: dict[str, Any] = {
        "physical": {
            "dd": result_row(times["dd"], dd_bytes, command=cmd),
            "python_write": result_row(
                times["python_write"], finals["python_write"]["bytes"], **finals["python_write"]
            ),
        }
    }
    for m in WRITE_METHODS[1:]:
        out[m] = {m: result_row(times[m], finals[m]["bytes"], **finals[m])}
    pre = times["save_preempt"][1:]
    out["paired"] = {
        "safetensors_time_over_preempt": [a / b for a, b in zip(times["save_safetensors"][1:], pre, strict=True)],
        "torch_time_over_preempt": [a / b for a, b in zip(times["save_torch"][1:], pre, strict=True)],
    }
    print(f"  {'writes':<17} done in {time.perf_counter() - t0:5.1f} s", file=sys.stderr, flush=True)
    return out


def run_load(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Load rows: files written once, then every timed load in its own fresh process, variants interleaved."""
    t0 = time.perf_counter()
    res = spawn("load_prepare", args, work)
    modes = ("warm", "cold") if res["cold_measurable"] else ("warm",)
    calls: dict[str, list[dict[str, Any]]] = {f"{m}_{v}": [] for m in modes for v in LOAD_VARIANTS}
    for mode in modes:
        for rnd in range(args.repeats + 1):  # the first round is the warm-up
            k = rnd % len(LOAD_VARIANTS)
            for variant in LOAD_VARIANTS[k:] + LOAD_VARIANTS[:k]:  # rotated, so no variant always goes first
                r = spawn("load_call", args, work, "--variant", variant, "--mode", mode, quiet=True)
                calls[f"{mode}_{variant}"].append(r)
    for key, rs in calls.items():
        times = [r["time_s"] for r in rs]
        extra = max(r["peak_extra"] for r in rs[1:])
        res[key] = result_row(times, res["bytes"], peak_extra=extra, peak_exact=all(r["peak_exact"] for r in rs))
    ckpt_dir, st_path = load_paths(work)
    shutil.rmtree(st_path.parent)
    n = sum(len(rs) for rs in calls.values())
    print(
        f"  {'load (' + str(n) + ' procs)':<17} done in {time.perf_counter() - t0:5.1f} s", file=sys.stderr, flush=True
    )
    return res


def fmt_ratio(x: float, target: str | None = None, ok: bool | None = None) -> str:
    s = f"{x:.2f}x"
    if target:
        s += f"  (target {target}: {'PASS' if ok else 'MISS'})"
    return s


def report(facts: dict[str, Any], state: dict[str, Any], args: argparse.Namespace, r: dict[str, Any]) -> str:
    gb = state["state_bytes"] / GB
    lines = []
    w = lines.append
    w(f"preempt checkpoint benchmark  {facts['date']}  host {facts['host']}")
    w(
        f"machine: {facts['cpu_count']} CPUs ({facts['cpu']}), {facts['mem_total_gib']:.0f} GiB RAM, "
        f"Linux {facts['kernel']}, scratch fs {facts['scratch_fs']}"
    )
    w(
        f"software: Python {facts['python']}, torch {facts['torch']} ({facts['torch_threads']} threads), "
        f"numpy {facts['numpy']}, safetensors {facts['safetensors']}, xxhash {facts['xxhash']}, "
        f"preempt {facts['preempt']}"
    )
    w(
        f"state: {state['state_bytes'] / GIB:.3f} GiB ({state['state_bytes']:,} B) = {state['params'] / 1e6:.1f}M "
        f"float32 params + AdamW exp_avg + exp_avg_sq; GPT-like, {state['layers']} layers, d={state['d_model']}, "
        f"vocab={state['vocab']:,}; {state['param_tensors']} param tensors ({state['param_tensors_ge_1MiB']} >= 1 MiB)"
        f" + {state['optimizer_tensors']} optimizer tensors"
    )
    w(
        f"method: one fresh process per method; 1 warm-up + {args.repeats} timed, median shown; rows 1-2 interleaved"
        " in rotating rounds; GB/s = state bytes / time (1 GB = 1e9 B); saves include fsync of files and directory"
    )
    w("")
    hdr = f"{'row':<46}{'median':>10}{'GB/s':>8}  {'peak extra RSS':>15}  ratio / note"
    w(hdr)
    w("-" * (len(hdr) + 30))

    def row(label: str, d: dict[str, Any], note: str = "", mem: bool = True) -> None:
        gbs = f"{d['gb_per_s']:.2f}" if "gb_per_s" in d else ""
        m = ""
        if mem and "peak_extra" in d:
            m = f"{d['peak_extra'] / GIB:6.2f} GiB {d['peak_extra'] / state['state_bytes']:4.2f}x"
        t = d["median_s"]
        ts = f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.3f} s"
        w(f"{label:<46}{ts:>10}{gbs:>8}  {m:>15}  {note}")

    ph = r["physical"]
    w("1. physical reference (same byte count)")
    row(f"   dd bs=16M conv=fdatasync ({ph['dd']['bytes'] / GB:.2f} GB)", ph["dd"], "reference", mem=False)
    pw = ph["python_write"]
    row(
        "   python os.write + fdatasync (64 MiB chunks)",
        pw,
        f"{pw['gb_per_s'] / ph['dd']['gb_per_s']:.2f}x of dd",
        False,
    )
    w("")
    sp, ss, stt = (
        r["save_preempt"]["save_preempt"],
        r["save_safetensors"]["save_safetensors"],
        r["save_torch"]["save_torch"],
    )
    dd = ph["dd"]["gb_per_s"]
    w(f"2. synchronous save of the {gb:.2f} GB state (model + AdamW), fsync included")
    row("   preempt CheckpointManager.save_state", sp, f"{sp['gb_per_s'] / dd:.2f}x of dd")
    row("   safetensors.torch.save_file + fsync", ss, f"{ss['gb_per_s'] / dd:.2f}x of dd")
    row("   torch.save + fsync", stt, f"{stt['gb_per_s'] / dd:.2f}x of dd")
    r_st = sp["gb_per_s"] / ss["gb_per_s"]
    r_torch = stt["median_s"] / sp["median_s"]
    w(f"   => preempt / safetensors throughput: {fmt_ratio(r_st, '>= 0.85x', r_st >= 0.85)}")
    w(f"   => torch.save time / preempt time:   {fmt_ratio(r_torch, '> 1x, preempt faster', r_torch > 1)}")
    pr = r["paired"]
    w(
        "   (same-round paired time ratios: safetensors/preempt "
        + " ".join(f"{x:.2f}" for x in pr["safetensors_time_over_preempt"])
        + "; torch/preempt "
        + " ".join(f"{x:.2f}" for x in pr["torch_time_over_preempt"])
        + ")"
    )
    w(
        f"   (file bytes: preempt {sp['file_bytes']:,}, safetensors {ss['file_bytes']:,}, torch {stt['file_bytes']:,};"
        f" model build {sp['build_s']:.1f} s, untimed)"
    )
    w("")
    ld = r["load"]
    w("3. load, each timed call in its own fresh process (as a resume is); preempt = read + xxh3 of every file + parse")
    for mode in ("warm", "cold"):
        if f"{mode}_preempt_load" not in ld:
            w("   cold: not measurable here (cannot write /proc/sys/vm/drop_caches)")
            continue
        pre = ld[f"{mode}_preempt_load"]
        what = "page cache" if mode == "warm" else "drop_caches before every call"
        w(f"   {mode} ({what})")
        row("     preempt manager.load('latest')", pre)
        for key, label, note in (
            ("st_load_file_mmap", "safetensors load_file (default mmap)", "lazy: no data read"),
            ("st_load_file_mmap_hash", "  load_file mmap + xxh3 of all tensors", "= read + verify"),
            ("st_load_file_pread", "  load_file(backend='pread')", "eager read, no verify"),
            ("raw_read_hash", "raw readinto fresh buffer + xxh3", "copy into new memory, 1 file"),
            ("first_touch", "ref: first touch of fresh memory, no I/O", "np.empty + fill, same bytes"),
        ):
            d = ld[f"{mode}_{key}"]
            ratio = pre["gb_per_s"] / d["gb_per_s"]
            row(f"     {label}", d, f"preempt {ratio:.2f}x  ({note})")
        best = max(ld[f"{mode}_st_load_file_mmap_hash"]["gb_per_s"], ld[f"{mode}_st_load_file_pread"]["gb_per_s"])
        ratio = pre["gb_per_s"] / best
        w(
            f"     => preempt / best eager safetensors load: {fmt_ratio(ratio, '>= 0.9x', ratio >= 0.9)};"
            f" vs lazy default load_file: {pre['gb_per_s'] / ld[f'{mode}_st_load_file_mmap']['gb_per_s']:.3f}x"
        )
    w("")
    s = r["step"]
    net = s["step"]["ns_per_call"] - s["pass"]["ns_per_call"]
    w(f"4. run.step() with nothing due ({s['calls']:,} calls per timing, checkpoint_interval=None)")
    per_call = s["step"]["ns_per_call"]
    verdict = "PASS" if per_call < 2000 else "MISS"
    w(
        f"   run.step() loop: {per_call:.0f} ns/call; bare `pass` loop: {s['pass']['ns_per_call']:.1f} ns/iteration;"
        f" net {net:.0f} ns/call  (target < 2000 ns: {verdict})"
    )
    w("")
    x = r["xxh3"]["xxh3_128"]
    w(
        f"5. xxh3_128 of a {x['bytes'] / GIB:.2f} GiB in-memory buffer: {x['median_s'] * 1e3:.1f} ms ="
        f" {x['gb_per_s']:.1f} GB/s (reference; preempt hashes every byte it writes and reads)"
    )
    w("")
    w("peak extra RSS = peak RSS during the timed calls minus RSS before them (VmHWM reset via /proc/self/clear_refs);")
    w("for mmap loads it counts file pages mapped into the process (page cache), not new anonymous memory.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB (params + 2 AdamW moments), default 1.0")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per method after 1 warm-up, default 3")
    ap.add_argument(
        "--dir", default=str(DEFAULT_DIR), help=f"scratch directory on the disk to test (default {DEFAULT_DIR})"
    )
    ap.add_argument("--json", help="also write all results (every timing) to this JSON file")
    ap.add_argument("--step-calls", type=int, default=1_000_000, help=argparse.SUPPRESS)
    ap.add_argument("--only", choices=CHILD_PHASES, help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=LOAD_VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--method", choices=WRITE_METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("warm", "cold"), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.gib <= 0 or args.repeats < 1:
        ap.error("--gib must be > 0 and --repeats >= 1")
    if args.only:
        run_phase(args)
        return

    scratch = Path(args.dir).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    state = describe_state(args.gib)
    free = shutil.disk_usage(scratch).free
    need = 4 * state["state_bytes"]
    if free < need:
        raise SystemExit(
            f"bench: {scratch} has {free / GIB:.1f} GiB free; this run needs at least 4x the state size,"
            f" {need / GIB:.1f} GiB. Free space, pass a smaller --gib or another --dir."
        )
    facts = machine_facts(scratch)
    work = Path(tempfile.mkdtemp(prefix="bench-", dir=scratch))
    print(f"bench: state {state['state_bytes'] / GIB:.2f} GiB, scratch {work}", file=sys.stderr, flush=True)
    results: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        for phase in PHASES:
            if phase == "writes":
                results.update(run_writes(args, work, state["state_bytes"]))
            elif phase == "load":
                results[phase] = run_load(args, work)
            else:
                results[phase] = spawn(phase, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = time.perf_counter() - t0
    text = report(facts, state, args, results)
    print(text)
    print(f"\ntotal wall time {total:.0f} s", flush=True)
    if args.json:
        out = {
            "facts": facts,
            "args": {"gib": args.gib, "repeats": args.repeats, "dir": str(scratch)},
            "state": state,
            "results": results,
            "total_wall_s": total,
            "table": text,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"results written to {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
