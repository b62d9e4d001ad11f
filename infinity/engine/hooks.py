"""The hooks that gather parameters just before they are used and release them right after.

- Forward: a module's pre-hook gathers its own parameters (recurse=False),
  its post-hook releases them. A module called twice gathers twice.
- Backward: see [Note: saved parameters].
- Gradients: each parameter's post-accumulate-grad hook hands the full
  gradient to `ParamStore.on_grad`, which gives it to the optimizer's
  GradientBuckets (buckets.py), which reduce-scatter it to its owner.

[Note: saved parameters]
Autograd saves the tensors a backward will need, and for a linear layer that
is the weight itself or a view of it (`weight.t()`). Saved as-is, those would
keep every layer's gathered weights alive from forward to backward: the
whole model. Instead the engine's saved-tensor hooks store a reference (the
parameter, and the view's size, stride and offset) and, when backward
unpacks it, gather the parameter again and rebuild the view. The gathered
tensor lives only while that backward node runs. This is also what makes
tied weights, parameters used several times, and activation checkpointing
work without special cases: whatever backward needs, it asks for.

[Note: state_dict guard]
After initialize a partitioned parameter's `.data` is its placeholder (NaN)
between uses, so `model.state_dict()` would hand NaN to whoever asked, and
Hugging Face's `save_pretrained`, peft's `save_pretrained` and
`get_peft_model_state_dict` and `torch.save(model.state_dict())` would
write it to disk without a word. Each module that owns partitioned
parameters gets a state_dict pre-hook that raises instead, naming the routes
that give the true values. Inside `gathered_parameters(model)` the values
exist and state_dict works; `keep_vars=True` returns the Parameter objects
themselves (what the engine's own savers walk), so it passes. The guard is
not removed by `engine.close()`: the placeholders stay, and the values are
gone then.
"""

from __future__ import annotations

import torch

from infinity.engine.params import ParamStatus, ParamStore, managed
from infinity.errors import PartitionedStateError


class _SavedParam:
    __slots__ = ("mp", "size", "stride", "offset")

    def __init__(self, mp, size, stride, offset):
        self.mp, self.size, self.stride, self.offset = mp, size, stride, offset


class ParamHooks:
    """Installs and removes the module, saved-tensor and gradient hooks for one ParamStore."""

    def __init__(self, store: ParamStore):
        self.store = store
        self._handles: list = []

    def install(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            if any(managed(p) is not None and not managed(p).persistent for p in module.parameters(recurse=False)):
                self._handles.append(module.register_forward_pre_hook(self._pre_forward))
                self._handles.append(module.register_forward_hook(self._post_forward, always_call=True))
        seen = set()
        for p in model.parameters():
            # Parameters left out of the optimizer's groups too: on_grad drops the gradient autograd made.
            if managed(p) is not None and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._handles.append(p.register_post_accumulate_grad_hook(self.store.on_grad))

    def guard_state_dict(self, model: torch.nn.Module) -> None:
        """See [Note: state_dict guard]. Stays installed after remove()."""
        for module in model.modules():
            if any(managed(p) is not None and not managed(p).persistent for p in module.parameters(recurse=False)):
                module.register_state_dict_pre_hook(_refuse_placeholders)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def saved_tensors(self):
        """The context that forward and backward run under (see [Note: saved parameters])."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # ------------------------------------------------------------------ hooks

    def _pre_forward(self, module, args):
        for p in module.parameters(recurse=False):
            mp = managed(p)
            if mp is not None:
                self.store.use(mp)

    def _post_forward(self, module, args, output):
        for p in module.parameters(recurse=False):
            mp = managed(p)
            if mp is not None and mp.users > 0:
                self.store.unuse(mp)

    def _pack(self, t: torch.Tensor):
        mp = managed(t)
        if mp is not None:
            return _SavedParam(mp, None, None, None)
        base = t._base
        if base is not None:
            mp = managed(base)
            if mp is not None and mp.status is ParamStatus.GATHERED and t.untyped_storage().data_ptr() == \
                    base.untyped_storage().data_ptr():
                return _SavedParam(mp, t.size(), t.stride(), t.storage_offset())
        return t

    def _unpack(self, saved):
        if not isinstance(saved, _SavedParam):
            return saved
        full = self.store.gather_full(saved.mp)
        if saved.size is None:
            return full
        return full.as_strided(saved.size, saved.stride, saved.offset)


def _refuse_placeholders(module, prefix, keep_vars) -> None:
    """A state_dict pre-hook: see [Note: state_dict guard]."""
    if keep_vars:
        return
    for p in module.parameters(recurse=False):
        mp = managed(p)
        if mp is not None and mp.status is ParamStatus.SHARDED:
            closed = not mp.store.swap_open()
            raise PartitionedStateError(
                f"state_dict(): {mp.name} is partitioned over ranks and offloaded, so this module holds a "
                "placeholder (NaN), not its value" + (", and the engine is closed, so the values are gone; save "
                "before engine.close()" if closed else "") + ". To save the model use engine.save_pretrained(dir"
                "[, tokenizer=...]) (a Hugging Face directory, streamed; for peft models the adapter, or "
                "merge_lora=True); for a dict on rank 0 use engine.consolidated_16bit_state_dict(); to read "
                "values in place use `with infinity.gathered_parameters(model): ...`")
