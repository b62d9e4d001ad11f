"""deepspeed.runtime.zero.partition_parameters: ZeroParamStatus (the values of `param.ds_status`), Init and
GatheredParameters, as scripts import them by this path (see [Note: DeepSpeed's ZeRO-3 attributes])."""

from infinity.deepspeed.zero import GatheredParameters, Init
from infinity.engine.params import ZeroParamStatus

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus"]
