"""Where a DeepSpeed script's config comes from: args.deepspeed_config, config=, or config_params=."""

from __future__ import annotations

import copy
import json
import os


def config_from(source) -> dict:
    """A DeepSpeed config as a dict (a copy): from a dict, a path to JSON, or a JSON string."""
    if source is None:
        raise ValueError("deepspeed: no config; pass config= (a dict or a JSON file), config_params=, or "
                         "--deepspeed_config on the command line (add_config_arguments)")
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if hasattr(source, "__fspath__") or (isinstance(source, str) and os.path.exists(source)):
        with open(os.fspath(source), encoding="utf-8") as f:
            return json.load(f)
    if isinstance(source, str):
        try:
            return json.loads(source)
        except json.JSONDecodeError:
            raise FileNotFoundError(f"deepspeed: config {source!r} is neither an existing file nor JSON") from None
    raise TypeError(f"deepspeed: a config is a dict or a path, got {type(source).__name__}")


def script_config(args, config, config_params) -> dict:
    """DeepSpeed's rule: the config comes from exactly one of args.deepspeed_config, config, config_params."""
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is None and args is not None:
        from_args = getattr(args, "deepscale_config", None)
    given = [x for x in (from_args, config, config_params) if x is not None]
    if len(given) > 1:
        raise ValueError("deepspeed.initialize: a config came both from args.deepspeed_config and from "
                         "config=/config_params=; keep one of them")
    return config_from(given[0] if given else None)
