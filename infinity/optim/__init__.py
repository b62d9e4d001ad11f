"""Optimizers for offloaded state: the SIMD CPU Adam kernel and a torch Optimizer over it."""

from infinity.optim.cpu_adam import CPUAdam, cpu_adam_step, grads_finite

__all__ = ["CPUAdam", "cpu_adam_step", "grads_finite"]
