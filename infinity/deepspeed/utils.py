"""deepspeed.utils: the helpers training scripts import (RepeatingLoader, logger, log_dist, ...)."""

from __future__ import annotations

import logging
import warnings

logger = logging.getLogger("DeepSpeed")
if not logger.handlers:
    _h = logging.StreamHandler()
    _h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s deepspeed (infinity): %(message)s"))
    logger.addHandler(_h)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log on the ranks listed (all with -1; rank 0 when None), prefixed with the rank, as DeepSpeed does."""
    from infinity.deepspeed.comm import get_rank

    rank = get_rank()
    ranks = ranks if ranks is not None else [0]
    if -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


class RepeatingLoader:
    """An iterator over `loader` that starts it again when it runs out (DeepSpeed's, for pipeline scripts)."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


_leaf_said = False


def set_z3_leaf_modules(model, leaf_module_classes):
    """DeepSpeed marks these modules' parameters to be gathered as one (for MoE layers whose experts run in a
    data-dependent order). Accepted and said once to have no effect: here every module's own parameters are
    gathered at its forward, whatever order the modules run in, so a leaf needs nothing special. Returns the
    modules it matched, as DeepSpeed does."""
    global _leaf_said
    classes = tuple(c for c in leaf_module_classes if isinstance(c, type))
    names = {c for c in leaf_module_classes if isinstance(c, str)}
    matched = [m for m in model.modules() if isinstance(m, classes) or type(m).__name__ in names]
    for m in matched:
        m._z3_leaf = True
    if not _leaf_said:
        _leaf_said = True
        warnings.warn("infinity.deepspeed.utils.set_z3_leaf_modules has no effect here: each module's parameters "
                      "are gathered at its own forward, in whatever order the modules run", stacklevel=2)
    return matched


def unset_z3_leaf_modules(model, leaf_module_classes):
    out = [m for m in model.modules() if getattr(m, "_z3_leaf", False)]
    for m in out:
        m._z3_leaf = False
    return out


def z3_leaf_module(module) -> bool:
    return getattr(module, "_z3_leaf", False)


def get_z3_leaf_modules(model):
    return [m for m in model.modules() if z3_leaf_module(m)]


def safe_get_full_fp32_param(param):
    """The full value of a (possibly partitioned) parameter, as fp32 (a collective: call it on every rank)."""
    from infinity.engine.zero_init import gathered_parameters

    with gathered_parameters([param]):
        return param.detach().float().clone()


def see_memory_usage(message: str, force: bool = False) -> None:
    if not force:
        return
    from infinity.memory_stats import peak_rss_bytes, rss_bytes

    logger.info(f"{message}: RSS {rss_bytes() / 2**30:.2f} GiB, peak {peak_rss_bytes() / 2**30:.2f} GiB")
