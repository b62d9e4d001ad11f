"""The CPU kernel's random rounding bits in torch ops, for any device: what the accelerator path, the 8-bit
format's reference encoder (moments8.py) and the tests compute to match native/cpu/adam.hpp bit for bit."""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF


def moment_bits(seed: int, index: torch.Tensor) -> torch.Tensor:
    """native/cpu/adam.hpp's moment_bits in torch ops (int64 holding uint32 values), for any device."""
    x = ((index * 0x9E3779B1) & MASK32) ^ seed
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def bf16_stochastic(x: torch.Tensor, seed: int, shift: int, *, chunk: int = 1 << 24) -> torch.Tensor:
    """fp32 -> bf16 as the CPU kernel rounds a moment: bits (moment_bits(seed, i) >> shift) & 0xffff added below
    the kept 16 (shift 0 for exp_avg, 16 for exp_avg_sq); NaN becomes 0xffff. Works in chunks to bound the
    int64 temporaries."""
    flat = x.reshape(-1)
    out = torch.empty(flat.numel(), dtype=torch.int16, device=x.device)
    for lo in range(0, flat.numel(), chunk):
        part = flat[lo:lo + chunk]
        idx = torch.arange(lo, lo + part.numel(), dtype=torch.int64, device=x.device) & MASK32
        r = (moment_bits(seed, idx) >> shift) & 0xFFFF
        u = part.view(torch.int32).to(torch.int64) & MASK32
        bits = ((u + r) >> 16).masked_fill_(torch.isnan(part), 0xFFFF)
        out[lo:lo + part.numel()] = (bits - ((bits >> 15) << 16)).to(torch.int16)  # uint16 -> int16, same bits
    return out.view(torch.bfloat16).view(x.shape)
