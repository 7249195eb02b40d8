"""A causal language model fine-tuned the way transformers' ``run_clm.py`` example does it, with preempt's one line.

Written here in that example's shape (not copied): logging set up as the example sets it (the root logger at WARNING,
transformers' verbosity from the arguments), raw text in a ``datasets`` DatasetDict split into train and validation,
tokenized with ``map`` (batched, the text column removed) and grouped into blocks of ``block_size`` tokens with a
second ``map`` (``group_texts``: labels are the inputs), ``default_data_collator``, a Trainer with ``save_steps``,
``eval_strategy="steps"``, ``load_best_model_at_end`` and an ``EarlyStoppingCallback``, ``train()`` then
``log_metrics``/``save_metrics`` of the result. No hub: the tokenizer is a word-level one trained here with the
``tokenizers`` library on the same text, the model a tiny GPT-2 built from its config (dropout on).

``preempt.hf.install(trainer, save_dir)`` is the one added line. The test's options: ``--hold_at_step N`` (the N-th
step of this process waits until the run was asked to stop), ``--final_out`` (the final tensors and what the user
reads of the run, ``train_hf.write_final``).
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from itertools import chain
from pathlib import Path

import datasets
import tokenizers
import torch
import transformers
from tokenizers import models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_hf import Steps, write_final  # noqa: E402

import preempt.hf  # noqa: E402

logger = logging.getLogger(__name__)

WORDS = (
    "the a one two cat dog bird fish sees eats likes runs sleeps near under over big small red blue old new and"
).split()


def corpus(n: int, seed: int) -> list[str]:
    """Short sentences from a fixed word list, the same for a given seed."""
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(4, 12))) for _ in range(n)]


def tokenizer_for(lines: list[str]) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer trained on ``lines`` with the tokenizers library, wrapped for transformers."""
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "[EOS]"]))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save_dir", required=True)
    p.add_argument("--output_dir", default=None)
    p.add_argument("--final_out", default=None)
    p.add_argument("--hold_at_step", type=int, default=None)
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    # (as set, the evaluations stop improving by the threshold after step 12, and training stops at step 21)
    p.add_argument("--patience", type=int, default=3, help="EarlyStoppingCallback's early_stopping_patience")
    p.add_argument("--threshold", type=float, default=0.006, help="EarlyStoppingCallback's early_stopping_threshold")
    args = p.parse_args()

    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir or str(Path(args.save_dir).parent / "clm_out"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        num_train_epochs=args.epochs,
        learning_rate=2e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        logging_steps=2,
        save_strategy="steps",
        save_steps=3,
        save_total_limit=2,
        eval_strategy="steps",
        eval_steps=3,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        include_num_input_tokens_seen="all",
        dataloader_num_workers=args.workers,
        report_to=[],
        seed=42,
        use_cpu=True,
        disable_tqdm=True,
    )
    # Setup logging, as the example does: WARNING unless this process should log, transformers' verbosity after it
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    log_level = logging.WARNING
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    datasets.disable_progress_bars()
    torch.set_num_threads(1)
    transformers.set_seed(training_args.seed)

    text = corpus(120, seed=0)
    raw = datasets.Dataset.from_dict({"text": text}).train_test_split(test_size=0.1, seed=0)
    raw = datasets.DatasetDict(train=raw["train"], validation=raw["test"])
    tokenizer = tokenizer_for(text)
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=args.block_size,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = transformers.GPT2LMHeadModel(config)

    def tokenize_function(examples):
        return tokenizer([line + " [EOS]" for line in examples["text"]])

    tokenized = raw.map(tokenize_function, batched=True, remove_columns=["text"], desc="Running tokenizer on dataset")
    block_size = args.block_size

    def group_texts(examples):
        # Concatenate all texts, then cut them in blocks of block_size (the remainder dropped)
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total_length = (len(concatenated[next(iter(examples))]) // block_size) * block_size
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)] for k, t in concatenated.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    lm_datasets = tokenized.map(group_texts, batched=True, desc=f"Grouping texts in chunks of {block_size}")
    steps = Steps(args.hold_at_step)
    trainer = transformers.Trainer(
        model=model,
        args=training_args,
        train_dataset=lm_datasets["train"],
        eval_dataset=lm_datasets["validation"],
        processing_class=tokenizer,
        data_collator=transformers.default_data_collator,
        callbacks=[steps, transformers.EarlyStoppingCallback(args.patience, args.threshold)],
    )
    steps.driver = preempt.hf.install(trainer, args.save_dir)

    train_result = trainer.train()
    metrics = train_result.metrics
    metrics["train_samples"] = len(lm_datasets["train"])
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    if args.final_out:
        write_final(trainer, model, args.final_out, train_result)
    print(f"done at step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
