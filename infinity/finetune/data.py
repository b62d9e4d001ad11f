"""Your text, as training windows: load (through `datasets`), tokenize once (cached), pack or pad, shuffle, share.

[Note: fine-tuning data]
- **Load.** `.txt` (one row per line), `.json`/`.jsonl`, `.parquet`, or a
  directory written by `datasets.save_to_disk`, all through the `datasets`
  library: Arrow tables memory-mapped from its cache, so a corpus bigger
  than RAM is paged in as it is read, never held.
- **Shape.** A row is one of three shapes, told from the columns:
  `text`; `prompt` + `completion`; or chat `messages` (a list of
  `{"role", "content"}`). Labels are the tokens themselves, except that
  prompts and every non-assistant turn are masked (-100): the loss is on
  what the model should write.
- **Tokenize once.** `Dataset.map` with the model's tokenizer. `datasets`
  caches the result under a fingerprint of the data and the function, so
  a second run over the same file with the same tokenizer reads the cache.
- **Chat masks.** A conversation is rendered by the tokenizer's own chat
  template. The assistant's tokens are found by rendering it turn by turn:
  the tokens turn i adds after the prompt that asks for it
  (`add_generation_prompt=True`) are that turn's answer. This works with
  every template, also those without `{% generation %}` markers, and is
  checked: if a prefix does not render to a prefix of the whole, the row
  is refused with its index.
- **Windows.** Packing concatenates rows and cuts `seq`-token windows
  (the tail of each map batch that does not fill a window is dropped);
  padding keeps one row per window, truncated, with an attention mask.
- **Order.** Each epoch is a permutation of the windows drawn from
  `seed + epoch`; optimizer step s takes the next `micro x world x accum`
  windows, and rank r's micro-batch k is the (k x world + r)-th slice of
  them. Every rank computes the same permutation, so they agree without
  talking, and step s's windows depend on s alone: a resumed run reads
  what the uninterrupted one would have.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

IGNORE = -100
"""The label that Hugging Face's causal-LM loss skips."""

_SUFFIXES = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet",
             ".csv": "csv"}


class DataError(ValueError):
    """The data file cannot be used: the message names the file, the row or the column, and the fix."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Windows:
    """A tokenized corpus cut into training windows (an Arrow-backed `datasets.Dataset`)."""

    dataset: object
    """Rows of `input_ids`, `labels` and, when padded, `attention_mask`, each `seq` long."""
    source: str
    """Where it came from, for the run's header line."""
    shape: str
    """"text", "prompt/completion" or "chat"."""
    tokens: int
    """Tokens in all windows (padding excluded)."""
    seq: int
    packed: bool

    def __len__(self) -> int:
        return len(self.dataset)


def load_rows(path: str, *, cache_dir: str | None = None):
    """The raw rows of `path` as a `datasets.Dataset` (memory-mapped; see [Note: fine-tuning data])."""
    import datasets

    if not os.path.exists(path):
        raise DataError(f"--data {path}: no such file or directory")
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "dataset_info.json")) and \
                not os.path.exists(os.path.join(path, "dataset_dict.json")):
            raise DataError(f"--data {path}: a directory must be one written by datasets' save_to_disk (it has no "
                            "dataset_info.json); for a folder of files, pass one file")
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"--data {path}: a DatasetDict without a 'train' split ({list(ds)}); save the split "
                                "to train on")
            ds = ds["train"]
        return ds
    suffix = os.path.splitext(path)[1].lower()
    kind = _SUFFIXES.get(suffix)
    if kind is None:
        raise DataError(f"--data {path}: cannot tell the format from {suffix or 'no suffix'!r}; use .txt, .jsonl, "
                        ".json, .parquet, .csv or a datasets directory")
    if os.path.getsize(path) == 0:
        raise DataError(f"--data {path}: the file is empty")
    try:
        return datasets.load_dataset(kind, data_files=path, split="train", cache_dir=cache_dir)
    except Exception as exc:  # datasets wraps parse errors in several types: say which file, keep the cause
        raise DataError(f"--data {path}: could not be read as {kind}: {exc}") from exc


def row_shape(columns, path: str) -> str:
    cols = set(columns)
    if "messages" in cols:
        return "chat"
    if {"prompt", "completion"} <= cols:
        return "prompt/completion"
    if "text" in cols:
        return "text"
    raise DataError(f"--data {path}: rows have columns {sorted(cols)}; expected a 'text' column, 'prompt' and "
                    "'completion', or chat 'messages' (a list of {'role', 'content'})")


def tokenize(rows, tokenizer, shape: str, *, path: str, plain_lines: bool):
    """Rows of `input_ids` and `labels` (unpadded, any length), through `Dataset.map` (cached)."""
    if shape == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataError(f"--data {path}: chat 'messages' need the tokenizer's chat template, and this tokenizer has "
                        "none; set tokenizer.chat_template (save it with the model) or convert the rows to "
                        "prompt/completion")
    eos = tokenizer.eos_token_id
    if shape == "text":
        def fn(batch):
            if plain_lines:  # a .txt file is one document cut into lines: keep the newlines, no special tokens
                ids = tokenizer([t + "\n" for t in batch["text"]], add_special_tokens=False)["input_ids"]
            else:  # each row is a document: the tokenizer's own framing, and EOS between documents
                ids = [x + ([eos] if eos is not None else [])
                       for x in tokenizer(list(batch["text"]), add_special_tokens=True)["input_ids"]]
            return {"input_ids": ids, "labels": [list(x) for x in ids]}
    elif shape == "prompt/completion":
        def fn(batch):
            p = tokenizer(list(batch["prompt"]), add_special_tokens=True)["input_ids"]
            c = tokenizer(list(batch["completion"]), add_special_tokens=False)["input_ids"]
            tail = [eos] if eos is not None else []
            return {"input_ids": [a + b + tail for a, b in zip(p, c)],
                    "labels": [[IGNORE] * len(a) + b + tail for a, b in zip(p, c)]}
    else:
        def fn(batch, idx):
            out = {"input_ids": [], "labels": []}
            for messages, i in zip(batch["messages"], idx):
                ids, labels = chat_tokens(tokenizer, messages, row=i, path=path)
                out["input_ids"].append(ids)
                out["labels"].append(labels)
            return out
    return rows.map(fn, batched=True, with_indices=shape == "chat", remove_columns=rows.column_names,
                    desc="tokenizing")


def _render(tokenizer, messages, **kw) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
    return list(out["input_ids"] if isinstance(out, dict) else out)


def chat_tokens(tokenizer, messages, *, row: int, path: str) -> tuple[list[int], list[int]]:
    """A conversation's tokens, and labels that keep exactly the assistant turns (see [Note: fine-tuning data])."""
    ids = _render(tokenizer, messages)
    labels = [IGNORE] * len(ids)
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        asked = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else []
        answered = _render(tokenizer, messages[:i + 1])
        if ids[:len(answered)] != answered or answered[:len(asked)] != asked:
            raise DataError(f"--data {path}: row {row}: the chat template does not render turn {i} as a prefix of "
                            "the whole conversation, so its assistant tokens cannot be told apart; convert the rows "
                            "to prompt/completion")
        labels[len(asked):len(answered)] = answered[len(asked):]
    if all(x == IGNORE for x in labels):
        raise DataError(f"--data {path}: row {row} has no assistant turn, so nothing in it would be trained; drop it")
    return ids, labels


def pack(tokens, seq: int):
    """Rows concatenated and cut into windows of `seq` tokens (per map batch; the unfilled tail is dropped)."""
    def fn(batch):
        ids = [t for row in batch["input_ids"] for t in row]
        labels = [t for row in batch["labels"] for t in row]
        n = len(ids) // seq * seq
        return {"input_ids": [ids[i:i + seq] for i in range(0, n, seq)],
                "labels": [labels[i:i + seq] for i in range(0, n, seq)]}
    return tokens.map(fn, batched=True, batch_size=1000, remove_columns=tokens.column_names, desc=f"packing {seq}")


def pad(tokens, seq: int, pad_id: int):
    """One row per window: truncated to `seq`, padded with `pad_id`, labels and attention mask off on padding."""
    def fn(batch):
        out = {"input_ids": [], "labels": [], "attention_mask": []}
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            ids, labels = ids[:seq], labels[:seq]
            n = len(ids)
            out["input_ids"].append(ids + [pad_id] * (seq - n))
            out["labels"].append(labels + [IGNORE] * (seq - n))
            out["attention_mask"].append([1] * n + [0] * (seq - n))
        return out
    return tokens.map(fn, batched=True, remove_columns=tokens.column_names, desc=f"padding to {seq}")


def windows(path: str, tokenizer, seq: int, *, packed: bool | None = None, cache_dir: str | None = None) -> Windows:
    """The file or datasets directory `path` as training windows (see [Note: fine-tuning data])."""
    plain = os.path.isfile(path) and os.path.splitext(path)[1].lower() in (".txt", ".text")
    return windows_of(load_rows(path, cache_dir=cache_dir), tokenizer, seq, source=path, plain_lines=plain,
                      packed=packed)


def windows_of(rows, tokenizer, seq: int, *, source: str, plain_lines: bool = False,
               packed: bool | None = None) -> Windows:
    """Rows (a `datasets.Dataset`) as training windows. packed=None packs plain text and pads the rest (a
    prompt or a conversation cut across two windows would train on half an answer)."""
    if len(rows) == 0:
        raise DataError(f"--data {source}: no rows")
    shape = row_shape(rows.column_names, source)
    if packed is None:
        packed = shape == "text"
    toks = tokenize(rows, tokenizer, shape, path=source, plain_lines=plain_lines)
    if packed:
        out = pack(toks, seq)
    else:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_id is None:
            raise DataError(f"--data {source}: padding needs a pad or EOS token, and the tokenizer has neither; "
                            "use --packing on")
        out = pad(toks, seq, pad_id)
    # A window whose every target is masked (a prompt longer than --seq) has no loss: 0/0 in the model.
    out = out.filter(lambda b: [any(x != IGNORE for x in labels[1:]) for labels in b["labels"]], batched=True,
                     desc="dropping windows with nothing to learn")
    if len(out) == 0:
        raise DataError(f"--data {source}: {len(rows)} rows give not one --seq {seq} window with a token to learn; "
                        "give more text, a smaller --seq, or shorter prompts")
    if packed:
        tokens = len(out) * seq
    else:
        counts = out.map(lambda b: {"n": [sum(m) for m in b["attention_mask"]]}, batched=True,
                         remove_columns=out.column_names, desc="counting tokens")
        tokens = sum(counts["n"])
    return Windows(dataset=out.with_format("torch"), source=source, shape=shape, tokens=tokens, seq=seq,
                   packed=packed)


def split(w: Windows, fraction: float, seed: int) -> tuple[Windows, Windows]:
    """(train, eval): a seeded `fraction` of the windows held out for evaluation."""
    n_eval = int(round(len(w) * fraction))
    if not 0 < n_eval < len(w):
        raise DataError(f"--eval-fraction {fraction}: {len(w)} windows give {n_eval} for evaluation; need at least "
                        "one on each side")
    parts = w.dataset.train_test_split(test_size=n_eval, seed=seed, shuffle=True)
    per = w.tokens / len(w)
    return (Windows(dataset=parts["train"], source=w.source, shape=w.shape, tokens=int(per * len(parts["train"])),
                    seq=w.seq, packed=w.packed),
            Windows(dataset=parts["test"], source=w.source, shape=w.shape, tokens=int(per * n_eval), seq=w.seq,
                    packed=w.packed))


class Schedule:
    """Which windows each rank reads at each optimizer step (see [Note: fine-tuning data])."""

    def __init__(self, *, windows: int, micro: int, world: int, accum: int, seed: int):
        self.windows, self.micro, self.world, self.accum, self.seed = windows, micro, world, accum, seed
        self._perm: tuple[int, list[int]] | None = None  # (epoch, its permutation): one epoch is kept

    @property
    def per_step(self) -> int:
        """Windows per optimizer step, over all ranks and accumulation steps."""
        return self.micro * self.world * self.accum

    @property
    def steps_per_epoch(self) -> int:
        return self.windows // self.per_step

    def indices(self, step: int, rank: int, k: int) -> list[int]:
        """The windows of rank `rank`'s k-th micro-batch of optimizer step `step` (0-based)."""
        epoch, s = divmod(step, self.steps_per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = (epoch, torch.randperm(self.windows, generator=g).tolist())
        base = s * self.per_step + (k * self.world + rank) * self.micro
        return self._perm[1][base:base + self.micro]


def micro_batch(w: Windows, idx: list[int]) -> dict:
    """The rows `idx` as a batch of tensors (input_ids, labels[, attention_mask])."""
    return dict(w.dataset[idx])
