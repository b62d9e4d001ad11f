"""DeepSpeed's training API over infinity's engine: `import infinity.deepspeed as deepspeed`.

A DeepSpeed training script runs with only its import changed (submodules
included: `infinity.deepspeed.comm`, `.accelerator`, `.ops.adam`, `.utils`,
`.runtime.zero.partition_parameters`, `.moe.utils`, `.pipe`,
`.compression.helper`). This package is a thin layer: `initialize` builds
the DeepSpeed-shaped pieces (the config from args/config/config_params, the
optimizer's groups and hyper-parameters, the data loader DeepSpeed would
make) and hands the model to `infinity.initialize`; the engine it returns is
infinity's, which carries DeepSpeed's methods (`train_batch_size()`,
`get_lr()`, `save_16bit_model()`, ...) and acts as the module. What differs
from DeepSpeed is listed in the README ("Coming from DeepSpeed").
"""

from infinity.deepspeed import accelerator, comm, compression, moe, ops, pipe, runtime, utils, zero
from infinity.deepspeed.accelerator import get_accelerator
from infinity.deepspeed.api import DeepSpeedDataLoader, add_config_arguments, init_distributed, initialize
from infinity.engine.engine import Engine as DeepSpeedEngine

__all__ = ["initialize", "init_distributed", "add_config_arguments", "get_accelerator", "DeepSpeedEngine",
           "DeepSpeedDataLoader", "zero", "comm", "accelerator", "ops", "utils", "pipe", "moe", "compression",
           "runtime"]
