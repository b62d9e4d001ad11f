"""`infinity bench finetune`: the fine-tuning path's three promises, measured in one run.

1. **A corpus bigger than RAM streams.** A jsonl corpus of --corpus-mb is written, then, in a fresh process
   standing in for the trainer, prepared through `infinity.finetune.data.windows` (tokenized and packed in a
   child process into a memory-mapped Arrow file) and every window read once in training order. Reported: the
   trainer-side peak growth of anonymous memory (RssAnon, sampled; target < 100 MB whatever the corpus size),
   the growth of VmHWM, which also counts the mapped file's pages (file-backed, given back under memory
   pressure), and the preparation child's time and peak RSS (it exits before training starts).
2. **from_pretrained keeps its memory bound.** A Llama-style model of --layers x --hidden is saved with
   save_pretrained, then `infinity train --model DIR --data ...` fine-tunes it with parameters and optimizer
   on NVMe and parameter buffers a fraction of the checkpoint (the directory is >= 8x the buffer pool).
   Reported: the peak RSS of the from_pretrained phase over the RSS it started at (the run's run.json), and
   the whole run's peak over its baseline, beside the checkpoint size and the buffer pool.
3. **Data loading stays off the critical path.** From the same run: `data_s` / `step_s` per step (target
   < 5 %).

Everything is written under --dir (default: a temp dir under /var/tmp) and removed at the end.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=None, help="work directory (default: a temp dir under /var/tmp), removed after")
    p.add_argument("--corpus-mb", type=int, default=200, help="size of the streamed corpus (MB)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--json", action="store_true")


def _corpus(path: str, mb: int) -> None:
    from infinity.data import text

    block = text(1 << 20).decode().split("\n\n")
    written = 0
    with open(path, "w") as f:
        i = 0
        while written < mb * 1_000_000:
            line = json.dumps({"text": block[i % len(block)]}) + "\n"
            f.write(line)
            written += len(line)
            i += 1


def _stream_child(model_dir: str, corpus: str, seq: int, cache: str) -> None:
    """In a fresh process: tokenize + pack, then read every window in order; print the RSS figures."""
    import datasets  # noqa: F401 - the libraries' own memory (pyarrow, pandas) is code, not the corpus
    import transformers

    from infinity.finetune import data
    from infinity.memory_stats import PeakSampler, anon_bytes, peak_rss_bytes, reset_peak, rss_bytes

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    tok(["warm up the tokenizer's thread pool"] * 64)
    reset_peak()
    base, anon_base = rss_bytes(), anon_bytes()
    with PeakSampler(read=anon_bytes) as anon:
        t0 = time.perf_counter()
        w = data.windows(corpus, tok, seq, cache_dir=cache)
        prepare_s = time.perf_counter() - t0
        sched = data.Schedule(windows=len(w), micro=8, world=1, accum=1, seed=0)
        t0 = time.perf_counter()
        n = 0
        for step in range(sched.steps_per_epoch):
            n += data.micro_batch(w, sched.indices(step, 0, 0))["input_ids"].numel()
        read_s = time.perf_counter() - t0
    anon_peak = anon.peak
    meta = max(glob.glob(os.path.join(cache, "infinity-windows", "*", "meta.json")), key=os.path.getmtime)
    with open(meta) as f:
        prepared = json.load(f)["prepared"]
    print(json.dumps({"windows": len(w), "tokens": n, "prepare_s": prepare_s, "read_s": read_s,
                      "rss_growth_bytes": peak_rss_bytes() - base, "anon_growth_bytes": anon_peak - anon_base,
                      "child_peak_rss_bytes": prepared["peak_rss_bytes"]}))


def run(args) -> int:
    from infinity.testing.tiny_hf import make_model_dir

    own = args.dir is None
    work = args.dir or tempfile.mkdtemp(prefix="infinity-bench-finetune.", dir="/var/tmp")
    os.makedirs(work, exist_ok=True)
    try:
        model_dir = os.path.join(work, "model")
        make_model_dir(model_dir, "llama", hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                       num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                       num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=max(args.seq, 128))
        ckpt_bytes = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
                         if f.endswith(".safetensors"))
        corpus = os.path.join(work, "corpus.jsonl")
        _corpus(corpus, args.corpus_mb)
        print(f"bench finetune: corpus {os.path.getsize(corpus) / 1e6:.0f} MB, model {ckpt_bytes / 1e6:.0f} MB "
              f"({args.layers} layers x {args.hidden}), seq {args.seq}, work dir {work}", flush=True)
        child = subprocess.run([sys.executable, "-c", "import sys; from infinity.bench.finetune import _stream_child;"
                                " _stream_child(*sys.argv[1:3], int(sys.argv[3]), sys.argv[4])", model_dir, corpus,
                                str(args.seq), os.path.join(work, "cache")], capture_output=True, text=True,
                               check=True)
        stream = json.loads(child.stdout.strip().splitlines()[-1])
        train = _train(args, work, model_dir, corpus, ckpt_bytes)
        result = {"corpus_bytes": os.path.getsize(corpus), "stream": stream, "train": train}
        _report(result, args.json)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def _train(args, work: str, model_dir: str, corpus: str, ckpt_bytes: int) -> dict:
    # Parameter buffers: 4, each as big as the largest tensor (the least that works), so that the directory is
    # many times the pool.
    buf_numel = _largest_numel(os.path.join(model_dir, "model.safetensors"))
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 4_000_000,
                                 "offload_param": {"device": "nvme", "buffer_count": 4, "buffer_size": buf_numel},
                                 "offload_optimizer": {"device": "nvme", "buffer_count": 3}},
           "bf16": {"enabled": True}, "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    cfg_path = os.path.join(work, "cfg.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    run_dir = os.path.join(work, "run")
    env = dict(os.environ, HF_DATASETS_CACHE=os.path.join(work, "cache"))
    done = subprocess.run([sys.executable, "-m", "infinity", "train", "--model", model_dir, "--data", corpus,
                           "--config", cfg_path, "--steps", str(args.steps), "--seq", str(args.seq), "--nvme-path",
                           os.path.join(work, "swap"), "--out", run_dir], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench finetune: infinity train failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    with open(os.path.join(run_dir, "run.json")) as f:
        load = json.load(f)["load"]
    later = rows[1:] or rows
    return {"buffer_pool_bytes": 4 * buf_numel * 4, "checkpoint_bytes": ckpt_bytes,
            "dir_over_pool": ckpt_bytes / (4 * buf_numel * 4),
            "peak_over_baseline_bytes": max(r["peak_rss_bytes"] for r in rows) - rows[0]["baseline_rss_bytes"],
            "load_peak_over_start_bytes": load["peak_rss_bytes"] - load["start_rss_bytes"],
            "load_s": load["seconds"],
            "data_share": max(r["data_s"] / r["step_s"] for r in later),
            "median_step_s": sorted(r["step_s"] for r in later)[len(later) // 2],
            "median_data_s": sorted(r["data_s"] for r in later)[len(later) // 2]}


def _largest_numel(path: str) -> int:
    import math
    import struct

    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return max(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def _report(r: dict, as_json: bool) -> None:
    s, t = r["stream"], r["train"]
    print(f"corpus {r['corpus_bytes'] / 1e6:.0f} MB -> {s['windows']:,} windows, {s['tokens'] / 1e6:.1f}M tokens "
          f"read in order: trainer's anonymous memory growth {s['anon_growth_bytes'] / 2**20:.0f} MiB (target "
          f"< 100 MB); its VmHWM growth {s['rss_growth_bytes'] / 2**20:.0f} MiB (includes the memory-mapped Arrow "
          f"file's reclaimable pages); prepared in {s['prepare_s']:.0f} s by a child process (peak RSS "
          f"{s['child_peak_rss_bytes'] / 2**20:.0f} MiB, gone before training); read {s['read_s']:.1f} s")
    print(f"fine-tune from a {t['checkpoint_bytes'] / 1e6:.0f} MB directory ({t['dir_over_pool']:.1f}x the "
          f"{t['buffer_pool_bytes'] / 2**20:.1f} MiB parameter pool): from_pretrained peak "
          f"{t['load_peak_over_start_bytes'] / 2**20:.0f} MiB over its start ({t['load_s']:.1f} s); whole run peak "
          f"{t['peak_over_baseline_bytes'] / 2**20:.0f} MiB over the baseline")
    print(f"data loading: at most {t['data_share']:.2%} of a step after the first (median {t['median_data_s'] * 1e3:.1f} "
          f"ms of {t['median_step_s']:.2f} s; target < 5 %)")
    if as_json:
        print(json.dumps(r))
