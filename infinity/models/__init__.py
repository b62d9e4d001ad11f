"""Models for the tests, the benchmarks and the tools: the built-in GPT with its presets, and `build_model`
(a preset or a Hugging Face config.json by name)."""

from infinity.models.build import build_model
from infinity.models.gpt import GPT, PRESETS, GPTConfig

__all__ = ["GPT", "GPTConfig", "PRESETS", "build_model"]
