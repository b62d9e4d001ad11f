"""deepspeed.zero: Init (build partitioned) and GatheredParameters (see the full values)."""

from __future__ import annotations

import contextlib

from infinity.deepspeed.config import config_from


class Init:
    """DeepSpeed's zero.Init: modules built inside are partitioned as they are built (infinity.zero_init).

    config_dict_or_path (or config) is the DeepSpeed config (none: stage 3 in RAM); enabled=False builds
    normally, and so does an Init nested in another. remote_device ("cpu"/"nvme"/"none") applies when the
    config has no offload_param section, as in DeepSpeed. `module` partitions a model that was already built. DeepSpeed's other arguments (data_parallel_group, mem_efficient_linear, pin_memory,
    mpu, dtype) are accepted; dtype must agree with the config's precision if given.
    """

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear: bool = True,
                 remote_device: str | None = None, pin_memory: bool = False, config_dict_or_path=None,
                 config=None, enabled: bool = True, dtype=None, mpu=None, **kwargs):
        from infinity.engine.zero_init import current_store

        self._ctx = None
        self.enabled = enabled and current_store() is None  # nested: only the outermost one acts, as in DeepSpeed
        if not self.enabled:
            return
        source = config_dict_or_path if config_dict_or_path is not None else config
        raw = config_from(source) if source is not None else {"zero_optimization": {"stage": 3}}
        zero = raw.setdefault("zero_optimization", {})
        if remote_device is not None and "offload_param" not in zero:  # the config's section wins, as in DeepSpeed
            zero["offload_param"] = {"device": str(remote_device)}
        self.raw = raw
        _check_dtype(raw, dtype)
        self.module = module
        if module is not None:
            self._partition_existing(module)

    def _partition_existing(self, module) -> None:
        from infinity.engine.zero_init import _partition, zero_init

        with zero_init(self.raw) as store:
            for m in module.modules():
                _partition(store, m)

    def __enter__(self):
        if not self.enabled:
            return self
        from infinity.engine.zero_init import zero_init

        self._ctx = zero_init(self.raw)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            return ctx.__exit__(*exc)
        return False


def _check_dtype(raw: dict, dtype) -> None:
    import torch

    if dtype is None:
        return
    want = torch.bfloat16 if (raw.get("bf16") or raw.get("bfloat16") or {}).get("enabled") is True else \
        torch.float16 if (raw.get("fp16") or {}).get("enabled") is True else torch.float32
    if dtype != want:
        raise ValueError(f"deepspeed.zero.Init(dtype={dtype}): the config computes in {want}; the parameters are "
                         "kept as fp32 masters and computed in the config's precision, so drop dtype or change the "
                         "config's bf16/fp16 section")


@contextlib.contextmanager
def GatheredParameters(params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
    """DeepSpeed's GatheredParameters: full values inside; with modifier_rank, that rank's changes are kept."""
    if not enabled:
        yield
        return
    from infinity.engine.zero_init import gathered_parameters

    with gathered_parameters(params, modifier_rank=modifier_rank):
        yield
