"""A model by name, for the tools: a built-in GPT preset, or a Hugging Face config.json (no download).

`infinity train` builds the model with it (under zero_init) and the planner builds the same model on the
meta device to read its shape; both take it from here, so neither tool imports the other for it.
"""

from __future__ import annotations

from pathlib import Path

from infinity.models.gpt import GPT, PRESETS


def build_model(name: str):
    """(model, vocab, seq, forward) for a preset, a Hugging Face config.json or the directory that holds one.

    `forward(model_or_engine, x, y)` returns the loss: `m(x, y)` for the GPT, `m(input_ids=x, labels=x).loss`
    for a Hugging Face model. The model is built on the current default device (meta, or under zero_init).
    """
    if name in PRESETS:
        cfg = PRESETS[name]
        model = GPT(cfg)
        return model, cfg.vocab, cfg.seq, lambda m, x, y: m(x, y)
    path = Path(name)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        try:
            import transformers
        except ImportError:
            raise ValueError(f"--model {name}: a Hugging Face config needs the transformers package") from None
        hf_cfg = transformers.AutoConfig.from_pretrained(str(path.parent))
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
        seq = getattr(hf_cfg, "n_positions", None) or getattr(hf_cfg, "max_position_embeddings", 256)
        return model, hf_cfg.vocab_size, seq, lambda m, x, y: m(input_ids=x, labels=x).loss
    known = ", ".join(PRESETS)
    raise ValueError(f"--model {name!r}: not a preset ({known}) nor an existing config.json file")
