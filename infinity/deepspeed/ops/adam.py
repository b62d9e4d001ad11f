"""deepspeed.ops.adam: DeepSpeedCPUAdam and FusedAdam as client optimizers.

Passed to `deepspeed.initialize(optimizer=...)` (built, or as a callable),
each becomes the engine's CPU Adam with its parameter groups and its
hyper-parameters: lr, betas, eps, weight_decay, bias_correction, and
adamw_mode (adam_w_mode for FusedAdam): decoupled weight decay when true,
L2 added to the gradient when false, as DeepSpeed's kernels do. Used on
their own, outside an engine, they step as torch.optim.Adam with the same
settings (`decoupled_weight_decay` = adamw_mode); bias_correction=False has
no torch equivalent and is refused there.
"""

from __future__ import annotations

import torch


class _ClientAdam(torch.optim.Adam):
    _mode_key = "adamw_mode"

    def __init__(self, params, lr, betas, eps, weight_decay, amsgrad, bias_correction, adamw_mode):
        if amsgrad:
            raise ValueError(f"{type(self).__name__}(amsgrad=True): AMSGrad is not supported (DeepSpeed's kernels "
                             "refuse it too); drop amsgrad")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adamw_mode)
        self.defaults["bias_correction"] = bias_correction
        self.adam_w_mode = adamw_mode

    @torch.no_grad()
    def step(self, closure=None):
        if not self.defaults["bias_correction"]:
            raise ValueError(f"{type(self).__name__}(bias_correction=False) steps only inside deepspeed.initialize "
                             "(the engine's CPU Adam has the switch; torch.optim.Adam has not)")
        return super().step(closure)


class DeepSpeedCPUAdam(_ClientAdam):
    """DeepSpeed's CPU Adam, with its signature; see the module's docstring."""

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True):
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False): set the moments' dtype in the config "
                             "instead (zero_optimization.offload_optimizer.moments_dtype: \"bf16\" or \"int8\")")
        super().__init__(model_params, lr, betas, eps, weight_decay, amsgrad, bias_correction, adamw_mode)


class FusedAdam(_ClientAdam):
    """DeepSpeed's fused (GPU) Adam, with its signature; see the module's docstring."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, bias_correction, adam_w_mode)


class DeepSpeedCPUAdagrad:  # noqa: D101 - named so that its import fails with a reason, not an AttributeError
    def __init__(self, *args, **kwargs):
        raise TypeError("DeepSpeedCPUAdagrad is not supported: infinity's engine steps Adam/AdamW only")
