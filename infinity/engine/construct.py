"""Reads and writes of partitioned parameters while a model is being built.

[Note: partitioned access]
Between `zero_init` and `initialize`, code that is not ours touches
parameters that are already partitioned: a parent's `__init__` re-initialises
a child's weight, an init loop walks `modules()` or `named_parameters()`,
Hugging Face's `post_init` zeroes a padding row, PEFT reads a base layer.
Each such parameter's `.data` is a placeholder (see [Note: placeholder] in
params.py), so the op would hit one NaN element, or be refused by torch for
writing overlapping memory. `PartitionedAccess` is a TorchDispatchMode that
sees every aten op during that window and, when an argument is a placeholder
or a view of one, runs the op on the parameter's real value instead:

- a view op (`p[0]`, `p.t()`, `p.view(...)`, `p.data`) returns a new
  placeholder that remembers the chain of view ops from the parameter;
- any other op gets the full value (the store's staged copy, see below) with
  the chain replayed on it, so it computes exactly what it would on a plain
  module and consumes the RNG exactly as it would;
- if the op wrote to it, the staged copy is marked dirty.

The store stages one parameter's full value at a time and writes it back as
this rank's shard when another parameter is touched, or at a settle point
(the end of a module's `__init__`, the end of `zero_init`, a gather,
`initialize`). So a sequence such as `trunc_normal_` (a draw, a compare, a
clamp) reads and writes the shard once, and at most one parameter's full
value exists beyond the module under construction. An op that only
overwrites a whole parameter (`normal_`, `zero_`, `copy_` of a full tensor,
...) does not read the old shard at all.

`p.data = t` is not an aten op, so no mode sees it; the store notices the
swapped storage at the next settle point and re-partitions `t`
(`ParamStore.adopt_reassigned`). After `initialize` the optimizer owns the
master weights, the mode is gone, and a placeholder reads as NaN.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten, tree_unflatten

# Ops that overwrite every element of their first argument without reading it: the old shard need not be
# read when the target is a whole parameter.
_OVERWRITES = {
    "normal_", "uniform_", "zero_", "fill_", "random_", "bernoulli_", "exponential_", "geometric_",
    "log_normal_", "cauchy_", "copy_", "eye", "randn", "rand", "randperm", "full", "zeros", "ones",
}


def _op_name(func) -> str:
    return func._schema.name.split("::")[-1]


class PartitionedAccess(TorchDispatchMode):
    """See [Note: partitioned access]. One per ParamStore, active from zero_init until initialize."""

    def __init__(self, store):
        super().__init__()
        self._store = weakref.ref(store)
        self.views: dict[int, tuple] = {}
        """storage address of a view placeholder -> (ManagedParam, view chain, the placeholder itself)."""
        self.active = True
        self.watch: list = []
        """Parameters whose full value an op just returned (a conversion: `_to_copy`, `clone`): if user code
        assigns it to `.data` (Module._apply does, for model.half() or .to()), it is re-partitioned at the
        next op, so a whole-model conversion holds one or two full parameters, not all of them."""

    def _lookup(self, store, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        mp = store.placeholder_owner(ptr)
        if mp is not None:
            return mp, ()
        entry = self.views.get(ptr)
        if entry is not None and entry[0].status.name == "SHARDED":
            return entry[0], entry[1]
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        store = self._store()
        if not self.active or store is None or store.frozen:
            return func(*args, **kwargs)
        if self.watch:
            watched, self.watch = self.watch, []
            store.adopt_reassigned(watched)
        flat, spec = tree_flatten((args, kwargs))
        hits = {}
        for i, a in enumerate(flat):
            if isinstance(a, torch.Tensor) and a.layout is torch.strided and not a.is_meta:
                found = self._lookup(store, a)
                if found is not None:
                    hits[i] = found
        if not hits:
            return func(*args, **kwargs)
        schema = func._schema
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return self._view(func, flat, spec, hits)
        return self._on_values(store, func, args, kwargs, flat, spec, hits)

    # ------------------------------------------------------------------ views

    def _view(self, func, flat, spec, hits):
        """A view of a placeholder: a new placeholder that remembers how to get there from the parameter."""
        if len(hits) != 1:
            raise RuntimeError(f"infinity: {func} takes views of two partitioned parameters at once; gather them "
                               "with infinity.gathered_parameters(...) first")
        (idx, (mp, chain)), = hits.items()
        probe = list(flat)
        probe[idx] = torch.empty(flat[idx].shape, dtype=flat[idx].dtype, device="meta")
        a, k = tree_unflatten(probe, spec)
        out = func(*a, **k)
        template = list(flat)
        template[idx] = None

        def placeholder_for(meta, pos):
            ph = torch.full((), float("nan"), dtype=meta.dtype, device=flat[idx].device).expand(meta.shape)
            self.views[ph.untyped_storage().data_ptr()] = (mp, chain + ((func, template, spec, idx, pos),), ph)
            return ph

        if isinstance(out, torch.Tensor):
            return placeholder_for(out, None)
        return type(out)(placeholder_for(o, j) for j, o in enumerate(out))

    @staticmethod
    def replay(full: torch.Tensor, chain) -> torch.Tensor:
        t = full
        for func, template, spec, idx, pos in chain:
            args = list(template)
            args[idx] = t
            a, k = tree_unflatten(args, spec)
            out = func(*a, **k)
            t = out if pos is None else out[pos]
        return t

    # ------------------------------------------------------------ reads/writes

    def _on_values(self, store, func, args, kwargs, flat, spec, hits):
        written = _written_tensors(func, args, kwargs)
        mps = []
        for mp, _ in hits.values():
            if mp not in mps:
                mps.append(mp)
        if len(mps) > 1:
            # Two partitioned parameters in one op (p.copy_(q) with both partitioned): both full at once,
            # still bounded by two parameters.
            store.settle_staged()
        (first, (_, first_chain)), = list(hits.items())[:1]
        overwrite = (len(hits) == 1 and _op_name(func) in _OVERWRITES and not first_chain
                     and id(flat[first]) in written)
        fulls = {}
        for mp in mps:
            fulls[id(mp)] = store.staged_full(mp, need_values=not overwrite, keep_others=len(mps) > 1)
        real = list(flat)
        for i, (mp, chain) in hits.items():
            real[i] = self.replay(fulls[id(mp)], chain)
        a, k = tree_unflatten(real, spec)
        try:
            out = func(*a, **k)
        except BaseException:
            store.drop_staged(mps, clean_only=True)  # what this op staged unwritten (torch.empty) must not stay
            raise
        dirty = [mp for i, (mp, _) in hits.items() if id(flat[i]) in written]
        for mp in dirty:
            store.mark_staged_dirty(mp)
        if len(mps) > 1:
            store.settle_staged()
        if not dirty and isinstance(out, torch.Tensor):
            self.watch.extend(mp for mp in mps if tuple(out.shape) == tuple(mp.shape))
        return _restore_aliases(func, out, args, kwargs)

    def live(self) -> bool:
        store = self._store()
        return self.active and store is not None and not store.frozen and store.swap_open()

    def close(self) -> None:
        """Stop intercepting and leave the dispatch stack, wherever on it this mode is: the modes entered after
        it are exited and entered again around its exit, so every mode's bookkeeping stays in order."""
        self.active = False
        self.views.clear()
        stack = _get_current_dispatch_mode_stack()
        if self not in stack:
            return
        above = stack[stack.index(self) + 1:]
        for mode in reversed(above):
            mode.__exit__(None, None, None)
        self.__exit__(None, None, None)
        for mode in above:
            mode.__enter__()


def _written_tensors(func, args, kwargs) -> set[int]:
    """ids of the tensors the op writes to (schema arguments marked `Tensor(a!)`)."""
    out = set()
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(v, torch.Tensor):
                out.add(id(v))
    return out


def _restore_aliases(func, out, args, kwargs):
    """An in-place or out= op returns its written argument: give back the placeholder the caller passed."""
    schema = func._schema
    if not schema.returns or schema.returns[0].alias_info is None or not schema.returns[0].alias_info.is_write:
        return out
    tag = schema.returns[0].alias_info.before_set
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.before_set == tag:
            return args[i] if i < len(args) else kwargs[arg.name]
    return out


