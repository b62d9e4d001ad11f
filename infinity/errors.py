"""Every exception infinity raises for a user to catch, under one base: `except infinity.InfinityError`.

Each also derives from the built-in exception a caller would have caught before (ValueError for bad input,
OSError for bad bytes on disk, RuntimeError for a state the call cannot proceed from, TimeoutError for a wait
that gave up), so code written against those keeps working. The modules that raise them import them from here.
"""

from __future__ import annotations

import errno


class InfinityError(Exception):
    """The base of every exception below."""


class ConfigError(InfinityError, ValueError):
    """A swap config is invalid. `key` is the dotted path of the offending key ("" for the whole file)."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


class SwapCorruptionError(InfinityError, OSError):
    """A swap file's bytes do not match the checksum recorded when they were written.

    Carries errno EIO, `filename`, `partition`, `expected` and `actual` (CRC-32C values).
    """

    def __init__(self, path: str, partition: str, expected: int, actual: int):
        super().__init__(errno.EIO, f"swap file of partition {partition!r} is corrupted: CRC-32C is {actual:#010x}, "
                                    f"{expected:#010x} was written", path)
        self.partition = partition
        self.expected = expected
        self.actual = actual


class PartitionedStateError(InfinityError, RuntimeError):
    """A route that reads every parameter at once (`model.state_dict()`, and through it Hugging Face's and peft's
    `save_pretrained`, `torch.save(model.state_dict())`) met a partitioned parameter whose full value does not
    exist here: it would have returned its placeholder (NaN). The message names `engine.save_pretrained`."""


class DataError(InfinityError, ValueError):
    """The data file cannot be used: the message names the file, the row or the column, and the fix."""


class RankFailure(InfinityError, RuntimeError):
    """A collective failed: another rank died, hung past the timeout, or the group broke."""


class DirectoryInUse(InfinityError, RuntimeError):
    """Another live process owns the directory; the message names the directory, the process and the fix."""


class NoPlacement(InfinityError, ValueError):
    """No placement fits the budget; the message says what each would need."""


class CheckpointError(InfinityError, RuntimeError):
    """A checkpoint is missing, partial, corrupted, or does not fit the model it is loaded into."""


class CheckpointCorruptionError(CheckpointError, OSError):
    """A chunk's bytes do not match the CRC-32C stored with them (errno EIO, `filename`)."""

    def __init__(self, path: str, what: str, expected: int, actual: int):
        OSError.__init__(self, errno.EIO, f"checkpoint chunk of {what} is corrupted: CRC-32C is {actual:#010x}, "
                                          f"{expected:#010x} was stored", path)
        self.expected, self.actual = expected, actual


class NoLatest(CheckpointError):
    """The directory has no `latest` file and no tag was given (DeepSpeed's load_checkpoint returns (None, None))."""


class PoolExhausted(InfinityError, TimeoutError):
    """acquire() waited longer than its timeout; the message says who holds the buffers."""


class StaleLend(InfinityError, RuntimeError):
    """Internal: a master weight lent from an optimizer state that a speculative step has since stepped in place;
    the scheduler reads the shard from the live file instead ([Note: the speculative step] in
    engine/optimizer.py). A user never sees it."""
