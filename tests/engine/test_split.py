"""A shard larger than sub_group_size split over sub-groups of its own ([Note: a large shard is split over
sub-groups of its own] in infinity/engine/optimizer.py), on a nanoGPT-shaped model whose tied embedding
(1,179,648 elements) is the largest tensor, parameters and optimizer both on NVMe: training is bit-identical to
the same run with the embedding in one sub-group, the pool's buffers hold a piece instead of the embedding, a
checkpoint written from the pieces loads into the unsplit layout (and back) bit for bit, and a flipped byte in
a later piece's file is caught."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import infinity
from infinity.config import load_config
from infinity.engine import initialize, zero_init
from infinity.testing.files import flip_bit
from tests.engine.test_sizing import DIM, VOCAB, TiedLM

WHOLE, PIECE = 2_000_000, 300_000  # sub_group_size: above the embedding, and a quarter of it


def config(disk_dir, sub_group_size, precision):
    nvme = {"device": "nvme", "nvme_path": str(disk_dir)}
    # zero_init builds the store before the model: buffers of the embedding's size, not DeepSpeed's 1e8 elements
    param = dict(nvme, buffer_size=VOCAB * DIM)
    return load_config({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                        "bf16": {"enabled": precision == "bf16"},
                        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
                        "zero_optimization": {"stage": 3, "sub_group_size": sub_group_size,
                                              "stage3_param_persistence_threshold": 0,
                                              "offload_param": param, "offload_optimizer": dict(nvme)}})


def engine(disk_dir, sub_group_size, precision):
    cfg = config(disk_dir, sub_group_size, precision)
    torch.manual_seed(0)
    with zero_init(cfg):
        model = TiedLM(layers=2)
    return initialize(model, cfg)


def step(e, s):
    x = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(100 + s))
    loss = e(x[:, :-1]).float().reshape(-1, VOCAB)
    loss = F.cross_entropy(loss, x[:, 1:].reshape(-1))
    e.backward(loss)
    e.step()
    return loss.item()


def test_a_split_embedding_trains_bit_identically_and_its_checkpoint_loads_either_way(disk_dir, tmp_path):
    """bf16: the forward reads each piece of the embedding from its sub-group's bf16 tail."""
    whole = engine(disk_dir / "a", WHOLE, "bf16")
    split = engine(disk_dir / "b", PIECE, "bf16")
    try:
        emb = [g for g in split.optimizer.groups if g.params[0].name == "wte.weight"]
        assert len(emb) == 4 and all(g.split for g in emb), "the embedding is four sub-groups of its own"
        assert [g.spans[0] for g in emb] == [(0, 299008), (299008, 598016), (598016, 897024), (897024, VOCAB * DIM)]
        assert split.optimizer.swap.pool.size < whole.optimizer.swap.pool.size / 3, "buffers hold a piece"
        assert split.store.alias is not None and len(split.store.alias.where["alias/0"]) == 4
        # The parameter pool was built for the fp32 embedding and holds it in bf16 from initialize on ([Note:
        # the parameter pool shrinks after setup]); training, saving and loading below all go through it.
        assert split.store.swap.pool.size == whole.store.swap.pool.size == 2 * VOCAB * DIM
        assert split.store.swap.pool.nbytes <= split.store.swap.pool.count * (2 * VOCAB * DIM + 4096)
        a = [step(whole, s) for s in range(3)]
        b = [step(split, s) for s in range(3)]
        assert a == b, "the same arithmetic, grouped otherwise"
        sa, sb = whole.module_state_dict(), split.module_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        split.save_checkpoint(str(tmp_path / "from-split"), tag="s3")
        whole.save_checkpoint(str(tmp_path / "from-whole"), tag="s3")
        rest = [step(whole, s) for s in range(3, 5)]
    finally:
        whole.close()
        split.close()
    for saved, sub_group_size in (("from-split", WHOLE), ("from-whole", PIECE)):
        e = engine(disk_dir / f"c-{saved}", sub_group_size, "bf16")
        try:
            e.load_checkpoint(str(tmp_path / saved), tag="s3")
            assert [step(e, s) for s in range(3, 5)] == rest, f"{saved} loaded at sub_group_size {sub_group_size}"
        finally:
            e.close()


def test_fp32_pieces_train_as_the_whole_and_a_flipped_byte_in_a_later_one_is_caught(disk_dir):
    """fp32: the shard is the master itself, read from each piece's p region."""
    whole = engine(disk_dir / "a", WHOLE, "fp32")
    split = engine(disk_dir / "b", PIECE, "fp32")
    try:
        assert [step(whole, s) for s in range(2)] == [step(split, s) for s in range(2)]
        assert split.store.alias.where["alias/0"][2][3] == 598016  # the third piece starts at element 598016
        path, offset, _ = split.store.alias.files_of("alias/0")[2]
        flip_bit(path, offset + 8)
        with pytest.raises(infinity.SwapCorruptionError, match="is corrupted") as info:
            step(split, 2)
        assert info.value.filename == path
    finally:
        whole.close()
        split.close()


class Gated(torch.nn.Module):
    """A head as large as the embedding that only some micro-batches use (a task head, an MoE expert)."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x, use_head: bool):
        h = self.wte(x)
        return self.head(h) if use_head else h.sum(-1, keepdim=True).expand(-1, -1, VOCAB)


def test_a_split_shard_without_a_gradient_in_the_last_micro_batch_keeps_what_it_accumulated(disk_dir):
    """Accumulation 2, no clipping (sub-groups step during the last backward): the split head has a gradient
    from the first micro-batch only, so its pieces step after backward, from the accumulated gradient, and
    the run equals the unsplit one bit for bit."""
    def run(sub_group_size, where):
        cfg = config(where, sub_group_size, "fp32")
        cfg = dataclasses.replace(cfg, gradient_accumulation_steps=2, train_batch_size=None)
        torch.manual_seed(0)
        with zero_init(cfg):
            model = Gated()
        e = initialize(model, cfg)
        try:
            losses = []
            for s in range(6):
                x = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(s))
                logits = e(x[:, :-1], s % 2 == 0)
                loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
                e.backward(loss)
                e.step()
                losses.append(loss.item())
            return losses, {k: v.clone() for k, v in e.module_state_dict().items()}, e.optimizer.groups
        finally:
            e.close()

    a, wa, _ = run(WHOLE, disk_dir / "a")
    b, wb, groups = run(PIECE, disk_dir / "b")
    assert sum(g.params[0].name == "head.weight" for g in groups) == 4, "the head is split"
    assert a == b
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_with_the_parameters_in_ram_a_split_shard_trains_as_the_whole(disk_dir, tmp_path, precision):
    """ZeRO-Offload's layout (parameters in RAM, optimizer on NVMe): each piece's new weights are written into
    its slice of the shard in RAM as the piece steps. Bit-identical to the unsplit run, through a checkpoint
    that loads either way."""
    def build(where, sub_group_size):
        cfg = config(where, sub_group_size, precision)
        zero = dataclasses.replace(cfg.zero_optimization, offload_param=dataclasses.replace(
            cfg.zero_optimization.offload_param, device="cpu"))
        cfg = dataclasses.replace(cfg, zero_optimization=zero)
        torch.manual_seed(0)
        with zero_init(cfg):
            model = TiedLM(layers=2)
        return initialize(model, cfg)

    whole, split = build(disk_dir / "a", WHOLE), build(disk_dir / "b", PIECE)
    try:
        assert split.store.alias is None and split.store.nvme is None, "shards in RAM, not in the state's files"
        emb = [g for g in split.optimizer.groups if g.params[0].name == "wte.weight"]
        assert len(emb) == 4 and all(g.split for g in emb)
        assert split.optimizer.swap.pool.size < whole.optimizer.swap.pool.size / 3, "buffers hold a piece"
        a = [step(whole, s) for s in range(3)]
        assert a == [step(split, s) for s in range(3)]
        sa, sb = whole.module_state_dict(), split.module_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        split.save_checkpoint(str(tmp_path / "ck"), tag="s3")
        rest = [step(whole, s) for s in range(3, 5)]
    finally:
        whole.close()
        split.close()
    again = build(disk_dir / "c", WHOLE)
    try:
        again.load_checkpoint(str(tmp_path / "ck"), tag="s3")
        assert [step(again, s) for s in range(3, 5)] == rest
    finally:
        again.close()
