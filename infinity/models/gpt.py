"""A small decoder-only transformer (GPT-2 layout) for the engine's parity tests, benchmarks and `infinity train`.

Pre-norm blocks, learned positions, and the LM head tied to the token
embedding (`lm_head.weight is wte.weight`), so that the tied-weight path of
the engine is always exercised. `checkpoint=True` wraps each block in
torch.utils.checkpoint (non-reentrant).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 64
    layers: int = 2
    dim: int = 64
    heads: int = 4
    checkpoint: bool = False

    @property
    def num_params(self) -> int:
        d = self.dim
        per_block = 4 * d + 3 * d * d + 3 * d + d * d + d + 4 * d * d + 4 * d + 4 * d * d + d
        return self.vocab * d + self.seq * d + self.layers * per_block + 2 * d


PRESETS = {
    "gpt-tiny": GPTConfig(vocab=256, seq=64, layers=2, dim=64, heads=4),
    "gpt-small": GPTConfig(vocab=256, seq=128, layers=4, dim=256, heads=4),
    # Wide and shallow with a byte vocabulary: 25M parameters of state but small activations and no big
    # embedding, for the planner's CI test (state many times a tiny memory budget).
    "gpt-25m": GPTConfig(vocab=256, seq=128, layers=8, dim=512, heads=8),
    # Deep and narrow, checkpointed: 57M parameters (0.9 GB of training state) whose largest parameter and
    # activations are small, so that it trains within a memory budget a tenth of its state (the planner's test).
    "gpt-57m": GPTConfig(vocab=256, seq=128, layers=32, dim=384, heads=6, checkpoint=True),
    "gpt-125m": GPTConfig(vocab=50304, seq=1024, layers=12, dim=768, heads=12, checkpoint=True),
    # The billion-scale presets use an 8192-token vocabulary: a 50k-row embedding would be the largest
    # parameter by far, and every swap buffer must hold the largest parameter's shard.
    "gpt-100m": GPTConfig(vocab=8192, seq=1024, layers=12, dim=832, heads=13, checkpoint=True),
    "gpt-350m": GPTConfig(vocab=8192, seq=1024, layers=24, dim=1088, heads=16, checkpoint=True),
    "gpt-1b": GPTConfig(vocab=8192, seq=1024, layers=24, dim=1856, heads=16, checkpoint=True),
    "gpt-2b": GPTConfig(vocab=8192, seq=1024, layers=32, dim=2304, heads=16, checkpoint=True),
    # 4.0B and 6.0B: the largest that this project's 79 GB test disk holds with fp32 moments (14 B/param of
    # swap files in bf16) and with bf16 moments (10 B/param).
    "gpt-4b": GPTConfig(vocab=8192, seq=1024, layers=40, dim=2880, heads=20, checkpoint=True),
    "gpt-6b": GPTConfig(vocab=8192, seq=1024, layers=48, dim=3200, heads=25, checkpoint=True),
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)
        self.heads = cfg.heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        # GPT-2's scaled init of the residual projections, applied the way Hugging Face does: through apply().
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.cfg.layers) if module in self._residual_projections() else 0.02
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, 0.02)

    def _residual_projections(self):
        return {m for b in self.blocks for m in (b.proj, b.out)}

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = _checkpoint(block, x, use_reentrant=False) if self.cfg.checkpoint and self.training else block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
