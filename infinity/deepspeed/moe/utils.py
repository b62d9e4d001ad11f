"""deepspeed.moe.utils for models without mixture-of-experts layers (infinity has no expert parallelism).

A parameter DeepSpeed's MoE layers made would carry `allreduce = False`; a
model with one is refused, since its experts would be averaged over ranks as
if they were one replica."""

from __future__ import annotations


def is_moe_param(param) -> bool:
    if hasattr(param, "allreduce") and not param.allreduce:
        raise ValueError("deepspeed.moe: this parameter belongs to an expert (allreduce=False); expert parallelism "
                         "is not supported by infinity")
    return False


def has_moe_layers(model) -> tuple[bool, int]:
    for p in model.parameters():
        is_moe_param(p)
    return False, 0


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971):
    """No expert parameters, so the groups are returned as they are (each checked)."""
    groups = param_groups if isinstance(param_groups, (list, tuple)) else [param_groups]
    for g in groups:
        for p in (g["params"] if isinstance(g, dict) else [g]):
            is_moe_param(p)
    return param_groups


def configure_moe_param_groups(model_parameters):
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)


def split_params_grads_into_shared_and_expert_params(group):
    return list(group), []


def is_moe_param_group(param_group) -> bool:
    return bool(param_group.get("moe", False))
