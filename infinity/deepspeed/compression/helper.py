"""deepspeed.compression.helper: the dotted-name module access LoRA scripts (DeepSpeed-Chat) use.

DeepSpeed's compression methods themselves are not here."""

from __future__ import annotations


def recursive_getattr(model, module_name: str):
    """The submodule at dotted path `module_name` ("h.0.attn")."""
    out = model
    for part in module_name.split("."):
        out = getattr(out, part)
    return out


def recursive_setattr(model, module_name: str, module) -> None:
    """Replace the submodule at dotted path `module_name` with `module`."""
    parent, _, last = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, last, module)
