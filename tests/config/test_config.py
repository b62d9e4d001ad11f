"""Swap configs: shipped and DeepSpeed-style configs load; each malformed one gets its own message."""

import json
import os
import pathlib
import subprocess
import warnings

import pytest

from infinity import ConfigError, load_config
from infinity.config import check_buffer_size, check_free_space

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "swap_configs").glob("*.json"))


def test_three_configs_are_shipped():
    assert {p.name for p in SHIPPED} == {"cpu_offload.json", "nvme_offload.json", "nvme_optimizer_only.json",
                                          "huge_2b.json", "huge_bf16_moments.json"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_load(path, tmp_path):
    cfg = load_config(path, nvme_path=tmp_path)
    assert cfg.zero_optimization.stage == 3 and cfg.bf16.enabled
    for section in (cfg.zero_optimization.offload_param, cfg.zero_optimization.offload_optimizer):
        assert section.nvme_path in (None, str(tmp_path))
    assert cfg.ignored == ()


def _deepspeed_docs_style(nvme):
    """A ZeRO-3 NVMe config in the shape DeepSpeed's documentation gives, DeepSpeed-only keys included."""
    return {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8,
        "steps_per_print": 10, "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                  "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                 "hysteresis": 2, "min_loss_scale": 1},
        "zero_optimization": {
            "stage": 3, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 1e7,
            "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7, "sub_group_size": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True, "overlap_comm": True,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "buffer_count": 4,
                                  "fast_init": False},
            "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "buffer_count": 5,
                              "buffer_size": 1e8, "max_in_cpu": 1e9}},
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
    }


def test_deepspeed_documentation_config_loads_as_is(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_deepspeed_docs_style(str(tmp_path))))
    with pytest.warns(UserWarning, match="have no effect here") as record:
        cfg = load_config(path)
    text = str(record[0].message)
    for key in ("steps_per_print", "wall_clock_breakdown", "zero_optimization.contiguous_gradients",
                "zero_optimization.overlap_comm", "zero_optimization.offload_optimizer.fast_init"):
        assert f"{key} (" in text, f"{key} is not reported with its reason: {text}"
    assert "scheduler" not in text and cfg.scheduler.type == "WarmupLR", "the scheduler section has its effect"
    assert "max_in_cpu" not in text and cfg.zero_optimization.offload_param.max_in_cpu == 10 ** 9, "it has its effect"
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save
    z = cfg.zero_optimization
    assert z.stage3_max_live_parameters == 10 ** 9 and isinstance(z.sub_group_size, int)
    assert z.offload_param.buffer_size == 10 ** 8 and z.offload_param.nvme_path == str(tmp_path)
    assert cfg.aio.intra_op_parallelism == 1 and cfg.aio.queue_depth == 8
    assert cfg.fp16.enabled and cfg.optimizer.params.betas == (0.8, 0.999)


def test_config_is_frozen(tmp_path):
    cfg = load_config({})
    with pytest.raises(AttributeError):
        cfg.gradient_clipping = 3.0


def test_memory_budget_accepts_sizes():
    assert load_config({"infinity": {"memory_budget": "8GiB"}}).infinity.memory_budget == 8 << 30
    assert load_config({"infinity": {"memory_budget": 1 << 30}}).infinity.memory_budget == 1 << 30


def _nvme(tmp, **extra):
    section = {"device": "nvme", "nvme_path": str(tmp)}
    section.update(extra)
    return {"zero_optimization": {"stage": 3, "offload_param": section}}


BAD = [
    ({"zero_optimization": {"stag": 3}}, "zero_optimization.stag: unknown key; did you mean 'stage'?"),
    ({"zero_optimisation": {}}, "zero_optimisation: unknown key; did you mean 'zero_optimization'?"),
    ({"aio": {"blocksize": 4096}}, "aio.blocksize: unknown key; did you mean 'block_size'?"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage: must be <= 3, got 4"),
    ({"zero_optimization": {"stage": "3"}}, 'zero_optimization.stage: must be an integer, got the string "3"'),
    ({"zero_optimization": {"stage": 2.5}}, "zero_optimization.stage: must be a whole number, got 2.5"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"buffer_count": 0}}},
     "zero_optimization.offload_param.buffer_count: must be >= 1, got 0"),
    ({"bf16": {"enabled": "true"}},
     'bf16.enabled: must be true or false (a JSON boolean, no quotes), got the string "true"'),
    ({"bf16": {"enabled": 1}}, "bf16.enabled: must be true or false (a JSON boolean, no quotes), got int 1"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "fp16.enabled: fp16 and bf16 are both enabled; enable one of them"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer: optimizer offload needs zero_optimization.stage >= 1"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     'zero_optimization.offload_param.nvme_path: is required when device is "nvme"; point it at a directory on '
     "a fast disk"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}},
     'zero_optimization.offload_param.device: must be one of none, cpu, nvme, got "disk"'),
    ({"optimizer": {"type": "SGD"}}, 'optimizer.type: must be one of Adam, AdamW, got "SGD"'),
    ({"optimizer": {"params": {"betas": [0.9, 1.0]}}},
     "optimizer.params.betas[1]: must be a number in [0, 1), got float 1.0"),
    ({"optimizer": {"params": {"betas": 0.9}}},
     "optimizer.params.betas: must be a list of two numbers [beta1, beta2], got float 0.9"),
    ({"optimizer": {"params": {"lr": -1}}}, "optimizer.params.lr: must be >= 0.0, got -1.0"),
    ({"optimizer": {"params": {"amsgrad": True}}},
     "optimizer.params.amsgrad: amsgrad is not supported; set it to false or remove it"),
    ({"aio": {"block_size": 5000}}, "aio.block_size: must be a multiple of 4096, got 5000"),
    ({"aio": {"block_size": 1024}}, "aio.block_size: must be >= 4096, got 1024"),
    ({"aio": {"queue_depth": 0}}, "aio.queue_depth: must be >= 1, got 0"),
    ({"aio": {"backend": "spdk"}}, 'aio.backend: must be one of auto, io_uring, libaio, threads, python, got "spdk"'),
    ({"aio": {"thread_count": 2, "intra_op_parallelism": 2}},
     "aio.intra_op_parallelism: given twice (as thread_count and as intra_op_parallelism); keep one"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "nvme",
                                                                                     "nvme_path": "/x"}}},
     'zero_optimization.cpu_offload: is true (optimizer state on the CPU) but offload_optimizer.device is "nvme"; '
     "keep one of them"),
    ({"amp": {"enabled": True}}, "amp: NVIDIA apex AMP is not supported; use bf16 or fp16"),
    ({"zero_optimization": {"zero_quantized_weights": True}},
     "zero_optimization.zero_quantized_weights: quantized weight gathers are not supported; remove it"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
     "train_batch_size: 10 is not a multiple of train_micro_batch_size_per_gpu x gradient_accumulation_steps = "
     "4 x 1; it must equal that times the number of ranks"),
    ({"gradient_clipping": None}, "gradient_clipping: must not be null; remove the key to use the default"),
    ({"fp16": {"initial_scale_power": 65}}, "fp16.initial_scale_power: must be <= 64, got 65"),
    ({"zero_optimization": []}, "zero_optimization: must be a JSON object, got list"),
    ({"infinity": {"memory_budget": "lots"}},
     "infinity.memory_budget: cannot read 'lots' as a size; write e.g. 4096, 64KiB, 1MiB or 1GiB"),
    ({"infinity": {"leftovers": "keep"}}, 'infinity.leftovers: must be one of clear, reuse, error, got "keep"'),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x",
                                                              "buffer_count": 2, "pipeline_read": True}}},
     "zero_optimization.offload_optimizer.buffer_count: pipelining needs at least 3 buffers (read, Adam, write), "
     "got 2"),
]


@pytest.mark.parametrize("raw,message", BAD, ids=[m.split(":")[0] + f"-{i}" for i, (_, m) in enumerate(BAD)])
def test_malformed_config(raw, message):
    with pytest.raises(ConfigError) as ei:
        load_config(raw)
    assert str(ei.value) == message
    assert ei.value.key == message.split(": ")[0]


def test_messages_are_distinct():
    assert len({m for _, m in BAD}) == len(BAD) >= 20


def test_bad_json_gives_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "zero_optimization": {\n    "stage": 3,\n  }\n}\n')
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    assert str(ei.value) == f"{path}: invalid JSON at line 4, column 3: Expecting property name enclosed in double quotes"


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match=f"config file {tmp_path / 'nope.json'} does not exist"):
        load_config(tmp_path / "nope.json")


def test_top_level_must_be_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=f"{path}: the top level must be a JSON object, got list"):
        load_config(path)


def test_nvme_path_must_be_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=f"zero_optimization.offload_param.nvme_path: {f} is not a directory"):
        load_config(_nvme(f))


def test_nvme_path_must_be_writable(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() != 0:
        target.chmod(0o500)
        mounted = False
    else:
        # Root writes through any mode bits, so make the directory a read-only bind mount instead.
        first = subprocess.run(["mount", "--bind", str(target), str(target)], capture_output=True, text=True)
        if first.returncode != 0:
            pytest.skip(f"cannot bind-mount here to make a read-only directory: {first.stderr.strip()}")
        subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], check=True)
        mounted = True
    try:
        with pytest.raises(ConfigError) as ei:
            load_config(_nvme(target))
        assert str(ei.value).startswith(f"zero_optimization.offload_param.nvme_path: {target} is not writable (")
        assert str(ei.value).endswith("); choose a directory you can write")
    finally:
        if mounted:
            subprocess.run(["umount", str(target)], check=False)
        else:
            target.chmod(0o700)


def test_nothing_is_written_by_a_rejected_config(tmp_path):
    before = set(tmp_path.iterdir())
    with pytest.raises(ConfigError):
        load_config({**_nvme(tmp_path), "bf16": {"enabled": "yes"}})
    assert set(tmp_path.iterdir()) == before


def test_buffer_size_too_small_names_the_size_that_works(tmp_path):
    cfg = load_config(_nvme(tmp_path, buffer_size=1000))
    with pytest.raises(ConfigError) as ei:
        check_buffer_size(cfg, 5000)
    assert str(ei.value) == ("zero_optimization.offload_param.buffer_size: 1000 elements cannot hold the largest "
                             "parameter partition (5000 elements); set it to at least 5000")
    check_buffer_size(cfg, 1000)


def test_free_space_check(tmp_path):
    cfg = load_config(_nvme(tmp_path))
    check_free_space(cfg, 1)
    with pytest.raises(ConfigError, match=r"GB free but the swap files need 1000000000.0 GB"):
        check_free_space(cfg, 10 ** 18)


def test_caller_dict_is_not_modified(tmp_path):
    raw = _nvme("/somewhere")
    snapshot = json.dumps(raw)
    load_config(raw, nvme_path=tmp_path)
    assert json.dumps(raw) == snapshot


def test_no_warning_without_ignored_keys():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({"aio": {"thread_count": 2}})


def test_readme_documents_every_field():
    import dataclasses

    from infinity.config import schema

    text = (ROOT / "swap_configs" / "README.md").read_text()
    for cls in (schema.Config, schema.ZeroConfig, schema.OffloadParamConfig, schema.OffloadOptimizerConfig,
                schema.Fp16Config, schema.Bf16Config, schema.OptimizerConfig, schema.OptimizerParams,
                schema.AioConfig, schema.InfinityConfig):
        for f in dataclasses.fields(cls):
            if not f.metadata.get("internal"):
                assert f"`{f.name}`" in text, f"swap_configs/README.md does not explain {cls.__name__}.{f.name}"


# ------------------------------------------------------------- DeepSpeed's semantics (issue: DeepSpeed drop-in)

def test_batch_sizes_are_derived_as_deepspeed_derives_them():
    from infinity.config.resolve import resolve_batch

    assert resolve_batch(32, 4, None, 1).gradient_accumulation_steps == 8
    assert resolve_batch(32, 4, None, 2).gradient_accumulation_steps == 4
    assert resolve_batch(32, None, 2, 4).micro_batch_per_rank == 4
    assert resolve_batch(None, 4, 2, 2).train_batch_size == 16
    assert resolve_batch(None, 4, None, 3).train_batch_size == 12
    b = resolve_batch(12, None, None, 3)
    assert (b.micro_batch_per_rank, b.gradient_accumulation_steps) == (4, 1)
    assert resolve_batch(None, None, None, 2).gradient_accumulation_steps == 1
    with pytest.raises(ConfigError) as ei:
        resolve_batch(32, 4, 4, 1)
    assert str(ei.value) == ("train_batch_size: train_batch_size 32, train_micro_batch_size_per_gpu 4 and "
                             "gradient_accumulation_steps 4 on 1 rank(s): 4 x 4 x 1 = 16, not 32; fix one of them "
                             "(or give only two and the third is derived)")
    with pytest.raises(ConfigError, match=r"on 3 rank\(s\): train_batch_size must be a multiple of micro batch x "
                                          r"ranks = 12"):
        resolve_batch(32, 4, None, 3)


def test_bfloat16_is_deepspeeds_other_spelling_of_bf16():
    assert load_config({"bfloat16": {"enabled": True}}).bf16.enabled


def test_reduce_bucket_size_zero_loads_as_in_hugging_faces_zero3_config():
    assert load_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": 0}}).zero_optimization \
        .reduce_bucket_size == 0


def test_cpu_offload_true_puts_the_optimizer_on_the_cpu():
    cfg = load_config({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


def test_parsing_creates_no_nvme_path_the_engine_does_and_an_uncreatable_one_is_named(tmp_path):
    """A shipped config names /local_nvme: loading it must not make directories; the engine that swaps does."""
    path = tmp_path / "new" / "swap"
    cfg = load_config(_nvme(path))
    assert not (tmp_path / "new").exists(), "parsing a config created its nvme_path"
    import torch

    from infinity.engine import zero_init

    with zero_init(cfg) as store:
        torch.nn.Linear(8, 8)
        assert path.is_dir()
        store.close()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError) as ei:
        load_config(_nvme(tmp_path / "file" / "swap"))
    assert str(ei.value) == (f"zero_optimization.offload_param.nvme_path: {tmp_path / 'file' / 'swap'} cannot be "
                             f"created: {tmp_path / 'file'} is not a directory; point nvme_path at a directory on a "
                             "fast disk that you can write")


def test_auto_takes_deepspeeds_default_and_says_so():
    with pytest.warns(UserWarning, match=r'"auto" .* took DeepSpeed\'s default for train_micro_batch_size_per_gpu, '
                                         r"zero_optimization.reduce_bucket_size"):
        cfg = load_config({"train_micro_batch_size_per_gpu": "auto",
                           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})
    assert cfg.train_micro_batch_size_per_gpu is None and cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.auto == ("train_micro_batch_size_per_gpu", "zero_optimization.reduce_bucket_size")


def test_auto_bucket_sizes_come_from_the_models_hidden_size():
    import types

    from infinity.config.resolve import resolve_auto

    with pytest.warns(UserWarning):
        cfg = load_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                 "stage3_prefetch_bucket_size": "auto",
                                                 "stage3_param_persistence_threshold": "auto"}})
    model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=64))
    z = resolve_auto(cfg, model).zero_optimization
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == \
        (4096, 3686, 640)


def test_given_names_the_keys_the_config_wrote_and_not_auto_or_defaults():
    """Config.given drives which sizes the engine may fit to the model ([Note: sizes fitted to the model]): a key
    written with a value is in it (an alias under its field's name), one given as "auto" or left out is not."""
    cfg = load_config({"bfloat16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "sub_group_size": "auto", "offload_optimizer": {"device": "cpu", "buffer_count": 2}}})
    assert {"bf16", "bf16.enabled", "zero_optimization.stage", "zero_optimization.offload_optimizer.device",
            "zero_optimization.offload_optimizer.buffer_count"} <= cfg.given
    assert "zero_optimization.sub_group_size" not in cfg.given
    assert "zero_optimization.offload_param.buffer_size" not in cfg.given
