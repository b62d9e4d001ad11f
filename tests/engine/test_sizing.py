"""The NVMe optimizer's sizes fitted to the model when the config leaves them out ([Note: sizes fitted to the
model] in infinity/engine/plan.py), on a nanoGPT-shaped model whose tied embedding is the largest tensor, as
in GPT-2: sub_group_size becomes the largest trained shard, buffer_count is capped at the sub-group count, a
written value stands (and is said when it makes the pool larger than the state), and LoRA-sized training
fits the adapters, not the frozen base."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from infinity.config import load_config
from infinity.engine import initialize
from infinity.engine.plan import FLOOR

VOCAB, DIM = 4608, 256  # the embedding, 1,179,648 elements, is above the sizing floor of 1,048,576


class TiedLM(nn.Module):
    def __init__(self, layers=4):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(),
                                                  nn.Linear(4 * DIM, DIM)) for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, x):
        h = self.wte(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def config(tmp_path, **zero):
    z = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}}
    for k, v in zero.items():
        if k == "buffer_count":
            z["offload_optimizer"]["buffer_count"] = v
        else:
            z[k] = v
    return load_config({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": z,
                        "infinity": {"direct_io": False}})


def engine(cfg, params=None):
    torch.manual_seed(0)
    return initialize(TiedLM(), cfg, model_parameters=params)


def step(e):
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(e(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))
    e.backward(loss)
    e.step()
    return loss.item()


def test_left_out_sizes_fit_the_largest_shard_and_the_sub_group_count(tmp_path, caplog):
    cfg = config(tmp_path)
    assert "zero_optimization.sub_group_size" not in cfg.given
    with caplog.at_level(logging.INFO, logger="infinity"):
        e = engine(cfg)
    try:
        zero = e.config.zero_optimization
        assert zero.sub_group_size == VOCAB * DIM > FLOOR
        groups = e.optimizer.groups
        assert max(g.numel for g in groups) == VOCAB * DIM
        assert zero.offload_optimizer.buffer_count == min(4, len(groups))
        assert e.optimizer.swap.pool.size == 12 * VOCAB * DIM, "each buffer one sub-group's [p|m|v], no more"
        assert "NVMe optimizer sizes fitted to the model: sub_group_size 1,179,648 (the largest trained shard" \
            in caplog.text
        losses = [step(e) for _ in range(3)]
    finally:
        e.close()
    assert losses[-1] < losses[0]


def test_written_sizes_stand_and_an_oversized_pool_is_said(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="infinity"):
        e = engine(config(tmp_path, sub_group_size=100_000_000, buffer_count=4))
    try:
        zero = e.config.zero_optimization
        assert zero.sub_group_size == 100_000_000 and zero.offload_optimizer.buffer_count == 4
        # The persistent parameters (LayerNorms, biases) are a group of their own, packed first (see [Note: the
        # step finishes in the next forward]); everything else fits the one 100M group written.
        assert [all(mp.persistent for mp in g.params) for g in e.optimizer.groups] == [True, False]
    finally:
        e.close()
    assert "sub_group_size 100,000,000 and buffer_count 4 make the NVMe optimizer's pool 4 buffers" in caplog.text
    assert "leave sub_group_size and buffer_count out of the config" in caplog.text


def test_adapters_alone_are_sized_as_adapters(tmp_path):
    """Only the blocks' second Linear trained (as LoRA trains a few small tensors of a frozen base): the
    sub-groups are sized by the trained shards, not by the frozen embedding."""
    torch.manual_seed(0)
    model = TiedLM()
    trained = [b[3].weight for b in model.blocks]
    e = initialize(model, config(tmp_path), model_parameters=trained)
    try:
        assert e.config.zero_optimization.sub_group_size == FLOOR
        assert sum(g.numel for g in e.optimizer.groups) == 4 * 4 * DIM * DIM
        assert e.config.zero_optimization.offload_optimizer.buffer_count == len(e.optimizer.groups) == 1
        step(e)
    finally:
        e.close()
