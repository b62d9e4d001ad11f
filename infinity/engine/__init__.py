"""The ZeRO engine: zero_init -> initialize -> Engine, on top of the swap service.

config -> initialize (assemble.py: the OffloadPlan of plan.py, then the
store, optimizer and Engine) -> Engine (engine.py) -> parameter store and
scheduler (params.py, scheduler.py) -> swapper (infinity.swap) -> native I/O;
the step -> ShardedAdam (optimizer.py, its GradientBuckets) -> CPU Adam.
"""

from infinity.engine.comm import RankFailure
from infinity.engine.assemble import initialize
from infinity.engine.engine import Engine
from infinity.engine.report import StepReport
from infinity.engine.zero_init import gathered_parameters, zero_init

__all__ = ["Engine", "StepReport", "initialize", "zero_init", "gathered_parameters", "RankFailure"]
