"""GPUMonitor against the real NVML while CUDA works. Needs an NVIDIA GPU."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from preempt.health.monitor import SAMPLES, SUMMARY, THREAD_NAME, GPUMonitor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


def this_gpu(gpus: list[dict]) -> int:
    """The NVML index of CUDA device 0 (NVML ignores CUDA_VISIBLE_DEVICES; the UUID does not lie)."""
    uuid = str(getattr(torch.cuda.get_device_properties(0), "uuid", ""))
    for g in gpus:
        if uuid and g["uuid"] and g["uuid"].removeprefix("GPU-").removeprefix("MIG-") == uuid:
            return g["gpu"]
    assert len(gpus) == 1, f"cannot tell which of {gpus} is CUDA device 0 (uuid {uuid!r})"
    return gpus[0]["gpu"]


def test_monitor_samples_a_busy_gpu(tmp_path):
    mon = GPUMonitor(tmp_path, interval=0.2)
    assert mon.available, mon.reason
    held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB that NVML must see in use
    a = torch.randn(4096, 4096, device="cuda")
    with mon:
        assert [t for t in threading.enumerate() if t.name == THREAD_NAME]
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for _ in range(8):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
        now = mon.read_memory()
    gpu = this_gpu(mon.gpus)
    assert now[gpu] >= held.numel(), f"read_memory {now} should count the 1 GiB held on GPU {gpu}"
    assert mon.read_memory() == {} and not mon.running

    docs = [json.loads(line) for line in (tmp_path / SAMPLES).read_text().splitlines()]
    samples = [d for d in docs if d.get("gpu") == gpu and "event" not in d]
    assert len(samples) >= 3, f"~5 rounds expected in 1 s at 0.2 s, found {len(samples)}"
    for s in samples:
        assert 0 < s["mem_total_bytes"] and held.numel() <= s["mem_used_bytes"] <= s["mem_total_bytes"], s
        for field, low, high in [
            ("util_gpu_pct", 0, 100),
            ("util_mem_pct", 0, 100),
            ("temp_c", 1, 120),
            ("power_w", 1, 2000),
            ("sm_clock_mhz", 1, 5000),
        ]:
            assert s[field] is None or low <= s[field] <= high, (field, s)
    (session,) = json.loads((tmp_path / SUMMARY).read_text())["sessions"]
    (summary,) = [g for g in session["gpus"] if g["gpu"] == gpu]
    assert summary["samples"] == len(samples)
    assert summary["first"] == samples[0]["t"] and summary["last"] == samples[-1]["t"]
    assert summary["max"]["mem_used_bytes"] == max(s["mem_used_bytes"] for s in samples)
    assert summary["max"]["mem_total_bytes"] == samples[0]["mem_total_bytes"] > 0
    busy = [s["util_gpu_pct"] for s in samples if s["util_gpu_pct"] is not None]
    if busy:  # None under MIG, where NVML has no per-instance utilisation
        assert max(busy) > 0, f"the GPU ran matmuls for 1 s but NVML says {busy}"
    del held, a


def test_a_run_with_monitor_gpu_writes_samples_history_and_a_summary(tmp_path):
    """PreemptibleRun(monitor_gpu=...) on a real GPU: the samples, the summary, and GPU memory in history.jsonl."""
    from preempt import PreemptibleRun

    model = torch.nn.Linear(1024, 1024).cuda()
    opt = torch.optim.AdamW(model.parameters())
    kw = dict(monitor_gpu=0.2, progress_every_s=0.2, checkpoint_interval=None)
    with PreemptibleRun(tmp_path, model=model, optimizer=opt, **kw) as run:
        for _ in run.epochs(1):
            deadline = time.monotonic() + 1.5
            for _batch in run.batches(range(100_000)):
                model(torch.randn(256, 1024, device="cuda")).square().mean().backward()
                opt.step()
                opt.zero_grad()
                torch.cuda.synchronize()
                run.step()
                if time.monotonic() > deadline:
                    break
    samples = [json.loads(x) for x in (tmp_path / SAMPLES).read_text().splitlines()]
    assert sum(1 for s in samples if "mem_used_bytes" in s) >= 3, samples[:3]
    summary = json.loads((tmp_path / SUMMARY).read_text())
    assert summary["sessions"], summary
    records = [json.loads(x) for x in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert any(r.get("gpu_mem") for r in records if "metrics" in r), records
