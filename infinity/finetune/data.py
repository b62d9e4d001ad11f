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
- **Tokenize once, in another process.** The rows are tokenized with
  `Dataset.map` and cut into windows in a child process, which writes one
  Arrow file (`windows.arrow`) and `meta.json` into a cache entry named by
  a hash of the data file (path, size, mtime), the tokenizer (its
  serialized form, chat template and special tokens), `seq`, the packing
  and this format's version. The trainer then memory-maps that file.
  Parsing JSON and tokenizing leave tens of MiB in allocator arenas
  (pyarrow's mimalloc, the tokenizer's) that are never given back; in the
  child they go when it exits, so the training process grows by the
  mapping's bookkeeping only, whatever the corpus size. A second run with
  the same inputs finds the entry and starts no child.
- **Chat masks.** A conversation is rendered by the tokenizer's own chat
  template. The assistant's tokens are found by rendering it turn by turn:
  the tokens turn i adds after the prompt that asks for it
  (`add_generation_prompt=True`) are that turn's answer. This works with
  every template, also those without `{% generation %}` markers, and is
  checked: if a prefix does not render to a prefix of the whole, the row
  is refused with its index.
- **Windows.** Packing concatenates rows and cuts `seq`-token windows
  (the tail of each map batch that does not fill a window is dropped);
  padding keeps one row per window, truncated, with an attention mask. A
  window with no token to learn (every label after the first masked: a
  prompt longer than `seq`) is dropped in the same pass.
- **Order.** Each epoch is a permutation of the windows drawn from
  `seed + epoch`; optimizer step s takes the next `micro x world x accum`
  windows, and rank r's micro-batch k is the (k x world + r)-th slice of
  them. Every rank computes the same permutation, so they agree without
  talking, and step s's windows depend on s alone: a resumed run reads
  what the uninterrupted one would have.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch

from infinity.errors import DataError  # noqa: F401 - raised here, defined there

IGNORE = -100
"""The label that Hugging Face's causal-LM loss skips."""

_SUFFIXES = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet",
             ".csv": "csv"}


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


def tokenize(rows, tokenizer, shape: str, *, path: str, plain_lines: bool, cache_file_name: str | None = None):
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
                    desc="tokenizing", cache_file_name=cache_file_name)


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


def _learnable(labels) -> bool:
    """A window trains something: a label after the first one (which nothing predicts) is not masked."""
    return any(x != IGNORE for x in labels[1:])


def pack(tokens, seq: int, *, cache_file_name: str | None = None):
    """Rows concatenated and cut into windows of `seq` tokens (per map batch; the unfilled tail is dropped);
    windows with nothing to learn are dropped."""
    def fn(batch):
        ids = [t for row in batch["input_ids"] for t in row]
        labels = [t for row in batch["labels"] for t in row]
        out = {"input_ids": [], "labels": []}
        for i in range(0, len(ids) // seq * seq, seq):
            if _learnable(labels[i:i + seq]):
                out["input_ids"].append(ids[i:i + seq])
                out["labels"].append(labels[i:i + seq])
        return out
    return tokens.map(fn, batched=True, batch_size=1000, remove_columns=tokens.column_names, desc=f"packing {seq}",
                      cache_file_name=cache_file_name)


def pad(tokens, seq: int, pad_id: int, *, cache_file_name: str | None = None):
    """One row per window: truncated to `seq`, padded with `pad_id`, labels and attention mask off on padding;
    windows with nothing to learn are dropped."""
    def fn(batch):
        out = {"input_ids": [], "labels": [], "attention_mask": []}
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            ids, labels = ids[:seq], labels[:seq]
            if not _learnable(labels):
                continue
            n = len(ids)
            out["input_ids"].append(ids + [pad_id] * (seq - n))
            out["labels"].append(labels + [IGNORE] * (seq - n))
            out["attention_mask"].append([1] * n + [0] * (seq - n))
        return out
    return tokens.map(fn, batched=True, remove_columns=tokens.column_names, desc=f"padding to {seq}",
                      cache_file_name=cache_file_name)


FORMAT = 1
"""The version of what a prepared entry holds; part of its key, so a change here never reads an old entry."""


def windows(path: str, tokenizer, seq: int, *, packed: bool | None = None, cache_dir: str | None = None,
            isolate: bool = True) -> Windows:
    """The file or datasets directory `path` as training windows, prepared once into a cache entry under
    `cache_dir` (default: `datasets`' cache) and memory-mapped from there. isolate=True prepares it in a child
    process (see [Note: fine-tuning data]); False does it here (tests, notebooks)."""
    import datasets

    if not os.path.exists(path):
        raise DataError(f"--data {path}: no such file or directory")
    plain = os.path.isfile(path) and os.path.splitext(path)[1].lower() in (".txt", ".text")
    root = os.path.join(cache_dir or str(datasets.config.HF_DATASETS_CACHE), "infinity-windows")
    entry = os.path.join(root, _entry_key(path, tokenizer, seq, packed, plain))
    if not os.path.exists(os.path.join(entry, "meta.json")):
        _prepare(entry, path, tokenizer, seq, packed=packed, plain=plain, cache_dir=cache_dir, isolate=isolate)
    return open_entry(entry)


def open_entry(entry: str) -> Windows:
    """A prepared entry, memory-mapped."""
    import datasets

    with open(os.path.join(entry, "meta.json")) as f:
        meta = json.load(f)
    ds = datasets.Dataset.from_file(os.path.join(entry, "windows.arrow"))
    return Windows(dataset=ds.with_format("torch"), source=meta["source"], shape=meta["shape"],
                   tokens=meta["tokens"], seq=meta["seq"], packed=meta["packed"])


def _entry_key(path: str, tokenizer, seq: int, packed: bool | None, plain: bool) -> str:
    h = hashlib.sha256(repr((FORMAT, seq, packed, plain)).encode())
    path = os.path.abspath(path)
    # A datasets directory: its files, not the cache files a map over it may have written beside them.
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(d, f) for d, _, names in os.walk(path) for f in names if not f.startswith(("cache-", "tmp")))
    for f in files:
        st = os.stat(f)
        h.update(repr((f, st.st_size, st.st_mtime_ns)).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(type(tokenizer).__name__.encode())
    h.update(backend.to_str().encode() if backend is not None else
             repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(repr((getattr(tokenizer, "chat_template", None), tokenizer.all_special_tokens, tokenizer.bos_token_id,
                   tokenizer.eos_token_id, tokenizer.pad_token_id, getattr(tokenizer, "add_bos_token", None),
                   getattr(tokenizer, "add_eos_token", None))).encode())
    return h.hexdigest()[:24]


def _prepare(entry: str, path: str, tokenizer, seq: int, *, packed, plain: bool, cache_dir, isolate: bool) -> None:
    """Build the entry in a temp dir beside it, then rename it into place (a concurrent run that got there first
    wins; its entry is the same)."""
    import shutil
    import subprocess
    import sys
    import tempfile

    root = os.path.dirname(entry)
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(entry) + ".", dir=root)
    try:
        job = {"path": path, "seq": seq, "packed": packed, "plain": plain, "cache_dir": cache_dir, "out": tmp}
        if isolate:
            tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
            import infinity

            env = dict(os.environ)
            home = os.path.dirname(os.path.dirname(os.path.abspath(infinity.__file__)))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (home, env.get("PYTHONPATH")) if p)
            job["fast"] = bool(getattr(tokenizer, "is_fast", False))  # the child loads the same kind
            done = subprocess.run([sys.executable, "-c", "import sys; from infinity.finetune.data import _child; "
                                   "_child(sys.argv[1])", json.dumps(job)], env=env, stdin=subprocess.DEVNULL)
            failed = os.path.join(tmp, "error.json")
            if os.path.exists(failed):
                with open(failed) as f:
                    raise DataError(json.load(f)["message"])
            if done.returncode != 0:
                raise RuntimeError(f"--data {path}: preparing the windows failed in the child process (exit "
                                   f"{done.returncode}); its output, if any, is above")
            shutil.rmtree(os.path.join(tmp, "tokenizer"))
        else:
            _build_entry(job, tokenizer)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not os.path.exists(os.path.join(entry, "meta.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build_entry(job: dict, tokenizer) -> None:
    import time

    from infinity.memory_stats import peak_rss_bytes

    t0 = time.perf_counter()
    rows = load_rows(job["path"], cache_dir=job["cache_dir"])
    w = windows_of(rows, tokenizer, job["seq"], source=job["path"], plain_lines=job["plain"], packed=job["packed"],
                   into=os.path.join(job["out"], "windows.arrow"))
    meta = {"source": w.source, "shape": w.shape, "tokens": w.tokens, "seq": w.seq, "packed": w.packed,
            "windows": len(w), "format": FORMAT,
            "prepared": {"seconds": time.perf_counter() - t0, "peak_rss_bytes": peak_rss_bytes()}}
    del w
    tokens = os.path.join(job["out"], "tokens.arrow")
    if os.path.exists(tokens):
        os.unlink(tokens)
    with open(os.path.join(job["out"], "meta.json"), "w") as f:
        json.dump(meta, f)


def _child(job_json: str) -> None:
    """The child process of `_prepare`: build the entry; a DataError goes back as error.json (its message is the
    user's fix), anything else as a traceback and a non-zero exit."""
    import sys

    import transformers

    job = json.loads(job_json)
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.join(job["out"], "tokenizer"),
                                                           use_fast=job.get("fast", True))
    try:
        _build_entry(job, tokenizer)
    except DataError as exc:
        with open(os.path.join(job["out"], "error.json"), "w") as f:
            json.dump({"message": str(exc)}, f)
        sys.exit(1)


def windows_of(rows, tokenizer, seq: int, *, source: str, plain_lines: bool = False,
               packed: bool | None = None, into: str | None = None) -> Windows:
    """Rows (a `datasets.Dataset`) as training windows, written to the Arrow file `into` when given.
    packed=None packs plain text and pads the rest (a prompt or a conversation cut across two windows would
    train on half an answer)."""
    if len(rows) == 0:
        raise DataError(f"--data {source}: no rows")
    shape = row_shape(rows.column_names, source)
    if packed is None:
        packed = shape == "text"
    # With `into`, the tokenized rows go beside it (removed by the caller), never into the data's own directory
    # (a save_to_disk dataset's cache files would land there) or datasets' cache.
    toks = tokenize(rows, tokenizer, shape, path=source, plain_lines=plain_lines,
                    cache_file_name=None if into is None else os.path.join(os.path.dirname(into), "tokens.arrow"))
    if packed:
        out = pack(toks, seq, cache_file_name=into)
    else:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_id is None:
            raise DataError(f"--data {source}: padding needs a pad or EOS token, and the tokenizer has neither; "
                            "use --packing on")
        out = pad(toks, seq, pad_id, cache_file_name=into)
    if len(out) == 0:
        raise DataError(f"--data {source}: {len(rows)} rows give not one --seq {seq} window with a token to learn; "
                        "give more text, a smaller --seq, or shorter prompts")
    if packed:
        tokens = len(out) * seq
    else:
        import pyarrow.compute as pc

        tokens = int(pc.sum(pc.list_flatten(out.data.column("attention_mask"))).as_py())
    return Windows(dataset=out.with_format("torch"), source=source, shape=shape, tokens=tokens, seq=seq,
                   packed=packed)


def split(w: Windows, fraction: float, seed: int) -> tuple[Windows, Windows]:
    """(train, eval): a seeded `fraction` of the windows held out for evaluation (index maps kept in memory:
    the prepared entry is never written to)."""
    n_eval = int(round(len(w) * fraction))
    if not 0 < n_eval < len(w):
        raise DataError(f"--eval-fraction {fraction}: {len(w)} windows give {n_eval} for evaluation; need at least "
                        "one on each side")
    order = torch.randperm(len(w), generator=torch.Generator().manual_seed(seed)).tolist()
    per = w.tokens / len(w)

    def part(idx):
        return Windows(dataset=w.dataset.select(sorted(idx), keep_in_memory=True), source=w.source, shape=w.shape,
                       tokens=int(per * len(idx)), seq=w.seq, packed=w.packed)
    return part(order[n_eval:]), part(order[:n_eval])


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
