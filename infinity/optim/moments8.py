"""8-bit Adam moments (offload_optimizer.moments_dtype "int8"): the block format, in torch ops.

[Note: 8-bit moments]
Each moment of a sub-group is stored as one byte per element plus one fp32 scale per BLOCK elements,
blocks counted from the sub-group's first element. A block's scale is a power of two, 2^e, with e the
exponent of the block's largest magnitude (at least EXP_FLOOR), and each element is an 8-bit float relative
to it:

- exp_avg (signed): a sign bit and a 7-bit magnitude, 4 exponent bits and 3 mantissa bits (E4M3);
- exp_avg_sq is stored as its square root u = sqrt(v) (the update needs sqrt(v) anyway), unsigned, 4
  exponent bits and 4 mantissa bits (E4M4). Then v = u * u, exact in fp32 (EXP_FLOOR keeps it normal).

A magnitude code k > 0 means the fp32 value whose bits are (k + base) << (23 - M), base = (e + 127 - 15) << M
(M mantissa bits): the 16 binades below the block's largest, each in 2^M steps. Code 0 is zero, so the
smallest nonzero magnitude is code 1, (1 + 2^-M) 2^(e - 15); anything below 2^(e - 15) is zero, and within
that lowest binade rounding leans toward zero (it rounds as if code 0 were 2^(e - 15)). Encoding and decoding
are integer operations on the fp32 bits (no tables, no division), so the SIMD kernel and this file produce
the same bytes.

The codes round stochastically: 16 random bits per element (moment_bits(seed, i), low half for exp_avg,
high half for exp_avg_sq, as bf16 moments use them) are added below the kept bits before they are cut.
Rounding to nearest stalls a moment whose change per step is below half a code step (6 % here, 0.1 % per step
for beta2 = 0.999); stochastic rounding keeps each one right in expectation.

Why these choices (bench/moments8_formats.py and bench/moments_rounding.py; figures in bench/RESULTS.md,
"Compressed moments"): a power-of-two scale makes decoding exact and encoding a shift; 16 binades keep a
small v from rounding to zero beside a large one in its block (a zero v under a nonzero m would make the
update m / eps); storing sqrt(v) halves v's relative error for the same bits. Block size (64 to 2048) and
E4M3 against E3M4 for m moved the final loss by less than the runs' noise; nearest rounding did not.
The format's known weakness: an element 2^15 times larger than the rest of its block (an outlier gradient)
flushes its neighbours' m and v to zero until it decays.

The bytes of one moment of n elements: the n codes, zero-padded to a multiple of 4, then ceil(n / BLOCK) fp32
scales (`nbytes`). A decoded value re-encodes to the same code in the same block, so a checkpoint that stores
decoded fp32 moments resumes bit for bit on the same sub-groups; loaded into other sub-groups (another world
size or sub_group_size), values are re-encoded against their new blocks, and the load says how many changed.
"""

from __future__ import annotations

import torch

from infinity.optim.rounding import moment_bits

BLOCK = 256
"""Elements per scale."""
M_BITS = {"exp_avg": 3, "exp_avg_sq": 4}
"""Mantissa bits of each moment's code (4 exponent bits in both)."""
E_BITS = {"exp_avg": 4, "exp_avg_sq": 4}
"""Exponent bits of each moment's code."""
_MAX = {"exp_avg": 127, "exp_avg_sq": 255}
EXP_FLOOR = {"exp_avg": 16, "exp_avg_sq": 79}
"""The least block exponent (biased): 16 keeps every decoded value a normal float; for exp_avg_sq, 79 keeps
u * u of its smallest nonzero code normal too, so v = u * u is exact and a decoded v encodes back to its code.
A block whose largest sqrt(v) is under 2^-48 (v under 4e-29, against eps^2 = 1e-16) flushes it to zero."""
_SHIFT = {"exp_avg": 0, "exp_avg_sq": 16}
"""Which half of moment_bits(seed, i) rounds each moment."""
_CHUNK = 1 << 22


def blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def codes_nbytes(numel: int) -> int:
    """The codes' bytes, padded so that the scales start 4-byte aligned."""
    return -(-numel // 4) * 4


def nbytes(numel: int) -> int:
    """Bytes of one 8-bit moment of `numel` elements: codes, padding, scales."""
    return codes_nbytes(numel) + 4 * blocks(numel)


def split(blob: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8[numel], scales fp32[blocks]) views of one moment's bytes."""
    flat = blob.view(torch.uint8).reshape(-1)
    if flat.numel() != nbytes(numel):
        raise ValueError(f"an 8-bit moment of {numel} elements takes {nbytes(numel)} bytes, got {flat.numel()}")
    c = codes_nbytes(numel)
    return flat[:numel], flat[c:].view(torch.float32)


def _pad_blocks(x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    pad = blocks(n) * BLOCK - n
    return torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK) if pad else x.view(-1, BLOCK)


def decode(blob: torch.Tensor, numel: int, which: str) -> torch.Tensor:
    """fp32 values of one moment (`which` "exp_avg", or "exp_avg_sq", whose stored u is squared back)."""
    codes, scales = split(blob, numel)
    m_bits = M_BITS[which]
    out = torch.empty(numel, dtype=torch.float32, device=blob.device)
    for lo in range(0, numel, _CHUNK):
        hi = min(numel, lo + _CHUNK)
        c = codes[lo:hi].to(torch.int32)
        e = (scales.view(torch.int32)[torch.arange(lo, hi, device=blob.device) // BLOCK] >> 23)
        base = (e - (2 ** E_BITS[which] - 1)) << m_bits
        mag = c & _MAX[which]
        bits = torch.where(mag == 0, torch.zeros_like(c), (mag + base) << (23 - m_bits))
        if which == "exp_avg":
            bits = bits | ((c >> 7) << 31)
        val = bits.view(torch.float32)
        out[lo:hi] = val * val if which == "exp_avg_sq" else val
    return out


def encode_(blob: torch.Tensor, values: torch.Tensor, which: str, *, seed: int | None = None) -> None:
    """Write `values` (fp32; for exp_avg_sq the v itself, >= 0) into one moment's bytes. seed: round
    stochastically with moment_bits(seed, i); None: to nearest (even), which re-encodes decoded values exactly."""
    numel = values.numel()
    codes, scales = split(blob, numel)
    m_bits, top = M_BITS[which], _MAX[which]
    x = values.reshape(-1).float()
    if which == "exp_avg_sq":
        x = x.sqrt()
    mag = x.view(torch.int32) & 0x7FFFFFFF
    peak = _pad_blocks(mag).amax(dim=1) if numel else mag[:0]
    e = torch.clamp(peak >> 23, min=EXP_FLOOR[which])
    scales.view(torch.int32).copy_(e << 23)
    cut = 23 - m_bits
    for lo in range(0, numel, _CHUNK):
        hi = min(numel, lo + _CHUNK)
        a = mag[lo:hi].to(torch.int64)
        if seed is None:
            r = ((1 << (cut - 1)) - 1) + ((a >> cut) & 1)
        else:
            idx = torch.arange(lo, hi, dtype=torch.int64, device=x.device)
            r = ((moment_bits(seed, idx) >> _SHIFT[which]) & 0xFFFF) << (cut - 16)
        base = ((e.to(torch.int64)[torch.arange(lo, hi, device=x.device) // BLOCK]) - (2 ** E_BITS[which] - 1)) << m_bits
        q = torch.clamp(((a + r) >> cut) - base, 0, top)
        if which == "exp_avg":
            q = q | ((x[lo:hi].view(torch.int32) < 0).to(torch.int64) << 7)  # -0.0 keeps its sign bit
        codes[lo:hi] = q.to(torch.uint8)
