"""The OffloadPlan ([Note: one plan for the placement] in infinity/engine/plan.py): how shards are packed into
sub-groups, which sub-groups are offloaded, and where trained shards are read from, for each kind of config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from infinity.config.tier import Tier
from infinity.engine.plan import SPLIT_ALIGN, ShardSource, pack
from infinity.testing.parity import engine_config, gpt_engine


def _mp(index: int, part: int, persistent: bool = False):
    return SimpleNamespace(index=index, part=part, persistent=persistent)


def test_shards_pack_in_order_within_the_size_and_persistent_ones_first():
    a, b, c, p = _mp(0, 300), _mp(1, 500), _mp(2, 400), _mp(3, 10, persistent=True)
    groups = pack([[a, b, c, p]], 900, split=False)
    assert [[m.index for m in g.params] for g in groups] == [[3], [0, 1], [2]]
    assert [g.numel for g in groups] == [10, 800, 400] and all(g.span is None for g in groups)
    assert [g.index for g in groups] == [0, 1, 2] and all(g.tier is Tier.DEVICE for g in groups)


def test_parameter_groups_never_share_a_sub_group():
    groups = pack([[_mp(0, 10)], [_mp(1, 10)]], 1000, split=False)
    assert [g.param_group for g in groups] == [0, 1]


def test_a_large_shard_splits_into_aligned_pieces_that_cover_it_once():
    big = _mp(0, 5 * SPLIT_ALIGN + 7)
    groups = pack([[_mp(1, 100), big]], 2 * SPLIT_ALIGN + 5, split=True, tier=Tier.NVME)
    pieces = [g for g in groups if g.span is not None]
    assert [g.span for g in pieces] == [(0, 2 * SPLIT_ALIGN), (2 * SPLIT_ALIGN, 4 * SPLIT_ALIGN),
                                         (4 * SPLIT_ALIGN, 5 * SPLIT_ALIGN + 7)]
    assert all(g.params == (big,) for g in pieces) and sum(g.numel for g in pieces) == big.part
    unsplit = pack([[_mp(1, 100), big]], 2 * SPLIT_ALIGN + 5, split=False)
    assert [g.numel for g in unsplit] == [big.part, 100]  # registration order: big is parameter 0


@pytest.mark.parametrize("ratio, offloaded", [(1.0, 4), (0.5, 2), (0.3, 1), (0.0, 0)])
def test_the_first_int_ratio_x_count_sub_groups_are_offloaded(ratio, offloaded):
    groups = pack([[_mp(i, 10) for i in range(4)]], 10, split=False, tier=Tier.CPU, ratio=ratio)
    assert [g.tier for g in groups] == [Tier.CPU] * offloaded + [Tier.DEVICE] * (4 - offloaded)


def _plan(cfg):
    e = gpt_engine(cfg)
    try:
        return e.plan, e.store.shard_source
    finally:
        e.close()


def test_both_on_nvme_read_trained_shards_from_the_optimizer_file(tmp_path):
    plan, store_source = _plan(engine_config("nvme", str(tmp_path), **{"bf16.enabled": True}))
    assert (plan.param_tier, plan.optimizer_tier) == (Tier.NVME, Tier.NVME)
    assert plan.shard_source is ShardSource.OPTIMIZER_FILE is store_source
    assert plan.shard_dtype == torch.bfloat16 == plan.compute_dtype and plan.tail_bytes == 2
    assert plan.split and plan.optimizer_buffers == 3 and all(g.tier is Tier.NVME for g in plan.sub_groups)


def test_params_in_ram_and_optimizer_on_nvme_keep_their_own_homes_and_split(tmp_path):
    cfg = engine_config("nvme", str(tmp_path), **{"zero_optimization.sub_group_size": 8192})
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    plan, store_source = _plan(cfg)
    assert plan.param_tier is Tier.CPU and plan.optimizer_tier is Tier.NVME
    assert plan.shard_source is ShardSource.HOME is store_source and plan.shard_dtype is None
    assert plan.tail_bytes == 0 and plan.split and any(g.span is not None for g in plan.sub_groups)


def test_an_optimizer_in_ram_has_no_nvme_pool_and_a_partial_offload_keeps_the_rest_on_the_device(tmp_path):
    plan, _ = _plan(engine_config("cpu", str(tmp_path), **{"zero_optimization.offload_optimizer.ratio": 0.5}))
    assert plan.optimizer_buffers == 0 and not plan.split and plan.shard_source is ShardSource.HOME
    tiers = [g.tier for g in plan.sub_groups]
    assert tiers == [Tier.CPU] * (len(tiers) // 2) + [Tier.DEVICE] * (len(tiers) - len(tiers) // 2)


def _swap_files(root) -> dict:
    import os

    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".swp"):
                out[os.path.join(d, f)] = os.path.getsize(os.path.join(d, f))
    return out


@pytest.mark.parametrize("precision, sub_group", [("bf16", 8192), ("fp32", 40_000)])
def test_the_plan_holds_the_swap_files_bytes_exactly(tmp_path, precision, sub_group):
    """The plan's room on disk (DiskNeed, checked before anything is written) is, for the optimizer, the bytes
    its files then take after two steps, headers and tails included; with split shards (bf16: the tied
    embedding in pieces) and without."""
    from infinity.testing.parity import train_step

    over = {"zero_optimization.sub_group_size": sub_group, **({"bf16.enabled": True} if precision == "bf16" else {})}
    e = gpt_engine(engine_config("nvme", str(tmp_path), **over))
    try:
        for s in range(2):
            train_step(e, s)
        e.optimizer.settle()
        files = _swap_files(tmp_path)
        (need,) = e.plan.disk
        assert need.path == str(tmp_path) and need.ranks == 1 and need.free > 0
        optim = sum(n for f, n in files.items() if "/optim_" in f)
        assert optim == need.optimizer_bytes and len([f for f in files if "/optim_" in f]) == len(e.plan.sub_groups)
        assert sum(files.values()) - optim <= need.param_bytes, "the parameters' files within the room planned"
    finally:
        e.close()


def test_a_plan_without_nvme_needs_no_disk(tmp_path):
    plan, _ = _plan(engine_config("cpu", str(tmp_path)))
    assert plan.disk == ()
