"""Fine-tune with transformers' Trainer on the infinity engine: the Trainer's loop, callbacks, logging and
checkpoints; the engine's ZeRO-3 partitions, with parameters and optimizer state where the config says.

    python examples/trainer.py --model DIR --data train.jsonl --out finetuned [--config ds.json]
    torchrun --nproc_per_node 2 examples/trainer.py ...        # several ranks

DIR is a directory from save_pretrained (or a model id). --data is JSON lines with a "text" field. The config
is DeepSpeed-style; "auto" values come from the TrainingArguments below, as Hugging Face fills them.
"""

import argparse
import json
import tempfile

from datasets import load_dataset
from transformers import AutoTokenizer, DataCollatorForLanguageModeling, TrainingArguments

from infinity.integrations.transformers import InfinityTrainer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--config", default=None, help="a DeepSpeed-style JSON (default: ZeRO-3, all on NVMe)")
    p.add_argument("--nvme-path", default=None, help="where the swap files go (default: a temp dir)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args()

    if args.config:
        with open(args.config) as f:
            config = json.load(f)
    else:
        nvme = {"device": "nvme", "nvme_path": args.nvme_path or tempfile.mkdtemp(prefix="infinity-")}
        config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                  "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                  "zero_optimization": {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme,
                                        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                        "stage3_param_persistence_threshold": "auto"}}

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    raw = load_dataset("json", data_files=args.data, split="train")

    def tokenize(batch):
        return tokenizer(batch["text"])

    def group(batch):  # concatenate, then cut into windows of --seq tokens
        ids = [t for row in batch["input_ids"] for t in row + [tokenizer.eos_token_id]]
        n = len(ids) // args.seq * args.seq
        return {"input_ids": [ids[i:i + args.seq] for i in range(0, n, args.seq)]}

    train = raw.map(tokenize, batched=True, remove_columns=raw.column_names).map(
        group, batched=True, remove_columns=["input_ids", "attention_mask"])

    training_args = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-4, warmup_steps=2, lr_scheduler_type="cosine", max_grad_norm=1.0, weight_decay=0.0,
        logging_steps=1, save_steps=max(1, args.steps // 2), save_total_limit=1, report_to=[])
    trainer = InfinityTrainer(model=args.model, args=training_args, infinity_config=config, train_dataset=train,
                              data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                              processing_class=tokenizer)
    trainer.train()
    trainer.save_model(args.out)  # a Hugging Face directory: AutoModelForCausalLM.from_pretrained(args.out)
    if trainer.is_world_process_zero():
        print(f"model written to {args.out}")


if __name__ == "__main__":
    main()
