"""Configs copied from DeepSpeed's and Hugging Face's docs load and mean what they mean there; the DeepSpeed
API's pieces one by one, and their bad-input messages."""

import json

import pytest
import torch

import infinity.deepspeed as deepspeed
from infinity import ConfigError, load_config

# Hugging Face's docs (main_classes/deepspeed): ds_config_zero3.json and ds_config_zero2.json, as published.
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
# DeepSpeed's ZeRO-Infinity tutorial (NVMe offload of parameters and optimizer).
ZERO_INFINITY = {
    "zero_optimization": {
        "stage": 3, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7, "sub_group_size": 1e9,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 4,
                              "fast_init": False},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5,
                          "buffer_size": 1e8, "max_in_cpu": 1e9}},
    "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1, "single_submit": False,
            "overlap_events": True},
}
# DeepSpeed's config-json page, its first example: zero_optimization as a bare boolean.
CONFIG_JSON = {"train_batch_size": 8, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}, "fp16": {"enabled": True},
               "zero_optimization": True}


def test_hugging_faces_zero3_config_means_what_it_means_there():
    with pytest.warns(UserWarning):
        cfg = load_config(HF_ZERO3)
    z = cfg.zero_optimization
    assert z.stage == 3 and z.offload_param.device == "cpu" and z.offload_optimizer.device == "cpu"
    assert z.stage3_gather_16bit_weights_on_model_save and not cfg.fp16.enabled
    assert cfg.scheduler.type == "WarmupLR" and cfg.scheduler.params["warmup_max_lr"] is None
    assert cfg.train_micro_batch_size_per_gpu is None and cfg.gradient_accumulation_steps is None
    assert "zero_optimization.reduce_bucket_size" in cfg.auto and "optimizer.params.lr" in cfg.auto


def test_hugging_faces_zero2_config_means_what_it_means_there():
    with pytest.warns(UserWarning, match=r"zero_optimization.allgather_bucket_size \(parameters are gathered"):
        cfg = load_config(HF_ZERO2)
    assert cfg.zero_optimization.stage == 2 and cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.reduce_bucket_size == 200_000_000


def test_the_zero_infinity_tutorial_config_loads_with_its_nvme_path(tmp_path):
    raw = json.loads(json.dumps(ZERO_INFINITY).replace("/local_nvme", str(tmp_path / "created")))
    with pytest.warns(UserWarning, match="contiguous_gradients") as record:
        cfg = load_config(raw)
    assert "max_in_cpu" not in str(record[0].message), "offload_param.max_in_cpu has its effect"
    assert cfg.zero_optimization.offload_param.device == "nvme"
    assert not (tmp_path / "created").exists(), "parsing creates no directory; the engine that swaps there does"
    assert cfg.zero_optimization.offload_param.max_in_cpu == ZERO_INFINITY["zero_optimization"]["offload_param"][
        "max_in_cpu"]
    assert cfg.aio.block_size == 262144 and cfg.aio.intra_op_parallelism == 1


def test_config_json_examples_boolean_zero_optimization_is_stage_1():
    cfg = load_config(CONFIG_JSON)
    assert cfg.zero_optimization.stage == 1 and cfg.optimizer.type == "Adam" and cfg.fp16.enabled


def test_hf_zero3_config_trains_a_hf_model_with_auto_filled_from_it():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (make deps installs it)")
    raw = dict(HF_ZERO3, train_micro_batch_size_per_gpu=2)
    with deepspeed.zero.Init(config_dict_or_path=raw):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                                     n_positions=32))
    engine, opt, loader, sched = deepspeed.initialize(model=model, config=raw)
    try:
        z = engine.config.zero_optimization
        assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size) == (32 * 32, int(0.9 * 32 * 32))
        assert engine.train_micro_batch_size_per_gpu() == 2 and engine.gradient_accumulation_steps() == 1
        assert loader is None and sched is engine.lr_scheduler and type(sched).__name__ == "WarmupLR"
        x = torch.randint(0, 64, (2, 8))
        engine.backward(engine(input_ids=x, labels=x).loss)
        assert engine.step()
    finally:
        engine.close()


# ----------------------------------------------------------------------------- the API's pieces


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum()


BASE = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}


def test_a_torch_adamw_becomes_the_engines_adam_with_its_groups():
    model = Tiny()
    torch_opt = torch.optim.AdamW([{"params": model.a.parameters(), "lr": 0.01},
                                   {"params": model.b.parameters(), "weight_decay": 0.0}],
                                  lr=0.002, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=torch_opt, config=BASE)
    try:
        assert [g["lr"] for g in opt.param_groups] == [0.01, 0.002]
        assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
        assert all(g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 for g in opt.param_groups)
        assert engine.config.optimizer.type == "AdamW"
    finally:
        engine.close()


def test_unsupported_optimizers_and_double_configs_are_refused_by_name():
    model = Tiny()
    with pytest.raises(TypeError, match="optimizer SGD is not supported; supported: torch.optim.Adam, "
                                        "torch.optim.AdamW"):
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=BASE)
    with pytest.raises(ValueError, match="an optimizer was passed and the config has an optimizer section"):
        deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()),
                             config=dict(BASE, optimizer={"type": "Adam"}))
    with pytest.raises(ValueError, match="sets amsgrad=True"):
        deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), amsgrad=True), config=BASE)
    import argparse

    args = argparse.Namespace(deepspeed_config="x.json")
    with pytest.raises(ValueError, match="both from args.deepspeed_config and from config="):
        deepspeed.initialize(args=args, model=model, config=BASE)


def test_training_data_is_batched_and_shuffled_as_deepspeed_does(monkeypatch):
    from torch.utils.data import TensorDataset

    monkeypatch.setenv("LOCAL_RANK", "0")  # as under a launcher: a DistributedSampler, seed 0
    data = TensorDataset(torch.arange(10).float().unsqueeze(1).repeat(1, 4))
    engine, _, loader, _ = deepspeed.initialize(model=Tiny(), training_data=data,
                                                config=dict(BASE, dataloader_drop_last=True))
    try:
        first = [b[0][:, 0].tolist() for b in loader]
        second = [b[0][:, 0].tolist() for b in loader]
        g = torch.Generator()
        g.manual_seed(0)
        want = torch.randperm(10, generator=g).tolist()  # DistributedSampler's epoch-0 order (seed 0 + epoch 0)
        assert sum(first, []) == [float(i) for i in want]
        assert first != second, "the epoch advances at every pass"
        assert all(len(b) == 2 for b in first) and len(loader) == 5
        loader.data_sampler.set_epoch(7)  # as scripts do: the loader keeps the caller's epoch
        third = [b[0][:, 0].tolist() for b in loader]
        g.manual_seed(7)
        assert sum(third, []) == [float(i) for i in torch.randperm(10, generator=g).tolist()]
    finally:
        engine.close()


def test_engine_getters_and_switches():
    engine, opt, _, _ = deepspeed.initialize(model=Tiny(), config=dict(BASE, gradient_accumulation_steps=2,
                                                                         bf16={"enabled": True}))
    try:
        assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                engine.gradient_accumulation_steps()) == (4, 2, 2)
        assert engine.zero_optimization_stage() == 3 and engine.bfloat16_enabled() and not engine.fp16_enabled()
        assert engine.local_rank == 0 and engine.device == torch.device("cpu") and engine.get_lr() == [1e-3]
        assert engine.train() is engine and engine.module.training and not engine.eval().module.training
        with pytest.raises(RuntimeError, match="gradients are partitioned at ZeRO stage 2 and 3"):
            with engine.no_sync():
                pass
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(engine(torch.ones(2, 4)))
        assert engine.step() and engine.global_steps == 1 and engine.global_samples == 4
        assert opt.overflow is False and engine.get_global_grad_norm() > 0
        with pytest.raises(ValueError, match="allreduce_gradients=False"):
            engine.backward(engine(torch.ones(2, 4)), allreduce_gradients=False)
    finally:
        engine.close()


def test_zero_init_disabled_builds_normally_and_add_config_arguments_parses():
    import argparse

    with deepspeed.zero.Init(config_dict_or_path=BASE, enabled=False):
        model = Tiny()
    assert model.a.weight.data.untyped_storage().nbytes() == 4 * 32, "not partitioned"
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed and args.deepspeed_config == "ds.json"
    with pytest.raises(ValueError, match=r"zero.Init\(dtype=torch.float16\): the config computes in torch.float32"):
        deepspeed.zero.Init(config_dict_or_path=BASE, dtype=torch.float16)


def test_config_errors_name_key_value_and_fix():
    with pytest.raises(ConfigError) as ei:
        load_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})
    assert str(ei.value).startswith("train_batch_size: 10 is not a multiple of train_micro_batch_size_per_gpu")
    engine_cfg = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
                  "zero_optimization": {"stage": 3}}
    with pytest.raises(ConfigError, match=r"train_batch_size 32, train_micro_batch_size_per_gpu 4 and "
                                          r"gradient_accumulation_steps 4 on 1 rank\(s\): 4 x 4 x 1 = 16, not 32"):
        deepspeed.initialize(model=Tiny(), config=engine_cfg)


def test_a_model_too_big_for_the_disk_fails_before_writing_and_leaves_nothing(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from infinity.engine import initialize

    nvme = tmp_path / "swap"
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(nvme),
                                                               "buffer_size": 64},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}}}
    real = shutil.disk_usage
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 100, 100) if str(p) == str(nvme)
                        else real(p))
    with pytest.raises(ConfigError) as ei:
        initialize(Tiny(), cfg)
    # 49 parameters in 4 tensors: a file each, each with its 4 KiB header; 4 B/param for the parameters, 12 for
    # the optimizer's master and moments.
    assert str(ei.value) == (f"zero_optimization.offload_param.nvme_path: {nvme} has 100 bytes free, but "
                             "the swap files of this host's ranks need 33,552 (16,580 for parameters, 16,972 for the "
                             "optimizer); free space there or point nvme_path at a bigger disk")
    assert not any(nvme.rglob("*.swp")) and not [f for f in nvme.rglob("*") if f.is_file()]
    # bf16 with bf16 moments: 8 B/param of optimizer state and 2 B/param of compute copies, which live in the
    # optimizer files' tails ([Note: compute-dtype shards in the optimizer file]); the fp32 files go as each
    # sub-group reads them ([Note: swap files during setup]), so they never add to the state.
    cfg["bf16"] = {"enabled": True}
    cfg["zero_optimization"]["offload_optimizer"]["moments_dtype"] = "bf16"
    with pytest.raises(ConfigError, match=r"need 16,874 \(0 for parameters, 16,874 for the optimizer\)"):
        initialize(Tiny(), cfg)
    # With the optimizer in RAM the copies are the parameters' own files, beside nothing else.
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    with pytest.raises(ConfigError, match=r"need 16,580 \(16,580 for parameters, 0 for the optimizer\)"):
        initialize(Tiny(), cfg)
    assert not [f for f in nvme.rglob("*") if f.is_file()]


def test_a_scheduler_built_on_the_torch_optimizer_drives_the_engine():
    """The usual pattern: opt = AdamW(...); sched = warmup(opt); deepspeed.initialize(optimizer=opt,
    lr_scheduler=sched). The scheduler moves onto the engine's optimizer and wins over a config scheduler."""
    model = Tiny()
    torch_opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda s: min(1.0, (s + 1) / 4))
    cfg = dict(BASE, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 100}})
    with pytest.warns(UserWarning, match="the lr_scheduler passed to initialize is used"):
        engine, opt, _, lr_sched = deepspeed.initialize(model=model, optimizer=torch_opt, lr_scheduler=sched,
                                                        config=cfg)
    try:
        assert lr_sched is sched and sched.optimizer is opt and opt.param_groups[0]["lr"] == 0.0025
        for s in range(3):
            engine.backward(engine(torch.ones(2, 4)))
            engine.step()
        assert abs(opt.param_groups[0]["lr"] - 0.01) < 1e-12, "warmed up to the base lr after 3 steps"
    finally:
        engine.close()


def test_save_16bit_model_needs_the_gather_flag_at_stage_3(tmp_path):
    engine, _, _, _ = deepspeed.initialize(model=Tiny(), config=BASE)
    try:
        assert engine.save_16bit_model(tmp_path, "m.bin") is False and not (tmp_path / "m.bin").exists()
    finally:
        engine.close()


def test_the_consolidated_16bit_state_dict_is_the_trained_model_in_the_compute_dtype(tmp_path):
    """engine._zero3_consolidated_16bit_state_dict() (what Hugging Face Accelerate calls on a DeepSpeed engine):
    every key of the model's state_dict, gathered, in bf16, equal to the weights the engine trains."""
    torch.manual_seed(0)
    cfg = dict(BASE, bf16={"enabled": True},
               zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}})
    model = Tiny()
    model.b.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.a.parameters(), config=cfg)
    try:
        engine.backward(engine(torch.ones(2, 4)))
        engine.step()
        assert engine.zero_gather_16bit_weights_on_model_save() is False
        sd = engine._zero3_consolidated_16bit_state_dict()
        assert list(sd) == ["a.weight", "a.bias", "b.weight", "b.bias"]
        assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in sd.values())
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            for name, p in engine.module.named_parameters():
                assert torch.equal(sd[name], p.detach().to(torch.bfloat16)), name
        assert list(engine.consolidated_16bit_state_dict(exclude_frozen_parameters=True)) == ["a.weight", "a.bias"]
        assert torch.isnan(engine.module.a.weight).all(), "the parameters are partitioned again afterwards"
    finally:
        engine.close()


def test_after_initialize_only_frozen_parameters_may_be_modified_in_a_gather():
    model = Tiny()
    model.b.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.a.parameters(), config=BASE)
    try:
        with pytest.raises(RuntimeError, match=r"fp32 master weights of \['a.weight', 'a.bias'\] would not see the "
                                               r"change; modify trained parameters inside zero_init"):
            with deepspeed.zero.GatheredParameters(list(engine.module.a.parameters()), modifier_rank=0):
                pass
        with deepspeed.zero.GatheredParameters(engine.module.b.weight, modifier_rank=0):
            engine.module.b.weight.data.fill_(2.0)
        with deepspeed.zero.GatheredParameters(engine.module.b.weight):
            assert torch.equal(engine.module.b.weight, torch.full((1, 8), 2.0)), "the frozen weight was changed"
    finally:
        engine.close()
