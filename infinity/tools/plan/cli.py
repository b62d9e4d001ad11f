"""`infinity plan`: its arguments, `make_plan` (parse, measure, plan: shared with `infinity train
--memory-budget`), and the plan as text or JSON.

`infinity plan --model gpt-1b --memory-budget 8GiB --nvme-path /nvme` (and
`infinity train --memory-budget ...`, which plans first) decides:

  * where the parameters live (in RAM, or NVMe behind a pool of buffers);
  * where the optimizer state lives (RAM with the SIMD CPU Adam, or NVMe);
  * the buffer counts and sizes, the optimizer sub-group size and the prefetch size;

and predicts the peak host memory and the step time: see [Note: the cost model] and [Note: what the memory
budget covers] in cost.py. Without --memory-budget it plans nothing: it predicts the run of --config as written
(default: `infinity train`'s, swap_configs/nvme_offload.json), see [Note: predicting a config's run] in cost.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

from infinity.tools.plan.cost import Plan, _tier, config_batch, format_size_h, plan_batch, predict
from infinity.tools.plan.measure import Rates, baseline_rss, measure_rates
from infinity.tools.plan.shape import ModelShape, model_shape
from infinity.units import parse_size


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="a preset (gpt-small, gpt-1b, ...) or a Hugging Face config.json")
    p.add_argument("--memory-budget", default=None,
                   help="host memory the training may add over the process baseline, e.g. 8GiB (without it: "
                   "predict the --config's own run, as `infinity train --config` would run it)")
    p.add_argument("--nvme-path", default=None, help="directory for swap files (without it, all must fit in RAM)")
    p.add_argument("--config", default=None, help="a config to start from (its optimizer, aio, clipping ...); "
                   "without --memory-budget, the config whose run is predicted (default: infinity train's)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                   help="default: the --config's, else bf16")
    p.add_argument("--micro-batch", type=int, default=None, help="samples per rank per step (default: the "
                   "--config's train_micro_batch_size_per_gpu, else 1)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's, at most 256)")
    p.add_argument("--nproc", type=int, default=1, help="ranks on this host (the budget is shared)")
    p.add_argument("--write", default=None, metavar="CONFIG", help="write the planned config here")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def make_plan(*, model: str, memory_budget, nvme_path: str | None, config: str | None = None,
              precision: str | None = None, micro: int | None = None, seq: int | None = None, nproc: int = 1,
              rates: Rates | None = None, grad_accum: int | None = None,
              split_batch: bool = False) -> tuple[Plan, ModelShape, Rates]:
    """Parse, measure and plan: what `infinity plan` and `infinity train --memory-budget` share. `split_batch`:
    the micro-batch is a default the plan may split ([Note: the planner may split the batch] in cost.py)."""
    import torch

    from infinity.config import load_config

    budget = None if memory_budget is None else parse_size(memory_budget, name="--memory-budget")
    if budget is not None and budget < (1 << 20):
        raise ValueError(f"--memory-budget must be at least 1MiB, got {memory_budget!r}")
    if micro is not None and micro < 1:
        raise ValueError(f"--micro-batch must be >= 1, got {micro}")
    if seq is not None and seq < 1:
        raise ValueError(f"--seq must be >= 1, got {seq}")
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if nvme_path is not None and not os.path.isdir(nvme_path):
        raise ValueError(f"--nvme-path {nvme_path}: not a directory")
    base = {}
    if config is None and budget is None:
        from infinity.config.shipped import shipped_config

        config = str(shipped_config("nvme_offload.json"))  # what `infinity train` runs without --config
    if config is not None:
        # Validated as a whole first, naming any bad key; its nvme_path is replaced by the plan's, so a
        # placeholder such as DeepSpeed's "/local_nvme" must not fail here.
        loaded = load_config(config, nvme_path=nvme_path or tempfile.gettempdir())
        with open(config) as f:
            base = json.load(f)
    if budget is None:
        zero = loaded.zero_optimization
        if nvme_path is None and "nvme" in (zero.offload_param.device, zero.offload_optimizer.device):
            raise ValueError(f"--config {config} swaps to NVMe: pass --nvme-path (a directory on that disk) so the "
                             "planner can measure it")
        if precision is not None or micro is not None or grad_accum is not None:
            raise ValueError("without --memory-budget the run of --config is predicted as written: set its "
                             "precision and batch in the config, not with --precision or --micro-batch")
        precision = "bf16" if loaded.bf16.enabled else "fp16" if loaded.fp16.enabled else "fp32"
        micro = config_batch(loaded, nproc)[0]  # the rates are measured at the run's micro-batch
    if precision is None:
        precision = "bf16" if base.get("bf16", {}).get("enabled") or not base else (
            "fp16" if base.get("fp16", {}).get("enabled") else "fp32")
    if micro is None:
        micro = int(base.get("train_micro_batch_size_per_gpu") or 1)
    shape = model_shape(model, seq)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if rates is None:
        rates = measure_rates(dim=shape.dim, tokens=micro * shape.seq, dtype=dtype, nvme_path=nvme_path,
                              aio=base.get("aio"), shape=shape, micro=micro,
                              direct=bool(base.get("infinity", {}).get("direct_io", True)))
    if budget is None:
        p = predict(shape, rates, loaded, base, world=nproc)
        return p, shape, rates
    p = plan_batch(shape, budget, rates, precision=precision, micro=micro, world=nproc, nvme_path=nvme_path,
                   base=base, clipping=float(base.get("gradient_clipping", 0) or 0) > 0,
                   grad_accum=grad_accum or int(base.get("gradient_accumulation_steps", 1)), split=split_batch)
    load_config(p.config)  # the planned config must load as it is
    return p, shape, rates


def describe(p: Plan, shape: ModelShape, rates: Rates, baseline: int | None = None) -> str:
    lines = [f"# infinity plan: {shape.name}, {shape.numel / 1e6:.1f}M params, seq {shape.seq}",
             f"# measured: {rates.describe()}",
             f"parameters: {_tier(p.param_tier)}"
             + (f" ({p.param_buffer_count} buffers x {p.param_buffer_size / 1e6:.2f}M elements, prefetch "
                f"{p.prefetch_bucket / 1e6:.2f}M)" if p.param_tier == "nvme" else ""),
             f"optimizer:  {_tier(p.optimizer_tier)}"
             + (f" ({p.optimizer_buffer_count} buffers x sub-group {p.sub_group_size / 1e6:.2f}M elements)"
                if p.optimizer_tier == "nvme" else "")]
    if p.grad_accum > 1:
        lines.append(f"batch: micro-batches of {p.micro_batch}, {p.grad_accum} per optimizer step")
    lines.append(f"predicted peak memory over baseline: {format_size_h(p.predicted_peak_bytes)}, in {p.peak_phase} ("
                 + ", ".join(f"{k.replace('_', ' ')} {format_size_h(v)}" for k, v in p.memory.items() if v) + ")")
    if baseline is not None:
        lines.append(f"predicted peak RSS: {format_size_h(baseline + p.predicted_peak_bytes)} "
                     f"(baseline {format_size_h(baseline)})")
    t = p.time
    lines.append(f"predicted step time: {p.predicted_step_s:.2f} s (compute {t['compute']:.2f}, Adam {t['adam']:.2f}, "
                 f"copies {t['copies']:.2f}, engine {t['engine']:.2f}, disk {t['io']:.2f}; I/O {p.io_read_bytes / 1e9:.2f} GB read + "
                 f"{p.io_write_bytes / 1e9:.2f} GB written per step)")
    lines.append(f"  by phase: first forward {t['forward_s']:.2f} s, the rest of forward and backward {t['rest_s']:.2f} s"
                 + (f", after backward {t['after_s']:.2f} s" if t["after_s"] else "")
                 + f"; the optimizer's step runs {_WHEN[t['step_phase']]}")
    return "\n".join(lines)


_WHEN = {"backward": "during backward", "forward": "in the next forward (clipping or fp16)",
         "after": "after backward (clipping or fp16)"}


def run(args) -> int:
    if args.write and args.memory_budget is None:
        raise ValueError("--write needs --memory-budget: without one nothing is planned (the run of --config is "
                         "predicted as written)")
    p, shape, rates = make_plan(model=args.model, memory_budget=args.memory_budget, nvme_path=args.nvme_path,
                                config=args.config, precision=args.precision, micro=args.micro_batch, seq=args.seq,
                                nproc=args.nproc)
    base = baseline_rss()
    if args.write:
        tmp = f"{args.write}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(p.config, f, indent=2)
            f.write("\n")
        os.replace(tmp, args.write)
    if args.json:
        d = dataclasses.asdict(p)
        model = {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape) if f.name != "block"}
        d.update(model=model, rates=dataclasses.asdict(rates), baseline_rss_bytes=base)
        print(json.dumps(d))
    else:
        if args.memory_budget is None:
            which = args.config or "swap_configs/nvme_offload.json (infinity train's default)"
            print(f"# no --memory-budget: predicting the run of {which} as written")
        print(describe(p, shape, rates, base))
        if args.write:
            print(f"# config written to {args.write}")
        elif args.memory_budget is not None:
            print(json.dumps(p.config, indent=2))
    return 0
