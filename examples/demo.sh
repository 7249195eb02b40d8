#!/usr/bin/env bash
# Installs preempt, then shows a training being stopped by SIGTERM and resuming exactly where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."

# The CPU build of torch when torch is missing (a plain "pip install torch" fetches a multi-GB CUDA build).
python -c "import torch" 2>/dev/null || pip install torch==2.13.0
pip install -q -e .

save_dir=runs/quickstart
rm -rf "$save_dir"
echo "== 1. train, stopped after 8 s by 'timeout --signal=TERM' (as SLURM's --signal=TERM@N would)"
status=0
timeout --signal=TERM 8 python examples/quickstart.py --save_dir "$save_dir" || status=$?
echo "== exit code $status (124: timeout fired and the run saved and stopped)"
echo "== 2. the same command again: it resumes from the checkpoint, mid-epoch, and finishes"
python examples/quickstart.py --save_dir "$save_dir"
echo "== 3. a third time: the run is complete, so it exits at once with code 0"
python examples/quickstart.py --save_dir "$save_dir"
echo "== 4. what is on disk"
preempt ls "$save_dir"
preempt verify "$save_dir"
