"""Exceptions users are meant to catch."""

from __future__ import annotations


class ConfigError(ValueError):
    """A swap config is invalid. `key` is the dotted path of the offending key ("" for the whole file)."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


class SwapCorruptionError(OSError):
    """A swap file's bytes do not match the checksum recorded when they were written.

    Carries errno EIO, `filename`, `partition`, `expected` and `actual` (CRC-32C values).
    """

    def __init__(self, path: str, partition: str, expected: int, actual: int):
        import errno

        super().__init__(errno.EIO, f"swap file of partition {partition!r} is corrupted: CRC-32C is {actual:#010x}, "
                                    f"{expected:#010x} was written", path)
        self.partition = partition
        self.expected = expected
        self.actual = actual


class PartitionedStateError(RuntimeError):
    """A route that reads every parameter at once (`model.state_dict()`, and through it Hugging Face's and peft's
    `save_pretrained`, `torch.save(model.state_dict())`) met a partitioned parameter whose full value does not
    exist here: it would have returned its placeholder (NaN). The message names `engine.save_pretrained`."""
