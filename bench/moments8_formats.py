"""Choosing the 8-bit moments' format: train one model with AdamW whose moments go through candidate codes.

    python bench/moments8_formats.py --steps 300

[Note: 8-bit moments] (infinity/optim/moments8.py) fixes a block size, each moment's exponent/mantissa split and
the rounding. This trains the gpt-small preset on the built-in text, in plain torch (one process, no engine),
once with fp32 moments and once per candidate, where after every step each moment is encoded with moments8's
codec under that candidate's settings and decoded for the next one: the same arithmetic as the kernel, with
the candidate's constants. AdamW's update is torch's formula in fp32, clipping at 1.0, the same data and seed
for every run. Prints each candidate's final loss (mean of the last 20 steps) against fp32's and the largest
per-step difference. Slow (the codec runs in torch ops on every parameter every step): about 2 minutes per
candidate for 300 steps on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from infinity.data import batch
from infinity.models.gpt import GPT, PRESETS
from infinity.optim import moments8

CANDIDATES = {
    "fp32": None,
    "e4m3-sr": dict(m=(4, 3), block=256, stochastic=True),  # the shipped format
    "e3m4-sr": dict(m=(3, 4), block=256, stochastic=True),
    "e4m3-nearest": dict(m=(4, 3), block=256, stochastic=False),
    "e4m3-sr-b64": dict(m=(4, 3), block=64, stochastic=True),
    "e4m3-sr-b2048": dict(m=(4, 3), block=2048, stochastic=True),
}


def train(name: str, steps: int, model_name: str, lr: float) -> list[float]:
    cand = CANDIDATES[name]
    saved = (dict(moments8.E_BITS), dict(moments8.M_BITS), moments8.BLOCK)
    if cand is not None:
        moments8.E_BITS["exp_avg"], moments8.M_BITS["exp_avg"] = cand["m"]
        moments8.BLOCK = cand["block"]
    try:
        torch.manual_seed(0)
        cfg = PRESETS[model_name]
        model = GPT(cfg)
        params = list(model.parameters())
        b1, b2, eps, wd = 0.9, 0.95, 1e-8, 0.1
        if cand is None:
            state = [[torch.zeros(p.numel()), torch.zeros(p.numel())] for p in params]
        else:
            state = [[torch.zeros(moments8.nbytes(p.numel()), dtype=torch.uint8) for _ in range(2)] for p in params]
        losses = []
        for step in range(1, steps + 1):
            x, y = batch(step, 8, cfg.seq, cfg.vocab)
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            losses.append(loss.item())
            with torch.no_grad():
                for k, p in enumerate(params):
                    g, w, n = p.grad.reshape(-1), p.data.view(-1), p.numel()
                    if cand is None:
                        m, v = state[k]
                    else:
                        m = moments8.decode(state[k][0], n, "exp_avg")
                        v = moments8.decode(state[k][1], n, "exp_avg_sq")
                    w.mul_(1 - lr * wd)
                    m.lerp_(g, 1 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
                    w.addcdiv_(m, v.sqrt() / math.sqrt(bc2) + eps, value=-lr / bc1)
                    if cand is not None:
                        seed = (step * 7919 + k * 104729) & 0xFFFFFFFF if cand["stochastic"] else None
                        moments8.encode_(state[k][0], m, "exp_avg", seed=seed)
                        moments8.encode_(state[k][1], v, "exp_avg_sq", seed=seed)
                    p.grad = None
        return losses
    finally:
        moments8.E_BITS.update(saved[0])
        moments8.M_BITS.update(saved[1])
        moments8.BLOCK = saved[2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--candidates", default=",".join(k for k in CANDIDATES if k != "fp32"))
    p.add_argument("--json", default=None, help="also write every loss curve here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    names = ["fp32", *[c.strip() for c in args.candidates.split(",") if c.strip()]]
    curves = {name: train(name, args.steps, args.model, args.lr) for name in names}
    ref = curves["fp32"]

    def final(c):
        return sum(c[-20:]) / len(c[-20:])

    print(f"{args.model}, {args.steps} steps; fp32 moments: final loss {final(ref):.4f}")
    for name in names[1:]:
        c = curves[name]
        diff = max(abs(a - b) for a, b in zip(c, ref))
        print(f"{name:16} final {final(c):.4f} ({100 * (final(c) - final(ref)) / final(ref):+.2f} %)  "
              f"max |loss diff| {diff:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(curves, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
