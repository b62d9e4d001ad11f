"""infinity: a memory-offload engine for training PyTorch models larger than memory.

The data path, from the top: config -> engine -> scheduler -> swapper ->
native I/O (`infinity.io`) -> disk; and the optimizer step -> CPU Adam.
"""

from infinity._native_loader import warn_if_missing as _warn_if_missing

__version__ = "0.1.0"

_warn_if_missing()

from infinity import io  # noqa: E402
from infinity.config import load_config  # noqa: E402
from infinity.engine import gathered_parameters, initialize, zero_init  # noqa: E402
from infinity.errors import (  # noqa: E402
    CheckpointCorruptionError, CheckpointError, ConfigError, DataError, DirectoryInUse, InfinityError, NoLatest,
    NoPlacement, PartitionedStateError, PoolExhausted, RankFailure, StaleLend, SwapCorruptionError)

__all__ = ["io", "load_config", "zero_init", "initialize", "gathered_parameters", "InfinityError", "ConfigError",
           "SwapCorruptionError", "PartitionedStateError", "RankFailure", "CheckpointError",
           "CheckpointCorruptionError", "NoLatest", "DataError", "DirectoryInUse", "NoPlacement", "PoolExhausted",
           "StaleLend", "__version__"]
