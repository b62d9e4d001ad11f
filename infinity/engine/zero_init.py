"""zero_init and gathered_parameters: build a model partitioned from the start, and see its full values.

[Note: partition at construction]
Inside `zero_init`, every nn.Module subclass's __init__ is wrapped. When the
outermost __init__ of an instance returns, the parameters it owns directly
(recurse=False) are handed to the ParamStore, which keeps this rank's shard
(in RAM or in a swap file) and releases the rest. So at most one module's
full parameters exist at a time, and a model bigger than RAM can be built.
The values are exactly those of a normal build: the module's own
initialisation runs unchanged, on the full tensor, with the same RNG calls in
the same order. Whatever runs later and touches an already partitioned
parameter (a parent's init loop, `Module.apply`, Hugging Face's `post_init`,
user code between zero_init and initialize) goes through
[Note: partitioned access] in construct.py, so its writes land and its reads
see the real values. `from_pretrained` of a Hugging Face model streams the
checkpoint into the shards (pretrained.py).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from infinity.config.load import as_config
from infinity.engine.build import build_store
from infinity.engine.comm import init_distributed
from infinity.engine.memory import CONSTRUCTION, mmap_threshold, set_mmap_threshold
from infinity.engine.construct import PartitionedAccess
from infinity.engine.params import ParamStatus, managed
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

_active = threading.local()


def current_store():
    return getattr(_active, "store", None)


def _subclasses(cls):
    out, todo = set(), [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.add(sub)
                todo.append(sub)
    return out


@contextlib.contextmanager
def zero_init(config=None):
    """Partition the parameters of every module built inside the block (see [Note: partition at construction])."""
    if current_store() is not None:
        raise RuntimeError("infinity.zero_init: already inside a zero_init block; nest them not")
    cfg = as_config(config)
    previous = mmap_threshold()
    set_mmap_threshold(CONSTRUCTION)  # construction stays memory-bounded: [Note: glibc's mmap threshold]
    try:
        comm = init_distributed(cfg.infinity.comm_timeout_s)
        store = build_store(cfg, comm)
    except BaseException:
        _restore_threshold(previous)
        raise
    patched = []

    def wrap_init(orig):
        @functools.wraps(orig)
        def __init__(self, *args, **kwargs):
            # Only the outermost __init__ of an instance partitions: a subclass may still change the
            # parameters after its super().__init__() returns.
            outer = "_infinity_building" not in self.__dict__
            if outer:
                self.__dict__["_infinity_building"] = True
            try:
                orig(self, *args, **kwargs)
            finally:
                if outer:
                    del self.__dict__["_infinity_building"]
            if outer:
                _partition(store, self)
        return __init__

    for cls in _subclasses(torch.nn.Module):
        if "__init__" in cls.__dict__:
            orig = cls.__dict__["__init__"]
            patched.append((cls, "__init__", orig))
            cls.__init__ = wrap_init(orig)
    hf = _hf_pretrained_model()
    if hf is not None:
        from infinity.engine.pretrained import partitioned_from_pretrained

        orig_fp = hf.__dict__["from_pretrained"]
        patched.append((hf, "from_pretrained", orig_fp))
        hf.from_pretrained = classmethod(partitioned_from_pretrained(store))
    _end_stale_access()
    store.begin_access(PartitionedAccess(store))
    _active.store = store
    try:
        yield store
    except BaseException:
        store.end_access()  # the build failed: nothing of it will be initialized
        raise
    finally:
        _active.store = None
        _restore_threshold(previous)
        for cls, name, orig in reversed(patched):
            setattr(cls, name, orig)
        # The access mode stays until initialize(): writes after the block land too (see [Note: partitioned
        # access]); what the block left staged is written back now.
        store.settle_staged()
        store.adopt_reassigned(store.params)


def _restore_threshold(previous: int | None) -> None:
    """An engine that runs while another model is built keeps its own threshold once the block ends."""
    if previous is not None:
        set_mmap_threshold(previous)


def _end_stale_access() -> None:
    """Drop access modes whose store is gone or was closed without initialize (they only pass ops through)."""
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, PartitionedAccess) and not mode.live():
            mode.close()


def _partition(store, module) -> None:
    for name, p in module.named_parameters(recurse=False):
        if p is not None and managed(p) is None:
            store.adopt(p, f"{type(module).__name__}.{name}")
            if "_infinity_values_hook" not in module.__dict__:
                module.__dict__["_infinity_values_hook"] = module.register_state_dict_post_hook(_true_values)
    # A parent may have written its children's parameters: what it staged or assigned becomes their shards now.
    store.settle_staged()
    store.adopt_reassigned([m for m in (managed(p) for p in module.parameters()) if m is not None])


def _true_values(module, state_dict, prefix, local_metadata) -> None:
    """Between zero_init and initialize, `state_dict()` gives each partitioned parameter's real value, gathered
    one at a time (a collective: call it on every rank), so `torch.save(model.state_dict())` never writes a
    placeholder's NaN. From initialize on, the guard in hooks.py raises first ([Note: state_dict guard]);
    keep_vars=True returns the Parameters themselves, untouched."""
    from infinity.errors import PartitionedStateError

    for name, p in module._parameters.items():
        mp = managed(p)
        key = prefix + name
        if mp is None or mp.status is not ParamStatus.SHARDED or isinstance(state_dict.get(key), torch.nn.Parameter):
            continue
        if mp.store.frozen:
            continue
        if not mp.store.swap_open():
            raise PartitionedStateError(f"state_dict(): {mp.name} belongs to a store that was closed before "
                                        "initialize(), so its values are gone; build the model again")
        state_dict[key] = mp.store.gather_full(mp, scheduled=False).detach().clone()


def _hf_pretrained_model():
    """transformers.PreTrainedModel, if the user's program has imported transformers (we never import it first).

    `import transformers` is lazy: its modeling_utils may not be loaded yet, and a from_pretrained inside the
    block would load it too late to be streamed, so it is loaded here."""
    import importlib
    import sys

    if "transformers" not in sys.modules:
        return None
    mod = importlib.import_module("transformers.modeling_utils")
    return getattr(mod, "PreTrainedModel", None)


@contextlib.contextmanager
def gathered_parameters(params_or_module, modifier_rank: int | None = None, *, store=None):
    """Full parameters inside the block. With modifier_rank=r, rank r's changes are kept (on every rank).

    Changing parameters is allowed until `infinity.initialize` has built the
    optimizer; after that the master weights of trained parameters are the
    optimizer's, and a modification of one raises instead of being silently
    lost. Frozen parameters have no master weights and may change at any time.
    """
    if isinstance(params_or_module, torch.nn.Module):
        params = list(params_or_module.parameters())
    elif isinstance(params_or_module, torch.nn.Parameter):
        params = [params_or_module]
    else:
        params = list(params_or_module)
    mps = []
    seen = set()
    for p in params:
        mp = managed(p)
        if mp is not None and id(mp) not in seen:
            seen.add(id(mp))
            mps.append(mp)
    if not mps:
        yield
        return
    st = store or mps[0].store or current_store()
    if st is None:
        raise RuntimeError("infinity.gathered_parameters: these parameters belong to no live store")
    trained = [mp.name for mp in mps if mp.trainable]
    if modifier_rank is not None and st.frozen and trained:
        raise RuntimeError(f"infinity.gathered_parameters: modifier_rank is set, but initialize() already built the "
                           f"optimizer, whose fp32 master weights of {trained[:3]} would not see the change; modify "
                           "trained parameters inside zero_init, or before initialize() (frozen ones may change "
                           "at any time)")
    st.adopt_reassigned(mps)
    for mp in mps:
        st.use(mp, scheduled=False)
    try:
        yield
        if modifier_rank is not None:
            with torch.no_grad():
                for mp in mps:
                    full = st.comm.broadcast_(mp.param.data.contiguous(), modifier_rank).reshape(-1)
                    lo, hi = st.comm.rank * mp.part, min(mp.numel, (st.comm.rank + 1) * mp.part)
                    shard = torch.zeros(mp.part, dtype=full.dtype)
                    if hi > lo:
                        shard[:hi - lo].copy_(full[lo:hi])
                    st.write_shard(mp, shard, wait=True, keep_dtype=True)
                    if mp.persistent:
                        mp.param.data = full.view(mp.shape)
    finally:
        for mp in mps:
            st.unuse(mp)
        assert all(mp.persistent or mp.users or mp.status is ParamStatus.SHARDED for mp in mps)
