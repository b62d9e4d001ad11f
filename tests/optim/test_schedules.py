"""The config's scheduler section: DeepSpeed's five lr schedules, against the sequences DeepSpeed 0.19.8 itself
produced (deepspeed_lr_sequences.json says how they were made), and against their closed forms."""

import json
import math
import pathlib

import pytest
import torch

from infinity import ConfigError, load_config
from infinity.config.schema import SchedulerConfig
from infinity.optim.schedules import build_scheduler, check_scheduler

CASES = json.loads((pathlib.Path(__file__).parent / "deepspeed_lr_sequences.json").read_text())["cases"]


def two_groups(lrs):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.AdamW(groups, lr=lrs[0])


@pytest.mark.parametrize("case", CASES, ids=[f"{c['type']}-{i}" for i, c in enumerate(CASES)])
def test_lr_and_betas_equal_deepspeeds_sequence(case):
    opt = two_groups(case["group_lrs"])
    kind, params = check_scheduler(case["type"], case["params"])
    sched = build_scheduler(SchedulerConfig(type=kind, params=params), opt)
    got_lr = [[g["lr"] for g in opt.param_groups]]
    got_betas = [[list(g["betas"]) for g in opt.param_groups]]
    for _ in range(len(case["lr"]) - 1):
        sched.step()
        got_lr.append([g["lr"] for g in opt.param_groups])
        got_betas.append([list(g["betas"]) for g in opt.param_groups])
    for t, (want, got) in enumerate(zip(case["lr"], got_lr)):
        for w, g in zip(want, got):
            assert math.isclose(w, g, rel_tol=1e-9, abs_tol=1e-15), f"step {t}: DeepSpeed {want}, infinity {got}"
    for t, (want, got) in enumerate(zip(case["betas"], got_betas)):
        assert torch.allclose(torch.tensor(want, dtype=torch.float64), torch.tensor(got, dtype=torch.float64),
                              rtol=1e-9, atol=0), f"betas at step {t}: DeepSpeed {want}, infinity {got}"
    assert sched.state_dict() == case["state"]


def test_closed_forms():
    opt = two_groups([0.1])
    s = build_scheduler(SchedulerConfig(type="WarmupLR", params=check_scheduler("WarmupLR", {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 100})[1]), opt)
    for t in range(5):
        s.step()
        assert math.isclose(opt.param_groups[0]["lr"], math.log(t + 1) / math.log(100), rel_tol=1e-12)
    opt = two_groups([2.0])
    s = build_scheduler(SchedulerConfig(type="WarmupCosineLR", params=check_scheduler("WarmupCosineLR", {
        "total_num_steps": 12, "warmup_num_steps": 2, "cos_min_ratio": 0.0, "warmup_type": "linear"})[1]), opt)
    assert opt.param_groups[0]["lr"] == 0.0
    for _ in range(12):
        s.step()
    assert math.isclose(opt.param_groups[0]["lr"], 0.0, abs_tol=1e-12), "the cosine ends at cos_min_ratio"


def test_scheduler_config_errors_name_the_key_the_value_and_the_fix():
    with pytest.raises(ConfigError) as ei:
        load_config({"scheduler": {"type": "CosineAnnealing"}})
    assert str(ei.value) == ("scheduler.type: must be one of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, "
                             "LRRangeTest, got 'CosineAnnealing'")
    with pytest.raises(ConfigError) as ei:
        load_config({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}})
    assert str(ei.value) == "scheduler.params.total_num_steps: WarmupDecayLR needs it; give a value"
    with pytest.raises(ConfigError) as ei:
        load_config({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 10}}})
    assert str(ei.value).startswith("scheduler.params.warmup_steps: is not a parameter of WarmupLR; its parameters "
                                    "are warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type")
    with pytest.raises(ConfigError) as ei:
        load_config({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}})
    assert str(ei.value) == "scheduler.params.warmup_num_steps: must be a whole number >= 1, got 0"
    with pytest.raises(ConfigError) as ei:
        load_config({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}})
    assert str(ei.value) == "scheduler.params.warmup_type: must be \"log\" or \"linear\", got 'cosine'"


def test_the_engine_steps_the_config_scheduler_once_per_optimizer_step(tmp_path):
    from infinity.engine import initialize

    cfg = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 4,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2,
                                                             "warmup_max_lr": 0.01, "warmup_type": "linear"}}}
    model = torch.nn.Linear(4, 1)
    engine = initialize(model, cfg)
    try:
        assert engine.gas == 2, "4 = 2 x accumulation x 1 rank"
        seen = []
        for micro in range(8):
            seen.append(engine.optimizer.param_groups[0]["lr"])
            engine.backward(engine(torch.ones(2, 4)).sum())
            engine.step()
        # lr(t) for t = -1, 0, 1, 2 (each held for the 2 micro-batches of one optimizer step)
        want = [0.0, 0.0, 0.0, 0.0, 0.005, 0.005, 0.01, 0.01]
        assert all(math.isclose(a, b, abs_tol=1e-15) for a, b in zip(seen, want)), seen
    finally:
        engine.close()
