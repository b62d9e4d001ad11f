"""deepspeed.runtime.zero: Init, GatheredParameters and the ZeRO-3 parameter status."""

from infinity.deepspeed.runtime.zero.partition_parameters import GatheredParameters, Init, ZeroParamStatus

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus"]
