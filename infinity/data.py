"""The built-in dataset of `infinity train`: English-like text generated from a fixed seed.

A small grammar (sentences of determiners, adjectives, nouns, verbs,
prepositions and numbers, in paragraphs) is expanded with a seeded RNG into
256 KiB of text, the same bytes on every machine and every version of
this code that keeps the grammar. Tokens are bytes. The text has real
structure at several scales (the byte distribution, spelling, word order,
punctuation), so the loss falls fast and then keeps falling. A sequence is a
window at a position drawn from the step number, so every rank derives the
same global batch and takes its slice.
"""

from __future__ import annotations

import random

CORPUS_BYTES = 256 << 10
_SEED = 20261203

_DET = "the a one every this that some no each another".split()
_ADJ = ("small large quiet bright old new fast slow heavy light warm cold red green blue deep shallow early late "
        "simple strange careful sudden").split()
_NOUN = ("disk buffer page file thread kernel queue block worker model layer tensor river mountain city garden "
         "engine signal window bridge letter station market teacher student number").split()
_VERB = ("reads writes moves holds finds opens closes follows carries sends keeps builds crosses watches counts "
         "lifts").split()
_PREP = "on under near behind beside over into from through after before with".split()
_CONJ = ["and", "but", "because", "while", "so"]

_CORPUS = None


def _phrase(rng: random.Random) -> str:
    words = [rng.choice(_DET)]
    if rng.random() < 0.6:
        words.append(rng.choice(_ADJ))
    words.append(_plural(rng.choice(_NOUN)) if rng.random() < 0.2 else rng.choice(_NOUN))
    if rng.random() < 0.3:
        words += [rng.choice(_PREP), rng.choice(_DET), rng.choice(_NOUN)]
    return " ".join(words)


def _plural(noun: str) -> str:
    return noun[:-1] + "ies" if noun.endswith("y") else noun + "s"


def _sentence(rng: random.Random) -> str:
    clause = f"{_phrase(rng)} {rng.choice(_VERB)} {_phrase(rng)}"
    if rng.random() < 0.25:
        clause += f" {rng.choice(_PREP)} {rng.randint(2, 99)} {_plural(rng.choice(_NOUN))}"
    if rng.random() < 0.3:
        clause += f", {rng.choice(_CONJ)} {_phrase(rng)} {rng.choice(_VERB)} {_phrase(rng)}"
    return clause[0].upper() + clause[1:] + rng.choice([".", ".", ".", "!", "?"])


def text(nbytes: int = CORPUS_BYTES, seed: int = _SEED) -> bytes:
    """Paragraphs of generated sentences, `nbytes` long."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < nbytes:
        para = " ".join(_sentence(rng) for _ in range(rng.randint(3, 8))) + "\n\n"
        parts.append(para)
        size += len(para)
    return "".join(parts).encode("ascii")[:nbytes]


def corpus():
    """The text as an int64 tensor of byte values (built once per process)."""
    global _CORPUS
    if _CORPUS is None:
        import torch

        _CORPUS = torch.frombuffer(bytearray(text()), dtype=torch.uint8).long()
    return _CORPUS


def batch(step: int, size: int, seq: int, vocab: int):
    """(inputs, targets) of `size` windows of `seq` bytes, drawn from the step number."""
    import torch

    data = corpus()
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, data.numel() - seq - 1, (size,), generator=g)
    tokens = torch.stack([data[i:i + seq + 1] for i in starts.tolist()])
    if vocab < 256:
        tokens = tokens % vocab
    return tokens[:, :-1], tokens[:, 1:]
