#!/usr/bin/env bash
# Installs preempt, then shows the LatentWire example stopped by SIGTERM mid-run and resuming exactly where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."

# The CPU build of torch when torch is missing (a plain "pip install torch" fetches a multi-GB CUDA build).
python -c "import torch" 2>/dev/null || pip install torch==2.13.0
pip install -q -e .

save_dir=runs/latentwire_demo
rm -rf "$save_dir"
args=(examples/latentwire_train.py --samples 2048 --epochs 3 --save_dir "$save_dir")  # ~35 s of training
echo "== 1. train; 'timeout --signal=TERM 20' sends SIGTERM after 20 s (as SLURM's --signal=TERM@N would)"
status=0
timeout --preserve-status --signal=TERM 20 python "${args[@]}" || status=$?
echo "== exit code $status (75: stopped by the signal with its state saved; rerun with --auto_resume to continue)"
echo "== 2. the same command with --auto_resume: it continues from that checkpoint, mid-epoch, and finishes"
python "${args[@]}" --auto_resume
echo "== 3. once more: the run is complete, so it exits at once with code 0 (what a late requeue sees)"
python "${args[@]}" --auto_resume
echo "== 4. what is on disk: every checkpoint file re-hashed against its manifest"
preempt ls "$save_dir"
preempt verify "$save_dir"
