"""dtype names as files store them ("float32", "bfloat16", ...): swap-file headers and checkpoint manifests."""

from __future__ import annotations

import torch

BY_NAME = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


def name_of(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
