"""OffloadAdamW beside torch.optim.AdamW (all in RAM) and DeepSpeed on the same model: step time, peak RSS.

    python bench/offload_adamw.py --params 100e6 --dir /path/on/nvme [--steps 6] [--ds-python PY]

Each variant runs in its own process (a clean peak RSS) on a model of --params fp32 parameters in 8 layers.
- Optimizer steps: the parameters are given gradients and `step()` is timed (median of the steps after the
  first): torch AdamW, OffloadAdamW cpu and nvme, torchao's CPUOffloadOptimizer when it imports (it offloads
  from a GPU, so not on a CPU-only machine), and DeepSpeed's ZeRO-Offload optimizer (DeepSpeedCPUAdam on the
  same parameters).
- Whole training steps ("loop-"): forward, backward, clip to 1.0 and step on a batch of 8, in a plain loop
  with torch AdamW or OffloadAdamW, and in DeepSpeed's ZeRO-Offload engine (stage 2, offload_optimizer cpu;
  DeepSpeed offloads the optimizer to NVMe only at stage 3).
Printed: each median, its ratio to torch's (of the same kind), the peak RSS over the process's RSS before
the optimizer existed, and for the NVMe optimizer step the bytes moved and the floor they imply at the
disk's O_DIRECT read and write rates measured just before and just after it (`infinity bench io`, the best
backend's; the mean of the two, since the disk drifts).
DeepSpeed's and torchao's variants run under --ds-python, a Python where the peers are installed (kept out of
this repo's environment).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def child(kind: str, params: int, steps: int, directory: str) -> dict:
    import resource

    import torch

    torch.manual_seed(0)
    layers = 8
    width = int((params / layers) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    if kind.startswith("loop-"):
        return whole_steps(kind[5:], model, width, steps, directory)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    rss0 = _rss()
    if kind == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif kind in ("cpu", "nvme"):
        from infinity.optim import OffloadAdamW

        opt = OffloadAdamW(model.parameters(), lr=1e-4, offload=kind, nvme_path=directory,
                           sub_group_size=max(1, params // 8))
    elif kind == "deepspeed":  # ZeRO-Offload's CPU optimizer (DeepSpeedCPUAdam), stepping the same parameters
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(model.parameters(), lr=1e-4, adamw_mode=True)
    elif kind == "torchao":
        from torchao.optim import CPUOffloadOptimizer

        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4)
    else:
        raise SystemExit(f"unknown kind {kind}")
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    n = sum(p.numel() for p in model.parameters())
    # bytes one step reads (and writes again): the state files' sizes, as the optimizer laid them out
    moved = sum(s.state.io_bytes for s in opt.sub_groups) if kind == "nvme" else 0
    if hasattr(opt, "close"):
        opt.close()
    return {"kind": kind, "params": n, "step_s": statistics.median(times[1:]), "first_s": times[0],
            "steps_s": times, "peak_over_start_bytes": peak - rss0, "state_bytes": moved}


def whole_steps(kind: str, model, width: int, steps: int, directory: str) -> dict:
    """Whole training steps (forward, backward, clip to 1.0, optimizer step) on a batch of 8: a plain loop with
    torch AdamW or OffloadAdamW, or DeepSpeed's ZeRO-Offload (stage 2, offload_optimizer cpu) engine."""
    import resource

    import torch

    x = torch.randn(8, width, generator=torch.Generator().manual_seed(1))
    rss0 = _rss()
    if kind == "deepspeed":
        import deepspeed

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
        cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
               "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

        def step():
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
    else:
        if kind == "torch":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            from infinity.optim import OffloadAdamW

            opt = OffloadAdamW(model.parameters(), lr=1e-4, offload=kind, nvme_path=directory)

        def step():
            loss = model(x).pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if kind in ("cpu", "nvme"):
        opt.close()
    return {"kind": f"loop-{kind}", "params": sum(p.numel() for p in model.parameters()),
            "step_s": statistics.median(times[1:]), "first_s": times[0], "peak_over_start_bytes": peak - rss0}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def disk_rates(directory: str) -> tuple[float, float]:
    """The disk's O_DIRECT read and write rates (bytes/s), the best native backend's, from `infinity bench io`."""
    out = subprocess.run([sys.executable, "-m", "infinity", "bench", "io", "--dir", directory, "--size", "1GiB",
                          "--json"], capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    best = {op: max(r["gbps"] for r in rows if r["op"] == op) * 1e9 for op in ("read", "write")}
    return best["read"], best["write"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--params", type=float, default=50e6)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dir", default=None, help="where the NVMe variant's swap files go (default: a temp dir)")
    p.add_argument("--child", default=None)
    p.add_argument("--ds-python", default=None, help="a python with the peers installed (deepspeed, torchao): adds "
                                                      "their rows")
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, int(a.params), a.steps, a.dir)))
        return
    directory = a.dir or tempfile.mkdtemp(prefix="offload-bench-")
    results = {}
    rates = []  # the disk's rates just before and just after the NVMe optimizer step (it drifts within the hour)
    for kind in ("torch", "cpu", "nvme", "torchao", "deepspeed", "loop-torch", "loop-cpu", "loop-nvme",
                 "loop-deepspeed"):
        python = a.ds_python if kind.endswith("deepspeed") or kind == "torchao" else sys.executable
        if python is None:
            print(f"{kind}: not run (no --ds-python)")
            continue
        if kind == "nvme":
            rates.append(disk_rates(directory))
        out = subprocess.run([python, __file__, "--child", kind, "--params", str(a.params), "--steps",
                              str(a.steps), "--dir", directory], capture_output=True, text=True)
        if kind == "nvme":
            rates.append(disk_rates(directory))
        if out.returncode != 0:
            print(f"{kind}: not run ({out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode})")
            continue
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    read_rate = statistics.mean(r for r, _ in rates) if rates else 0.0
    write_rate = statistics.mean(w for _, w in rates) if rates else 0.0
    for kind, r in results.items():
        base = results["loop-torch" if kind.startswith("loop-") else "torch"]["step_s"]
        line = (f"{kind:8s} {r['params'] / 1e6:.1f}M params  step {r['step_s'] * 1e3:8.1f} ms  "
                f"x{r['step_s'] / base:5.2f} of torch  peak RSS +{r['peak_over_start_bytes'] / 2**20:7.0f} MiB")
        if kind == "nvme":
            state = r["state_bytes"]  # read once and written once per step
            floor = state / read_rate + state / write_rate  # one disk: the reads and writes share it
            line += (f"  moves {2 * state / 2**20:.0f} MiB/step ({state / r['params']:.0f} B/param each way); "
                     f"I/O floor at {read_rate / 1e9:.2f} GB/s read, {write_rate / 1e9:.2f} GB/s write (mean of "
                     f"{len(rates)} runs beside it): {floor * 1e3:.0f} ms (x{r['step_s'] / floor:.2f} of it)")
        print(line)
    print(json.dumps({"results": results, "disk_read_Bps": read_rate, "disk_write_Bps": write_rate}))


if __name__ == "__main__":
    main()
