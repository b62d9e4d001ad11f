"""The hooks that gather parameters just before they are used and release them right after.

- Forward: a module's pre-hook gathers its own parameters (recurse=False),
  its post-hook releases them. A module called twice gathers twice.
- Backward: see [Note: saved parameters].
- Gradients: each parameter's post-accumulate-grad hook hands the full
  gradient to `ParamStore.on_grad`, which reduce-scatters it to its owner.

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
"""

from __future__ import annotations

import torch

from infinity.engine.params import ParamStatus, ParamStore, managed


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
