"""The offload planner (`infinity plan`, and `infinity train --memory-budget`): what lives where, from the model's
shape (shape.py), speeds measured at plan time (measure.py) and the cost model (cost.py); cli.py is the command."""

from infinity.tools.plan.cli import add_arguments, describe, make_plan, run
from infinity.tools.plan.cost import (Placement, Plan, PoolSizing, activation_bytes, format_size_h, io_bytes,
                                      io_phases, plan, predict, step_phase, step_time)
from infinity.tools.plan.measure import Rates, baseline_rss, measure_disk, measure_layer, measure_rates
from infinity.tools.plan.shape import ModelShape, model_shape

__all__ = ["add_arguments", "describe", "make_plan", "run", "Placement", "Plan", "PoolSizing", "activation_bytes",
           "format_size_h", "io_bytes", "io_phases", "plan", "predict", "step_phase", "step_time", "Rates", "baseline_rss", "measure_disk", "measure_layer",
           "measure_rates", "ModelShape", "model_shape"]
