"""DeepSpeed's training API over infinity's engine: `import infinity.deepspeed as deepspeed`.

A DeepSpeed training script runs with only its import changed. This package
is a thin layer: `initialize` builds the DeepSpeed-shaped pieces (the config
from args/config/config_params, the optimizer's groups and hyper-parameters,
the data loader DeepSpeed would make) and hands the model to
`infinity.initialize`; the engine it returns is infinity's, which carries
DeepSpeed's methods (`train_batch_size()`, `get_lr()`, `save_16bit_model()`,
...). What differs from DeepSpeed is listed in the README ("Coming from
DeepSpeed").
"""

from infinity.deepspeed import zero
from infinity.deepspeed.api import add_config_arguments, init_distributed, initialize

__all__ = ["initialize", "init_distributed", "add_config_arguments", "zero"]
