"""Swap files die with the process that made them.

[Note: swap files die with the process]
An engine's swap files are removed by `engine.close()` (or the end of a
`with` block). A script that raises before that, calls `sys.exit`, or is
stopped with SIGTERM would leave them behind: at 6B parameters that is
about 59 GB that only a later run on the same path would reclaim. So every
live engine and parameter store is tracked here (weakly: a collected one is
forgotten), an atexit handler closes those still open, and SIGTERM, if
nothing else handles it, becomes `SystemExit(143)`, so that the stack
unwinds through `with` blocks and `finally` clauses and atexit runs. A
kill -9 runs nothing; the next run on the same path reclaims its files
(`infinity.leftovers`). `infinity.remove_swap_at_exit: false` keeps them.
"""

from __future__ import annotations

import atexit
import signal
import threading
import weakref

_live: "weakref.WeakSet" = weakref.WeakSet()


def track(obj, *, remove_at_exit: bool = True) -> None:
    """Close `obj` (anything with close()) at exit if it is still open then."""
    if not remove_at_exit:
        return
    _live.add(obj)
    _install_sigterm()


def forget(obj) -> None:
    _live.discard(obj)


def _close_all() -> None:
    for obj in list(_live):
        try:
            obj.close()
        except Exception:  # noqa: BLE001 - exiting; closing the others matters more than this one's error
            pass


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _install_sigterm() -> None:
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


atexit.register(_close_all)
