"""Tiny Hugging Face models with real tokenizers, made on the spot (nothing is downloaded): for the tests, the
examples' CI run and the fine-tuning benchmarks.

`make_model_dir(path, arch)` writes what a user would have on disk after `save_pretrained`: config.json,
model.safetensors, generation_config.json, and a byte-level BPE tokenizer trained here with `tokenizers` on
the built-in text, with a chat template.
"""

from __future__ import annotations

import json
import os

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %}<|end|>{% else %}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def make_tokenizer(path: str, *, vocab: int = 384, text: str | None = None):
    """A byte-level BPE tokenizer trained on `text` (default: the built-in text), saved into `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from infinity.data import text as builtin

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = (text or builtin(64 << 10).decode()).splitlines()
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def model_config(arch: str, vocab: int, **over):
    import transformers

    if arch == "llama":
        base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=128, tie_word_embeddings=False)
        base.update(over)
        return transformers.LlamaConfig(**base)
    if arch == "gpt2":
        base = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=128)
        base.update(over)
        return transformers.GPT2Config(**base)
    raise ValueError(f"arch {arch!r}: llama or gpt2")


def make_model_dir(path: str, arch: str = "llama", *, seed: int = 1, **over) -> str:
    """A saved model directory (weights, config, generation config, tokenizer) at `path`."""
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    tok = make_tokenizer(path)
    cfg = model_config(arch, len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, **over)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def write_corpus(path: str, *, rows: int = 200, shape: str = "text", seed: int = 0) -> str:
    """A jsonl file of `rows` rows in one of the three shapes, from the built-in text."""
    import random

    from infinity.data import text

    import re

    lines = [s.strip() for s in re.split(r"(?<=[.!?]) ", text(64 << 10, seed=seed + 11).decode()) if s.strip()]
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(rows):
            a, b = rng.choice(lines), rng.choice(lines)
            if shape == "text":
                row = {"text": f"{a} {b}"}
            elif shape == "prompt/completion":
                row = {"prompt": f"Continue: {a}\n", "completion": b}
            else:
                row = {"messages": [{"role": "system", "content": "Answer in one sentence."},
                                    {"role": "user", "content": a},
                                    {"role": "assistant", "content": b},
                                    {"role": "user", "content": "And then?"},
                                    {"role": "assistant", "content": rng.choice(lines)}]}
            f.write(json.dumps(row) + "\n")
    return path
