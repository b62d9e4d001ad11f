"""How compressed Adam moments change training: `infinity train` several ways, one after another, on one model.

    python bench/moments_rounding.py --model gpt-small --steps 300 --seq 64
    python bench/moments_rounding.py --model gpt-25m --steps 300 --seq 64 --fp32
    python bench/moments_rounding.py --llama 4x256 --data corpus.txt --steps 300 --seq 128

Runs the model with fp32 moments, then each of --variants (default: bf16 and int8 moments, both rounded
stochastically; also bf16-nearest and int8-nearest), all from the same seed and data, and prints each run's
largest per-step loss difference from the fp32 run and the difference of the final loss (the mean of the
last 10 steps, as `infinity train` reports it). The optimizer state is kept in host RAM (offload_optimizer
cpu): the moments' numerics are the same on every tier (tests/engine/test_bf16_moments.py and
test_int8_moments.py assert equal losses on none, cpu and nvme), and RAM keeps a 300-step run short.
Everything else is the config's. `--llama LxH` fine-tunes a Hugging Face Llama of L layers x H hidden,
written with save_pretrained and loaded back with from_pretrained by `infinity train --model DIR`, on
--data (a text file; default: the built-in generated text).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "..", "swap_configs", "nvme_offload.json")
VARIANTS = ("bf16-nearest", "bf16-stochastic", "int8-nearest", "int8-stochastic")


def _config(base: dict, variant: str, fp32: bool) -> dict:
    cfg = json.loads(json.dumps(base))
    zero = cfg.setdefault("zero_optimization", {})
    zero["offload_param"] = {"device": "cpu"}
    off = zero["offload_optimizer"] = {"device": "cpu"}
    if variant != "fp32":
        dtype, rounding = variant.split("-")
        off.update(moments_dtype=dtype, moments_rounding=rounding)
    if fp32:
        cfg["bf16"] = {"enabled": False}
        cfg["fp16"] = {"enabled": False}
    return cfg


def _llama(out: str, shape: str) -> str:
    """A small Hugging Face Llama, saved with save_pretrained (and a byte-level tokenizer), as --model."""
    import torch
    import transformers

    layers, hidden = (int(x) for x in shape.lower().split("x"))
    path = os.path.join(out, f"llama-{shape}")
    if os.path.isdir(path):
        return path
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=260, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                                   num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                   max_position_embeddings=512, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    transformers.ByT5Tokenizer(extra_ids=0).save_pretrained(path)
    return path


def _losses(run_dir: str) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: infinity train's)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="base config (default: the shipped nvme_offload.json)")
    p.add_argument("--variants", default="bf16-stochastic,int8-stochastic",
                   help=f"comma-separated, against fp32 moments: {', '.join(VARIANTS)}")
    p.add_argument("--fp32", action="store_true", help="fp32 compute (the config's bf16/fp16 turned off)")
    p.add_argument("--llama", default=None, metavar="LxH", help="fine-tune a saved Hugging Face Llama instead")
    p.add_argument("--data", default=None, help="training text for infinity train --data")
    p.add_argument("--out", default=None, help="where the run directories go (default: a temp dir)")
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: {', '.join(unknown)} not among {', '.join(VARIANTS)}")
    with open(args.config) as f:
        base = json.load(f)
    out = args.out or tempfile.mkdtemp(prefix="moments-")
    os.makedirs(out, exist_ok=True)
    model = _llama(out, args.llama) if args.llama else args.model
    curves = {}
    for name in ["fp32", *variants]:
        cfg_path = os.path.join(out, f"{name}.json")
        with open(cfg_path, "w") as f:
            json.dump(_config(base, name, args.fp32), f)
        run_dir = os.path.join(out, name)
        cmd = [sys.executable, "-m", "infinity", "train", "--config", cfg_path, "--model", model,
               "--steps", str(args.steps), "--out", run_dir]
        if args.seq:
            cmd += ["--seq", str(args.seq)]
        if args.data:
            cmd += ["--data", args.data]
        print("#", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        curves[name] = _losses(run_dir)
    ref = curves["fp32"]
    tail = min(10, len(ref))
    final_ref = sum(ref[-tail:]) / tail
    print(f"model {model}, {args.steps} steps, config {os.path.basename(args.config)} (state in RAM); "
          f"fp32 moments: loss {ref[0]:.4f} -> {final_ref:.4f} (mean of the last {tail})")
    for name in variants:
        c = curves[name]
        diffs = [abs(a - b) for a, b in zip(c, ref)]
        final = sum(c[-tail:]) / tail
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        print(f"{name:16} final {final:.4f} ({final - final_ref:+.4f}, {100 * (final - final_ref) / final_ref:+.2f} %)"
              f"  max |loss diff| {diffs[worst]:.4f} at step {worst + 1}")
    with open(os.path.join(out, "curves.json"), "w") as f:
        print(json.dumps({"model": model, "steps": args.steps, "losses": curves}), file=f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
