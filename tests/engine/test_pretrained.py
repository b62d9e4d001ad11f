"""Hugging Face from_pretrained under zero_init (streamed into shards), PEFT LoRA on frozen partitioned weights.

Models are saved with save_pretrained into a temp dir (nothing is downloaded), loaded plainly and under
zero_init, and trained 6 steps with torch.optim.AdamW and with the engine on offload none, cpu and nvme.
"""

from __future__ import annotations

import pytest
import torch

from infinity.engine import gathered_parameters, initialize, zero_init
from infinity.testing.parity import engine_config
from tests.engine.test_construction import TIERS, assert_close, assert_same_values, engine_losses, \
    plain_losses

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make deps installs it)")


def llama_config():
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
                                    tie_word_embeddings=False)


def gpt2_config():
    return transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0)


def tokens(step):
    g = torch.Generator().manual_seed(step % 2)
    x = torch.randint(0, 256, (4, 32), generator=g)
    return (), {"input_ids": x, "labels": x}


def saved(tmp_path, config, **save_kw):
    torch.manual_seed(1)
    src = transformers.AutoModelForCausalLM.from_config(config)
    path = tmp_path / "model"
    src.save_pretrained(path, **save_kw)
    return path


MODELS = {
    "llama-single": (llama_config, {}),
    "llama-sharded": (llama_config, {"max_shard_size": "40KB"}),
    "gpt2-single": (gpt2_config, {}),  # tied head: the checkpoint has one tensor for both
    "gpt2-sharded-bin": (gpt2_config, {"max_shard_size": "40KB", "safe_serialization": False}),
}


@pytest.mark.slow
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("kind", list(MODELS))
def test_from_pretrained_under_zero_init_matches_plain_from_pretrained(kind, tier, tmp_path, disk_dir):
    make, save_kw = MODELS[kind]
    if save_kw.get("safe_serialization") is False and "safe_serialization" not in \
            transformers.PreTrainedModel.save_pretrained.__code__.co_varnames:
        save_kw = {k: v for k, v in save_kw.items() if k != "safe_serialization"}
    path = saved(tmp_path, make(), **save_kw)
    files = sorted(p.name for p in path.iterdir())
    if "sharded" in kind:
        assert any(f.endswith(".index.json") for f in files), files
    plain = transformers.AutoModelForCausalLM.from_pretrained(path)
    cfg = engine_config(tier, disk_dir, largest=256 * 64)
    with zero_init(cfg):
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert_same_values(plain, model)
    want = plain_losses(plain, tokens)
    got = engine_losses(model, cfg, tokens)
    assert_close(want, got)
    assert want[-1] < want[0]


def test_missing_weights_are_initialised_as_plain_from_pretrained_does(tmp_path, disk_dir):
    """A base model's checkpoint into a model with a new head: the head is initialised with the RNG draws
    plain HF makes, and only those."""
    torch.manual_seed(1)
    transformers.GPT2Model(gpt2_config()).save_pretrained(tmp_path / "base")
    torch.manual_seed(5)
    plain, info = transformers.GPT2ForSequenceClassification.from_pretrained(tmp_path / "base", num_labels=3,
                                                                             output_loading_info=True)
    torch.manual_seed(5)
    with zero_init(engine_config("nvme", disk_dir, largest=256 * 64)):
        model, mine = transformers.GPT2ForSequenceClassification.from_pretrained(tmp_path / "base", num_labels=3,
                                                                                 output_loading_info=True)
    assert mine["missing_keys"] == ["score.weight"] == list(info["missing_keys"])
    assert_same_values(plain, model)


def test_from_pretrained_errors_name_the_problem(tmp_path, disk_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = saved(tmp_path, llama_config())
    with zero_init(engine_config("none", disk_dir, largest=40_000)):
        with pytest.raises(OSError, match=r"reads a local directory, and 'org/not-here' is not one; download it first"):
            transformers.LlamaForCausalLM.from_pretrained("org/not-here")
        with pytest.raises(ValueError, match=r"\['device_map'\] are not supported"):
            transformers.AutoModelForCausalLM.from_pretrained(path, device_map="auto")
        with pytest.raises(ValueError, match=r"dtype=torch.float16\) under infinity.zero_init: the engine keeps fp32"):
            transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
        bad = transformers.LlamaConfig.from_pretrained(path)
        bad.intermediate_size = 96
        with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight in .*model.safetensors has shape "
                                             r"\(64, 128\), the model's model.layers.0.mlp.down_proj.weight has "
                                             r"\(64, 96\); pass ignore_mismatched_sizes=True"):
            transformers.AutoModelForCausalLM.from_pretrained(path, config=bad)


peft = pytest.importorskip("peft", reason="peft is not installed (make deps installs it)")


def lora(model):
    torch.manual_seed(7)  # LoRA's A matrices are drawn from the RNG: the same draws for both runs
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("tier", TIERS)
def test_peft_lora_on_a_partitioned_from_pretrained_model(tier, tmp_path, disk_dir):
    path = saved(tmp_path, llama_config())
    plain = lora(transformers.AutoModelForCausalLM.from_pretrained(path))
    cfg = engine_config(tier, disk_dir, largest=256 * 64)
    with zero_init(cfg):
        base = transformers.AutoModelForCausalLM.from_pretrained(path)
    model = lora(base)
    assert_same_values(plain, model)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    with gathered_parameters(model):
        before = {n: p.detach().clone() for n, p in model.named_parameters() if n in frozen}
    want = plain_losses(plain, tokens)
    engine = initialize(model, cfg)
    try:
        trained = {id(p) for g in engine.optimizer.groups for p in (mp.param for mp in g.params)}
        assert all(not p.requires_grad for p in model.parameters() if id(p) not in trained)
        n_adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert sum(g.numel for g in engine.optimizer.groups) == n_adapter, "optimizer state for adapters only"
        got = []
        for s in range(6):
            args, kw = tokens(s)
            loss = engine(*args, **kw).loss
            engine.backward(loss)
            engine.step()
            got.append(loss.item())
        report = engine.last_report
        if tier == "nvme":
            assert report.optimizer_read_bytes == 12 * n_adapter, "the step reads the adapters' state only"
        with gathered_parameters(model):
            for n, p in model.named_parameters():
                if n in frozen:
                    assert torch.equal(p, before[n]), f"frozen {n} changed"
    finally:
        engine.close()
    assert_close(want, got)


def test_a_lora_checkpoint_resumes_exactly_on_nvme(tmp_path, disk_dir):
    """The checkpoint holds the adapters' state and the frozen base weights: it resumes exactly into a model
    built at random (not from the pretrained weights)."""
    path = saved(tmp_path, llama_config())
    cfg = engine_config("nvme", disk_dir, largest=256 * 64)

    def build(pretrained=True):
        torch.manual_seed(11)
        with zero_init(cfg):
            base = (transformers.AutoModelForCausalLM.from_pretrained(path) if pretrained else
                    transformers.AutoModelForCausalLM.from_config(llama_config()))
        return initialize(lora(base), cfg)

    def step(engine, s):
        args, kw = tokens(s)
        loss = engine(*args, **kw).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    engine = build()
    try:
        for s in range(3):
            step(engine, s)
        engine.save_checkpoint(tmp_path / "ckpt")
        want = [step(engine, s) for s in range(3, 6)]
    finally:
        engine.close()
    engine = build(pretrained=False)
    try:
        engine.load_checkpoint(tmp_path / "ckpt")
        got = [step(engine, s) for s in range(3, 6)]
    finally:
        engine.close()
    assert got == want


def test_export_hf_gives_from_pretrained_the_trained_weights(tmp_path, disk_dir):
    from infinity.tools.cli import main

    from infinity.testing.tiny_hf import make_tokenizer

    path = saved(tmp_path, gpt2_config())  # a tied head: exported once, tied again by from_pretrained
    make_tokenizer(str(path))  # the tokenizer beside the weights: the export copies it
    cfg = engine_config("nvme", disk_dir, largest=256 * 64)
    with zero_init(cfg):
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
    engine = initialize(model, cfg)
    try:
        for s in range(2):
            args, kw = tokens(s)
            engine.backward(engine(*args, **kw).loss)
            engine.step()
        with gathered_parameters(model):
            trained = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine.save_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf"),
                 "--max-shard-size", "100KB"]) == 0
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists(), "sharded above --max-shard-size"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("a b").input_ids == transformers.AutoTokenizer.from_pretrained(path)("a b").input_ids
    assert (tmp_path / "hf" / "generation_config.json").exists()
    assert back.lm_head.weight is back.transformer.wte.weight
    for n, p in back.named_parameters():
        assert torch.equal(p, trained[n]), f"{n}: the exported weights are not the trained ones"


def test_export_hf_of_a_non_hf_checkpoint_says_what_to_do(tmp_path, disk_dir):
    from infinity.checkpoint.export import export_hf
    from infinity.checkpoint.layout import CheckpointError

    cfg = engine_config("none", disk_dir, largest=40_000)
    engine = initialize(torch.nn.Linear(4, 4), cfg)
    try:
        engine.save_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()
    with pytest.raises(CheckpointError, match=r"not saved from a Hugging Face PreTrainedModel .* export a state_dict "
                                              r"instead: infinity checkpoint export DIR model.safetensors"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf")


def test_bench_peft_smoke(tmp_path, capsys):
    import json

    from infinity.tools.cli import main

    assert main(["bench", "peft", "--dir", str(tmp_path), "--layers", "1", "--hidden", "64", "--vocab", "256",
                 "--steps", "2", "--in-process", "--json"]) == 0
    out = capsys.readouterr().out
    r = json.loads(out[out.index("{"):])
    assert r["lora"]["trained"] < r["full"]["trained"] / 10
    assert r["lora"]["optimizer_read_bytes"] == 12 * r["lora"]["trained"]
    assert r["full"]["optimizer_read_bytes"] == 12 * r["full"]["trained"]
    assert list(tmp_path.iterdir()) == [], "the bench removes its work directory"
