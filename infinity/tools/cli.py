"""The `infinity` command (also `python -m infinity`): train, tune, plan, info, checkpoint export|info,
bench io|adam|swap|train|plan|checkpoint|peft|finetune.

Each command is a module with `add_arguments(parser)` and `run(args) -> int`, named once in the tables below:
the parser and the dispatch both come from them."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "info": ("infinity.tools.info", "version, I/O backends, SIMD level, O_DIRECT alignment, free space"),
    "train": ("infinity.tools.train", "train a transformer with the ZeRO engine (the main job)"),
    "plan": ("infinity.tools.plan", "decide what lives where for a memory budget; write the config"),
    "tune": ("infinity.tools.tune", "sweep the aio settings on a disk; print and write the best"),
    "checkpoint": ("infinity.checkpoint.export", "export a checkpoint to a plain state_dict, or summarise it"),
}
BENCHES = {
    "io": ("infinity.bench.io", "read/write GB/s per backend, beside fio"),
    "adam": ("infinity.bench.adam", "CPU Adam params/s beside torch.optim.AdamW"),
    "swap": ("infinity.bench.swap", "NVMe-offloaded optimizer step vs the I/O lower bound"),
    "train": ("infinity.bench.train", "training step on NVMe vs the same model in RAM"),
    "plan": ("infinity.bench.plan", "the planner's predictions vs real runs; cost per parameter"),
    "checkpoint": ("infinity.bench.checkpoint", "checkpoint save/load GB/s vs fio; memory"),
    "peft": ("infinity.bench.peft", "LoRA on frozen offloaded weights vs full training"),
    "finetune": ("infinity.bench.finetune", "corpus streaming RSS, from_pretrained memory, data share"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infinity", description="memory-offload engine for huge-model training")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, (module, help_) in COMMANDS.items():
        importlib.import_module(module).add_arguments(sub.add_parser(name, help=help_))
    bsub = sub.add_parser("bench", help="standalone benchmarks").add_subparsers(dest="what", required=True)
    for name, (module, help_) in BENCHES.items():
        importlib.import_module(module).add_arguments(bsub.add_parser(name, help=help_))
    return p


def main(argv: list[str] | None = None) -> int:
    from infinity.errors import InfinityError, RankFailure

    args = build_parser().parse_args(argv)
    module = BENCHES[args.what][0] if args.cmd == "bench" else COMMANDS[args.cmd][0]
    try:
        return importlib.import_module(module).run(args)
    except RankFailure as exc:  # another rank died or hung: its own output says why
        print(f"infinity {args.cmd}: {exc}", file=sys.stderr)
        return 1
    except (InfinityError, ValueError, OSError) as exc:
        # Bad input, and a directory another run owns, is one line naming what was wrong, not a traceback.
        print(f"infinity {args.cmd}: {exc}", file=sys.stderr)
        return 2
    except FloatingPointError as exc:  # a run that diverged: its message names the step and the lr
        print(f"infinity {args.cmd}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
