"""ZeRO-3 with parameters and optimizer on NVMe: infinity beside DeepSpeed, one process each, alternating.

    python bench/zero3_vs_deepspeed.py --nvme-path /var/tmp/z3 --rounds 3
    python bench/zero3_vs_deepspeed.py --nvme-path /var/tmp/z3 --gas 4     # gradient accumulation 4
    python bench/zero3_vs_deepspeed.py --nvme-path /var/tmp/z3 --bf16      # bf16 compute, fp32 master
    python bench/zero3_vs_deepspeed.py --nvme-path /var/tmp/z3 --clip 1.0 --moments int8  # clipping on both
                                                            # sides; infinity's moments in 8 bits

The model is 16 x Linear(2048, 2048) (67.1M fp32 parameters) trained on a
fixed random regression batch with a DeepSpeed-style config: 5 parameter
buffers of 2048^2 elements, 12 optimizer buffers, sub-groups of 2 x 2048^2,
queue depth 32, 1 MiB blocks. The training script is one function; each
side runs it in its own process with only the `deepspeed` import changed
(`import infinity.deepspeed as deepspeed` for ours), alternating sides for
--rounds rounds so that the disk's drift hits both alike.

Reported per side (medians over rounds of the median steady step): the step
time, the final loss, and the bytes per parameter per optimizer step, from
/proc/self/io (what reached the storage layer, every side) and, for
infinity, from the engine's own counters (parameter reads, optimizer reads
and writes). Where DeepSpeed is not installed, only infinity's side runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

LAYERS, DIM = 16, 2048


def config(nvme: str, gas: int, bf16: bool = False, clip: float = 0.0, moments: str = "fp32",
           no_bet: bool = False) -> dict:
    """The DeepSpeed-style config; `moments` (offload_optimizer.moments_dtype) is infinity's alone: DeepSpeed's
    side always gets fp32 (it has no such key). `no_bet` (infinity's alone) turns its speculative step off."""
    block = DIM * DIM
    optimizer = {"device": "nvme", "nvme_path": nvme, "buffer_count": 12}
    if moments != "fp32":
        optimizer["moments_dtype"] = moments
    extra = {"infinity": {"speculative_step": False}} if no_bet else {}
    return {
        **extra,
        "train_micro_batch_size_per_gpu": 8,
        "bf16": {"enabled": bf16},
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "steps_per_print": 1 << 30,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": 5, "buffer_size": block,
                              "max_in_cpu": 0},
            "offload_optimizer": optimizer,
            "sub_group_size": 2 * block,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 2 * block,
            "stage3_max_live_parameters": 4 * block,
            "stage3_max_reuse_distance": 0,
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True},
    }


def _proc_io() -> tuple[int, int]:
    with open("/proc/self/io") as f:
        kv = dict(line.split(": ") for line in f.read().splitlines())
    return int(kv["read_bytes"]), int(kv["write_bytes"])


def train(side: str, nvme: str, steps: int, gas: int, bf16: bool = False, clip: float = 0.0,
          moments: str = "fp32", no_bet: bool = False) -> dict:
    """The training script, written as DeepSpeedExamples write theirs; only the import differs by side."""
    import torch

    if side == "deepspeed":
        import deepspeed
    else:
        import infinity.deepspeed as deepspeed
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed(dist_backend="gloo")
    ours = side == "infinity"
    cfg = config(nvme, gas, bf16, clip, moments if ours else "fp32", no_bet and ours)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = torch.nn.Sequential(*(torch.nn.Linear(DIM, DIM) for _ in range(LAYERS)))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, DIM, generator=gen)
    y = torch.randn(8, DIM, generator=gen) * 0.1
    if bf16:
        x = x.to(torch.bfloat16)  # as DeepSpeed's bf16 examples feed their batches
    numel = LAYERS * (DIM * DIM + DIM)
    times, io, counters, loss = [], [], [], None
    for _ in range(steps):
        r0, w0 = _proc_io()
        t0 = time.perf_counter()
        for _ in range(gas):
            loss = torch.nn.functional.mse_loss(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
        times.append(time.perf_counter() - t0)
        r1, w1 = _proc_io()
        io.append(((r1 - r0) / numel, (w1 - w0) / numel))
        rep = getattr(engine, "last_report", None)
        if rep is not None:
            counters.append({"param_read": rep.param_read_bytes / numel, "opt_read": rep.optimizer_read_bytes / numel,
                             "opt_write": rep.optimizer_write_bytes / numel, "param_write": rep.param_write_bytes / numel,
                             "grad_norm": rep.grad_norm, "speculation": rep.speculation})
    out = {"side": side, "numel": numel, "gas": gas, "bf16": bf16, "step_s": times, "proc_io_b_per_param": io,
           "final_loss": float(loss.item()), "counters_b_per_param": counters}
    if hasattr(engine, "close"):
        engine.close()
    return out


def _side(side: str, nvme: str, steps: int, gas: int, bf16: bool, clip: float, moments: str, no_bet: bool) -> dict:
    d = tempfile.mkdtemp(prefix=f"{side}-", dir=nvme)
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, "--nvme-path", d, "--steps", str(steps),
               "--gas", str(gas), "--clip", str(clip), "--moments", moments] + (["--bf16"] if bf16 else []) + \
            (["--no-bet"] if no_bet else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _have_deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or present but unusable here (no accelerator, no ops)
        return False
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvme-path", required=True, help="a directory on the disk under test")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run; the first is warm-up")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gas", type=int, default=1, help="gradient accumulation steps per optimizer step")
    p.add_argument("--bf16", action="store_true", help="bf16 compute (fp32 master weights and moments)")
    p.add_argument("--clip", type=float, default=0.0, help="gradient_clipping on both sides (default 0: off)")
    p.add_argument("--moments", choices=("fp32", "bf16", "int8"), default="fp32",
                   help="infinity's offload_optimizer.moments_dtype (DeepSpeed keeps fp32)")
    p.add_argument("--no-bet", action="store_true",
                   help="infinity's speculative step off: with --clip, its step runs after backward")
    p.add_argument("--worker", choices=("infinity", "deepspeed"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(train(args.worker, args.nvme_path, args.steps, args.gas, args.bf16, args.clip, args.moments,
                               args.no_bet)))
        return 0
    os.makedirs(args.nvme_path, exist_ok=True)
    sides = ["infinity"] + (["deepspeed"] if _have_deepspeed() else [])
    if len(sides) == 1:
        print("# DeepSpeed is not importable here: infinity's side only")
    runs = {s: [] for s in sides}
    for r in range(args.rounds):
        for s in (sides if r % 2 == 0 else sides[::-1]):
            runs[s].append(_side(s, args.nvme_path, args.steps, args.gas, args.bf16, args.clip, args.moments,
                                 args.no_bet))
    summary = {}
    for s, rs in runs.items():
        steady = [statistics.median(r["step_s"][1:]) for r in rs]
        io = [r["proc_io_b_per_param"][-1] for r in rs]
        summary[s] = {"step_s": statistics.median(steady), "final_loss": rs[-1]["final_loss"],
                      "proc_read_b": statistics.median(x[0] for x in io),
                      "proc_write_b": statistics.median(x[1] for x in io),
                      "counters": rs[-1]["counters_b_per_param"][-1] if rs[-1]["counters_b_per_param"] else None}
        c = summary[s]["counters"]
        extra = (f"  engine: param reads {c['param_read']:.2f}, optimizer reads {c['opt_read']:.2f}, writes "
                 f"{c['opt_write']:.2f} + params {c['param_write']:.2f}" if c else "")
        bets = [b["speculation"] for r in rs for b in r["counters_b_per_param"] if b.get("speculation")]
        if bets:  # infinity's speculative step ([Note: the speculative step])
            extra += f"  bets: {len(bets)}, lost {bets.count('redone')}"
        print(f"{s:9} step {summary[s]['step_s']:.3f} s (rounds: {', '.join(f'{x:.3f}' for x in steady)})  "
              f"loss {summary[s]['final_loss']:.6f}  /proc/self/io per param per step: read "
              f"{summary[s]['proc_read_b']:.2f} B, write {summary[s]['proc_write_b']:.2f} B{extra}")
    if "deepspeed" in summary:
        ours, theirs = summary["infinity"], summary["deepspeed"]
        rel = abs(ours["final_loss"] - theirs["final_loss"]) / abs(theirs["final_loss"])
        print(f"infinity / deepspeed step time: {ours['step_s'] / theirs['step_s']:.2f}  "
              f"(final loss relative difference {rel:.1e})")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
