"""Every natural way to save a partitioned model after initialize: the true values on disk, or an error that
names engine.save_pretrained. Never NaN. And LoRA at real sizes (r=32, adapters partitioned: threshold 0)."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make deps installs it)")
peft = pytest.importorskip("peft", reason="peft is not installed (make deps installs it)")

from infinity import PartitionedStateError  # noqa: E402
from infinity.engine import gathered_parameters, initialize, zero_init  # noqa: E402
from infinity.engine.params import managed  # noqa: E402
from infinity.testing.parity import engine_config  # noqa: E402
from infinity.testing.tiny_hf import make_model_dir  # noqa: E402

TIERS = ["none", "cpu", "nvme"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("m") / "llama"), "llama")


def lora(model, r=32):
    torch.manual_seed(7)
    return peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))


def train_steps(engine, vocab, steps=3):
    losses = []
    for s in range(steps):
        x = torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(s))
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def no_nan_files(d):
    """Every safetensors file under d holds finite values."""
    from safetensors.torch import load_file

    for root, _, names in os.walk(d):
        for n in names:
            if n.endswith(".safetensors"):
                for k, v in load_file(os.path.join(root, n)).items():
                    assert torch.isfinite(v).all(), f"{n}: {k} has NaN"


ROUTES = {
    "model.state_dict()": lambda m, d: m.state_dict(),
    "torch.save(model.state_dict())": lambda m, d: torch.save(m.state_dict(), d / "sd.pt"),
    "model.save_pretrained()": lambda m, d: m.save_pretrained(d / "hf"),
    "get_peft_model_state_dict": lambda m, d: peft.get_peft_model_state_dict(m),
    "peft save_pretrained": lambda m, d: m.save_pretrained(d / "adapter"),
}


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("tier", TIERS)
def test_every_save_route_gives_true_values_or_names_save_pretrained(route, tier, model_dir, tmp_path, disk_dir):
    cfg = engine_config(tier, disk_dir, largest=40_000)
    with zero_init(cfg):
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    model = lora(base) if "peft" in route else base
    with initialize(model, cfg) as engine:
        train_steps(engine, base.config.vocab_size, steps=1)
        with pytest.raises(PartitionedStateError, match=r"state_dict\(\): .* placeholder \(NaN\), not its value\. "
                                                       r"To save the model use engine\.save_pretrained\(dir"):
            ROUTES[route](model, tmp_path)
        with gathered_parameters(model):  # inside a gather the values exist, and state_dict gives them
            sd = model.state_dict()
            assert all(torch.isfinite(v).all() for v in sd.values() if v.is_floating_point())
    assert not (tmp_path / "sd.pt").exists()
    no_nan_files(tmp_path)
    with pytest.raises(PartitionedStateError, match="the engine is closed, so the values are gone"):
        model.state_dict()


@pytest.mark.parametrize("tier", TIERS)
def test_lora_bf16_r32_partitioned_adapters_train_and_round_trip(tier, model_dir, tmp_path, disk_dir):
    """The placeholder carries bf16, so peft casts its input to bf16 and the adapter's matmul runs (it raised
    'expected m1 and m2 to have the same dtype' with fp32 placeholders). The adapter saved by the engine loads
    with PeftModel.from_pretrained and holds the trained values."""
    cfg = engine_config(tier, disk_dir, largest=40_000, **{"bf16.enabled": True})
    with zero_init(cfg):
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    model = lora(base)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    # r=32 on 2 layers: q_proj A 32x64 + B 64x32, v_proj (2 kv heads of 16) A 32x64 + B 32x32
    assert sum(p.numel() for p in adapters) == 2 * (2 * 64 * 32 + 64 * 32 + 32 * 32)
    with initialize(model, cfg) as engine:
        assert all(managed(p) is not None and not managed(p).persistent for p in adapters), "adapters partitioned"
        assert all(p.dtype == torch.bfloat16 for p in adapters), "placeholders carry the compute dtype"
        losses = train_steps(engine, base.config.vocab_size, steps=4)
        files = engine.save_pretrained(tmp_path / "adapter")
        with gathered_parameters(model):
            trained = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert all(torch.isfinite(torch.tensor(losses)))
    assert set(files) == {"adapter_model.safetensors", "adapter_config.json"}
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    loaded = peft.PeftModel.from_pretrained(plain, tmp_path / "adapter")
    got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert set(got) == set(trained)
    for n in trained:
        assert torch.equal(got[n].to(torch.bfloat16), trained[n]), n
    assert any(trained[n].abs().sum() > 0 for n in trained if "lora_B" in n), "lora_B moved from zero"


def test_merged_lora_equals_peft_merge_and_unload(model_dir, tmp_path, disk_dir):
    cfg = engine_config("nvme", disk_dir, largest=40_000)
    with zero_init(cfg):
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    model = lora(base)
    with initialize(model, cfg) as engine:
        train_steps(engine, base.config.vocab_size)
        engine.save_pretrained(tmp_path / "adapter")
        engine.save_pretrained(tmp_path / "merged", merge_lora=True)
    want = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(model_dir),
                                          tmp_path / "adapter").merge_and_unload().state_dict()
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert set(got) == set(want)
    changed = 0
    for k in want:
        assert torch.equal(got[k], want[k]), k
        changed += "q_proj" in k
    assert changed


def test_save_pretrained_refuses_merge_without_peft_and_a_file_as_directory(model_dir, tmp_path, disk_dir):
    cfg = engine_config("cpu", disk_dir, largest=40_000)
    with zero_init(cfg):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    (tmp_path / "f").write_text("")
    with initialize(model, cfg) as engine:
        with pytest.raises(ValueError, match=r"merge_lora=True\): the model is not a peft model"):
            engine.save_pretrained(tmp_path / "m", merge_lora=True)
        with pytest.raises(NotADirectoryError, match="is a file; pass a directory"):
            engine.save_pretrained(tmp_path / "f")
        with pytest.raises(ValueError, match="max_shard_size: cannot read 'big'"):
            engine.save_pretrained(tmp_path / "m", max_shard_size="big")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("tier", TIERS)
def test_before_initialize_state_dict_gives_the_real_values(tier, model_dir, tmp_path, disk_dir):
    """Between zero_init and initialize the parameters are already partitioned: torch.save(model.state_dict())
    wrote the placeholders' NaN. It now gets each value, gathered."""
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    cfg = engine_config(tier, disk_dir, largest=40_000)
    with zero_init(cfg) as store:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    try:
        torch.save(model.state_dict(), tmp_path / "sd.pt")
        back = torch.load(tmp_path / "sd.pt")
        assert set(back) == set(plain)
        for k in plain:
            assert torch.equal(back[k], plain[k]), k
        assert all(isinstance(v, torch.nn.Parameter) for v in model.state_dict(keep_vars=True).values()
                   if v.is_floating_point() and v.dim() > 1)
    finally:
        store.close()
