#!/usr/bin/env bash
# Installs preempt, then shows the LatentWire example stopped by SIGTERM mid-run and resuming exactly where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."

# The CPU build of torch when torch is missing (a plain "pip install torch" fetches a multi-GB CUDA build).
python -c "import torch" 2>/dev/null || pip install torch==2.13.0
# preempt from this tree, installed (editable) only when `import preempt` finds none or another copy.
python -c "import pathlib, sys, preempt; sys.exit(pathlib.Path(preempt.__file__).resolve().parents[1] != pathlib.Path.cwd())" \
  2>/dev/null || pip install -q -e .

save_dir=runs/latentwire_demo
rm -rf "$save_dir"
# ~35 s of training here; DEMO_SAMPLES makes it smaller (the test suite runs the demo with 512: ~15 s)
args=(examples/latentwire_train.py --samples "${DEMO_SAMPLES:-2048}" --epochs 3 --save_dir "$save_dir")
echo "== 1. train; SIGTERM as soon as the run reports a step of epoch 1 (as SLURM's --signal=TERM@N would, mid-run)"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
python -u "${args[@]}" > >(tee "$log") &  # its progress lines (stdout) to the screen and the log; the log lines stay on stderr
pid=$!
# Stop on progress, not on a clock: however fast or loaded the machine, the signal lands mid-run.
deadline=$((SECONDS + 300))
until grep -qE '^step +[0-9]+/[0-9]+ +epoch 1 ' "$log"; do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "demo.sh: the training ended before reaching epoch 1; see its output above" >&2
        exit 1
    fi
    if ((SECONDS > deadline)); then
        kill -KILL "$pid" 2>/dev/null || true
        echo "demo.sh: no step of epoch 1 within 300 s; gave up" >&2
        exit 1
    fi
    sleep 0.2
done
kill -TERM "$pid"
status=0
wait "$pid" || status=$?
sleep 0.2  # let tee print the last lines
echo "== exit code $status (75: stopped by the signal with its state saved; rerun with --auto_resume to continue)"
if [ "$status" -ne 75 ]; then
    echo "demo.sh: expected exit code 75 from the stopped run, got $status" >&2
    exit 1
fi
echo "== 2. the same command with --auto_resume: it continues from that checkpoint, mid-epoch, and finishes"
python "${args[@]}" --auto_resume
echo "== 3. once more: the run is complete, so it exits at once with code 0 (what a late requeue sees)"
python "${args[@]}" --auto_resume
echo "== 4. what is on disk: every checkpoint file re-hashed against its manifest"
preempt ls "$save_dir"
preempt verify "$save_dir"
echo "== 5. the run's story across its processes: the stop, the resume, and where the time went (goodput)"
if python -c "import matplotlib" 2>/dev/null; then
    preempt report "$save_dir" --plot "${save_dir}_report.png"  # beside the save_dir: nothing is written into it
else
    preempt report "$save_dir"
    echo "(pip install 'preempt-torch[plot]' for a picture: preempt report $save_dir --plot report.png)"
fi
