"""Construction on 2 gloo ranks: parent-level re-initialisation, from_pretrained and parameter groups give every
rank its shard of the plain build's values, and training matches plain torch on the whole batch."""

from __future__ import annotations

import pytest
import torch

from infinity.engine import gathered_parameters, initialize, zero_init
from infinity.testing.parity import engine_config, free_port, gloo_rank
from tests.engine.test_construction import STEPS, NanoGPT, ParentInit, assert_close, lm_batch, plain_losses, \
    two_groups


def _train_my_half(engine, steps):
    out = []
    for s in range(steps):
        (x, y), _ = lm_batch(s)
        half = x.shape[0] // engine.world_size
        lo = engine.rank * half
        loss = engine(x[lo:lo + half], y[lo:lo + half])
        engine.backward(loss)
        engine.step()
        t = torch.tensor([loss.item()])
        engine.comm.all_reduce_(t)
        out.append(t.item() / engine.world_size)
    return out


def _rank_main(rank, world, port, kind, tier, disk, out_path, hf_dir):
    with gloo_rank(rank, world, port):
        cfg = engine_config(tier, disk, largest=40_000)  # the swap files carry the rank in their names
        if kind == "pretrained":
            import transformers  # noqa: F401 - as a user's script does, before zero_init
        torch.manual_seed(0)
        with zero_init(cfg):
            if kind == "pretrained":
                import transformers

                model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
            else:
                model = {"nanogpt": NanoGPT, "parent": ParentInit}[kind]()
        with gathered_parameters(model):
            values = {n: p.detach().clone() for n, p in model.named_parameters()}
        groups = two_groups(model) if kind == "nanogpt" else None
        engine = initialize(model, cfg, model_parameters=groups)
        try:
            if kind == "pretrained":
                losses = []
                for s in range(STEPS):
                    (x, _), _ = lm_batch(s)
                    x = x[rank * 2:(rank + 1) * 2]
                    loss = engine(input_ids=x, labels=x).loss
                    engine.backward(loss)
                    engine.step()
                    t = torch.tensor([loss.item()])
                    engine.comm.all_reduce_(t)
                    losses.append(t.item() / world)
            else:
                losses = _train_my_half(engine, STEPS)
            engine.save_checkpoint(f"{disk}/ckpt")
            with gathered_parameters(model):
                trained = {n: p.detach().clone() for n, p in model.named_parameters()}
        finally:
            engine.close()
        if rank == 0:
            torch.save({"values": values, "losses": losses, "trained": trained}, out_path)


def _spawn(kind, tier, disk_dir, tmp_path, hf_dir=None):
    import torch.multiprocessing as mp

    out = str(tmp_path / "r0.pt")
    mp.spawn(_rank_main, args=(2, free_port(), kind, tier, str(disk_dir), out, hf_dir), nprocs=2, join=True)
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("kind,tier", [("nanogpt", "nvme"), ("parent", "cpu")])
def test_two_ranks_build_the_plain_values_and_train_like_torch(kind, tier, disk_dir, tmp_path):
    torch.manual_seed(0)
    plain = {"nanogpt": NanoGPT, "parent": ParentInit}[kind]()
    got = _spawn(kind, tier, disk_dir, tmp_path)
    for n, p in plain.named_parameters():
        assert torch.equal(p, got["values"][n]), f"{n} differs from a plain build on 2 ranks"
    want = plain_losses(plain, lm_batch, two_groups(plain) if kind == "nanogpt" else None)
    assert_close(want, got["losses"])
    # Resharded 2 -> 1: the same weights, and every parameter group's lr.
    cfg = engine_config(tier, str(disk_dir), largest=40_000)
    with zero_init(cfg):
        model = {"nanogpt": NanoGPT, "parent": ParentInit}[kind]()
    engine = initialize(model, cfg, model_parameters=two_groups(model) if kind == "nanogpt" else None)
    try:
        engine.load_checkpoint(disk_dir / "ckpt")
        with gathered_parameters(model):
            for n, p in model.named_parameters():
                assert torch.equal(p, got["trained"][n]), f"{n} differs after a 2 -> 1 reshard"
        assert [g["lr"] for g in engine.optimizer.param_groups] == ([1e-3, 3e-3] if kind == "nanogpt" else [1e-3])
    finally:
        engine.close()


@pytest.mark.slow
def test_two_ranks_stream_from_pretrained(disk_dir, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (make deps installs it)")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama", max_shard_size="30KB")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    got = _spawn("pretrained", "nvme", disk_dir, tmp_path, str(tmp_path / "llama"))
    for n, p in plain.named_parameters():
        assert torch.equal(p, got["values"][n]), f"{n} differs from plain from_pretrained on 2 ranks"

    def batches(s):
        (x, _), _ = lm_batch(s)
        return (), {"input_ids": x, "labels": x}

    assert_close(plain_losses(plain, batches), got["losses"])
