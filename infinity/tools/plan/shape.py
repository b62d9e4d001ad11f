"""Model introspection for the planner: a model built on the meta device (no memory, no init), read for its shape."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """What the planner needs to know of a model, read off a meta-device build."""

    name: str
    numel: int                 # unique parameters
    largest: int               # elements of the largest parameter
    layers: int
    dim: int
    vocab: int
    seq: int
    checkpoint: bool           # activation checkpointing per layer
    largest_module: int        # most parameter elements one module owns directly (gathered at once)
    modules: int               # modules that own parameters (each is gathered and released, twice a step)
    block: object = None       # one repeated layer, on the meta device, for timing (None if none was found)


def model_shape(name: str, seq: int | None = None) -> ModelShape:
    """Build the model on the meta device (no memory, no init) and read its shape."""
    import torch

    from infinity.models import build_model

    with torch.device("meta"):
        model, vocab, model_seq, _ = build_model(name)
    seen, numel, largest = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        numel += p.numel()
        largest = max(largest, p.numel())
    owned = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    largest_module = max(owned)
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    block = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))[0] if lists else None
    layers = _attr(cfg, "layers", "n_layer", "num_hidden_layers")
    dim = _attr(cfg, "dim", "n_embd", "hidden_size")
    checkpoint = bool(getattr(cfg, "checkpoint", False))
    return ModelShape(name=name, numel=numel, largest=largest, layers=layers, dim=dim, vocab=vocab,
                      seq=min(seq or model_seq, model_seq, 256), checkpoint=checkpoint,
                      largest_module=largest_module, modules=sum(1 for n in owned if n), block=block)


def _attr(obj, *names) -> int:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, int):
            return v
    raise ValueError(f"the planner cannot read {' / '.join(names)} from the model's config")
