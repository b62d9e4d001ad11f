"""deepspeed.compression: only `helper`'s attribute utilities, which LoRA scripts import."""

from infinity.deepspeed.compression import helper

__all__ = ["helper"]
