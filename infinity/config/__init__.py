"""Swap configs: DeepSpeed-compatible JSON -> typed, frozen, validated dataclasses."""

from infinity.config.load import check_buffer_size, check_free_space, load_config
from infinity.config.schema import (AioConfig, Bf16Config, Config, Fp16Config, InfinityConfig, OffloadOptimizerConfig,
                                    OffloadParamConfig, OptimizerConfig, OptimizerParams, ZeroConfig)
from infinity.errors import ConfigError

__all__ = ["load_config", "check_buffer_size", "check_free_space", "Config", "ConfigError", "ZeroConfig",
           "OffloadParamConfig", "OffloadOptimizerConfig", "AioConfig", "Fp16Config", "Bf16Config",
           "OptimizerConfig", "OptimizerParams", "InfinityConfig"]
