#!/usr/bin/env python
"""What exact data pipelines cost: the per-sample reseeding of ``run.sampler(per_sample_rng=True)``.

Run from the repository root::

    python bench/bench_data_replay.py            # ~2 min
    python bench/bench_data_replay.py --quick    # a few seconds, rough

Measures, on this machine, in one run:

1. the reseeding alone, per sample: ``sample_seed`` (the splitmix hash of
   (seed, epoch, index)) and ``reseed`` (Python's ``random.seed``, NumPy's
   ``np.random.seed``, ``torch.default_generator.manual_seed``), each part on
   its own and together (median of rounds of ``--calls`` calls);
2. the capture/restore of the three generators that keeps the loop's own
   generators out of a batch fetched in the main process (``num_workers=0``), per batch;
3. end to end, one epoch of a DataLoader whose ``__getitem__`` is a realistic
   augmentation (a 3x256x256 uint8 image in memory: random resized crop to 224,
   horizontal flip, brightness/contrast jitter with torch ops, one NumPy and one
   ``random`` draw), iterated exactly as the run does (``LoaderFeed.iterate``)
   with ``per_sample_rng`` on and off, for ``num_workers`` 0 and 2, in
   alternating rounds so that drift on a shared machine hits both alike.

The ratio on/off of the end-to-end time per sample is what a user pays; the
reseed cost as a share of the per-sample time puts it against the ``__getitem__``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from preempt.data_replay import LoaderFeed, _capture, _restore, reseed, sample_seed
from preempt.sampler import ResumableSampler


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
        side = int(size * (0.6 + 0.4 * float(torch.rand(()))))  # random resized crop
        top, left = (int(torch.randint(0, size - side + 1, ())) for _ in range(2))
        crop = img[:, top : top + side, left : left + side]
        x = F.interpolate(crop[None], size=(self.out, self.out), mode="bilinear", align_corners=False)[0]
        if random.random() < 0.5:  # flip, drawn from Python's random
            x = x.flip(-1)
        brightness = 1.0 + 0.2 * (float(np.random.rand()) - 0.5)  # jitter, drawn from NumPy
        contrast = 1.0 + 0.2 * (float(torch.rand(())) - 0.5)
        mean = x.mean()
        return ((x - mean) * contrast + mean) * brightness


def per_call_us(fn, calls: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def epoch_seconds(data: Images, per_sample_rng: bool, workers: int, batch: int) -> float:
    sampler = ResumableSampler(data, seed=0, per_sample_rng=per_sample_rng)
    loader = DataLoader(data, batch_size=batch, sampler=sampler, num_workers=workers)
    feed = LoaderFeed(loader, run_seed=0)
    t0 = time.perf_counter()
    for _ in feed.iterate(loader, 0):
        pass
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=512, help="images per epoch (default 512)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5, help="alternating on/off rounds per worker count")
    p.add_argument("--calls", type=int, default=20000, help="calls per round in the micro-benchmarks")
    p.add_argument("--quick", action="store_true", help="small sizes: a rough figure in seconds")
    args = p.parse_args()
    if args.quick:
        args.samples, args.rounds, args.calls = 128, 2, 2000
    torch.set_num_threads(1)

    seed = 2**63 + 12345
    parts = {
        "sample_seed (hash)": lambda i: sample_seed(7, 3, i),
        "random.seed": lambda i: random.seed(seed + i),
        "np.random.seed": lambda i: np.random.seed((seed + i) & 0xFFFFFFFF),
        "torch default_generator.manual_seed": lambda i: torch.default_generator.manual_seed(seed + i),
        "sample_seed + reseed (what a fetch pays)": lambda i: reseed(sample_seed(7, 3, i)),
    }
    print(f"# bench_data_replay: torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    print("\n| per sample | us |\n|---|---:|")
    micro = {name: per_call_us(fn, args.calls, args.rounds) for name, fn in parts.items()}
    for name, us in micro.items():
        print(f"| {name} | {us:.2f} |")
    keep = per_call_us(lambda i: _restore(_capture()), max(args.calls // 10, 100), args.rounds)
    print(f"| capture + restore of the 3 generators (per batch, num_workers=0 only) | {keep:.2f} |")

    data = Images(args.samples)
    getitem_us = per_call_us(lambda i: data[i % len(data)], max(args.calls // 100, 20), args.rounds)
    reseed_us = micro["sample_seed + reseed (what a fetch pays)"]
    print(f"| the dataset's __getitem__ (augmenting one 3x256x256 image) | {getitem_us:.1f} |")
    print(f"\nreseed / __getitem__: {100 * reseed_us / getitem_us:.2f} %")
    print(f"\n| one epoch, {args.samples} samples, batch {args.batch} | off (ms/sample) | on (ms/sample) | on/off |")
    print("|---|---:|---:|---|")
    for workers in (0, 2):
        epoch_seconds(data, True, workers, args.batch)  # warm-up: worker start, allocator
        on, off = [], []
        for r in range(args.rounds):
            for flag in (True, False) if r % 2 == 0 else (False, True):
                (on if flag else off).append(epoch_seconds(data, flag, workers, args.batch) / args.samples)
        ratios = sorted(a / b for a, b in zip(on, off, strict=True))
        m_on, m_off = statistics.median(on), statistics.median(off)
        print(
            f"| num_workers={workers} | {m_off * 1e3:.3f} | {m_on * 1e3:.3f} | {m_on / m_off:.3f}"
            f" (rounds {ratios[0]:.3f} to {ratios[-1]:.3f}) |"
        )


if __name__ == "__main__":
    main()
