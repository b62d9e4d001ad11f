"""`infinity train`: train or fine-tune a model with the ZeRO engine (the main job).

`--model` is a preset of the repo's GPT, a Hugging Face model directory (its
weights streamed into partitions, its tokenizer beside them) or a
config.json (trained from scratch). `--data` is your text
(`infinity.finetune.data`); without it the run trains on English-like text
generated from a fixed seed (`infinity.data`): one token per byte for the
presets and a tokenizer-less config, the model's tokenizer otherwise.
`--lora` trains peft adapters on the frozen, offloaded base weights.

Writes `metrics.jsonl` (one object per optimizer step), `metrics.png` (loss,
eval loss, and the step time split into compute, exposed I/O and
communication) and, for a Hugging Face model, the trained model as a Hugging
Face directory (`final/`, and `step-N/` with each checkpoint) into --out.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

_FLOAT = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def add_arguments(p) -> None:
    # `--lr -1e-3` is a value, not an option: argparse's own test misses exponents (see _FLOAT).
    p._negative_number_matcher = _FLOAT
    p.add_argument("--config", default=None,
                   help="swap config (default: the shipped nvme_offload.json: parameters and optimizer on NVMe)")
    p.add_argument("--model", default="gpt-small",
                   help="a preset (gpt-tiny, gpt-small, gpt-25m, gpt-57m, gpt-100m, gpt-125m, gpt-350m, gpt-1b, gpt-2b, "
                        "gpt-4b, gpt-6b), a Hugging Face model directory (weights and tokenizer are loaded from it) or "
                        "a config.json (trained from scratch; nothing is downloaded)")
    p.add_argument("--data", default=None,
                   help="training text: .txt, .jsonl/.json (text, prompt/completion or chat messages), .parquet, .csv "
                        "or a datasets directory (default: built-in generated text)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--eval-data", default=None, help="held-out text, in the same formats as --data")
    p.add_argument("--eval-fraction", type=float, default=None, help="hold out this fraction of --data instead")
    p.add_argument("--eval-every", type=int, default=0, help="steps between evaluations (default: only at the end)")
    p.add_argument("--packing", choices=["auto", "on", "off"], default="auto",
                   help="pack rows into --seq windows, or pad one row per window (auto: pack plain text, pad "
                        "prompt/completion and chat)")
    p.add_argument("--epochs", type=float, default=None,
                   help="passes over --data (default 1); --steps, when given, wins")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 60, or --epochs over --data)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per rank per forward (default: the config's train_micro_batch_size_per_gpu, or 4)")
    p.add_argument("--grad-accum", type=int, default=None,
                   help="micro-batches per optimizer step (default: the config's gradient_accumulation_steps, or 1)")
    p.add_argument("--lora", default=None, metavar="r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj",
                   help="train LoRA adapters (peft) on the frozen base weights; the output is the adapter")
    p.add_argument("--merge-lora", action="store_true", help="with --lora: write the merged model instead")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's, at most 256)")
    p.add_argument("--nvme-path", action="append", default=None,
                   help="directory for swap files (default: a temp dir, removed after); give it once per disk to "
                        "place the files across several")
    p.add_argument("--nproc", type=int, default=1, help="ranks to launch on this machine (gloo on CPU)")
    p.add_argument("--memory-budget", default=None,
                   help="plan the placement and buffers for this much host memory over the baseline (e.g. 8GiB); "
                        "the config then supplies only what the planner does not decide")
    p.add_argument("--out", default=None, help="run directory (default: runs/<timestamp>/)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the config's optimizer.params.lr)")
    p.add_argument("--warmup", type=int, default=0, help="steps of linear learning-rate warmup (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=None,
                   help="without a terminal: a progress line every N steps (default: about 20 lines a run)")
    p.add_argument("--save-dir", default=None, help="write checkpoints (zarr) here: every --save-every steps and at "
                                                    "the end")
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (default: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir (if it "
                                                         "has one), bit-exactly")
    p.add_argument("--resume-changed", action="store_true",
                   help="with --resume: continue a checkpoint saved with another --lr, --warmup or --config")


def _check_args(args) -> None:
    """Every argument's own range, before anything is read or built."""
    for name, low in (("steps", 1), ("seq", 1), ("micro_batch", 1), ("grad_accum", 1), ("log_every", 1)):
        v = getattr(args, name)
        if v is not None and v < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {v}")
    for name in ("warmup", "save_every", "eval_every"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    if args.lr is not None and not (args.lr > 0 and math.isfinite(args.lr)):
        raise ValueError(f"--lr must be a finite number > 0, got {args.lr}")
    if args.epochs is not None and not args.epochs > 0:
        raise ValueError(f"--epochs must be > 0, got {args.epochs}")
    if args.eval_fraction is not None and not 0 < args.eval_fraction < 1:
        raise ValueError(f"--eval-fraction must be in (0, 1), got {args.eval_fraction}")
    if args.eval_fraction is not None and args.eval_data:
        raise ValueError("--eval-data and --eval-fraction both name the eval set; give one")
    if args.eval_fraction is not None and not args.data:
        raise ValueError("--eval-fraction holds out part of --data, and there is no --data")
    if (args.resume or args.save_every) and not args.save_dir:
        raise ValueError("--resume and --save-every need --save-dir (where the checkpoints are)")
    if args.merge_lora and not args.lora:
        raise ValueError("--merge-lora merges the adapter that --lora trains, and there is no --lora")
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} is a file; --out names the run directory (it is created if missing)")


def run(args) -> int:
    user_config = args.config is not None
    if args.config is None:
        from infinity.config.shipped import shipped_config

        args.config = str(shipped_config("nvme_offload.json"))
    _check_args(args)
    out = Path(args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        from infinity.tools.launch import launch

        return launch(args.nproc, [*_without_nproc(sys.argv[1:]), "--out", str(out)])
    own_nvme = args.nvme_path is None
    if own_nvme and os.environ.get("RANK", "0") == "0":
        _reclaim_dead_runs(os.environ.get("TMPDIR", "/var/tmp"))
    nvme = args.nvme_path or [tempfile.mkdtemp(prefix="infinity-train.", dir=os.environ.get("TMPDIR", "/var/tmp"))]
    if own_nvme and user_config and os.environ.get("RANK", "0") == "0":
        _say_nvme_path_overridden(args.config, nvme)
    previous = signal.signal(signal.SIGTERM, _sigterm) if _main_thread() else None
    try:
        return _train(args, out, nvme)
    except KeyboardInterrupt as exc:  # during setup (reading data, loading weights); the loop says its own line
        term = isinstance(exc, Terminated)
        _stop_line(f"infinity train: {'terminated (SIGTERM)' if term else 'interrupted'} during setup, before step 1 "
                   f"(rank {os.environ.get('RANK', '0')}); swap files removed")
        return 143 if term else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if own_nvme:
            shutil.rmtree(nvme[0], ignore_errors=True)


def _say_nvme_path_overridden(config: str, nvme: list) -> None:
    """--nvme-path (default: a temp dir removed at the end) wins over the config's nvme_path; said once, so a
    path the user wrote is never dropped without a word."""
    try:
        with open(config) as f:
            zero = json.load(f).get("zero_optimization") or {}
    except (OSError, ValueError, AttributeError):
        return  # load_config reports a bad file later, with its own message
    given = [zero[k]["nvme_path"] for k in ("offload_param", "offload_optimizer")
             if isinstance(zero.get(k), dict) and zero[k].get("nvme_path")]
    paths = sorted({str(p) for g in given for p in (g if isinstance(g, list) else [g])})
    if paths:
        print(f"infinity train: swap files go to {nvme[0]} (removed at the end), not the config's nvme_path "
              f"{', '.join(paths)}; pass --nvme-path DIR to choose", flush=True)


def _reclaim_dead_runs(base: str) -> None:
    """Remove the default swap directories of earlier runs that were killed (kill -9, the OOM killer), which
    nothing else would: each swapper holds a lock on its directory's owner.pid while it lives ([Note:
    directories are owned through flock] in infinity/dirlock.py), and a run directory none of whose locks is
    held, and whose owners' processes are gone, is removed (the pid guards the moment between a claimer's
    open and its lock, and runs of versions that wrote no lock). One without any owner.pid (killed before
    its first swapper) goes after an hour."""
    from infinity.dirlock import alive, probe, read_pid

    def dead(root: str) -> bool:
        pid = read_pid(os.path.join(root, "owner.pid"))
        return probe(root) is False and not (pid and alive(pid))

    try:
        names = [n for n in os.listdir(base) if n.startswith("infinity-train.")]
    except OSError:
        return
    for name in names:
        path = os.path.join(base, name)
        owners = [root for root, _, files in os.walk(path) if "owner.pid" in files]
        try:
            stale = (owners and all(dead(r) for r in owners)) or (
                not owners and time.time() - os.stat(path).st_mtime > 3600)
        except OSError:
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            print(f"infinity train: removed {path}, the swap files of a run that was killed", flush=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into the same orderly stop as Ctrl-C (swap files removed, one line, exit 143)."""


def _stop_line(text: str) -> None:
    """One line on stderr in one write: every rank says it at the same moment, and print's separate write of
    the newline let two ranks' lines run together."""
    sys.stderr.flush()
    os.write(2, (text + "\n").encode())


def _sigterm(signum, frame):
    raise Terminated()


class StopBetweenSteps:
    """[Note: Ctrl-C stops between steps]
    Ctrl-C in a terminal signals every rank at once (and SIGTERM reaches each rank through the launcher). A
    KeyboardInterrupt raised wherever each rank happens to be would let one rank leave the step while another
    waits in a collective for it: that rank then hangs until the collective times out (seen once in 15 runs of
    the 2-rank Ctrl-C test). So, while the loop runs, the first SIGINT or SIGTERM only asks for a stop: each
    rank finishes its step, the ranks agree on the request in one all-reduce (any rank's request stops all of
    them), and all raise together, between steps, where nothing is in flight. A second signal stops at once;
    the same signal again within REPEAT_S is the first one arriving twice (a SIGTERM sent to the whole process
    group reaches each rank directly and again through the launcher) and changes nothing. Rank 0 says so when
    the first one arrives. One rank stops between steps too, though it has no collective to be caught in: a
    KeyboardInterrupt raised at whatever instruction the main thread is on can land inside threading's own
    locks and queues, which it shares with the swap reaper threads, and leave one waiting for a wake-up that
    never comes; close() then hung for ever (twice in about 100 Ctrl-Cs of a one-rank NVMe run, and once a
    self-deadlock in the swapper, since fixed). A scheduler that cannot wait for the step sends a second
    signal, which stops at once, as it does with several ranks."""

    REPEAT_S = 2.0

    def __init__(self, comm):
        self.comm = comm
        self.requested = 0  # the signal number of the first request, 0 for none
        self._at = 0.0
        self._previous = {}

    def __enter__(self) -> "StopBetweenSteps":
        if _main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        if self.requested:
            # With several ranks a signal to the process group reaches a rank directly and through the launcher.
            if self.comm.world > 1 and signum == self.requested and time.monotonic() - self._at < self.REPEAT_S:
                return
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        self.requested = signum
        self._at = time.monotonic()
        if self.comm.rank == 0:
            _stop_line("infinity train: stopping after this step (send the signal again to stop now)")

    def check(self) -> None:
        """Raise the agreed stop (KeyboardInterrupt, or Terminated for SIGTERM) on every rank, or return."""
        import torch

        if self.comm.world == 1:
            if self.requested:
                raise Terminated() if self.requested == signal.SIGTERM else KeyboardInterrupt()
            return

        flag = torch.tensor([self.requested], dtype=torch.int64)
        self.comm.all_reduce_(flag, op=torch.distributed.ReduceOp.MAX)
        signum = int(flag.item())
        if signum:
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:  # the ranks get the same command without --nproc
        if skip or a == "--nproc" or a.startswith("--nproc="):
            skip = a == "--nproc"
            continue
        out.append(a)
    return out


def _with_lr(args, cfg):
    if args.lr is None:
        return cfg
    opt = cfg.optimizer
    return dataclasses.replace(cfg, optimizer=dataclasses.replace(opt, params=dataclasses.replace(opt.params,
                                                                                                 lr=args.lr)))


def _sized_config(args, nvme: list, largest: int):
    """The swap config, with nvme_path set and the parameter pool's buffers fitted to the model's largest
    parameter before zero_init builds the store (the optimizer's sizes are fitted at initialize)."""
    from infinity.config import load_config
    from infinity.engine.plan import fit_param_buffer

    return fit_param_buffer(load_config(args.config, nvme_path=nvme), largest)


def _batch_sizes(args, cfg) -> tuple[int, int, bool]:
    """--micro-batch and --grad-accum, else the config's batch keys resolved for this world size (DeepSpeed's
    rules: any two of train_batch_size, the micro batch and accumulation give the third), else 4 and 1; and
    whether the micro-batch is a default (not --micro-batch, nor a --config of the user's: --memory-budget may
    then split it)."""
    from infinity.config.resolve import resolve_batch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    sizes = resolve_batch(cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps,
                          world)
    micro = args.micro_batch or sizes.micro_batch_per_rank or 4
    accum = args.grad_accum or (sizes.gradient_accumulation_steps if not args.micro_batch else
                                cfg.gradient_accumulation_steps or 1)
    from infinity.config.shipped import shipped_config

    shipped = args.config is None or os.path.abspath(args.config) == os.path.abspath(shipped_config("nvme_offload.json"))
    return micro, accum, not args.micro_batch and (shipped or not sizes.micro_batch_per_rank)


def _with_batch(cfg, micro: int, accum: int):
    """The batch keys the run uses, in the config the engine gets (train_batch_size follows from them)."""
    return dataclasses.replace(cfg, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum,
                               train_batch_size=None)


def _die_with_launcher() -> None:
    """[Note: ranks die with their launcher]
    A rank started by `--nproc` or torchrun outlived a launcher killed with -9: it went on training and
    saving (into a --save-dir a new run may then share) with nobody to stop it. On Linux each rank asks the
    kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG), which the rank turns into the orderly stop
    of a Ctrl-C: one line, swap files removed, exit 143. A launcher that died before the request took effect
    is caught by comparing the parent with the one the launcher named (INFINITY_LAUNCHER_PID) or, under
    torchrun, with the parent seen just before the request. (A launcher may be pid 1, in a container; and the
    signal comes when the thread that spawned the rank exits, which for torchrun and ours is the main one.)"""
    if not sys.platform.startswith("linux") or "LOCAL_RANK" not in os.environ:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    parent = os.environ.get("INFINITY_LAUNCHER_PID") or str(os.getppid())
    if libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        print(f"infinity train: prctl(PR_SET_PDEATHSIG) failed ({os.strerror(err)}); this rank will not stop "
              "by itself if its launcher is killed", file=sys.stderr, flush=True)
        return
    if str(os.getppid()) != parent:
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher is already gone


def _train(args, out: Path, nvme: list) -> int:
    import torch

    from infinity.engine.comm import init_distributed
    from infinity.finetune import model as fmodel
    from infinity.models import build_model

    _die_with_launcher()
    src = fmodel.resolve(args.model)
    if src.kind == "preset" and (args.data or args.lora or args.eval_data or args.tokenizer):
        raise ValueError(f"--model {args.model} is a preset of the repo's GPT, which reads bytes and has no tokenizer; "
                         "--data, --eval-data, --tokenizer and --lora need a Hugging Face model directory "
                         "(--model DIR)")
    if src.kind != "preset":
        import transformers  # noqa: F401 - imported before zero_init, so from_pretrained streams ([Note: streamed from_pretrained])
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        meta, vocab, model_seq, _ = build_model(src.directory if src.kind != "preset" else args.model)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    largest = max(-(-p.numel() // world) for p in meta.parameters())  # one rank's shard
    del meta
    seq = _sequence_length(args, model_seq, src)
    from infinity.config import load_config

    micro, accum, defaulted = _batch_sizes(args, load_config(args.config, nvme_path=nvme))
    planned = None
    if args.memory_budget is not None:
        from infinity.tools.plan import make_plan

        world_env = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        planned = make_plan(model=args.model if src.kind == "preset" else src.directory,
                            memory_budget=args.memory_budget, nvme_path=nvme[0], config=args.config, micro=micro,
                            grad_accum=accum, seq=seq, nproc=world_env, split_batch=defaulted)
        # The plan is made for the first disk (its speed measured there); the swap files go to all of them.
        cfg = load_config(planned[0].config, nvme_path=nvme if len(nvme) > 1 else None)
        if (planned[0].micro_batch, planned[0].grad_accum) != (micro, accum):
            print(f"infinity train: --memory-budget: the batch of {micro} runs as {planned[0].grad_accum // accum} "
                  f"micro-batches of {planned[0].micro_batch} (a micro-batch of {micro} does not fit; "
                  "--micro-batch chooses it)", flush=True)
            micro, accum = planned[0].micro_batch, planned[0].grad_accum
    else:
        cfg = _sized_config(args, nvme, largest)
    cfg = _with_batch(_with_lr(args, cfg), micro, accum)
    comm = init_distributed(cfg.infinity.comm_timeout_s)
    claim = _claim_save_dir(args, comm)
    try:
        return _train_owning(args, out, nvme, src, cfg, comm, planned, seq, vocab, micro, accum)
    finally:
        if claim is not None:
            claim.release()


def _claim_save_dir(args, comm):
    """Rank 0 owns --save-dir from before the model is built ([Note: directories are owned through flock]): a
    second run into it stops here, in seconds, not after loading its model or at its first save. The engine
    holds it too from its first save (the same process: reentrant) until it closes."""
    if not args.save_dir:
        return None
    from infinity.dirlock import own_checkpoint_dir
    from infinity.engine.comm import together
    from infinity.errors import DirectoryInUse

    return together(comm, "the claim of --save-dir", lambda: own_checkpoint_dir(args.save_dir) if comm.rank == 0
                    else None, error=DirectoryInUse)


def _train_owning(args, out, nvme, src, cfg, comm, planned, seq, vocab, micro, accum) -> int:
    import torch

    from infinity.engine import initialize, zero_init
    from infinity.finetune import model as fmodel
    from infinity.memory_stats import PeakSampler, rss_bytes
    from infinity.models import build_model

    baseline = baseline_rss()
    if planned is not None and comm.rank == 0:
        _write_plan(out, planned, baseline)
    tokenizer = fmodel.load_tokenizer(src, args.tokenizer) if src.kind != "preset" else None
    data = _data(args, src, tokenizer, seq, vocab, comm, micro=micro, accum=accum)
    steps = _steps(args, data)
    torch.manual_seed(args.seed)
    load = {"start_rss_bytes": rss_bytes()}
    t0 = time.perf_counter()
    with PeakSampler() as sampled, zero_init(cfg):
        if src.kind == "preset":
            model, _, _, _ = build_model(args.model)
        else:
            model = fmodel.build(src)
    load.update(peak_rss_bytes=sampled.peak, seconds=time.perf_counter() - t0)
    if args.lora:
        torch.manual_seed(args.seed)
        model = fmodel.LoraSpec.parse(args.lora).apply(model)
    warmup = args.warmup
    schedule = None if not warmup else (
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup)))
    engine = initialize(model, cfg, lr_scheduler=schedule)
    try:
        return _loop(args, out, engine, src, tokenizer, data, steps, seq, micro, accum, baseline, nvme, load)
    finally:
        engine.close()


def _sequence_length(args, model_seq: int | None, src) -> int:
    """--seq, or the model's length capped at 256; beyond the model's positions it is cut there, and said."""
    if args.seq is None:
        return min(model_seq or 256, 256)
    if model_seq and args.seq > model_seq:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"--seq {args.seq} is beyond the model's {model_seq} positions; using --seq {model_seq}",
                  flush=True)
        return model_seq
    return args.seq


def _write_plan(out: Path, planned, baseline: int) -> None:
    from infinity.tools.plan import describe

    plan, shape, rates = planned
    out.mkdir(parents=True, exist_ok=True)
    print(describe(plan, shape, rates, baseline), flush=True)
    with open(out / "plan.json", "w") as f:
        json.dump({"predicted_step_s": plan.predicted_step_s, "predicted_peak_bytes": plan.predicted_peak_bytes,
                   "peak_phase": plan.peak_phase, "memory": plan.memory, "time": plan.time,
                   "rates": dataclasses.asdict(rates), "baseline_rss_bytes": baseline,
                   "memory_budget": plan.config["infinity"]["memory_budget"], "config": plan.config}, f, indent=2)


def _data(args, src, tokenizer, seq: int, vocab: int, comm, *, micro: int, accum: int):
    """The run's batches: the user's text, or the built-in text (as bytes, or through the tokenizer)."""
    from infinity.finetune import batches

    if tokenizer is None:
        if args.data:
            raise ValueError(f"--data needs a tokenizer, and {src.directory} has none; pass --tokenizer DIR")
        return batches.ByteBatches(vocab=vocab, seq=seq, micro=micro, world=comm.world, accum=accum,
                                   hf=src.kind != "preset")
    return batches.TextBatches.build(args, tokenizer, seq=seq, micro=micro, accum=accum, comm=comm)


def _steps(args, data) -> int:
    if not data.finite:
        return args.steps or 60
    per_epoch = data.steps_per_epoch
    if per_epoch < 1:
        raise ValueError(f"--data {args.data or 'the built-in text'}: {data.windows} windows of --seq {data.seq} make "
                         f"no full step of {data.per_step} windows (micro batch x ranks x accumulation); give more "
                         "text or smaller batches")
    if args.steps is not None:
        return args.steps
    return max(1, int(per_epoch * (args.epochs or 1)))


def _loop(args, out, engine, src, tokenizer, data, steps, seq, micro, accum, baseline, nvme, load) -> int:
    from infinity.finetune.progress import Progress

    rank, world = engine.rank, engine.world_size
    numel = sum(mp.numel for mp in engine.store.params)
    trained = sum(g.numel for g in engine.optimizer.groups)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        print(f"infinity train: {args.model}: {src.describe()}, {numel / 1e6:.1f}M params"
              + (f" ({trained / 1e6:.2f}M trained: LoRA)" if args.lora else "") + f"; data: {data.describe()}; "
              f"{world} rank(s), batch {micro} x {world} x {accum} (micro x ranks x accumulation) x {seq} tokens, "
              f"{steps} steps; bf16={engine.config.bf16.enabled} fp16={engine.config.fp16.enabled}, params on "
              f"{engine.store.tier}, optimizer on {engine.optimizer.tier}, swap files in {', '.join(nvme)}; writing {out}",
              flush=True)
        if engine.fitted:
            print(engine.fitted, flush=True)
        with open(out / "run.json", "w") as f:
            json.dump({"model": args.model, "model_source": src.kind, "data": data.describe(), "numel": numel,
                       "trained_numel": trained, "world": world, "micro_batch": micro, "accumulation": accum,
                       "seq": seq, "steps": steps, "param_tier": str(engine.store.tier),
                       "optimizer_tier": str(engine.optimizer.tier), "baseline_rss_bytes": baseline,
                       "swap_bytes_after_setup": sum(_dir_bytes(d) for d in nvme),
                       "swap_bytes_by_path": {d: _dir_bytes(d) for d in nvme}, "load": load}, f, indent=2)
    if args.save_dir:  # the engine holds it too, until it closes (re-entering the run's claim)
        from infinity.engine.comm import together
        from infinity.errors import DirectoryInUse

        together(engine.comm, "the claim of --save-dir", lambda: engine.own_save_dir(args.save_dir),
                 error=DirectoryInUse)
    start = _resume(args, engine, seq, rank)
    progress = Progress(total=steps, start=start, enabled=rank == 0, every=args.log_every)
    metrics = open(out / "metrics.jsonl", "w") if rank == 0 else None
    rows, step, saved = [], start, None
    model_dir = None
    try:
        with StopBetweenSteps(engine.comm) as stop:  # [Note: Ctrl-C stops between steps]
            for step in range(start, steps):
                row = _one_step(engine, data, step, accum)
                row.update(peak_rss_bytes=_peak_rss(), baseline_rss_bytes=baseline)
                every = args.eval_every and (step + 1) % args.eval_every == 0
                if every and step + 1 != steps and data.eval is not None:
                    row["eval_loss"] = data.evaluate(engine)
                if step + 1 == steps and data.eval is not None:
                    row["eval_loss"] = data.evaluate(engine)
                rows.append(row)
                if metrics is not None:
                    metrics.write(json.dumps(row) + "\n")
                    metrics.flush()
                progress.update(row)
                if args.save_dir and ((args.save_every and (step + 1) % args.save_every == 0) or step + 1 == steps):
                    saved = _save(args, engine, tokenizer, src, step + 1, seq, out, progress, final=step + 1 == steps)
                if step + 1 != steps:
                    stop.check()
        if src.kind != "preset" and rows:
            model_dir = out / "final"
            engine.save_pretrained(model_dir, tokenizer=tokenizer, merge_lora=args.merge_lora)
    except KeyboardInterrupt as exc:
        progress.close()
        what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        _stop_line(f"infinity train: {what} at step {step + 1 if rows and rows[-1]['step'] == step + 1 else step} "
                   f"of {steps} (rank {rank}); last checkpoint: {saved or 'none'}; swap files removed")
        return 143 if isinstance(exc, Terminated) else 130
    finally:
        progress.close()
        if metrics is not None:
            metrics.close()
    if rank == 0 and not rows:
        print(f"nothing to train: the checkpoint is already at step {start} of --steps {steps}")
    elif rank == 0:
        plotted = _plot(rows, out / "metrics.png", args.model)
        progress.summary(rows=rows, out_dir=out, model_dir=model_dir, peak_rss=max(r["peak_rss_bytes"] for r in rows))
        print(f"plot in {out}/metrics.png" if plotted else
              "no plot (matplotlib is not installed: pip install matplotlib)", flush=True)
    return 0


def _one_step(engine, data, step: int, accum: int) -> dict:
    """One optimizer step (accum micro-batches); its metrics row. A non-finite loss stops the run, unless fp16's
    loss scaler is skipping an overflow."""
    import torch

    t0 = time.perf_counter()
    lr = engine.get_lr()  # this step's; step() moves the scheduler on
    data_s, total, tokens = 0.0, 0.0, 0
    for k in range(accum):
        td = time.perf_counter()
        batch = data.batch(step, engine.rank, k)
        data_s += time.perf_counter() - td
        loss = data.forward(engine, batch)
        engine.backward(loss)
        engine.step()
        total += loss.item()
        tokens += data.tokens_in(batch)
    step_s = time.perf_counter() - t0
    stats = torch.tensor([total / accum, float(tokens)], dtype=torch.float64)
    engine.comm.all_reduce_(stats)
    loss = stats[0].item() / engine.world_size
    r = engine.last_report
    if not math.isfinite(loss) and not (engine.fp16_enabled() and r.skipped):  # fp16: the scaler backs off
        raise FloatingPointError(f"the loss is {loss} at step {step + 1} (lr {lr[0] if len(lr) == 1 else lr}); "
                                 "training diverged: lower --lr, add --warmup, or use bf16 instead of fp16")
    return {"step": step + 1, "loss": loss, "step_s": step_s, "data_s": data_s, "tokens": int(stats[1].item()),
            "tokens_per_s": stats[1].item() / step_s, "io_read_bytes": r.io_read_bytes,
            "io_write_bytes": r.io_write_bytes, "exposed_io_s": r.exposed_io_s, "comm_s": r.comm_s,
            "prefetch_hit_rate": r.prefetch_hit_rate, "param_fetches": r.param_fetches,
            "param_critical_reads": r.param_critical_reads, "param_stall_s": r.param_stall_s,
            "skipped": r.skipped, "loss_scale": r.loss_scale, "grad_norm": r.grad_norm,
            "speculation": r.speculation, "optimizer_io_wait_s": r.optimizer_io_wait_s, "lr": lr[0]}


def _resume(args, engine, seq: int, rank: int) -> int:
    if not args.resume:
        return 0
    tag, why = _resume_tag(args.save_dir)
    if tag is None:
        if rank == 0:
            print(f"--resume: no checkpoint in {args.save_dir} yet" + (f" ({why})" if why else "")
                  + "; starting at step 0", flush=True)
        return 0
    if why and rank == 0:
        print(f"--resume: {why}", flush=True)
    path, state = engine.load_checkpoint(args.save_dir, tag=tag)
    state = state if isinstance(state, dict) else {}
    if state.get("seq") != seq or state.get("model") != args.model or "next_step" not in state:
        raise ValueError(f"--resume: {path} was saved by a run with --model {state.get('model')} and --seq "
                         f"{state.get('seq')}; this run has --model {args.model} and --seq {seq}")
    mine = _data_position_keys(args, engine)
    theirs = {k: state.get(k, v) for k, v in mine.items()}
    if theirs != mine:  # any of these changes which windows step s reads, or what is trained
        diff = ", ".join(f"{k} {theirs[k]} (now {mine[k]})" for k in mine if theirs[k] != mine[k])
        raise ValueError(f"--resume: {path} was saved by a run with {diff}; resume with the same settings, or "
                         "start a new run in another --save-dir")
    mine, theirs = _run_keys(args), state.get("run")
    if theirs is not None and theirs != mine and not args.resume_changed:
        diff = ", ".join(f"{k} {theirs.get(k)} (now {mine[k]})" for k in mine if theirs.get(k) != mine[k])
        raise ValueError(f"--resume: {path} belongs to another run: it was saved with {diff}; resume with the "
                         "same settings, or pass --resume-changed to continue it with these")
    if rank == 0:
        print(f"resumed from {path} at step {state['next_step']}", flush=True)
    return state["next_step"]


def _resume_tag(save_dir: str) -> tuple[str | None, str | None]:
    """(tag, why): the checkpoint --resume loads, the one `latest` names; without `latest` (a save killed while
    writing it, ENOSPC there, or a deleted file), the newest complete checkpoint, `why` saying so. tag None for
    a directory with no checkpoint (interrupted saves, `.<tag>.partial`, are none: `why` names them). Never a
    silent restart over checkpoints: a directory whose only checkpoints are unusable raises, naming them."""
    from infinity.checkpoint.layout import CheckpointError, read_latest
    from infinity.checkpoint.load import resolve

    tag = read_latest(save_dir) if os.path.isdir(save_dir) else None
    if tag is not None:
        return tag, None
    if not os.path.isdir(save_dir):
        return None, None
    complete, broken, partial = [], [], []
    for name in sorted(os.listdir(save_dir)):
        if not os.path.isdir(os.path.join(save_dir, name)):
            continue
        if name.startswith(".") and name.endswith(".partial"):  # a save that was interrupted: never resumable
            partial.append(name)
            continue
        if not os.path.exists(os.path.join(save_dir, name, "zarr.json")):
            continue  # not a checkpoint (a save writes the root zarr.json before the directory gets its name)
        try:
            _, m = resolve(save_dir, name)
        except (CheckpointError, ValueError) as exc:
            broken.append(f"{name} ({exc})")
            continue
        complete.append(((m.engine or {}).get("global_steps", -1), m.created, name))
    if complete:
        newest = max(complete)[2]
        return newest, (f"{save_dir} has no 'latest' file (a save killed or out of space while writing it, or "
                        f"the file removed); resuming from the newest complete checkpoint, {newest}")
    if broken:
        raise CheckpointError(f"--resume: {save_dir} has no usable checkpoint to resume from: {'; '.join(broken)}; "
                              "remove them to start over, or point --save-dir at the right directory")
    if partial:
        return None, f"only interrupted saves, {', '.join(partial)}, which the next save removes"
    return None, None


def _run_keys(args) -> dict:
    """What makes a checkpoint this run's (beyond the data position): a --resume with others is refused unless
    --resume-changed (two runs saving into one directory would otherwise continue each other)."""
    import hashlib

    with open(args.config, "rb") as f:
        config = hashlib.sha256(f.read()).hexdigest()[:16]
    return {"lr": args.lr, "warmup": args.warmup, "config": config}


def _data_position_keys(args, engine) -> dict:
    """What decides which windows step s reads, and what is trained: a resume must match them all."""
    return {"data": args.data, "lora": args.lora, "seed": args.seed, "packing": args.packing,
            "eval_fraction": args.eval_fraction, "world": engine.world_size,
            "micro": engine.train_micro_batch_size_per_gpu(), "accum": engine.gradient_accumulation_steps()}


def _save(args, engine, tokenizer, src, done: int, seq: int, out: Path, progress, *, final: bool) -> str:
    t0 = time.perf_counter()
    path = engine.save_checkpoint(args.save_dir, client_state={
        "next_step": done, "model": args.model, "seq": seq, "model_dir": src.directory,
        **_data_position_keys(args, engine), "run": _run_keys(args)})
    if src.kind != "preset" and not final:  # the final one is out/final
        engine.save_pretrained(out / f"step-{done}", tokenizer=tokenizer, merge_lora=args.merge_lora)
    progress.say(f"saved {path} in {time.perf_counter() - t0:.1f} s")
    return path


def baseline_rss() -> int:
    from infinity.tools.plan import baseline_rss as measure

    return measure()


def _dir_bytes(path: str) -> int:
    """Bytes of the files under `path` (this rank's and the others' swap files)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass  # removed while walking
    return total


def _peak_rss() -> int:
    """Peak RSS since the baseline was taken (VmHWM, reset then), or the process's ru_maxrss where /proc is missing."""
    from infinity.memory_stats import peak_rss_bytes

    return peak_rss_bytes()


def _plot(rows: list, path: Path, title: str) -> bool:
    """The loss and step-time plot; False (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [r["step"] for r in rows]
    io = [r["exposed_io_s"] for r in rows]
    comm = [r["comm_s"] for r in rows]
    compute = [max(0.0, r["step_s"] - a - b) for r, a, b in zip(rows, io, comm)]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(steps, [r["loss"] for r in rows])
    ax1.set_ylabel("loss")
    ax1.set_title(f"infinity train: {title}")
    ax2.bar(steps, compute, label="compute")
    ax2.bar(steps, io, bottom=compute, label="exposed I/O")
    ax2.bar(steps, comm, bottom=[a + b for a, b in zip(compute, io)], label="communication")
    ax2.set_xlabel("step")
    ax2.set_ylabel("seconds")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
