"""The batches `infinity train` feeds the engine, and how it runs a forward on them.

Two sources behind one face (`batch`, `forward`, `tokens_in`, `evaluate`):
- `ByteBatches`: the built-in generated text, one token per byte, in windows
  drawn from the step number (`infinity.data.batch`): the presets, and a
  Hugging Face config without a tokenizer.
- `TextBatches`: windows of tokenized text (`data.py`), from --data or, when
  the model has a tokenizer but no --data is given, the built-in text.
"""

from __future__ import annotations

import math

import torch

from infinity.finetune import data as fdata


class ByteBatches:
    finite = False
    eval = None

    def __init__(self, *, vocab: int, seq: int, micro: int, world: int, accum: int, hf: bool):
        self.vocab, self.seq, self.micro, self.world, self.accum, self.hf = vocab, seq, micro, world, accum, hf

    def describe(self) -> str:
        return ("built-in generated text (256 KiB), one token per byte" +
                (" (no tokenizer beside the config: bytes as token ids)" if self.hf else ""))

    def batch(self, step: int, rank: int, k: int):
        from infinity.data import batch

        size = self.micro * self.world
        x, y = batch(step * self.accum + k, size, self.seq, self.vocab)
        return x[rank * self.micro:(rank + 1) * self.micro], y[rank * self.micro:(rank + 1) * self.micro]

    def forward(self, engine, b):
        x, y = b
        return engine(input_ids=x, labels=x).loss if self.hf else engine(x, y)

    def tokens_in(self, b) -> int:
        return b[0].numel()


class TextBatches:
    finite = True

    def __init__(self, train: fdata.Windows, eval_: fdata.Windows | None, schedule: fdata.Schedule):
        self.train, self.eval, self.schedule = train, eval_, schedule

    @classmethod
    def build(cls, args, tokenizer, *, seq: int, micro: int, accum: int, comm) -> "TextBatches":
        """Tokenized on rank 0 first; the other ranks then read `datasets`' cache instead of tokenizing again."""
        packed = {"auto": None, "on": True, "off": False}[args.packing]

        def make():
            train = (fdata.windows(args.data, tokenizer, seq, packed=packed) if args.data else
                     fdata.windows_of(_builtin_rows(), tokenizer, seq, source="built-in generated text",
                                      plain_lines=True, packed=packed))
            ev = fdata.windows(args.eval_data, tokenizer, seq, packed=packed) if args.eval_data else None
            if args.eval_fraction is not None:
                train, ev = fdata.split(train, args.eval_fraction, args.seed)
            return train, ev

        result, err = None, None
        all_ok = comm.untimed_all_ok()  # tokenizing takes as long as it takes
        for turn in (0, 1):
            if (comm.rank == 0) == (turn == 0):
                try:
                    result = make()
                except Exception as exc:  # noqa: BLE001 - raised below, after the other ranks hear of it
                    err = exc
            if not all_ok(err is None):
                if err is not None:
                    raise err
                raise RuntimeError("reading --data failed on another rank (its error says why)")
        train, ev = result
        schedule = fdata.Schedule(windows=len(train), micro=micro, world=comm.world, accum=accum, seed=args.seed)
        return cls(train, ev, schedule)

    # What _steps() reads.
    @property
    def windows(self) -> int:
        return len(self.train)

    @property
    def seq(self) -> int:
        return self.train.seq

    @property
    def per_step(self) -> int:
        return self.schedule.per_step

    @property
    def steps_per_epoch(self) -> int:
        return self.schedule.steps_per_epoch

    def describe(self) -> str:
        text = (f"{self.train.source} ({self.train.shape}, {len(self.train):,} windows, {self.train.tokens:,} "
                f"tokens, {'packed' if self.train.packed else 'padded'})")
        if self.eval is not None:
            text += f", eval {len(self.eval):,} windows"
        return text

    def batch(self, step: int, rank: int, k: int) -> dict:
        return fdata.micro_batch(self.train, self.schedule.indices(step, rank, k))

    def forward(self, engine, b: dict):
        return engine(**b).loss

    def tokens_in(self, b: dict) -> int:
        mask = b.get("attention_mask")
        return int(mask.sum()) if mask is not None else b["input_ids"].numel()

    def evaluate(self, engine) -> float:
        """The mean loss over the eval windows, weighted by the tokens each batch predicts. Every rank runs the
        same number of forwards (each one gathers parameters collectively); a rank whose share has run out
        repeats window 0 with weight 0."""
        micro, world, rank = self.schedule.micro, engine.world_size, engine.rank
        n = len(self.eval)
        rounds = math.ceil(n / (micro * world))
        total = torch.zeros(2, dtype=torch.float64)
        engine.eval()
        try:
            with torch.no_grad():
                for j in range(rounds):
                    lo = (j * world + rank) * micro
                    idx = list(range(lo, min(lo + micro, n)))
                    b = fdata.micro_batch(self.eval, idx or [0])
                    loss = engine(**b).loss
                    if idx:
                        targets = float((b["labels"][:, 1:] != fdata.IGNORE).sum())
                        total += torch.tensor([loss.item() * targets, targets], dtype=torch.float64)
        finally:
            engine.train()
        engine.comm.all_reduce_(total)
        return (total[0] / total[1]).item()


def _builtin_rows():
    import datasets

    from infinity.data import text

    return datasets.Dataset.from_dict({"text": text().decode().splitlines()})
