"""An SFT script written the way DeepSpeed-Chat's step-1 main.py is, with one change: the imports.

    deepspeed main.py --model_name_or_path DIR --zero_stage 3 --offload --lora_dim 32 ...
becomes, on infinity:
    torchrun --nproc_per_node 2 ds_sft.py --model_name_or_path DIR --zero_stage 3 --offload --lora_dim 32 ...

It builds the DeepSpeed config in code (as DeepSpeed-Chat's get_train_ds_config does), loads a Hugging Face
causal LM under zero.Init, swaps its Linear layers for its own LoRA layers (recursive_getattr/setattr from
deepspeed.compression.helper), optimizes with a client DeepSpeedCPUAdam over weight-decay groups and an HF
get_scheduler schedule, feeds training_data with a collate_fn, and saves the ZeRO-3 model as its save does:
gather when hasattr(p, "ds_id"), torch.save on rank 0. Rank 0 writes what it saw
to --out (JSON).
"""

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F
import transformers

import infinity.deepspeed as deepspeed
from infinity.deepspeed.accelerator import get_accelerator
from infinity.deepspeed.compression.helper import recursive_getattr, recursive_setattr
from infinity.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from infinity.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from infinity.deepspeed.utils import logger  # noqa: F401 - DeepSpeed-Chat's scripts import it


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name_or_path", required=True)
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--num_train_epochs", type=int, default=1)
    p.add_argument("--lr_scheduler_type", default="cosine")
    p.add_argument("--num_warmup_steps", type=int, default=1)
    p.add_argument("--zero_stage", type=int, default=3)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--offload_device", default="cpu")
    p.add_argument("--nvme_path", default=None)
    p.add_argument("--lora_dim", type=int, default=0)
    p.add_argument("--persistence_threshold", type=float, default=1e4)
    p.add_argument("--lora_module_name", default="layers.")
    p.add_argument("--only_optimize_lora", action="store_true")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


def get_train_ds_config(args, world):
    device = args.offload_device if args.offload else "none"
    offload = {"device": device}
    if device == "nvme":
        offload["nvme_path"] = args.nvme_path
    return {
        "train_batch_size": args.per_device_train_batch_size * world * args.gradient_accumulation_steps,
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "steps_per_print": 10,
        "zero_optimization": {"stage": args.zero_stage, "offload_param": dict(offload),
                              "offload_optimizer": dict(offload), "stage3_param_persistence_threshold": args.persistence_threshold,
                              "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                              "memory_efficient_linear": False},
        "fp16": {"enabled": False, "loss_scale_window": 100},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                          "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8},
    }


class LoRALinear(torch.nn.Module):
    """A frozen Linear weight plus a low-rank update (up @ down), scaled by alpha / r: the shape of the LoRA
    layers DeepSpeed-Chat injects itself, written for this test. Under ZeRO-3 the weight is a placeholder, so
    its size comes from ds_shape."""

    def __init__(self, linear, r, alpha=1.0):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.weight.requires_grad = False
        out_features, in_features = getattr(self.weight, "ds_shape", self.weight.shape)
        self.lora_down = torch.nn.Parameter(torch.empty(in_features, r))
        self.lora_up = torch.nn.Parameter(torch.zeros(r, out_features))
        torch.nn.init.kaiming_uniform_(self.lora_down, a=math.sqrt(5))
        self.scale = alpha / r

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + self.scale * (x @ self.lora_down @ self.lora_up)


def add_lora(model, name_part, r):
    targets = [n for n, m in model.named_modules() if name_part in n and isinstance(m, torch.nn.Linear)]
    for n in targets:
        recursive_setattr(model, n, LoRALinear(recursive_getattr(model, n), r))
    return model


def param_groups(model, weight_decay, skip=("bias", "norm.weight")):
    """Weight decay on matrices, none on biases and norms (trainable parameters only)."""
    decayed, plain = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (plain if any(s in n for s in skip) else decayed).append(p)
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def not_here(params):
    """The ZeRO-3 parameters whose full value is not in memory now."""
    return [p for p in params if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def save_full_weights(engine, rank, out_dir, stage):
    """Save the base model's weights (LoRA factors left out) to out_dir/pytorch_model.bin from rank 0, the way
    DeepSpeed-Chat's ZeRO-3 save goes about it: a parameter that has a ds_id is gathered (every rank joins)
    before its value is read."""
    os.makedirs(out_dir, exist_ok=True)
    model = engine.module if hasattr(engine, "module") else engine
    weights = {}
    for name, p in model.named_parameters():
        if stage == 3 and hasattr(p, "ds_id"):
            with deepspeed.zero.GatheredParameters(not_here([p]), enabled=True):
                value = p.data.cpu().clone()
        else:
            value = p.detach().cpu().clone()
        if "lora_" not in name:
            weights[name] = value
    if rank == 0:
        torch.save(weights, os.path.join(out_dir, "pytorch_model.bin"))


class SFTData(torch.utils.data.Dataset):
    def __init__(self, vocab, n=48, seq=24):
        g = torch.Generator().manual_seed(0)
        self.rows = [(torch.arange(seq) * (i % 5 + 1) + i) % vocab for i in range(n)]
        self.rows = [r if i % 3 else torch.randint(0, vocab, (seq,), generator=g) for i, r in enumerate(self.rows)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


def collate(rows):
    ids = torch.stack([r["input_ids"] for r in rows])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def main():
    args = parse_args()
    deepspeed.init_distributed()
    # DeepSpeed-Chat asks torch.distributed directly, at any world size.
    global_rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    device = torch.device(get_accelerator().device_name())
    torch.manual_seed(1234)
    ds_config = get_train_ds_config(args, world)
    with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=args.zero_stage == 3):
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    if args.lora_dim > 0:
        model = add_lora(model, args.lora_module_name, args.lora_dim)
    groups = param_groups(model, args.weight_decay)
    AdamOptimizer = DeepSpeedCPUAdam if args.offload else FusedAdam
    optimizer = AdamOptimizer(groups, lr=args.learning_rate, betas=(0.9, 0.95))
    data = SFTData(model.config.vocab_size)
    steps_per_epoch = math.ceil(len(data) / (args.per_device_train_batch_size * world *
                                             args.gradient_accumulation_steps))
    lr_scheduler = transformers.get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                              num_warmup_steps=args.num_warmup_steps,
                                              num_training_steps=args.num_train_epochs * steps_per_epoch)
    model, optimizer, loader, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                                  config=ds_config, lr_scheduler=lr_scheduler,
                                                                  training_data=data, collate_fn=collate,
                                                                  dist_init_required=True)
    trainable = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()
                    if p.requires_grad)
    losses, lrs = [], []
    model.train()
    for epoch in range(args.num_train_epochs):
        for step, batch in enumerate(loader):
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = model(**batch, use_cache=False).loss
            model.backward(loss)
            model.step()
            losses.append(loss.item())
            lrs.append(lr_scheduler.get_last_lr()[0])
    torch.distributed.barrier()
    partitioned = len(not_here(list(model.parameters())))
    save_full_weights(model, global_rank, args.output_dir, args.zero_stage)
    truth = model.module_state_dict()
    if global_rank == 0:
        json.dump({"losses": losses, "lrs": lrs, "world": world, "trainable": trainable,
                   "global_steps": model.global_steps, "partitioned": partitioned,
                   "truth": {k: v.float().sum().item() for k, v in truth.items() if "lora_" not in k}},
                  open(args.out, "w"))
        torch.save({k: v for k, v in truth.items() if "lora_" not in k}, os.path.join(args.output_dir, "truth.bin"))


if __name__ == "__main__":
    main()
