"""Exceptions users are meant to catch."""

from __future__ import annotations


class ConfigError(ValueError):
    """A swap config is invalid. `key` is the dotted path of the offending key ("" for the whole file)."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)
