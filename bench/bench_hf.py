"""The Hugging Face Trainer alone against the Trainer with ``preempt.hf.install``, side by side in one run.

    python bench/bench_hf.py                     # the three measures, 3 rounds each (~10 min on 2 cores)
    python bench/bench_hf.py --rounds 5 --steps 80

1. **Time per training step**: a GPT-2 (2 layers, width 256, vocabulary 2048, context 64, batch 8) whose step takes
   ~50 ms on 2 cores, AdamW (the Trainer's default, fused). Each round runs the Trainer alone, with preempt
   installed (no checkpoint due), and with a checkpoint every 20 steps in the background, each in a fresh process,
   each variant first in its turn. The median step time (steps 10 to the end) of each, and the ratios.
2. **A stop at ~1 GiB of state** (a GPT-2 of 8 layers and width 768, 95M parameters, with AdamW's moments, after
   one step), in the same process at the same step: the Trainer's own ``_save_checkpoint`` (the model in
   safetensors, the optimizer, scheduler and RNG through ``torch.save``, no fsync; timed with and without an fsync
   of every file it wrote) against preempt's stop: from ``os.kill(SIGTERM)`` to ``train()`` raising the stop's
   SystemExit(75) with its checkpoint durable.
3. **PEFT LoRA, bytes written per checkpoint** after the first (LoRA r=8 on the attention of the 95M model): the
   Trainer's ``checkpoint-N`` directory against what preempt's checkpoint wrote beside the base it carries.

Figures: bench/README.md. Needs ``pip install -e '.[hf]'`` and peft (the test extra).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, signal, statistics, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
import torch, transformers
import preempt.hf

mode, steps, where = sys.argv[2], int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(2)
transformers.set_seed(0)
big = not mode.startswith("step_")
vocab, width, layers, context, batch = (50257, 768, 8, 128, 2) if big else (2048, 256, 2, 64, 8)
config = transformers.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers, n_head=8, n_positions=context)
model = transformers.GPT2LMHeadModel(config)
if mode.startswith("peft"):
    import peft
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["c_attn"], fan_in_fan_out=True))

class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return batch * (steps + 2)
    def __getitem__(self, i):
        ids = torch.randint(0, config.vocab_size, (context,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}

out = {}

class Clock(transformers.TrainerCallback):
    def __init__(self):
        self.times = []
    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())
        if mode == "stop_trainer" and state.global_step == 1:
            t0 = time.perf_counter()
            trainer._save_checkpoint(trainer.model_wrapped, trial=None)
            t1 = time.perf_counter()
            files = [os.path.join(r, f) for r, _, fs in os.walk(args.output_dir) for f in fs]
            for f in files:
                fd = os.open(f, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            out.update(save_s=t1 - t0, save_fsync_s=time.perf_counter() - t0, bytes=sum(map(os.path.getsize, files)))
            control.should_training_stop = True
        if mode == "stop_preempt" and state.global_step == 1:
            out["t_signal"] = time.perf_counter()
            os.kill(os.getpid(), signal.SIGTERM)

with tempfile.TemporaryDirectory(dir=where) as d:
    clock = Clock()
    peft_trainer = mode == "peft_trainer"
    args = transformers.TrainingArguments(
        output_dir=os.path.join(d, "out"), per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-4,
        report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=10**6,
        save_strategy="steps" if peft_trainer else "no", save_steps=5, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[clock])
    if mode in ("step_preempt", "step_preempt_saves", "stop_preempt", "peft_preempt"):
        every = {"step_preempt_saves": 20, "peft_preempt": 5}.get(mode)
        preempt.hf.install(trainer, os.path.join(d, "run"), checkpoint_interval=None, checkpoint_every_steps=every,
                           async_save=mode != "peft_preempt", log_file=False, progress_every_s=None)
    try:
        trainer.train()
    except SystemExit as e:
        out["t_durable"] = time.perf_counter()
        out["code"] = e.code
    if mode == "peft_trainer":
        sizes = {}
        for c in sorted(os.listdir(args.output_dir)):
            base = os.path.join(args.output_dir, c)
            sizes[c] = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(base) for f in fs)
        out["sizes"] = sizes
    if mode == "peft_preempt":
        from preempt.checkpoint.manager import CheckpointManager
        out["sizes"] = {
            i.step: sum(f.size for f in i.manifest.files.values() if f.carried_from is None)
            for i in CheckpointManager(os.path.join(d, "run"), owner=False, keep_last=None).list()
        }
        out["carried"] = {
            i.step: sum(f.size for f in i.manifest.files.values() if f.carried_from is not None)
            for i in CheckpointManager(os.path.join(d, "run"), owner=False, keep_last=None).list()
        }
    t = clock.times
    out["step_s"] = statistics.median(b - a for a, b in zip(t[10:], t[11:])) if len(t) > 12 else None
    print(json.dumps(out))
"""


def child(mode: str, steps: int, where: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT), mode, str(steps), where], capture_output=True, text=True, check=False
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"{mode}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = p.parse_args()
    where = args.dir or tempfile.gettempdir()
    steps: dict[str, list[float]] = {"step_trainer": [], "step_preempt": [], "step_preempt_saves": []}
    stops: dict[str, list[dict]] = {"stop_trainer": [], "stop_preempt": []}
    modes = list(steps)
    for r in range(args.rounds):
        for mode in modes[r % 3 :] + modes[: r % 3]:  # each variant first in its turn
            steps[mode].append(child(mode, args.steps, where)["step_s"])
        for mode in stops:
            stops[mode].append(child(mode, 4, where))
            os.sync()  # the 1 GiB written is on disk before anything else is timed
        print(f"round {r + 1}: " + ", ".join(f"{m} {v[-1] * 1e3:.1f} ms" for m, v in steps.items()), flush=True)
    med = {m: statistics.median(v) for m, v in steps.items()}
    print("\n1. time per training step (median of the rounds' medians)")
    for m, v in med.items():
        print(f"   {m:20s} {v * 1e3:7.2f} ms   {v / med['step_trainer']:.3f}x the Trainer alone")
    trainer = statistics.median(s["save_s"] for s in stops["stop_trainer"])
    trainer_fsync = statistics.median(s["save_fsync_s"] for s in stops["stop_trainer"])
    assert all(s["code"] == 75 for s in stops["stop_preempt"]), stops["stop_preempt"]
    ours = statistics.median(s["t_durable"] - s["t_signal"] for s in stops["stop_preempt"])
    gib = stops["stop_trainer"][0]["bytes"] / (1 << 30)
    print(f"\n2. a stop at {gib:.2f} GiB (the Trainer's checkpoint-1), median of {args.rounds}")
    print(f"   Trainer _save_checkpoint                    {trainer:6.2f} s (not durable)")
    print(f"   Trainer _save_checkpoint + fsync of its files {trainer_fsync:6.2f} s")
    ratio = ours / trainer_fsync
    print(f"   preempt SIGTERM -> durable, exit 75          {ours:6.2f} s   {ratio:.2f}x the durable save")
    peft_trainer = child("peft_trainer", 15, where)["sizes"]
    peft_ours = child("peft_preempt", 15, where)
    print("\n3. PEFT LoRA (r=8 on c_attn), bytes written per checkpoint")
    print(f"   Trainer checkpoint-N directories: {peft_trainer}")
    print(f"   preempt, written beside the carried base: {peft_ours['sizes']} (carried: {peft_ours['carried']})")


if __name__ == "__main__":
    main()
