"""OffloadAdamW beside torch.optim.AdamW (all in RAM) on the same model: optimizer step time and peak RSS.

    python bench/offload_adamw.py --params 100e6 --dir /path/on/nvme [--steps 6]

Each optimizer runs in its own process (a clean peak RSS): build a model of --params fp32 parameters in
8 layers, give it gradients, and time `step()` (median of the steps after the first). Printed: each
variant's median step, its ratio to torch's, its peak RSS over the process's RSS before the optimizer
existed, and for NVMe the bytes it moved per step and the bound they imply at the disk rate measured in the
same run (a 256 MiB O_DIRECT-free sequential write+read of a scratch file). torchao's CPUOffloadOptimizer and
DeepSpeed's ZeRO-Offload are run when they import (neither is installed on the reference VM).
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
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    rss0 = _rss()
    if kind == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif kind in ("cpu", "nvme"):
        from infinity.optim import OffloadAdamW

        opt = OffloadAdamW(model.parameters(), lr=1e-4, offload=kind, nvme_path=directory,
                           sub_group_size=max(1, params // 8))
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
    if hasattr(opt, "close"):
        opt.close()
    return {"kind": kind, "params": n, "step_s": statistics.median(times[1:]), "first_s": times[0],
            "peak_over_start_bytes": peak - rss0}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def disk_rate(directory: str, nbytes: int = 256 << 20) -> float:
    """A plain sequential write (fsync'd) and read of a scratch file: bytes per second, both directions."""
    path = os.path.join(directory, "rate.tmp")
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    while os.read(fd, 1 << 22):
        pass
    os.close(fd)
    elapsed = time.perf_counter() - t0
    os.remove(path)
    return 2 * nbytes / elapsed


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--params", type=float, default=50e6)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dir", default=None, help="where the NVMe variant's swap files go (default: a temp dir)")
    p.add_argument("--child", default=None)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, int(a.params), a.steps, a.dir)))
        return
    directory = a.dir or tempfile.mkdtemp(prefix="offload-bench-")
    results = {}
    for kind in ("torch", "cpu", "nvme", "torchao"):
        out = subprocess.run([sys.executable, __file__, "--child", kind, "--params", str(a.params), "--steps",
                              str(a.steps), "--dir", directory], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{kind}: not run ({out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode})")
            continue
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    rate = disk_rate(directory)
    base = results["torch"]["step_s"]
    for kind, r in results.items():
        line = (f"{kind:8s} {r['params'] / 1e6:.1f}M params  step {r['step_s'] * 1e3:8.1f} ms  "
                f"x{r['step_s'] / base:5.2f} of torch  peak RSS +{r['peak_over_start_bytes'] / 2**20:7.0f} MiB")
        if kind == "nvme":
            moved = 24 * r["params"]  # [p|m|v] fp32 read and written once per step
            line += (f"  moves {moved / 2**20:.0f} MiB/step; bound at {rate / 1e9:.2f} GB/s: "
                     f"{moved / rate * 1e3:.0f} ms (x{r['step_s'] / (moved / rate):.2f} of it)")
        print(line)
    print(json.dumps({"results": results, "disk_rate_Bps": rate}))


if __name__ == "__main__":
    main()
