"""Fine-tune a Hugging Face model on your own text with the infinity engine, in your own training loop.

    python examples/finetune.py --model DIR --data train.jsonl --out finetuned [--lora 16] [--config ds.json]

DIR is a directory from save_pretrained (or huggingface_hub.snapshot_download). The weights are streamed into
partitions, so no rank ever holds the whole model; parameters and optimizer state live where the config says
(default: the shipped nvme_offload.json, swap files under --nvme-path). The output is a Hugging Face directory:
the full model, or with --lora the adapter (PeftModel.from_pretrained loads it).
"""

import argparse
import json
import tempfile

import torch
import transformers  # before zero_init: from_pretrained inside the block is then streamed into partitions

import infinity
from infinity.config.shipped import shipped_config
from infinity.finetune import data


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--config", default=str(shipped_config("nvme_offload.json")))
    p.add_argument("--nvme-path", default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    args = p.parse_args()

    with open(args.config) as f:
        config = json.load(f)
    config["optimizer"] = {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}}
    config["gradient_clipping"] = 1.0
    config["train_micro_batch_size_per_gpu"] = 4
    nvme = args.nvme_path or tempfile.mkdtemp(prefix="finetune-swap.")
    cfg = infinity.load_config(config, nvme_path=nvme)

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    windows = data.windows(args.data, tokenizer, args.seq)  # tokenized once in a child process, then mapped

    with infinity.zero_init(cfg):
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model)
    if args.lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=args.lora, lora_alpha=2 * args.lora,
                                                           task_type="CAUSAL_LM"))

    with infinity.initialize(model, cfg) as engine:  # the swap files go when the block ends, however it ends
        order = data.Schedule(windows=len(windows), micro=4, world=engine.world_size, accum=1, seed=0)
        for step in range(args.steps):
            batch = data.micro_batch(windows, order.indices(step, engine.rank, 0))
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            if engine.rank == 0:
                print(f"step {step + 1} loss {loss.item():.4f}", flush=True)
        # Streamed, one parameter at a time; model.save_pretrained() would refuse (its values are partitioned).
        engine.save_pretrained(args.out, tokenizer=tokenizer)
    if engine.rank == 0:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
