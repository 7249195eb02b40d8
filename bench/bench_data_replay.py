#!/usr/bin/env python
"""What exact data pipelines cost: the per-sample reseeding of ``run.sampler(per_sample_rng=True)``.

Run from the repository root::

    python bench/bench_data_replay.py            # 40 rounds, ~1.5 min
    python bench/bench_data_replay.py --quick    # a few seconds, rough

Measures, on this machine, in one run:

1. the reseeding alone, per sample: ``sample_seed`` (the splitmix hash of
   (seed, epoch, index)) and ``reseed`` (Python's ``random.seed``, NumPy's
   ``np.random.seed``, ``torch.default_generator.manual_seed``), each part on
   its own and together: median over ``--micro-rounds`` rounds of ``--calls``
   calls, the parts interleaved within each round; an empty call gives the
   loop's own overhead (included in every row, not subtracted);
2. the capture/restore of the three generators around each batch fetched in
   the main process (``num_workers=0`` only), per batch and per sample;
3. end to end, one epoch of a DataLoader whose ``__getitem__`` is a realistic
   augmentation (a 3x256x256 uint8 image in memory: random resized crop to 224,
   horizontal flip, brightness/contrast jitter, with torch ops drawing from
   torch's global generator, plus one NumPy and one ``random`` draw), iterated
   exactly as the run does (``LoaderFeed.iterate``) from a ``ResumableSampler``
   with ``per_sample_rng`` True and False (False: the loader is iterated
   plainly), for ``num_workers`` 0 and 2, in ``--rounds`` rounds alternating
   the order on/off, off/on, so that drift on a shared machine hits both alike.
   With workers, each setting has its own loader with ``persistent_workers``,
   warmed up by one epoch: worker start-up (the same with or without the
   option) is left out of the per-sample time.

Seeding a Mersenne Twister defers part of the work to the first draw (which
regenerates the 624-word state), so what a fetch really pays is taken as
(reseed + one draw from each generator) minus (one draw from each). The
dataset's ``__getitem__`` is also timed in-process without and with a reseed
before each call (paired rounds, no DataLoader). The end-to-end ratio on/off
is what a user pays; "reseed / __getitem__" puts the cost of a fetch against
the dataset's own per-sample time, and the "expected" column is
(__getitem__ + reseed [+ capture/restore / batch]) / __getitem__, what the
ratio would be without noise. Torch runs on one thread in the main process
(DataLoader workers use one thread anyway). The table goes to stdout, progress
to stderr; ``--json`` keeps every timing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from preempt.data.replay import LoaderFeed, _capture, _restore, reseed, sample_seed
from preempt.data.sampler import ResumableSampler

EMPTY = "empty call (the loop's overhead)"
RESEED = "`reseed(sample_seed(...))`"
DRAWS = "one draw from each generator"
RESEED_DRAWS = f"{RESEED} + {DRAWS}"


class Images(Dataset):
    """Random uint8 images in memory, augmented on every fetch from the global generators."""

    def __init__(self, n: int, size: int = 256, out: int = 224) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
        self.out = out

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> torch.Tensor:
        img = self.images[i].float().div_(255)
        size = img.shape[-1]
        side = int(size * (0.6 + 0.4 * float(torch.rand(()))))  # random resized crop (torch)
        top, left = (int(torch.randint(0, size - side + 1, ())) for _ in range(2))
        crop = img[:, top : top + side, left : left + side]
        x = F.interpolate(crop[None], size=(self.out, self.out), mode="bilinear", align_corners=False)[0]
        if random.random() < 0.5:  # horizontal flip, drawn from Python's random
            x = x.flip(-1)
        brightness = 1.0 + 0.2 * (float(np.random.rand()) - 0.5)  # colour jitter: NumPy and torch
        contrast = 1.0 + 0.2 * (float(torch.rand(())) - 0.5)
        mean = x.mean()
        return ((x - mean) * contrast + mean) * brightness


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def interleaved_us(fns: dict[str, Callable[[int], object]], calls: int, rounds: int) -> dict[str, list[float]]:
    """Per-call microseconds of each function, ``rounds`` rounds of ``calls`` calls, the functions rotating."""
    names = list(fns)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = fns[name]
            t0 = time.perf_counter()
            for i in range(calls):
                fn(i)
            out[name].append((time.perf_counter() - t0) / calls * 1e6)
    return out


def make_loader(data: Images, per_sample_rng: bool, workers: int, batch: int) -> tuple[DataLoader, LoaderFeed]:
    sampler = ResumableSampler(data, seed=0, per_sample_rng=per_sample_rng)
    loader = DataLoader(data, batch_size=batch, sampler=sampler, num_workers=workers, persistent_workers=workers > 0)
    feed = LoaderFeed(loader, run_seed=0)
    expected = "seeded" if per_sample_rng else "plain"
    if feed.kind != expected:
        raise SystemExit(
            f"LoaderFeed.kind is {feed.kind!r} with per_sample_rng={per_sample_rng}, expected {expected!r}"
        )
    return loader, feed


def epoch_seconds(loader: DataLoader, feed: LoaderFeed, epoch: int) -> float:
    loader.sampler.set_epoch(epoch)
    t0 = time.perf_counter()
    for _ in feed.iterate(loader, epoch):
        pass
    return time.perf_counter() - t0


def check_replay(data: Images, workers: int, batch: int) -> None:
    """Checks that with the option on, batches do not depend on the generators' state before the epoch."""
    loader, feed = make_loader(data, True, workers, batch)
    runs = []
    for junk in (1, 2):
        torch.manual_seed(junk), random.seed(junk), np.random.seed(junk)
        it = feed.iterate(loader, 0)
        runs.append([next(it) for _ in range(2)])
        del it
    feed.stop_workers(loader)
    if not all(torch.equal(a, b) for a, b in zip(runs[0], runs[1], strict=True)):
        raise SystemExit(f"per_sample_rng=True with num_workers={workers}: the batches did not replay")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=512, help="images per epoch (default 512, 96 MiB)")
    p.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    p.add_argument(
        "--rounds",
        type=int,
        default=40,
        help="end-to-end rounds per worker count, one epoch on + one off each (default 40)",
    )
    p.add_argument(
        "--calls", type=int, default=20000, help="calls per round in the reseed micro-benchmark (default 20000)"
    )
    p.add_argument("--micro-rounds", type=int, default=7, help="rounds of the micro-benchmarks (default 7)")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="num_workers values (default 0 2)")
    p.add_argument("--json", help="write every timing to this file")
    p.add_argument("--quick", action="store_true", help="128 samples, 2 rounds, 2000 calls: a rough figure in seconds")
    args = p.parse_args()
    if args.quick:
        args.samples, args.rounds, args.calls, args.micro_rounds = 128, 2, 2000, 3
    torch.set_num_threads(1)
    started = time.perf_counter()
    load = os.getloadavg()
    print(
        f"# bench_data_replay: torch {torch.__version__}, numpy {np.__version__}, {os.cpu_count()} CPUs,"
        f" load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, torch threads {torch.get_num_threads()}"
    )
    results: dict[str, object] = {"args": vars(args), "load_start": load}

    # 1. The reseeding, its parts, and the capture/restore.
    progress("micro-benchmarks ...")
    big = sample_seed(7, 3, 0)  # a real 64-bit sample seed
    parts: dict[str, Callable[[int], object]] = {
        EMPTY: lambda i: None,
        "`sample_seed` (hash of seed, epoch, index)": lambda i: sample_seed(7, 3, i),
        "`random.seed`": lambda i: random.seed(big + i),
        "`np.random.seed`": lambda i: np.random.seed(((big + i) ^ ((big + i) >> 32)) & 0xFFFFFFFF),
        "`torch.default_generator.manual_seed`": lambda i: torch.default_generator.manual_seed(big + i),
        RESEED: lambda i: reseed(sample_seed(7, 3, i)),
        DRAWS: lambda i: (random.random(), np.random.rand(), torch.rand(())),
        RESEED_DRAWS: lambda i: (reseed(sample_seed(7, 3, i)), random.random(), np.random.rand(), torch.rand(())),
    }
    micro = interleaved_us(parts, args.calls, args.micro_rounds)
    keep = interleaved_us(
        {"capture + restore": lambda i: _restore(_capture())}, max(args.calls // 20, 100), args.micro_rounds
    )
    data = Images(args.samples)
    n, fresh = len(data), itertools.count()
    getitem = interleaved_us(
        {
            "plain": lambda i: data[i % n],
            "reseeded": lambda i: (reseed(sample_seed(0, next(fresh), i % n)), data[i % n]),
        },
        args.samples,
        args.micro_rounds,
    )
    med = {k: statistics.median(v) for k, v in micro.items()}
    reseed_us = med[RESEED]
    first_draws_us = med[RESEED_DRAWS] - med[DRAWS]  # the seeding + regenerating the 3 states at the first draw
    keep_us = statistics.median(keep["capture + restore"])
    getitem_us = statistics.median(getitem["plain"])
    getitem_ratios = [a / b for a, b in zip(getitem["reseeded"], getitem["plain"], strict=True)]
    results.update(micro=micro, capture_restore=keep, getitem=getitem)

    # 2. End to end.
    e2e: dict[int, dict[str, list[float]]] = {}
    for workers in args.workers:
        progress(f"end to end, num_workers={workers}: checking the replay, warming up ...")
        check_replay(data, workers, args.batch)
        loaders = {flag: make_loader(data, flag, workers, args.batch) for flag in (True, False)}
        for flag in (True, False):
            epoch_seconds(*loaders[flag], 0)  # warm-up: worker start, allocator, caches
        times: dict[str, list[float]] = {"on": [], "off": []}
        for r in range(args.rounds):
            for flag in (True, False) if r % 2 == 0 else (False, True):
                s = epoch_seconds(*loaders[flag], r + 1)
                times["on" if flag else "off"].append(s / args.samples)
            progress(
                f"  round {r + 1}/{args.rounds}: on {times['on'][-1] * 1e6:.0f} us/sample,"
                f" off {times['off'][-1] * 1e6:.0f} us/sample"
            )
        for loader, feed in loaders.values():
            feed.stop_workers(loader)
        e2e[workers] = times
    results["e2e_seconds_per_sample"] = {str(k): v for k, v in e2e.items()}

    # The tables.
    print("\n| per call | median us | rounds min-max |\n|---|---:|---:|")
    for name, vals in micro.items():
        print(f"| {name} | {med[name]:.2f} | {min(vals):.2f}-{max(vals):.2f} |")
    print(
        f"| **what each fetch pays**: the two rows above subtracted (seeding + first draws) | {first_draws_us:.2f} | |"
    )
    print(
        f"| capture + restore of the 3 generators, per batch (`num_workers=0` only) | {keep_us:.1f} |"
        f" {min(keep['capture + restore']):.1f}-{max(keep['capture + restore']):.1f} |"
    )
    print(f"| ... the same per sample at batch {args.batch} | {keep_us / args.batch:.2f} | |")
    for name, vals in getitem.items():
        print(
            f"| the dataset's `__getitem__` (augmenting one 3x256x256 image), {name} | {statistics.median(vals):.1f} |"
            f" {min(vals):.1f}-{max(vals):.1f} |"
        )
    print(
        f"\nreseed / __getitem__: {100 * reseed_us / getitem_us:.2f} % (seeding alone),"
        f" {100 * first_draws_us / getitem_us:.2f} % (with the first draws)"
    )
    print(
        f"reseed with the first draws + capture/restore per sample / __getitem__ (num_workers=0):"
        f" {100 * (first_draws_us + keep_us / args.batch) / getitem_us:.2f} %"
    )
    print(
        f"__getitem__ reseeded / plain, paired rounds: median {statistics.median(getitem_ratios):.3f}"
        f" ({min(getitem_ratios):.3f}-{max(getitem_ratios):.3f})"
    )

    print(
        f"\n| one epoch, {args.samples} samples, batch {args.batch}, {args.rounds} rounds"
        " | off us/sample | on us/sample | on/off (of medians) | median per-round ratio (min-max) | expected |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for workers, times in e2e.items():
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        ratios = [a / b for a, b in zip(times["on"], times["off"], strict=True)]
        extra = first_draws_us + (keep_us / args.batch if workers == 0 else 0.0)
        print(
            f"| num_workers={workers} | {off * 1e6:.0f} | {on * 1e6:.0f} | {on / off:.3f} |"
            f" {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |"
            f" {(getitem_us + extra) / getitem_us:.3f} |"
        )
    load = os.getloadavg()
    results["load_end"] = load
    print(
        f"\nload average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f};"
        f" total {time.perf_counter() - started:.0f} s"
    )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
