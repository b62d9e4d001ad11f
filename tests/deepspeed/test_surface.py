"""The deepspeed.* surface training scripts import, with DeepSpeed's meaning, and the config keys DeepSpeed
accepts that we used to refuse: each accepted key's message is asserted."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

import infinity.deepspeed as deepspeed
from infinity import ConfigError, load_config
from infinity.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from infinity.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class Net(torch.nn.Module):
    """nanoGPT-ish: an embedding, a block with a .model-style attribute, a head."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(32, 16)
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.answer = 42

    def forward(self, x):
        return self.head(self.model(self.wte(x)))


def loaded(raw) -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(raw)
    return cfg, " ".join(str(w.message) for w in caught)


def test_hybrid_engine_off_is_accepted_and_on_is_refused_by_name():
    cfg, said = loaded(dict(BASE, hybrid_engine={"enabled": False, "max_out_tokens": 512}))
    assert "hybrid_engine (it is off; infinity has no inference engine to switch to" in said
    with pytest.raises(ConfigError, match="hybrid_engine: DeepSpeed's hybrid engine .* is not supported; set "
                                          "hybrid_engine.enabled to false"):
        load_config(dict(BASE, hybrid_engine={"enabled": True}))


@pytest.mark.parametrize("where,value,message", [
    ("zenflow", {"topk_ratio": 0.05, "update_interval": 4},
     "zero_optimization.zenflow (the step here is exact AdamW on every parameter at every step; ZenFlow's"),
    ("offload_optimizer.super_offload", True,
     "zero_optimization.offload_optimizer.super_offload (the step here is exact AdamW on every parameter at every "
     "step; SuperOffload's"),
    ("offload_optimizer.cpuadam_cores_perc", 0.8,
     "zero_optimization.offload_optimizer.cpuadam_cores_perc (the CPU Adam uses the cores torch.get_num_threads()"),
])
def test_zenflow_and_superoffload_keys_are_accepted_and_said_to_be_exact_adamw(where, value, message):
    raw = copy.deepcopy(BASE)
    raw["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    node = raw["zero_optimization"]
    *path, last = where.split(".")
    for p in path:
        node = node[p]
    node[last] = value
    cfg, said = loaded(raw)
    assert message in said
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


def test_grad_accum_dtype_is_said_to_have_no_effect_with_the_reason():
    _, said = loaded(dict(BASE, bf16={"enabled": True}, data_types={"grad_accum_dtype": "bf16"}))
    assert ("data_types (gradients are accumulated and reduced in fp32 (DeepSpeed's grad_accum_dtype defaults to "
            "bf16 with bf16; bench/RESULTS.md: Losses against DeepSpeed))") in said


def test_offload_param_below_stage_3_is_accepted_with_no_effect_as_in_deepspeed():
    cfg, said = loaded({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"},
                                              "offload_optimizer": {"device": "cpu"}}})
    assert ("zero_optimization.offload_param (device 'cpu' at stage 2: only stage 3 partitions the parameters, so "
            "they stay whole in memory, as in DeepSpeed)") in said
    assert cfg.zero_optimization.offload_param.device == "none"
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


@pytest.mark.parametrize("cls,mode_kw,mode", [(DeepSpeedCPUAdam, "adamw_mode", True),
                                              (DeepSpeedCPUAdam, "adamw_mode", False),
                                              (FusedAdam, "adam_w_mode", True)])
def test_deepspeeds_adams_become_the_engines_adam_with_their_settings(cls, mode_kw, mode):
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = cls([{"params": list(model.model.parameters()), "weight_decay": 0.1},
               {"params": list(model.wte.parameters()) + list(model.head.parameters()), "weight_decay": 0.0}],
              lr=1e-2, betas=(0.9, 0.95), **{mode_kw: mode})
    engine, eopt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=BASE)
    try:
        assert engine.config.optimizer.type == ("AdamW" if mode else "Adam")
        assert [g["weight_decay"] for g in eopt.param_groups] == [0.1, 0.0]
        # The same steps in plain torch: Adam with decoupled decay = adamw_mode.
        topt = torch.optim.Adam([{"params": list(ref.model.parameters()), "weight_decay": 0.1},
                                 {"params": list(ref.wte.parameters()) + list(ref.head.parameters()),
                                  "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95), decoupled_weight_decay=mode)
        x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            tl = ref(x).pow(2).mean()
            tl.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            topt.step()
            topt.zero_grad()
        got = engine.module_state_dict()
        for k, v in ref.state_dict().items():
            assert torch.allclose(got[k], v, rtol=1e-5, atol=1e-6), k
    finally:
        engine.close()


def test_the_engine_acts_as_its_module_and_its_parameters_carry_deepspeeds_zero3_attributes():
    model = Net()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=dict(BASE, optimizer={"type": "AdamW", "params": {"lr": 1e-3}}))
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1, "initialize leaves a process group"
        # DeepSpeed's engine is an nn.Module holding the model as `module`: its names start with "module."
        assert [n for n, _ in engine.named_parameters()] == ["module." + n for n, _ in model.named_parameters()]
        assert list(engine.parameters()) == list(model.parameters())
        assert [n for n, _ in engine.named_modules()] == [f"module.{n}".rstrip(".") for n, _ in
                                                          model.named_modules()]
        assert list(engine.children()) == [model]
        assert engine.model is model.model and engine.answer == 42, "unknown attributes come from the module"
        assert engine.head is model.head, "submodules too (they live in nn.Module's own dicts)"
        model.config = "the model's"
        assert engine.config != "the model's" and hasattr(engine.config, "zero_optimization"), "the engine's first"
        assert not hasattr(engine, "__iter__"), "dunders are not forwarded"
        with pytest.raises(AttributeError, match="has no attribute 'nope'"):
            engine.nope
        with pytest.raises(AttributeError, match="the engine places and casts the parameters itself"):
            engine.half()
        with pytest.raises(RuntimeError, match="engine.load_state_dict: after initialize the optimizer owns"):
            engine.load_state_dict({})
        w = model.head.weight
        assert hasattr(w, "ds_id") and w.ds_numel == 512 and w.ds_shape == torch.Size([32, 16])
        assert w.ds_status == ZeroParamStatus.NOT_AVAILABLE
        assert w.ds_tensor.numel() == 512  # one rank: the whole partition
        ids = [p.ds_id for p in model.parameters()]
        assert len(set(ids)) == len(ids)
        with deepspeed.zero.GatheredParameters([w]):
            assert w.ds_status == ZeroParamStatus.AVAILABLE and torch.isfinite(w).all()
        sd = engine.state_dict()
        assert list(sd) == ["module." + k for k in model.state_dict(keep_vars=True)]
        assert all(torch.isfinite(v).all() for v in sd.values())
        with deepspeed.zero.GatheredParameters([w]):
            assert torch.equal(sd["module.head.weight"], w.detach())
        assert engine.forward(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 32)
    finally:
        engine.close()


def test_the_other_submodules_answer_as_deepspeeds_do():
    from infinity.deepspeed.compression.helper import recursive_getattr, recursive_setattr
    from infinity.deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
    from infinity.deepspeed.pipe import LayerSpec, PipelineModule
    from infinity.deepspeed.utils import RepeatingLoader

    from infinity.deepspeed.accelerator import CPU_Accelerator

    acc = CPU_Accelerator()
    assert acc.device_name() == "cpu" and acc.device_name(0) == "cpu:0" and acc.communication_backend_name() == "gloo"
    assert acc.is_bf16_supported() and acc.current_device_name() == "cpu:0"
    assert type(deepspeed.get_accelerator()).__name__ == ("CUDA_Accelerator" if torch.cuda.is_available() else
                                                         "CPU_Accelerator")
    with pytest.raises(RuntimeError, match="infinity builds no DeepSpeed ops"):
        acc.create_op_builder("CPUAdamBuilder")
    loader = RepeatingLoader([1, 2])
    assert [next(loader) for _ in range(5)] == [1, 2, 1, 2, 1]
    net = Net()
    assert recursive_getattr(net, "model.0") is net.model[0]
    lin = torch.nn.Linear(16, 16)
    recursive_setattr(net, "model.2", lin)
    assert net.model[2] is lin
    groups = [{"params": list(net.parameters())}]
    assert split_params_into_different_moe_groups_for_optimizer(groups) is groups
    assert not is_moe_param(net.head.weight)
    net.head.weight.allreduce = False
    with pytest.raises(ValueError, match="expert parallelism is not supported"):
        is_moe_param(net.head.weight)
    assert isinstance(LayerSpec(torch.nn.Linear, 2, 3).build(), torch.nn.Linear)
    with pytest.raises(NotImplementedError, match="pipeline parallelism is not in infinity yet"):
        PipelineModule(layers=[LayerSpec(torch.nn.Linear, 2, 3)], num_stages=2)
