"""deepspeed.moe: the helpers scripts call on any model; they answer for a model without experts."""

from infinity.deepspeed.moe import utils

__all__ = ["utils"]
