"""deepspeed.comm: torch.distributed under DeepSpeed's names (`import deepspeed.comm as dist`).

Each collective is torch's own; DeepSpeed's extra keywords (`prof`,
`log_name`, `debug`) are accepted and dropped, since they only feed its
communication logger. Names not defined here are torch.distributed's.
`init_distributed` is DeepSpeed's: it always leaves a process group, a
one-rank one when no launcher set WORLD_SIZE (see api.init_distributed).
"""

from __future__ import annotations

import os

import torch.distributed as _dist
from torch.distributed import ReduceOp  # noqa: F401 - DeepSpeed re-exports it

from infinity.deepspeed.api import init_distributed  # noqa: F401

_LOGGING = ("prof", "log_name", "debug")


def _drop(kwargs: dict) -> dict:
    for k in _LOGGING:
        kwargs.pop(k, None)
    return kwargs


def is_initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def is_available() -> bool:
    return _dist.is_available()


def get_rank(group=None) -> int:
    return _dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return _dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    return _dist.get_global_rank(group, group_rank) if group is not None else group_rank


def barrier(group=None, async_op: bool = False, device_ids=None, **kwargs):
    return _dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, **kwargs):
    return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


inference_all_reduce = all_reduce


def reduce(tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False, **kwargs):
    return _dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor, src: int, group=None, async_op: bool = False, **kwargs):
    return _dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op: bool = False, **kwargs):
    return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


# torch 2.13 renamed the flat-tensor collectives; either spelling works here.
_ALL_GATHER = getattr(_dist, "all_gather_single", None) or _dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(_dist, "reduce_scatter_single", None) or _dist.reduce_scatter_tensor


def all_gather_into_tensor(output_tensor, tensor, group=None, async_op: bool = False, **kwargs):
    return _ALL_GATHER(output_tensor, tensor, group=group, async_op=async_op)


allgather_fn = all_gather_into_tensor


def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, **kwargs):
    return _REDUCE_SCATTER(output_tensor, tensor, op=op, group=group, async_op=async_op)


reduce_scatter_fn = reduce_scatter_tensor


def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op: bool = False, **kwargs):
    return _dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                   async_op=async_op)


def send(tensor, dst: int, group=None, tag: int = 0, **kwargs):
    return _dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor, src=None, group=None, tag: int = 0, **kwargs):
    return _dist.recv(tensor, src, group=group, tag=tag)


def new_group(ranks=None, **kwargs):
    return _dist.new_group(ranks, **_drop(kwargs))


def destroy_process_group(group=None) -> None:
    _dist.destroy_process_group(group)


def log_summary(show_straggler: bool = False) -> None:
    """DeepSpeed's communication-logger summary: there is no logger here (engine.last_report carries each step's
    communication time), so this prints nothing."""


def configure(*args, **kwargs) -> None:
    """DeepSpeed's comms-logger configuration: nothing to configure here (see log_summary)."""


def __getattr__(name: str):
    return getattr(_dist, name)
