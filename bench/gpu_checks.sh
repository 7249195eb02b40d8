#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one go (389 s on an H100, 395 s on an H200, 2026-11-28): the GPU tests,
# then the benchmarks whose figures bench/README.md gives for a GPU (bench_finetune.py, a 1.5 GiB base on the GPU,
# last). Run from the repository root; with $OUT set, each part's output is also kept there. torch, safetensors,
# xxhash, numpy and nvidia-ml-py must be importable; preempt is taken from this checkout.
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${OUT:-/tmp/preempt-gpu-checks}
mkdir -p "$out"
py=${PYTHON:-python3}
nvidia-smi -L
"$py" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
rc=0
timeout 240 "$py" -m pytest -q -p no:cacheprovider --timeout 120 tests/gpu 2>&1 | tee "$out/gpu_tests.txt"
rc=$((rc | PIPESTATUS[0]))
mkdir -p bench/results/tmp
timeout 200 "$py" bench/bench_async_gpu.py --gib 1.5 --repeats 3 --dir bench/results/tmp 2>&1 | tee "$out/bench_async_gpu.txt"
rc=$((rc | PIPESTATUS[0]))
timeout 240 "$py" bench/bench_lazy.py --device cuda --gib 1.5 --cycles 8 --every 6 2>&1 | tee "$out/bench_lazy_gpu.txt"
rc=$((rc | PIPESTATUS[0]))
timeout 240 "$py" bench/bench_finetune.py --device cuda --sigterm_trials 1 --json "$out/finetune_gpu.json" 2>&1 |
    tee "$out/bench_finetune_gpu.txt"
rc=$((rc | PIPESTATUS[0]))
exit $rc
