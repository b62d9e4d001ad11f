"""Peak RSS of building a model under zero_init, and of from_pretrained under zero_init, each in a fresh process.

Used by tests/engine/test_construction_memory.py: the state is many times the swap buffers, so a build that
held the model (or a load that held the checkpoint) would show at once.
"""

from __future__ import annotations

import gc
import json
import torch

from infinity.memory_stats import peak_rss_bytes, reset_peak, rss_bytes
from infinity.testing.parity import engine_config, run_in_child

WIDTH = 1024
LAYERS = 32


class Stack(torch.nn.Module):
    """A parent whose constructor re-initialises every child (init loop, then a scaled pass over names)."""

    def __init__(self, layers=LAYERS, width=WIDTH):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        for m in self.modules():
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.normal_(m.weight, std=0.02)
                torch.nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():
            if name.endswith("weight"):
                with torch.no_grad():
                    p.mul_(0.5)


def _cfg(nvme_path: str, largest: int, count: int) -> dict:
    return engine_config("nvme", nvme_path, **{
        "zero_optimization.offload_param.buffer_size": largest,
        "zero_optimization.offload_param.buffer_count": count})


def _measure(build) -> dict:
    torch.set_num_threads(1)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # torch._dynamo's one-time import
    gc.collect()
    reset_peak()
    baseline = rss_bytes()
    store, numel, largest_param = build()
    out = {"peak_over_baseline": peak_rss_bytes() - baseline, "pool_bytes": store.swap.pool.nbytes,
           "state_bytes": 4 * numel, "largest_bytes": 4 * largest_param}
    store.close()
    return out


def build_stack(nvme_path: str) -> dict:
    from infinity.engine import zero_init

    def build():
        with zero_init(_cfg(nvme_path, WIDTH * WIDTH, 4)) as store:
            model = Stack()
        return store, sum(p.numel() for p in model.parameters()), WIDTH * WIDTH

    return _measure(build)


def build_pretrained(nvme_path: str, model_dir: str) -> dict:
    import transformers

    from infinity.engine import zero_init

    with open(f"{model_dir}/config.json") as f:
        c = json.load(f)
    largest = c["vocab_size"] * c["hidden_size"]

    def build():
        with zero_init(_cfg(nvme_path, largest, 2)) as store:
            model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        return store, sum(p.numel() for p in model.parameters()), largest

    getattr(transformers, c["architectures"][0])  # the model's module imported before the baseline, as a user's is
    return _measure(build)


def _main(kind: str, out_path: str, args: tuple) -> None:
    result = build_stack(*args) if kind == "stack" else build_pretrained(*args)
    with open(out_path, "w") as f:
        json.dump(result, f)


def in_child(kind: str, out_path: str, *args) -> dict:
    return run_in_child(_main, (kind, out_path, args), out_path, f"{kind} memory")
