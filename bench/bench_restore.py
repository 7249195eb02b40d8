#!/usr/bin/env python
"""What a restart's restore costs: preempt's verified restore against a cold read of its files and the peers' loads.

Run from the repository root (as root: the page cache is dropped before each cold trial)::

    python bench/bench_restore.py                  # 1 GiB of model + AdamW state, 3 trials per row, cold and warm
    python bench/bench_restore.py --gib 3 --trials 5
    python bench/bench_restore.py --rows none --no-resume --ranks 1,2  # 1 rank against 2, with the floors

The state (``bench_checkpoint.build_state``: a GPT-like model and AdamW's moments) is saved once four ways: a preempt
checkpoint, a DCP checkpoint (no process group), one ``torch.save`` file and one safetensors file. Each trial is a
fresh process that imports torch and builds the model and an optimizer without state first (untimed), as a process
that resumes has them, then times its load:

* ``cat``: a cold read of the preempt checkpoint's files (``cat > /dev/null``): the floor the issue set;
* ``dd_direct``: the same files read by ``dd bs=32M iflag=direct`` one after the other (the files under 1 MiB
  without it): the disk's own speed without the page cache (warm, it reads the disk again);
* ``preempt``: ``CheckpointManager.read`` (every byte hashed against the manifest) and ``state.apply``;
* ``preempt_buffered``: the same, every file read through the page cache as when it is there already
  (``direct_io.cached`` made to say so in that process): what reading ``O_DIRECT`` gains;
* ``dcp``: ``get_state_dict`` (which makes the optimizer's state), ``torch.distributed.checkpoint.load`` into it and
  ``set_state_dict`` (verifies nothing);
* ``torch_load``: ``torch.load(weights_only=True)`` and ``load_state_dict``;
* ``st_xxh3``: ``safetensors.torch.load_file`` and an xxh3 of every tensor, then ``load_state_dict`` of the model.

The resume rows time a whole process, from its start to its restore's end, started cold, and the restore within
it: ``preempt`` alone, and ``preempt`` with ``preempt prefetch DIR`` started beside it (as the SLURM templates and
``preempt supervise`` do), so that the files are read while the child imports torch and builds its model. With
``--ranks 1,2``, ``PreemptibleRun`` is also entered under torchrun by each number of ranks on this machine (each
builds the whole model: replicated state, as under DDP), timed from a barrier to the slowest rank's restore, and
compared with the first number's and with a cold ``cat`` (every row of one run; ``--ranks`` alone is ``1,2``). A warm
trial reads its row's files once (untimed) first. Medians of ``--trials``; every row in the same run, the rows'
order rotated from one trial to the next.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ROWS = ("cat", "dd_direct", "preempt", "preempt_buffered", "dcp", "torch_load", "st_xxh3")
RESUMES = ("resume", "resume_prefetch")


def ranked_row(ranks: int) -> str:
    """The row of ``PreemptibleRun`` entered under torchrun by ``ranks`` ranks on this machine."""
    return f"run_{ranks}rank" if ranks == 1 else f"run_{ranks}ranks"


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def prepare(work: Path, gib: float) -> int:
    import safetensors.torch
    import torch
    import torch.distributed.checkpoint as dcp
    from bench_checkpoint import build_state, flat_tensors
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from preempt import CheckpointManager

    model, opt = build_state(gib)
    manager = CheckpointManager(work / "preempt", keep_last=1)
    manager.prepare()
    manager.save_state(step=1, model=model, optimizer=opt)
    kw = {"no_dist": True} if "no_dist" in dcp.save.__code__.co_varnames else {}
    model_sd, optim_sd = get_state_dict(model, opt)  # keyed by name, as the resuming process asks for them
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(work / "dcp"), **kw)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, work / "state.pt")
    flat = flat_tensors(model, opt)
    safetensors.torch.save_file(flat, str(work / "state.safetensors"))
    with contextlib.suppress(SystemExit):  # a run's own checkpoint (random state, loop), for the --ranks rows
        from preempt import PreemptibleRun

        with PreemptibleRun(work / "run", model=model, optimizer=opt) as run:
            run.step()
            run.request_stop()
            run.step()  # the stop's checkpoint, then SystemExit
    os.sync()
    return sum(t.numel() * t.element_size() for t in flat.values())


def ranked_child(work: Path, gib: float) -> None:
    """One rank of a ``run_*`` trial (under torchrun): the model built (untimed), then ``PreemptibleRun`` entered
    (the lock, the choice of the checkpoint, every rank's restore) timed from a barrier; left by SystemExit, so
    that it saves nothing. Prints this rank's seconds."""
    import torch.distributed as dist
    from bench_checkpoint import build_state

    from preempt import PreemptibleRun

    dist.init_process_group("gloo")
    model, opt = build_state(gib)
    opt.state.clear()
    dist.barrier()
    t0 = time.time()
    try:
        with PreemptibleRun(work / "run", model=model, optimizer=opt):
            took = time.time() - t0
            print(json.dumps({"rank": dist.get_rank(), "seconds": took}), flush=True)
            raise SystemExit(0)
    finally:
        dist.destroy_process_group()


def child(work: Path, gib: float, row: str) -> None:
    """One trial in this fresh process: the model built (untimed), then the load timed; prints the seconds."""
    t_import = time.time()
    import torch
    from bench_checkpoint import build_state

    model, opt = build_state(gib)
    opt.state.clear()  # as in a process that resumes: its optimizer has taken no step yet
    t0 = time.time()
    if row in ("preempt", "preempt_buffered", *RESUMES):
        from preempt import CheckpointManager
        from preempt.checkpoint import direct_io, state

        if row == "preempt_buffered":  # as if every file were in the page cache: read through it
            direct_io.cached = lambda *args, **kwargs: True  # type: ignore[assignment]

        manager = CheckpointManager(work / "preempt", owner=False)
        state.apply(state.Components(model, opt), manager.read(manager.list()[0]))
    elif row == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, opt)  # makes the optimizer's state for DCP to load into
        sd = {"model": model_sd, "optim": optim_sd}
        kw = {"no_dist": True} if "no_dist" in dcp.load.__code__.co_varnames else {}
        dcp.load(sd, checkpoint_id=str(work / "dcp"), **kw)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    elif row == "torch_load":
        sd = torch.load(work / "state.pt", weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
    elif row == "st_xxh3":
        import safetensors.torch
        import xxhash

        flat = safetensors.torch.load_file(str(work / "state.safetensors"))
        h = xxhash.xxh3_128()
        for t in flat.values():
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy())
        h.hexdigest()
        model.load_state_dict({k[len("model.") :]: v for k, v in flat.items() if k.startswith("model.")})
    t1 = time.time()
    # the load's seconds; for a resume row, from the process's start (the parent's clock) to the load's end
    whole = t1 - float(os.environ["BENCH_T0"])
    print(json.dumps({"seconds": whole if row in RESUMES else t1 - t0, "load": t1 - t0, "before": t0 - t_import}))


READS = {  # what each row reads: read once, untimed, before a warm trial
    "cat": ["preempt/step_*/*"],
    "preempt": ["preempt/step_*/*"],
    "dd_direct": ["preempt/step_*/*"],
    "preempt_buffered": ["preempt/step_*/*"],
    "dcp": ["dcp/*"],
    "torch_load": ["state.pt"],
    "st_xxh3": ["state.safetensors"],
}


def trial(work: Path, gib: float, row: str, cold: bool) -> tuple[float, float]:
    """(the row's seconds, the load's own seconds) of one trial."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    if not cold:
        files = [str(p) for pattern in READS[row] for p in sorted(work.glob(pattern))]
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    if row in ("cat", "dd_direct"):
        if cold:
            drop_caches()
        files = [str(p) for p in sorted((work / "preempt").glob("step_*/*"))]
        t0 = time.perf_counter()
        if row == "cat":
            subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
        for f in files if row == "dd_direct" else ():
            direct = ["iflag=direct"] if os.path.getsize(f) >= 1 << 20 else []  # as preempt reads them
            subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=32M", *direct], capture_output=True, check=True)
        took = time.perf_counter() - t0
        return took, took
    if cold:
        drop_caches()
    cmd = [sys.executable, __file__, "--child", row, "--gib", str(gib), "--work", str(work)]
    if row.startswith("run_"):
        ranks = int(row[len("run_") :].split("rank")[0])
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        cmd = [*torchrun, __file__, "--child", "ranked", "--gib", str(gib), "--work", str(work)]
        lines = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout.splitlines()
        took = max(float(json.loads(line)["seconds"]) for line in lines if line.startswith('{"rank"'))
        return took, took
    helper = None
    env["BENCH_T0"] = repr(time.time())
    if row == "resume_prefetch":
        prefetch = [sys.executable, "-m", "preempt", "prefetch", str(work / "preempt")]
        helper = subprocess.Popen(prefetch, stdout=subprocess.DEVNULL)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    if helper is not None:
        helper.wait()
    doc = json.loads(out.strip().splitlines()[-1])
    return float(doc["seconds"]), float(doc["load"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--dir", default=str(HERE / "results"), help="where the four copies of the state are written")
    p.add_argument("--no-resume", action="store_true", help="leave out the resume rows (a preempt without prefetch)")
    p.add_argument(
        "--ranks",
        nargs="?",
        const="1,2",
        default=None,
        help="also PreemptibleRun entered under torchrun by each of these numbers of ranks (default 1,2)",
    )
    p.add_argument("--rows", default=",".join(ROWS), help="the load rows to time (cat and dd_direct always are)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "ranked":
        ranked_child(Path(args.work), args.gib)
        return
    if args.child:
        child(Path(args.work), args.gib, args.child)
        return
    if args.gib <= 0 or args.trials < 1:
        p.error("--gib > 0, --trials >= 1")
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="restore-"))
    try:
        nbytes = prepare(work, args.gib)
        resumes = () if args.no_resume else RESUMES
        chosen = [r for r in ROWS if r in ("cat", "dd_direct", *args.rows.split(","))]
        counts = [int(n) for n in args.ranks.split(",")] if args.ranks else []
        if any(n < 1 for n in counts):
            p.error("--ranks: numbers of ranks >= 1, as 1,2")
        ranked = tuple(ranked_row(n) for n in counts)
        rows = [(r, cold) for cold in (True, False) for r in chosen] + [(r, True) for r in (*resumes, *ranked)]
        times: dict[tuple[str, bool], list[float]] = {k: [] for k in rows}
        loads: dict[tuple[str, bool], list[float]] = {k: [] for k in rows}
        for i in range(args.trials + 1):  # the first round warms up the interpreter's files; not counted
            order = rows[i % len(rows) :] + rows[: i % len(rows)]
            for row, cold in order:
                t, load = trial(work, args.gib, row, cold)
                if i:
                    times[(row, cold)].append(t)
                    loads[(row, cold)].append(load)
        med = {k: statistics.median(v) for k, v in times.items()}
        load_med = {k: statistics.median(v) for k, v in loads.items()}
        floor, direct = med[("cat", True)], med[("dd_direct", True)]

        def paired(r: str, base: str, of: dict[tuple[str, bool], list[float]] = times) -> float:
            """The median of the rounds' ratios: each trial against the same round's cold ``base``."""
            return statistics.median(a / b for a, b in zip(of[(r, True)], times[(base, True)], strict=True))

        print(f"\nstate {nbytes / (1 << 30):.2f} GiB, medians of {args.trials} fresh processes\n")
        print("| row | cold | vs a cold `cat` (paired) | vs `dd` direct (paired) | warm |\n|---|---:|---:|---:|---:|")
        for r in chosen:
            cold = med[(r, True)]
            print(
                f"| {r} | {cold:.2f} s | {cold / floor:.2f}x ({paired(r, 'cat'):.2f}x) |"
                f" {cold / direct:.2f}x ({paired(r, 'dd_direct'):.2f}x) | {med[(r, False)]:.2f} s |"
            )
        if resumes:
            print("\n| started cold | start to restored | of which the restore | restore vs a cold `cat` (paired) |")
            print("|---|---:|---:|---:|")
        for r in resumes:
            load = load_med[(r, True)]
            ratio = paired(r, "cat", loads)
            print(f"| {r} | {med[(r, True)]:.2f} s | {load:.2f} s | {load / floor:.2f}x ({ratio:.2f}x) |")
        if ranked:
            first = ranked[0]
            one = med[(first, True)]
            print(
                f"\n| started cold, under torchrun | PreemptibleRun entered (slowest rank) | vs {counts[0]} rank(s)",
                end="",
            )
            print(" (paired) | vs a cold `cat` (paired) |\n|---|---:|---:|---:|")
            for n, r in zip(counts, ranked, strict=True):
                took = med[(r, True)]
                print(
                    f"| {n} rank(s), one machine | {took:.2f} s | {took / one:.2f}x ({paired(r, first):.2f}x) |"
                    f" {took / floor:.2f}x ({paired(r, 'cat'):.2f}x) |"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
