"""Loads the compiled core `infinity._native`, or explains once why it is missing.

Set INFINITY_DISABLE_NATIVE=1 to run on the pure-Python fallback on purpose
(the tests do this to prove the fallback works).
"""

from __future__ import annotations

import os
import warnings

native = None
reason = ""

if os.environ.get("INFINITY_DISABLE_NATIVE") == "1":
    reason = "disabled by INFINITY_DISABLE_NATIVE=1"
else:
    try:
        from infinity import _native as native  # noqa: F401
    except ImportError as exc:
        reason = str(exc)

_warned = False


def warn_if_missing() -> None:
    """Emit one RuntimeWarning per process when the extension is unavailable."""
    global _warned
    if native is None and not _warned:
        _warned = True
        warnings.warn(
            f"infinity: native extension unavailable ({reason}); using the pure-Python I/O backend "
            "(slower, no O_DIRECT). Build it with `make build` or `pip install -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )
