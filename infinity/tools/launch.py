"""`infinity train --nproc N`: N ranks of the same command on this machine (gloo over 127.0.0.1).

The ranks get torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so `init_distributed` sees a
torchrun launch. They are started here rather than through torchrun so that a
Ctrl-C reaches every rank once, in the terminal's process group, and each
rank stops in order (one line each, swap files removed, exit 130), with no
launcher traceback. When a rank fails, the others are given a grace period
to notice (their collectives fail) and are then terminated.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

GRACE_S = 30.0


def launch(nproc: int, argv: list[str]) -> int:
    from infinity.testing.parity import free_port

    port = free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   INFINITY_LAUNCHER_PID=str(os.getpid()))  # [Note: ranks die with their launcher] in train.py
        procs.append(subprocess.Popen([sys.executable, "-m", "infinity", *argv], env=env))
    interrupted = False
    failed_at = None

    def forward(signum, frame):  # `kill` or a scheduler's SIGTERM/SIGHUP reaches only this process: pass it on
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                failed_at = float("inf")
            time.sleep(0.1)
        except KeyboardInterrupt:  # the ranks got it too: they stop on their own, and say so
            interrupted = True
    codes = [p.returncode for p in procs]
    if interrupted or any(c == 130 for c in codes):
        return 130
    return next((c for c in codes if c != 0), 0)
