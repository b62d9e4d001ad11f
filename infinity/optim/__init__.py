"""Optimizers for offloaded state: the SIMD CPU Adam kernel, a torch Optimizer over it, and OffloadAdamW (its
state in host RAM or on NVMe through the swap service, for any training loop)."""

from infinity.optim.cpu_adam import CPUAdam, cpu_adam_step, grads_finite

__all__ = ["CPUAdam", "OffloadAdamW", "cpu_adam_step", "grads_finite"]


def __getattr__(name):
    # OffloadAdamW sits on the swap service, which imports this package's kernel: imported on first use.
    if name == "OffloadAdamW":
        from infinity.optim.offload import OffloadAdamW

        return OffloadAdamW
    raise AttributeError(f"module 'infinity.optim' has no attribute {name!r}")
