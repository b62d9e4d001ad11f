"""The `infinity` command (also `python -m infinity`): train, tune, plan, info, checkpoint export|info,
bench io|adam|swap|train|plan|checkpoint|peft|finetune."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infinity", description="memory-offload engine for huge-model training")
    sub = p.add_subparsers(dest="cmd", required=True)

    info = sub.add_parser("info", help="version, I/O backends, SIMD level, O_DIRECT alignment, free space")
    info.add_argument("--dir", default=".", help="directory whose alignment and free space to report")
    info.add_argument("--json", action="store_true")

    from infinity.tools import train as train_cmd

    train_cmd.add_arguments(sub.add_parser("train", help="train a transformer with the ZeRO engine (the main job)"))

    from infinity.tools import plan

    plan.add_arguments(sub.add_parser("plan", help="decide what lives where for a memory budget; write the config"))
    from infinity.tools import tune

    tune.add_arguments(sub.add_parser("tune", help="sweep the aio settings on a disk; print and write the best"))

    from infinity.checkpoint import export as ckpt

    ckpt.add_arguments(sub.add_parser("checkpoint", help="export a checkpoint to a plain state_dict, or summarise it"))

    bench = sub.add_parser("bench", help="standalone benchmarks")
    bsub = bench.add_subparsers(dest="what", required=True)
    from infinity.bench import io as bench_io

    bench_io.add_arguments(bsub.add_parser("io", help="read/write GB/s per backend, beside fio"))
    from infinity.bench import adam as bench_adam

    bench_adam.add_arguments(bsub.add_parser("adam", help="CPU Adam params/s beside torch.optim.AdamW"))
    from infinity.bench import swap as bench_swap

    bench_swap.add_arguments(bsub.add_parser("swap", help="NVMe-offloaded optimizer step vs the I/O lower bound"))
    from infinity.bench import train as bench_train

    bench_train.add_arguments(bsub.add_parser("train", help="training step on NVMe vs the same model in RAM"))
    from infinity.bench import plan as bench_plan

    bench_plan.add_arguments(bsub.add_parser("plan", help="the planner's predictions vs real runs; cost per parameter"))
    from infinity.bench import checkpoint as bench_ckpt

    bench_ckpt.add_arguments(bsub.add_parser("checkpoint", help="checkpoint save/load GB/s vs fio; memory"))
    from infinity.bench import peft as bench_peft

    bench_peft.add_arguments(bsub.add_parser("peft", help="LoRA on frozen offloaded weights vs full training"))
    from infinity.bench import finetune as bench_ft

    bench_ft.add_arguments(bsub.add_parser("finetune", help="corpus streaming RSS, from_pretrained memory, data share"))
    return p


def main(argv: list[str] | None = None) -> int:
    from infinity.checkpoint import CheckpointError
    from infinity.dirlock import DirectoryInUse
    from infinity.engine.comm import RankFailure

    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except (ValueError, OSError, CheckpointError, DirectoryInUse) as exc:
        # Bad input, and a directory another run owns, is one line naming what was wrong, not a traceback.
        print(f"infinity {args.cmd}: {exc}", file=sys.stderr)
        return 2
    except RankFailure as exc:  # another rank died or hung: its own output says why
        print(f"infinity {args.cmd}: {exc}", file=sys.stderr)
        return 1
    except FloatingPointError as exc:  # a run that diverged: its message names the step and the lr
        print(f"infinity {args.cmd}: {exc}", file=sys.stderr)
        return 1


def _dispatch(args) -> int:
    if args.cmd == "train":
        from infinity.tools import train as train_cmd

        return train_cmd.run(args)
    if args.cmd == "plan":
        from infinity.tools import plan

        return plan.run(args)
    if args.cmd == "tune":
        from infinity.tools import tune

        return tune.run(args)
    if args.cmd == "checkpoint":
        from infinity.checkpoint import export as ckpt

        return ckpt.run(args)
    if args.cmd == "info":
        from infinity.tools import info

        return info.run(args)
    if args.cmd == "bench" and args.what == "io":
        from infinity.bench import io as bench_io

        return bench_io.run(args)
    if args.cmd == "bench" and args.what == "adam":
        from infinity.bench import adam as bench_adam

        return bench_adam.run(args)
    if args.cmd == "bench" and args.what == "swap":
        from infinity.bench import swap as bench_swap

        return bench_swap.run(args)
    if args.cmd == "bench" and args.what == "plan":
        from infinity.bench import plan as bench_plan

        return bench_plan.run(args)
    if args.cmd == "bench" and args.what == "checkpoint":
        from infinity.bench import checkpoint as bench_ckpt

        return bench_ckpt.run(args)
    if args.cmd == "bench" and args.what == "peft":
        from infinity.bench import peft as bench_peft

        return bench_peft.run(args)
    if args.cmd == "bench" and args.what == "finetune":
        from infinity.bench import finetune as bench_ft

        return bench_ft.run(args)
    if args.cmd == "bench" and args.what == "train":
        from infinity.bench import train as bench_train

        return bench_train.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
