"""`infinity bench peft`: LoRA on frozen partitioned weights beside full training of the same model, one run.

A Llama-style model is saved with save_pretrained into the work directory, then each mode runs in a fresh
process (so that each peak RSS is its own): `from_pretrained` under zero_init, LoRA through
`peft.get_peft_model` or not, `initialize`, a few steps. Reported per mode, from the engine's counters of the
last step: parameter reads, optimizer reads and writes, the step time, and the peak RSS over the RSS before
zero_init; then LoRA's ratios to full training.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import tempfile

MODES = ("full", "lora")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=None, help="work directory on the disk to measure (default: a temp dir under "
                   "/var/tmp); the model and swap files are removed at the end")
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (on q_proj and v_proj)")
    p.add_argument("--offload", choices=("nvme", "cpu", "none"), default="nvme")
    p.add_argument("--in-process", action="store_true",
                   help="run both modes in this process (quick, for smoke tests; the peak RSS figures then overlap)")
    p.add_argument("--json", action="store_true")


def _one(mode: str, args: dict, model_dir: str, swap_dir: str, out_path: str) -> None:
    import gc

    import torch
    import transformers

    from infinity.engine import initialize, zero_init
    from infinity.memory_stats import peak_rss_bytes, reset_peak, rss_bytes
    from infinity.testing.parity import engine_config

    largest = args["vocab"] * args["hidden"]
    cfg = engine_config(args["offload"], swap_dir, **{
        "zero_optimization.offload_param.buffer_size": largest, "zero_optimization.offload_param.buffer_count": 4,
        "zero_optimization.sub_group_size": largest, "zero_optimization.stage3_prefetch_bucket_size": 2 * largest})
    if args["offload"] != "nvme":
        cfg["zero_optimization"]["offload_param"].pop("buffer_size", None)
        cfg["zero_optimization"]["offload_param"].pop("buffer_count", None)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # torch._dynamo's one-time import
    if mode == "lora":
        import peft
    gc.collect()
    reset_peak()
    baseline = rss_bytes()
    with zero_init(cfg):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    if mode == "lora":
        model = peft.get_peft_model(model, peft.LoraConfig(r=args["rank"], target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.0))
    engine = initialize(model, cfg)
    x = torch.randint(0, args["vocab"], (2, 64), generator=torch.Generator().manual_seed(0))
    try:
        for _ in range(args["steps"]):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
        r = engine.last_report
        out = {"mode": mode, "params": sum(p.numel() for p in model.parameters()),
               "trained": sum(p.numel() for p in model.parameters() if p.requires_grad),
               "param_read_bytes": r.param_read_bytes, "optimizer_read_bytes": r.optimizer_read_bytes,
               "optimizer_write_bytes": r.optimizer_write_bytes, "step_s": r.step_s,
               "peak_rss_over_baseline": peak_rss_bytes() - baseline, "loss": loss.item()}
    finally:
        engine.close()
    with open(out_path, "w") as f:
        json.dump(out, f)


def run(args) -> int:
    import torch
    import transformers

    work = tempfile.mkdtemp(prefix="infinity-bench-peft-", dir=args.dir or "/var/tmp")
    try:
        cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                       num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                       vocab_size=args.vocab, tie_word_embeddings=False)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(os.path.join(work, "model"))
        print(f"bench peft: Llama {args.layers} layers x {args.hidden}, vocab {args.vocab}, offload "
              f"{args.offload}, fp32, batch 2 x 64, {args.steps} steps, LoRA r={args.rank} on q_proj,v_proj; "
              f"work dir {work}")
        ctx = multiprocessing.get_context("spawn")
        results = {}
        for mode in MODES:
            out = os.path.join(work, f"{mode}.json")
            if args.in_process:
                _one(mode, vars(args), os.path.join(work, "model"), work, out)
            else:
                proc = ctx.Process(target=_one, args=(mode, vars(args), os.path.join(work, "model"), work, out))
                proc.start()
                proc.join()
                if proc.exitcode != 0:
                    raise RuntimeError(f"bench peft: the {mode} run exited with {proc.exitcode}")
            with open(out) as f:
                results[mode] = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    for mode in MODES:
        r = results[mode]
        print(f"  {mode:5s} trained {r['trained'] / 1e6:7.2f}M of {r['params'] / 1e6:.2f}M  param reads "
              f"{r['param_read_bytes'] / 1e6:8.1f} MB  optimizer {r['optimizer_read_bytes'] / 1e6:8.1f} + "
              f"{r['optimizer_write_bytes'] / 1e6:8.1f} MB  step {r['step_s']:.2f} s  peak RSS +"
              f"{r['peak_rss_over_baseline'] / 2**20:.0f} MiB")
    full, lora = results["full"], results["lora"]
    print(f"  lora / full: optimizer bytes {lora['optimizer_read_bytes'] / full['optimizer_read_bytes']:.4f}, "
          f"step {lora['step_s'] / full['step_s']:.2f}, peak RSS "
          f"{lora['peak_rss_over_baseline'] / full['peak_rss_over_baseline']:.2f}")
    return 0
