"""Train / save / resume runs of the small GPT for the checkpoint tests (one process or gloo ranks).

`python -m infinity.testing.ckpt crash CFG.json DIR STEPS [POINT]` trains
STEPS steps, saving DIR/s<k> after each, with the crash hook at POINT armed
for the last save (without POINT it just runs; the test kills it at a
random moment).
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

from infinity.testing.parity import MODEL, batch, free_port, gloo_rank, train_step


class Tiny(torch.nn.Module):
    """A model whose parameters are smaller than the world: `gain` (one element) leaves rank 1 of 2 nothing
    but padding, and the bias (5) leaves it 2 values and a pad."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(MODEL.vocab, 3)
        self.lin = torch.nn.Linear(3, 5)
        self.gain = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x, y):
        logits = self.lin(self.emb(x)) * self.gain
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 5), y.reshape(-1) % 5)


def train(cfg: dict, steps: int, *, start: int = 0, load: str | None = None, load_tag: str | None = None,
          save: str | None = None, save_tag: str | None = None, save_every: bool = False, crash_at: str | None = None,
          model=MODEL, gas: int = 1, net: str = "gpt") -> dict:
    """Train steps [start, start+steps) (after loading `load`); returns losses and the full fp32 weights."""
    from infinity.engine import gathered_parameters, initialize, zero_init
    from infinity.models import GPT

    cfg = copy.deepcopy(cfg)
    cfg["gradient_accumulation_steps"] = gas
    torch.manual_seed(0)
    with zero_init(cfg):
        m = GPT(model) if net == "gpt" else Tiny()
    engine = initialize(m, cfg)
    out = {"losses": [], "client_state": None}
    try:
        if load is not None:
            _, out["client_state"] = engine.load_checkpoint(load, load_tag)
            assert out["client_state"]["next_step"] == start, out["client_state"]
        for s in range(start, start + steps):
            out["losses"].append(train_step(engine, s, model=model, gas=gas))
            if save_every:
                if crash_at is not None and s == start + steps - 1:
                    os.environ["INFINITY_CHECKPOINT_CRASH_AT"] = crash_at
                engine.save_checkpoint(save, f"s{s + 1}", client_state={"next_step": s + 1})
        if save is not None and not save_every:
            engine.save_checkpoint(save, save_tag, client_state={"next_step": start + steps})
        with gathered_parameters(list(m.parameters())):
            out["weights"] = {n: p.detach().float().clone() for n, p in m.named_parameters()}
        out["reports"] = [(r.grad_norm, r.speculation) for r in engine.reports]
    finally:
        engine.close()
    return out


def _rank_main(rank: int, world: int, port: int, cfg: dict, steps: int, out_path: str, kwargs: dict) -> None:
    with gloo_rank(rank, world, port):
        out = train(cfg, steps, **kwargs)
        if rank == 0:
            torch.save(out, out_path)


def spawn_train(world: int, cfg: dict, steps: int, out_path: str, **kwargs) -> dict:
    """train() on `world` gloo ranks; rank 0's result."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(world, free_port(), cfg, steps, out_path, kwargs), nprocs=world, join=True)
    return torch.load(out_path)


def _dying_save_main(rank: int, world: int, port: int, cfg: dict, ck: str, out_path: str) -> None:
    """Both ranks train a step and save s1; then rank 1 is SIGKILLed in the middle of saving s2.
    Rank 0 records how its save ended and how long that took."""
    from infinity.engine import initialize, zero_init
    from infinity.models import GPT

    with gloo_rank(rank, world, port):  # left by os._exit below, as a dying process would
        with zero_init(cfg):
            m = GPT(MODEL)
        engine = initialize(m, cfg)
        _dying_save(engine, rank, world, ck, out_path)


def _dying_save(engine, rank: int, world: int, ck: str, out_path: str) -> None:
    import time

    x, y = batch(0)
    engine.backward(engine(x[rank::world], y[rank::world]))
    engine.step()
    engine.save_checkpoint(ck, "s1")
    if rank == 1:
        os.environ["INFINITY_CHECKPOINT_CRASH_AT"] = "group"
    t0 = time.monotonic()
    try:
        engine.save_checkpoint(ck, "s2")
        result = {"error": None}
    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
        result = {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    os._exit(0)


def save_with_a_dying_rank(cfg: dict, ck: str, out_path: str, timeout_s: float = 120) -> dict:
    """Run _dying_save_main on 2 processes; rank 0's record (with "hung" if it had to be killed)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_dying_save_main, args=(r, 2, port, cfg, ck, out_path)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = procs[0].is_alive()
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    with open(out_path) as f:
        record = json.load(f)
    record["hung"] = hung
    return record


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["crash"] or len(argv) not in (4, 5):
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        cfg = json.load(f)
    torch.set_num_threads(1)
    train(cfg, int(argv[3]), save=argv[2], save_every=True, crash_at=argv[4] if len(argv) == 5 else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
