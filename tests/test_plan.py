"""The offload planner: placement by budget, complete configs, bad input, and the huge-model path in CI time."""

import json
import math
import subprocess
import sys

import pytest

from infinity.config import load_config
from infinity.tools.plan import Rates, activation_bytes, io_bytes, model_shape, plan
from infinity.tools.plan.cost import NoPlacement, plan_batch

RATES = Rates(flops=2e11, adam_params_s=1e9, memcpy_bytes_s=1e10, disk_read_bytes_s=1.5e9, disk_write_bytes_s=2e9,
              layer_s=0.01)
MiB = 1 << 20
INFINITY = [sys.executable, "-m", "infinity"]


@pytest.fixture(scope="module")
def small():
    return model_shape("gpt-small", 128)


def test_model_shape_reads_the_meta_model(small):
    # gpt-small: byte vocabulary, 4 layers of width 256; the LM head is tied, so counted once.
    assert small.numel == 3_257_856 and small.layers == 4 and small.dim == 256 and small.vocab == 256
    assert small.largest == 4 * 256 * 256 and small.largest_module == 4 * 256 * 256 + 4 * 256
    assert small.block is not None and not small.checkpoint


@pytest.mark.parametrize("budget,placement", [(512 * MiB, ("none", "cpu")), (48 * MiB, ("none", "nvme")),
                                              (32 * MiB, ("nvme", "nvme"))])
def test_the_fastest_placement_that_fits(small, tmp_path, budget, placement):
    p = plan(small, budget, RATES, precision="bf16", nvme_path=str(tmp_path))
    assert (p.param_tier, p.optimizer_tier) == placement
    assert p.predicted_peak_bytes <= budget
    assert p.predicted_peak_bytes == sum(p.memory.values())
    cfg = load_config(p.config)  # complete and valid as it is
    zero = cfg.zero_optimization
    assert zero.stage == 3 and cfg.bf16.enabled and cfg.infinity.memory_budget == budget
    assert (zero.offload_param.device, zero.offload_optimizer.device) == placement
    if placement[1] == "nvme":  # a larger shard is split over whole pieces ([Note: a large shard is split ...])
        assert zero.sub_group_size >= small.largest or zero.sub_group_size % 4096 == 0
    if placement[0] == "nvme":
        assert zero.offload_param.buffer_size >= small.largest and zero.offload_param.nvme_path == str(tmp_path)
        assert zero.stage3_prefetch_bucket_size <= (zero.offload_param.buffer_count - 1) * zero.offload_param.buffer_size
    if placement[1] == "nvme":
        assert zero.offload_optimizer.buffer_count >= 3, "read, Adam and write overlap"
        assert p.memory["swap_buffers"] >= zero.offload_optimizer.buffer_count * 12 * zero.sub_group_size


def test_a_bigger_budget_never_predicts_a_slower_step(small, tmp_path):
    steps = [plan(small, b * MiB, RATES, nvme_path=str(tmp_path)).predicted_step_s for b in (32, 48, 512)]
    assert steps[0] >= steps[1] >= steps[2]


def test_without_a_disk_everything_must_fit_in_ram(small):
    with pytest.raises(ValueError, match=r"--memory-budget 40\.00 MiB: no placement of gpt-small .*in RAM needs "
                                         r".*with --nvme-path the state can go to disk"):
        plan(small, 40 * MiB, RATES, nvme_path=None)


def test_too_small_a_budget_says_what_each_placement_needs(small, tmp_path):
    with pytest.raises(ValueError) as err:
        plan(small, 4 * MiB, RATES, nvme_path=str(tmp_path))
    text = str(err.value)
    for placement in ("params in RAM + optimizer in RAM", "params in RAM + optimizer on NVMe",
                      "params on NVMe + optimizer on NVMe"):
        assert placement in text


def test_ranks_share_the_host_budget(small, tmp_path):
    one = plan(small, 64 * MiB, RATES, nvme_path=str(tmp_path), world=1)
    two = plan(small, 64 * MiB, RATES, nvme_path=str(tmp_path), world=2)
    assert two.predicted_peak_bytes <= 32 * MiB < one.predicted_peak_bytes
    assert two.param_buffer_size <= math.ceil(one.param_buffer_size / 2), "each rank holds half of each parameter"


def test_clipping_keeps_every_gradient_in_ram(tmp_path):
    shape = model_shape("gpt-25m", 128)
    free = plan(shape, 256 * MiB, RATES, nvme_path=str(tmp_path))
    clipped = plan(shape, 256 * MiB, RATES, nvme_path=str(tmp_path), clipping=True)
    # Without clipping only the sub-groups in flight hold fp32 gradients; with it, every one waits in RAM for the
    # step, which the next forward finishes: they and the activations do not peak together.
    assert free.optimizer_tier == clipped.optimizer_tier == "nvme"
    assert free.memory.get("gradients", 0) < 4 * shape.numel <= clipped.memory["activations_then_gradients"]
    assert clipped.peak_phase == "training"
    assert clipped.predicted_peak_bytes > free.predicted_peak_bytes


def test_a_default_micro_batch_is_split_to_fit_and_a_written_one_is_not(tmp_path):
    """[Note: the planner may split the batch]: with clipping every fp32 gradient waits in RAM. In one micro-batch
    the next forward frees them as its activations grow, so the larger of the two counts; with accumulation the
    later micro-batches run beside all of them, so both count. At 200 MiB gpt-25m fits only as 8 micro-batches
    of one 128-token sequence, not as one of 8 (nor 2 x 4, 4 x 2)."""
    shape = model_shape("gpt-25m", 128)
    kw = dict(nvme_path=str(tmp_path), clipping=True)
    with pytest.raises(NoPlacement, match="no placement of gpt-25m"):
        plan_batch(shape, 200 * MiB, RATES, micro=8, **kw)  # written by the user: kept
    p = plan_batch(shape, 200 * MiB, RATES, micro=8, split=True, **kw)
    assert (p.micro_batch, p.grad_accum) == (1, 8), "the largest divisor of 8 that fits, the same 8 per step"
    assert p.predicted_peak_bytes <= 200 * MiB
    assert p.memory["gradients"] >= 4 * shape.numel and p.memory["activations"] > 0, "accumulation: both count"
    cfg = load_config(p.config)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (1, 8)
    one = plan(shape, 200 * MiB, RATES, micro=1, **kw)
    assert p.predicted_step_s > one.predicted_step_s, "eight micro-batches compute eight times"
    with pytest.raises(NoPlacement, match=r"nor with the batch of 8 split into micro-batches down to 1"):
        plan_batch(shape, 170 * MiB, RATES, micro=8, split=True, **kw)


def test_parameter_buffers_hold_fp32_in_setup_and_the_compute_dtype_in_training(tmp_path):
    """[Note: the parameter pool shrinks after setup] in engine/params.py, as the planner counts it."""
    shape = model_shape("gpt-57m", 128)
    p = plan(shape, 64 * MiB, RATES, micro=1, nvme_path=str(tmp_path))
    assert (p.param_tier, p.optimizer_tier, p.peak_phase) == ("nvme", "nvme", "training")
    zero = load_config(p.config).zero_optimization
    params = zero.offload_param.buffer_count * zero.offload_param.buffer_size
    opt = zero.offload_optimizer.buffer_count * zero.sub_group_size * (12 + 2)  # [p|m|v] + the bf16 tail
    assert p.memory["swap_buffers"] == 2 * params + opt


def test_two_ranks_get_a_loadable_config_with_gradient_buckets(small, tmp_path):
    p = plan(small, 64 * MiB, RATES, nvme_path=str(tmp_path), world=2)
    assert p.memory["comm_buckets"] > 0
    assert load_config(p.config).zero_optimization.reduce_bucket_size >= small.largest_module


def test_the_base_configs_other_choices_are_kept(small, tmp_path):
    base = {"zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": True, "buffer_count": 99},
                                  "offload_optimizer": {"pin_memory": True, "pipeline_read": True}},
            "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    with pytest.warns(UserWarning, match=r"the plan sets .*offload_param\.buffer_count to \d+, not the config's 99"):
        p = plan(small, 32 * MiB, RATES, nvme_path=str(tmp_path), base=base)
    zero = p.config["zero_optimization"]
    assert zero["offload_param"]["pin_memory"] and zero["offload_optimizer"]["pipeline_read"]
    assert zero["offload_param"]["buffer_count"] == p.param_buffer_count != 99, "sizes are planned"
    assert p.config["optimizer"]["params"]["lr"] == 0.01


@pytest.mark.parametrize("budget_mib", [32, 512])
def test_the_planner_keeps_bf16_moments(small, tmp_path, budget_mib):
    # What the planner does not decide is the config's: bf16 moments were once dropped here, silently.
    import warnings

    base = {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme",
                                                        "fast_init": True, "moments_dtype": "bf16",
                                                        "moments_rounding": "nearest"}}}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        p = plan(small, budget_mib * MiB, RATES, nvme_path=str(tmp_path), base=base)
    opt = load_config(p.config).zero_optimization.offload_optimizer
    assert (opt.moments_dtype, opt.moments_rounding, opt.fast_init) == ("bf16", "nearest", True)
    notes = [str(w.message) for w in seen if "the plan sets" in str(w.message)]
    if p.optimizer_tier == "nvme":
        assert notes == [], "nothing the config wrote was overridden"
    else:
        assert len(notes) == 1 and "offload_optimizer.device to 'cpu', not the config's 'nvme'" in notes[0]


@pytest.mark.parametrize("budget_mib,tiers", [(32, ("nvme", "nvme")), (512, ("none", "cpu"))])
def test_partial_placements_the_planner_does_not_model_are_planned_and_reported(small, tmp_path, budget_mib, tiers):
    # A DeepSpeed config's max_in_cpu (1e9 keeps a small model in RAM) and Twin-Flow ratio would each change
    # where state lives behind the plan's back; the plan sets them and says so where they would matter.
    import warnings

    base = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/x", "max_in_cpu": 1e9},
                                  "offload_optimizer": {"device": "cpu", "ratio": 0.5},
                                  "sub_group_size": "auto", "reduce_bucket_size": "auto"}}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        p = plan(small, budget_mib * MiB, RATES, nvme_path=str(tmp_path), base=base)
    assert (p.param_tier, p.optimizer_tier) == tiers  # each case takes the branch it is here for
    zero = load_config(p.config).zero_optimization
    notes = " ".join(str(w.message) for w in seen if "the plan sets" in str(w.message))
    assert "auto" not in notes, "an 'auto' value is the planner's to fill, not a conflict"
    if p.param_tier == "nvme":
        assert zero.offload_param.max_in_cpu == 0 and "offload_param.max_in_cpu to 0" in notes
    else:
        assert "max_in_cpu" not in p.config["zero_optimization"]["offload_param"] and "max_in_cpu" not in notes
    if p.optimizer_tier == "cpu":
        assert zero.offload_optimizer.ratio == 1.0 and "offload_optimizer.ratio to 1.0, not the config's 0.5" in notes
    else:
        assert "ratio" not in p.config["zero_optimization"]["offload_optimizer"]


def test_micro_batch_and_precision_come_from_the_base_config(tmp_path):
    from infinity.tools.plan import make_plan

    base = tmp_path / "base.json"
    base.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3, "fp16": {"enabled": True},
                                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                                            "nvme_path": "/local_nvme"}}}))
    p, shape, _ = make_plan(model="gpt-tiny", memory_budget="1GiB", nvme_path=None, config=str(base), rates=RATES)
    assert p.config["train_micro_batch_size_per_gpu"] == 3 and p.config["fp16"]["enabled"]
    assert not p.config["bf16"]["enabled"]


def test_io_volume_per_parameter():
    # The engine's figures: 28 B/param in fp32 and bf16 with everything on NVMe and the step during backward
    # (backward's weights come from the state read); 32 and 30 with the step after backward.
    assert sum(io_bytes("nvme", "nvme", 1000, "fp32")) == 28_000
    assert sum(io_bytes("nvme", "nvme", 1000, "bf16")) == 28_000
    assert sum(io_bytes("nvme", "nvme", 1000, "fp32", step_in_backward=False)) == 32_000
    assert sum(io_bytes("nvme", "nvme", 1000, "bf16", step_in_backward=False)) == 30_000
    assert sum(io_bytes("none", "nvme", 1000, "bf16")) == 24_000
    assert io_bytes("nvme", "cpu", 1000, "bf16") == (0, 2000)  # every shard fetch lent from the RAM master
    assert io_bytes("nvme", "cpu", 1000, "fp32") == (0, 4000)  # no optimizer file for the shard to be a slice of
    assert io_bytes("none", "cpu", 1000, "bf16") == (0, 0)


@pytest.mark.parametrize("otier,precision,moments", [("nvme", "fp32", "fp32"), ("nvme", "bf16", "fp32"),
                                                     ("nvme", "fp32", "bf16"), ("nvme", "bf16", "bf16"),
                                                     ("cpu", "fp32", "fp32"), ("cpu", "bf16", "fp32")])
def test_io_volume_is_what_the_engine_moves(otier, precision, moments, disk_dir):
    # The planner's bytes against the engine's counters, parameters on NVMe, after the step settles. Writes
    # match exactly; forward reads may exceed the plan by the tied embedding's second read (its two uses are
    # further apart than the reuse distance), never fall below it.
    import torch

    from infinity.engine import initialize, zero_init
    from infinity.models import GPT
    from infinity.testing.parity import MODEL, batch, engine_config

    over = {"zero_optimization.offload_optimizer.buffer_count": 6}  # room to read every group's state ahead
    if precision == "bf16":
        over["bf16.enabled"] = True
    if otier == "cpu":
        over["zero_optimization.offload_optimizer"] = {"device": "cpu"}
    else:
        over["zero_optimization.offload_optimizer.moments_dtype"] = moments
    cfg = engine_config("nvme", str(disk_dir), **over)
    torch.manual_seed(0)
    with zero_init(cfg):
        model = GPT(MODEL)
    engine = initialize(model, cfg)
    try:
        for s in range(3):
            x, y = batch(s)
            engine.backward(engine(x, y))
            engine.step()
        r = engine.last_report
        shard = sum(mp.part for mp in engine.store.params)
        reads, writes = io_bytes("nvme", otier, shard, precision, 8 if moments == "bf16" else 12)
        assert r.param_write_bytes + r.optimizer_write_bytes == writes
        got = r.param_read_bytes + r.optimizer_read_bytes
        tied = (4 if precision == "fp32" else 2) * model.wte.weight.numel()
        assert reads <= got <= reads + tied, (got, reads)
    finally:
        engine.close()


def test_checkpointing_keeps_less_activation(small):
    import dataclasses

    ckpt = dataclasses.replace(small, checkpoint=True)
    assert activation_bytes(ckpt, 4, "bf16") < activation_bytes(small, 4, "bf16")


@pytest.mark.slow
def test_plan_command_writes_a_config_that_loads(tmp_path):
    out = tmp_path / "planned.json"
    proc = subprocess.run(INFINITY + ["plan", "--model", "gpt-small", "--memory-budget", "32MiB", "--nvme-path",
                                      str(tmp_path), "--write", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "parameters: on NVMe" in proc.stdout and "predicted peak memory over baseline" in proc.stdout
    assert "predicted step time" in proc.stdout and "predicted peak RSS" in proc.stdout
    cfg = load_config(str(out))
    assert cfg.zero_optimization.offload_param.device == "nvme"
    proc = subprocess.run(INFINITY + ["plan", "--model", "gpt-small", "--memory-budget", "1GiB", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["param_tier"] == "none" and doc["predicted_peak_bytes"] <= 1 << 30
    assert doc["rates"]["disk_read_bytes_s"] is None, "no --nvme-path: the disk is not measured"


@pytest.mark.parametrize("args,message", [
    (["--memory-budget", "lots"], "--memory-budget: cannot read 'lots' as a size"),
    (["--memory-budget", "1KiB"], "--memory-budget must be at least 1MiB"),
    (["--memory-budget", "1GiB", "--nvme-path", "/nonexistent/swap"], "--nvme-path /nonexistent/swap: not a directory"),
    (["--memory-budget", "1GiB", "--model", "gpt-huge"], "--model 'gpt-huge': not a preset"),
    (["--memory-budget", "1GiB", "--micro-batch", "0"], "--micro-batch must be >= 1, got 0"),
    (["--memory-budget", "1GiB", "--seq", "-5"], "--seq must be >= 1, got -5"),
    (["--memory-budget", "1GiB", "--nproc", "0"], "--nproc must be >= 1, got 0"),
    (["--write", "planned.json"], "--write needs --memory-budget"),
    ([], "swaps to NVMe: pass --nvme-path"),
    (["--nvme-path", "/tmp", "--precision", "fp32"], "set its precision and batch in the config"),
])
def test_bad_plan_arguments(args, message, capsys):
    from infinity.tools.cli import main

    argv = ["plan"] + (["--model", "gpt-small"] if "--model" not in args else []) + args
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_train_within_a_budget_an_eighth_of_the_state(disk_dir, tmp_path):
    """The huge-model path in CI time: `infinity train --memory-budget` on a model whose training state
    (16 B/param) is over 8x the budget. The planner must put parameters and optimizer on NVMe, and the run's
    peak RSS over its baseline must stay within the budget while the loss falls."""
    budget = 96 * MiB
    out = tmp_path / "run"
    cfg = tmp_path / "base.json"
    cfg.write_text(json.dumps({"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1,
                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    proc = subprocess.run(INFINITY + ["train", "--model", "gpt-57m", "--config", str(cfg), "--memory-budget",
                                      str(budget), "--steps", "3", "--seq", "128", "--nvme-path", str(disk_dir),
                                      "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert 16 * run["numel"] >= 8 * budget
    assert (run["param_tier"], run["optimizer_tier"]) == ("nvme", "nvme")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    peak_over = max(r["peak_rss_bytes"] for r in rows) - run["baseline_rss_bytes"]
    assert peak_over <= budget, f"peak {peak_over / MiB:.1f} MiB over the baseline, budget {budget / MiB:.0f} MiB"
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(x) for x in losses) and min(losses[1:]) < losses[0]
    plan_doc = json.loads((out / "plan.json").read_text())
    assert plan_doc["predicted_peak_bytes"] <= budget
    # The memory model pinned on this case (2026-12-07): 72-88 MiB measured for 88.0 predicted. The swap pools
    # are counted whole, but their pages become resident only where shards are written (aligned_empty maps
    # them lazily), so the prediction is an upper bound that runs up to a fifth above.
    assert peak_over >= 0.75 * plan_doc["predicted_peak_bytes"], "the planner's memory model is off by over 25 %"
    assert list(disk_dir.glob("infinity-swap*/*")) == [], "swap files are removed at the end"


@pytest.mark.slow
def test_bench_plan_smoke(disk_dir):
    proc = subprocess.run(INFINITY + ["bench", "plan", "--models", "gpt-tiny", "--memory-budget", "64MiB",
                                      "--nvme-path", str(disk_dir), "--steps", "2", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["model"] == "gpt-tiny" and row["numel"] > 0 and row["step_s"] > 0 and row["predicted_step_s"] > 0
    assert row["step_ratio"] == pytest.approx(row["step_s"] / row["predicted_step_s"])
    assert row["peak_over_baseline_bytes"] <= row["memory_budget"] == 64 * MiB
    assert len(row["losses"]) == 2 and all(math.isfinite(x) for x in row["losses"])


def _shipped(name: str, tmp_path, **changes):
    from infinity.config.shipped import shipped_config

    raw = json.loads(shipped_config(name).read_text())
    for key, value in changes.items():
        node = raw
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    out = tmp_path / f"{len(list(tmp_path.iterdir()))}-{name}"
    out.write_text(json.dumps(raw))
    return raw, load_config(str(out), nvme_path=str(tmp_path))


def test_predict_takes_the_configs_placement_and_the_engines_fitted_sizes(small, tmp_path):
    """Without a budget the planner predicts the run of a config as written ([Note: predicting a config's run]):
    the config's tiers, the sizes the engine fits where the config writes none (engine/plan.py), and, with
    clipping, the step finished in the next forward moving 30 B/param in bf16."""
    from infinity.engine.plan import FLOOR, TARGET
    from infinity.tools.plan import predict

    raw, cfg = _shipped("nvme_offload.json", tmp_path)
    p = predict(small, RATES, cfg, raw)
    assert (p.param_tier, p.optimizer_tier) == ("nvme", "nvme")
    assert p.sub_group_size == min(max(small.largest, FLOOR), TARGET, small.numel)
    assert p.optimizer_buffer_count == min(4, math.ceil(small.numel / p.sub_group_size))
    assert p.param_buffer_size == small.largest and p.param_buffer_count == 5
    assert p.time["step_phase"] == "forward" and p.time["after_s"] == 0
    assert p.io_read_bytes + p.io_write_bytes == 30 * small.numel
    assert p.predicted_peak_bytes == sum(p.memory.values()) and p.config == raw
    # A written size stands, as in the engine.
    raw, cfg = _shipped("nvme_offload.json", tmp_path, **{"zero_optimization.sub_group_size": 4096,
                                                          "zero_optimization.offload_optimizer.buffer_count": 6})
    p = predict(small, RATES, cfg, raw)
    assert (p.sub_group_size, p.optimizer_buffer_count) == (4096, 6)
    # All in RAM with clipping: no disk, and every gradient stays (zeroed, not freed) beside the state.
    raw, cfg = _shipped("cpu_offload.json", tmp_path)
    ram = predict(small, RATES, cfg, raw)
    assert (ram.param_tier, ram.optimizer_tier) == ("none", "cpu") and ram.io_read_bytes == ram.io_write_bytes == 0
    assert ram.memory["state_in_ram"] == 14 * small.numel and ram.memory["gradients"] >= 4 * small.numel
    # Without clipping the step runs during backward, and backward's shards are lent from the state read.
    raw, cfg = _shipped("nvme_offload.json", tmp_path, gradient_clipping=0.0)
    p = predict(small, RATES, cfg, raw)
    assert p.time["step_phase"] == "backward" and p.io_read_bytes + p.io_write_bytes == 28 * small.numel


def test_predict_refuses_what_it_does_not_model(small, tmp_path):
    from infinity.tools.plan import predict

    raw, cfg = _shipped("cpu_offload.json", tmp_path, **{"zero_optimization.offload_optimizer.ratio": 0.5})
    with pytest.raises(ValueError, match="cannot predict a partial optimizer offload"):
        predict(small, RATES, cfg, raw)
    raw, cfg = _shipped("nvme_offload.json", tmp_path, **{"zero_optimization.offload_param.max_in_cpu": 1000})
    with pytest.raises(ValueError, match="cannot predict shards kept in RAM"):
        predict(small, RATES, cfg, raw)


@pytest.mark.slow
def test_the_predicted_run_of_a_shipped_config(disk_dir, tmp_path):
    """`infinity plan` without a budget against the run it predicts: the shipped both-on-NVMe config as written
    (clipping 1.0, so the step finishes in the next forward), one sequence a step. The memory model is pinned on
    this case; the step time is the benchmark's business (bench/defaults.py), not a unit test's."""
    from infinity.config.shipped import shipped_config

    raw = json.loads(shipped_config("nvme_offload.json").read_text())
    raw["train_micro_batch_size_per_gpu"] = 1
    cfg = tmp_path / "nvme_offload_micro1.json"
    cfg.write_text(json.dumps(raw))
    common = ["--model", "gpt-25m", "--config", str(cfg), "--nvme-path", str(disk_dir), "--seq", "128"]
    proc = subprocess.run(INFINITY + ["plan", *common, "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    predicted = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (predicted["param_tier"], predicted["optimizer_tier"]) == ("nvme", "nvme")
    assert predicted["time"]["step_phase"] == "forward"
    out = tmp_path / "run"
    proc = subprocess.run(INFINITY + ["train", *common, "--steps", "3", "--out", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    peak_over = max(r["peak_rss_bytes"] for r in rows) - run["baseline_rss_bytes"]
    ratio = peak_over / predicted["predicted_peak_bytes"]
    # 0.89 measured (2026-12-07, twice): the pools are counted whole and their pages become resident only where
    # shards are written (aligned_empty maps them lazily).
    assert 0.8 <= ratio <= 1.15, (f"peak {peak_over / MiB:.1f} MiB over the baseline, predicted "
                                  f"{predicted['predicted_peak_bytes'] / MiB:.1f} MiB: {predicted['memory']}")
