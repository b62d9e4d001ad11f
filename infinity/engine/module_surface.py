"""What the engine answers as the module it wraps, as DeepSpeed's engine (an nn.Module) does.

[Note: the engine acts as its module]
Scripts written for DeepSpeed treat the engine as the model: they iterate
`engine.parameters()`, walk `engine.named_modules()`, read `engine.config`
of the model through attribute access, and call `engine.state_dict()`.
`ModuleSurface` gives the Engine those, each with DeepSpeed's meaning:
- parameters, named_parameters, buffers, named_buffers, children,
  named_children, modules, named_modules: the module's own, named as
  DeepSpeed's engine names them ("module." first, as for state_dict);
- forward: the engine's call (never the bare module's forward, which would
  skip the engine's bookkeeping);
- state_dict: every value true, gathered one parameter at a time (a
  collective: call it on every rank; every rank gets a full copy, where
  DeepSpeed's would hold placeholders), under DeepSpeed's keys ("module."
  before the module's own); `module_state_dict()` without the prefix;
- load_state_dict, to/cuda/cpu/half/float/bfloat16/double/type: refused
  with the route that works (after initialize the optimizer owns the fp32
  master weights, and the engine places and casts parameters itself);
- any other attribute: the module's (`engine.model` for a model with a
  `.model`). The engine's own attributes come first: `engine.config` is the
  engine's config, the model's is `engine.module.config`, as in DeepSpeed.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict

import torch

_REFUSED = ("to", "cuda", "cpu", "half", "float", "bfloat16", "double", "type")


class ModuleSurface:
    module: torch.nn.Module

    # Names as DeepSpeed's engine (an nn.Module holding the model as `module`) gives them: "module." first.
    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_parameters(_under(prefix), recurse, remove_duplicate)

    def buffers(self, recurse: bool = True):
        return self.module.buffers(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_buffers(_under(prefix), recurse, remove_duplicate)

    def children(self):
        return iter([self.module])

    def named_children(self):
        return iter([("module", self.module)])

    def modules(self):
        return self.module.modules()

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        return self.module.named_modules(memo, _under(prefix), remove_duplicate)

    def forward(self, *args, **kwargs):
        return self(*args, **kwargs)

    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict:
        """The module's state_dict with every value true, in the compute dtype: partitioned parameters are
        gathered one at a time and copied out (a collective: every rank calls it, every rank gets the dict)."""
        from infinity.checkpoint.sixteen import consolidated_state_dict

        out = OrderedDict() if destination is None else destination
        if keep_vars:
            state = self.module.state_dict(keep_vars=True)
            skip = exclude_frozen_parameters
            state = {k: t for k, t in state.items()
                     if not (skip and isinstance(t, torch.nn.Parameter) and not t.requires_grad)}
        else:
            state = consolidated_state_dict(self, exclude_frozen=exclude_frozen_parameters, every_rank=True)
        out.update((prefix + k, v) for k, v in state.items())
        return out

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """DeepSpeed's engine.state_dict(): the module's, under "module." keys (see module_state_dict)."""
        return self.module_state_dict(destination, prefix + "module.", keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True):
        raise RuntimeError("engine.load_state_dict: after initialize the optimizer owns the fp32 master weights, "
                           "so values written into the module would be lost; load them before initialize "
                           "(model.load_state_dict, or from_pretrained under zero_init), or restore a checkpoint "
                           "with engine.load_checkpoint(dir, load_module_only=True)")

    def __getattr__(self, name: str):
        # Only reached when normal lookup fails: the engine's own attributes always win.
        if name == "module" or "module" not in self.__dict__ or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(name)
        if name in _REFUSED:
            raise AttributeError(f"engine.{name}(): the engine places and casts the parameters itself (the config's "
                                 "bf16/fp16 and offload sections); build the model as it is and let initialize move "
                                 "it")
        module = self.__dict__["module"]
        try:
            inspect.getattr_static(module, name)
        except AttributeError:
            # nn.Module keeps parameters, buffers and submodules in dicts that getattr_static does not see.
            if not any(name in getattr(module, d, {}) for d in ("_parameters", "_buffers", "_modules")):
                raise AttributeError(f"{type(self).__name__!r} object (nor its module, a {type(module).__name__}) "
                                     f"has no attribute {name!r}") from None
        return getattr(module, name)  # an AttributeError raised inside a property keeps its own message


def _under(prefix: str) -> str:
    return prefix + ("." if prefix else "") + "module"
