"""Supervised fine-tuning with trl's ``SFTTrainer``, with a PEFT LoRA adapter or without, and preempt's one line.

In the shape of trl's SFT examples (written here, not copied): a ``datasets`` Dataset of prompt/completion pairs, an
``SFTConfig`` (``max_length``, logging and evaluation every few steps, ``save_steps``), the model given as an object
and, with ``--peft``, a ``peft.LoraConfig`` passed as ``peft_config`` (SFTTrainer wraps the model itself). No hub: a
tiny Llama built from its config (attention dropout on) and a word-level tokenizer trained here with the ``tokenizers``
library. SFTTrainer counts the tokens it trained on itself (``num_tokens`` in its logs) and averages its own metrics
(``entropy``, ``mean_token_accuracy``) between logs.

``preempt.hf.install(trainer, save_dir)`` is the one added line. The test's options: ``--hold_at_step N`` and
``--final_out`` (``train_hf.Steps``, ``train_hf.write_final``).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import datasets
import torch
import transformers
import trl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_hf import Steps, write_final  # noqa: E402
from train_hf_clm import WORDS, tokenizer_for  # noqa: E402

import preempt.hf  # noqa: E402


def pairs(n: int, seed: int) -> dict[str, list[str]]:
    """Prompts of a few words and completions that repeat them reversed: something a tiny model can learn."""
    r = random.Random(seed)
    prompts = [" ".join(r.choice(WORDS) for _ in range(r.randint(3, 8))) for _ in range(n)]
    return {"prompt": prompts, "completion": [" ".join(reversed(p.split())) for p in prompts]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save_dir", required=True)
    p.add_argument("--final_out", default=None)
    p.add_argument("--hold_at_step", type=int, default=None)
    p.add_argument("--peft", action="store_true", help="LoRA on the attention's projections (peft_config=)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    transformers.set_seed(0)

    data = pairs(72, seed=1)
    tokenizer = tokenizer_for(data["prompt"] + data["completion"])
    split = datasets.Dataset.from_dict(data).train_test_split(test_size=8, seed=0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = transformers.LlamaForCausalLM(config)
    peft_config = None
    if args.peft:
        import peft

        peft_config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    training = trl.SFTConfig(
        output_dir=str(Path(args.save_dir).parent / "sft_out"),
        max_length=32,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        num_train_epochs=args.epochs,
        learning_rate=3e-3,
        logging_steps=3,
        eval_strategy="steps",
        eval_steps=4,
        save_strategy="steps",
        save_steps=4,
        dataloader_num_workers=args.workers,
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
    )
    steps = Steps(args.hold_at_step)
    trainer = trl.SFTTrainer(
        model=model,
        args=training,
        train_dataset=split["train"],
        eval_dataset=split["test"],
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[steps],
    )
    steps.driver = preempt.hf.install(trainer, args.save_dir)
    result = trainer.train()
    if args.final_out:
        write_final(trainer, trainer.model, args.final_out, result)
    print(f"done at step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
