"""Models from elsewhere, and the memory ceiling."""

import pytest
import torch

from infinity.engine import gathered_parameters, initialize, zero_init
from infinity.testing.parity import engine_config, memory_run_in_child

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make deps installs it)")


def _gpt2_config():
    return transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def _tokens(step):
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(step))


def test_hugging_face_gpt2_from_its_config_matches_torch_on_nvme(disk_dir):
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(_gpt2_config())
    cfg = engine_config("nvme", str(disk_dir))
    torch.manual_seed(0)
    with zero_init(cfg):
        model = transformers.GPT2LMHeadModel(_gpt2_config())
    assert model.lm_head.weight is model.transformer.wte.weight, "HF ties the head to the embedding"
    with gathered_parameters(model):
        for (name, p), (_, q) in zip(plain.named_parameters(), model.named_parameters()):
            assert torch.equal(p, q), f"{name} differs from a normal build (HF's own init must run unchanged)"
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.01)
    want = []
    for s in range(6):
        x = _tokens(s)
        loss = plain(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    engine = initialize(model, cfg)
    got = []
    try:
        for s in range(6):
            x = _tokens(s)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            got.append(loss.item())
        assert engine.last_report.prefetch_hit_rate >= 0.95
    finally:
        engine.close()
    assert max(abs(a - b) / a for a, b in zip(want, got)) <= 1e-5


@pytest.mark.slow
def test_peak_rss_stays_near_the_buffers_while_the_state_is_many_times_larger(disk_dir, tmp_path):
    r = memory_run_in_child(str(disk_dir), str(tmp_path / "mem.json"))
    assert r["state_bytes"] >= 4 * r["pool_bytes"], "the model must not fit in the buffers"
    assert r["losses"][-1] < r["losses"][0]
    # Measured here: pools 13 MiB, peak 66 MiB over the baseline for 197 MiB of state; activations of this
    # model are about 35 MiB and the engine's own constant about 16 MiB (threads, rings, Python objects).
    assert r["peak_over_baseline"] <= r["pool_bytes"] + 96 * 2**20, r
    assert r["peak_over_baseline"] <= r["state_bytes"] / 2, r
