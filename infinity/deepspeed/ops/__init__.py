"""deepspeed.ops: the optimizers scripts construct (`ops.adam`)."""

from infinity.deepspeed.ops import adam

__all__ = ["adam"]
