"""A small Hugging Face Trainer job for the HF tests: real transformers, real DataLoader workers, real signals.

A GPT-2 built from a small config (dropout on), a map-style set whose ``__getitem__`` draws a random crop of a
token stream, a collator that draws too (random token noise), in 2 DataLoader workers by default; AdamW with a
cosine schedule and warm-up; 96 samples in batches of 4, so 24 steps per epoch, 2 epochs. ``preempt.hf.install``
is the one added line. Every optimizer step prints ``step N epoch E``; ``--hold_at_step N`` makes the N-th step of
this process wait, before the run's safe point, until the run has been asked to stop. At the end ``--final_out``
gets the model's and the optimizer's tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import flatten, wait_for_stop  # noqa: E402

import preempt.hf  # noqa: E402
from preempt import _testing  # noqa: E402

VOCAB, CONTEXT = 64, 16


class Crops(Dataset):
    """Random crops of a fixed token stream: each ``__getitem__`` draws where its crop starts."""

    def __init__(self, n: int, seed: int = 3) -> None:
        self.n = n
        self.stream = torch.randint(0, VOCAB, (4096,), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = int(torch.randint(0, len(self.stream) - CONTEXT, ()))
        return {"input_ids": self.stream[start : start + CONTEXT].clone()}


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stacks the crops; replaces one token in twenty with a random one (a draw in the collator)."""
    ids = torch.stack([item["input_ids"] for item in items])
    noise = torch.rand(ids.shape) < 0.05
    ids = torch.where(noise, torch.randint(0, VOCAB, ids.shape), ids)
    return {"input_ids": ids, "labels": ids.clone()}


class Steps(transformers.TrainerCallback):
    """Prints each optimizer step; holds at one until the run is asked to stop (--hold_at_step)."""

    def __init__(self, hold_at: int | None, hold_rank: int = 0, hold_in_eval: int | None = None) -> None:
        self.hold_at = hold_at
        self.hold_rank = hold_rank
        self.hold_in_eval = hold_in_eval
        self.evaluations = 0
        self.in_eval = 0
        self.steps = 0
        self.driver = None

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1
        rank = f"rank {args.process_index} " if args.world_size > 1 else ""
        print(f"{rank}step {state.global_step} epoch {state.epoch:.4f}", flush=True)
        _testing.emit("step", step=state.global_step, rank=args.process_index)
        if self.steps == self.hold_at and args.process_index == self.hold_rank:
            print(f"{rank}holding at step {state.global_step} pid {os.getpid()}", flush=True)
            _testing.emit("holding", point="step", n=state.global_step, rank=args.process_index, pid=os.getpid())
            wait_for_stop(self.driver.run)
            print(f"released at step {state.global_step}", flush=True)

    def on_prediction_step(self, args, state, control, **kwargs):
        if self.in_eval == 0:  # the first batch of an evaluation
            self.evaluations += 1
            if self.evaluations == self.hold_in_eval:
                print(f"holding in evaluation {self.evaluations} after step {state.global_step}", flush=True)
                _testing.emit("holding", point="evaluation", n=self.evaluations, step=state.global_step)
                wait_for_stop(self.driver.run)
        self.in_eval += 1

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.in_eval = 0
        print(f"evaluated at step {state.global_step}: eval_loss {metrics['eval_loss']:.6f}", flush=True)
        _testing.emit("evaluated", step=state.global_step)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save_dir", required=True)
    p.add_argument("--final_out", default=None)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--every_steps", type=int, default=None)
    p.add_argument("--hold_at_step", type=int, default=None)
    p.add_argument("--sync_save", action="store_true")
    p.add_argument("--peft", action="store_true", help="a PEFT LoRA model (peft's get_peft_model)")
    p.add_argument("--width", type=int, default=32, help="GPT-2's n_embd")
    p.add_argument("--hold_rank", type=int, default=0, help="under torchrun: the rank that holds")
    p.add_argument(
        "--eval", action="store_true", help="an evaluation every 6 steps, the best model by eval_loss loaded at the end"
    )
    p.add_argument("--hold_in_eval", type=int, default=None, help="N: the N-th evaluation holds until a stop")
    p.add_argument("--max_steps", type=int, default=-1)
    p.add_argument("--tensorboard", action="store_true", help="report_to TensorBoard (TENSORBOARD_LOGGING_DIR)")
    args = p.parse_args()
    torch.set_num_threads(1)
    transformers.set_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=CONTEXT, n_embd=args.width, n_layer=2, n_head=2, resid_pdrop=0.1, embd_pdrop=0.1
    )
    model = transformers.GPT2LMHeadModel(config)
    if args.peft:  # LoRA on the attention: the base is frozen, the adapters trained
        import peft

        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1, fan_in_fan_out=True)
        model = peft.get_peft_model(model, lora)
    steps = Steps(args.hold_at_step, args.hold_rank, args.hold_in_eval)
    training = transformers.TrainingArguments(
        output_dir=str(Path(args.save_dir).parent / "hf_out"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=args.accumulate,
        num_train_epochs=args.epochs,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=3,
        logging_steps=5,
        save_strategy="steps" if args.eval else "no",
        save_steps=6,
        eval_strategy="steps" if args.eval else "no",
        eval_steps=6,
        load_best_model_at_end=args.eval,
        metric_for_best_model="loss",
        max_steps=args.max_steps,
        report_to=["tensorboard"] if args.tensorboard else [],
        dataloader_num_workers=args.workers,
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model,
        args=training,
        train_dataset=Crops(96),
        eval_dataset=Crops(16, seed=9) if args.eval else None,
        data_collator=collate,
        callbacks=[steps],
    )
    steps.driver = preempt.hf.install(
        trainer,
        args.save_dir,
        checkpoint_interval=None,
        checkpoint_every_steps=args.every_steps,
        async_save=not args.sync_save,
    )
    result = trainer.train()
    if args.final_out:
        write_final(trainer, model, args.final_out, result)
    print(f"done at step {trainer.state.global_step} rank {training.process_index}", flush=True)


def _timing(key: str) -> bool:
    """A figure of the clock (runtime, rates): not compared across runs."""
    return key.endswith("_runtime") or "_per_second" in key


def write_final(trainer: transformers.Trainer, model: torch.nn.Module, path: str, result: Any) -> None:
    """The model's and the optimizer's tensors and the torch generator to ``path`` (under torchrun each rank its own
    file, .rank<R> before the suffix); beside it, ``<path>.json``: what the user reads of the run (the train output,
    the log history, the best metric, the counters, the callbacks' states), the clock's figures left out."""
    out: dict[str, torch.Tensor] = {}
    flatten("model", model.state_dict(), out)
    flatten("optimizer", getattr(trainer.optimizer, "optimizer", trainer.optimizer).state_dict(), out)
    out["rng.torch"] = torch.get_rng_state()
    final = Path(path)
    args = trainer.args
    if args.world_size > 1:
        final = final.with_suffix(f".rank{args.process_index}{final.suffix}")
    save_file(out, str(final))
    state = trainer.state
    read = {
        "training_loss": result.training_loss,
        "metrics": {k: v for k, v in result.metrics.items() if not _timing(k)},
        "log_history": [{k: v for k, v in entry.items() if not _timing(k)} for entry in state.log_history],
        "best_metric": state.best_metric,
        "best_global_step": state.best_global_step,
        "total_flos": state.total_flos,
        "num_input_tokens_seen": state.num_input_tokens_seen,
        "callbacks": {
            type(cb).__name__: cb.state()["attributes"]
            for cb in trainer.callback_handler.callbacks
            if isinstance(cb, transformers.trainer_callback.ExportableState)
        },
        "train_runtime": result.metrics.get("train_runtime"),
    }
    Path(f"{final}.json").write_text(json.dumps(read, indent=1))


if __name__ == "__main__":
    main()
