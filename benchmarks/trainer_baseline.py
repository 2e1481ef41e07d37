"""The baseline efflab's fine-tuning is compared with: a plain HF Trainer + peft LoRA script, written the way
the transformers and peft docs teach it, with nothing of efflab in it.

It trains on the same tokenized rows efflab trains on (results/prepare_data/train.parquet: input ids and
labels with the prompt masked), so model, data, steps and hyperparameters are the same and only how the
training is run differs: here dynamic padding to the longest row of each batch (DataCollatorForSeq2Seq),
the model in the dtype it was saved in, the Trainer's defaults for everything else.

    python benchmarks/trainer_baseline.py --model results/base_model/model \
        --train results/prepare_data/train.parquet --max-steps 12 --json baseline.json

Prints and writes: wall time of trainer.train(), real (non-padding) tokens seen, tokens/s, the loss of every step,
the fraction of the computed token positions that were padding.
With $EFFLAB_PHASES set (by benchmarks/finetune_throughput.py), the one instrument the benchmark puts on both loops,
efflab.measure.phases.PhaseClock, stamps each step's phases into that file; otherwise nothing of efflab is imported.
"""
import argparse
import json
import os
import tempfile
import time

import pandas as pd
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local HF model folder")
    parser.add_argument("--train", required=True, help="a parquet file with input_ids and labels columns")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16)
    parser.add_argument("--dropout", type=float, default=0.05)
    parser.add_argument("--targets", default="all-linear",
                        help="comma-separated module names, or peft's all-linear (default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="from_pretrained's dtype (default auto, transformers 5's default: the saved dtype; "
                             "float32 is what transformers 4 loaded and many tutorials still ask for)")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's own, every core)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=args.dtype)
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=args.r, lora_alpha=args.alpha,
                                             lora_dropout=args.dropout, target_modules=targets))
    frame = pd.read_parquet(args.train)
    train = [{"input_ids": list(map(int, ids)), "labels": list(map(int, labels))}  # a list is a Dataset to the Trainer
             for ids, labels in zip(frame.input_ids, frame.labels, strict=True)]
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
            learning_rate=args.learning_rate, lr_scheduler_type="cosine", warmup_steps=args.warmup_steps,
            logging_steps=1, save_strategy="no", report_to=[], seed=args.seed,
            include_num_input_tokens_seen="non_padding")
        trainer = Trainer(model=model, args=training_args, train_dataset=train,
                          data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100))
        clock = None
        if os.environ.get("EFFLAB_PHASES"):
            from efflab.measure.phases import PhaseClock

            clock = PhaseClock(model.device).attach(trainer, model)
        positions = []  # every token position the model computes, pad tokens included
        model.register_forward_pre_hook(lambda m, a, kw: positions.append(kw["input_ids"].numel()), with_kwargs=True)
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0
        if clock:
            with open(os.environ["EFFLAB_PHASES"], "w") as f:
                json.dump({"steps": clock.steps()}, f)
    tokens = trainer.state.num_input_tokens_seen
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = {"train_s": train_s, "steps": trainer.state.global_step, "tokens_seen": tokens,
              "tokens_per_s": tokens / train_s, "last_loss": losses[-1], "losses": losses, "dtype": str(model.dtype),
              "pad_fraction": 1 - tokens / sum(positions),
              # what it computes with: the Trainer's optimizer, peft's adapter dtype, transformers' attention
              "optimizer": str(getattr(training_args.optim, "value", training_args.optim)),
              "adapter_dtype": str(next(p.dtype for p in model.parameters() if p.requires_grad)).replace("torch.", ""),
              "attn_implementation": getattr(model.config, "_attn_implementation", None),
              "threads": torch.get_num_threads()}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
