"""What `--model` names, built under zero_init: a preset, a Hugging Face directory (its weights streamed into
partitions, its tokenizer beside them), or a config.json (trained from scratch); and `--lora` through peft."""

from __future__ import annotations

import os
from dataclasses import dataclass

from infinity.models.gpt import PRESETS

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSource:
    """What --model named, resolved before anything is built."""

    arg: str
    """As the user wrote it."""
    kind: str
    """"preset", "pretrained" (a directory with weights) or "config" (a config.json: from scratch)."""
    directory: str | None = None
    """The Hugging Face directory (the config's own, for "config")."""
    has_tokenizer: bool = False

    def describe(self) -> str:
        if self.kind == "preset":
            return f"preset {self.arg} (random init)"
        if self.kind == "pretrained":
            return f"pretrained weights from {self.directory}"
        return f"{os.path.join(self.directory, 'config.json')} trained FROM SCRATCH (random init: no weights there)"


def resolve(arg: str) -> ModelSource:
    """--model as a preset, a directory or a config.json; an error that says which of them it is not."""
    if arg in PRESETS:
        return ModelSource(arg=arg, kind="preset")
    path = os.path.abspath(arg)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"--model {arg}: the directory has no config.json, so it is not a Hugging Face model "
                             "directory (save one with model.save_pretrained(DIR))")
        from infinity.engine.pretrained import weight_files

        try:
            weight_files(path)
            kind = "pretrained"
        except OSError:
            kind = "config"
        return ModelSource(arg=arg, kind=kind, directory=path, has_tokenizer=_has_tokenizer(path))
    if os.path.isfile(path) and path.endswith(".json"):
        d = os.path.dirname(path)
        return ModelSource(arg=arg, kind="config", directory=d, has_tokenizer=_has_tokenizer(d))
    raise ValueError(f"--model {arg!r}: not a preset ({', '.join(PRESETS)}), a Hugging Face model directory, nor a "
                     "config.json file")


def _has_tokenizer(d: str) -> bool:
    return any(os.path.isfile(os.path.join(d, f)) for f in _TOKENIZER_FILES)


def load_tokenizer(src: ModelSource, override: str | None = None):
    """The tokenizer of --tokenizer, else of the model's directory; None when there is none."""
    path = override or (src.directory if src.has_tokenizer else None)
    if path is None:
        return None
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise ValueError(f"--tokenizer {path}: not a directory (pass a tokenizer saved with save_pretrained)")
    return AutoTokenizer.from_pretrained(path)


def build(src: ModelSource):
    """The model, under an active zero_init: streamed from_pretrained, or built from the config."""
    import transformers

    if src.kind == "pretrained":
        return transformers.AutoModelForCausalLM.from_pretrained(src.directory)
    cfg = transformers.AutoConfig.from_pretrained(src.directory)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def max_positions(model) -> int | None:
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraSpec:
    """--lora r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj"""

    r: int = 16
    alpha: float | None = None
    """lora_alpha; default 2 x r."""
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None
    """target_modules; default peft's choice for the architecture."""

    @classmethod
    def parse(cls, text: str) -> "LoraSpec":
        fields: dict[str, list[str]] = {}
        last = None
        for token in (t.strip() for t in text.split(",") if t.strip()):
            if "=" in token:
                key, value = (s.strip() for s in token.split("=", 1))
                if key not in ("r", "alpha", "dropout", "targets"):
                    raise ValueError(f"--lora: unknown key {key!r} in {text!r}; the keys are r, alpha, dropout and "
                                     "targets (e.g. r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj)")
                fields[key] = [value]
                last = key
            elif last == "targets":  # targets=q_proj,v_proj: the commas after targets= continue its list
                fields["targets"].append(token)
            else:
                raise ValueError(f"--lora: {token!r} in {text!r} is not key=value (e.g. r=16,alpha=32)")
        try:
            r = int(fields.get("r", ["16"])[0])
            alpha = float(fields["alpha"][0]) if "alpha" in fields else None
            dropout = float(fields.get("dropout", ["0"])[0])
        except ValueError as exc:
            raise ValueError(f"--lora {text!r}: {exc}") from None
        if r < 1:
            raise ValueError(f"--lora: r must be >= 1, got {r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"--lora: dropout must be in [0, 1), got {dropout}")
        targets = tuple(fields["targets"]) if "targets" in fields else None
        return cls(r=r, alpha=alpha, dropout=dropout, targets=targets)

    def apply(self, model):
        """peft's get_peft_model with this spec (after zero_init: the adapters are partitioned by initialize)."""
        import peft

        targets = None if self.targets is None else (
            self.targets[0] if self.targets == ("all-linear",) else list(self.targets))
        cfg = peft.LoraConfig(r=self.r, lora_alpha=self.alpha if self.alpha is not None else 2 * self.r,
                              lora_dropout=self.dropout, target_modules=targets, task_type="CAUSAL_LM")
        try:
            return peft.get_peft_model(model, cfg)
        except ValueError as exc:
            raise ValueError(f"--lora: {exc}") from None
