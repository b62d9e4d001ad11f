"""infinity.mmap_threshold: setup keeps glibc's mmap threshold at 64 KiB, the steps get the configured one, and
the configured one has its effect (see [Note: glibc's mmap threshold] in infinity/engine/memory.py)."""

import importlib
import json
import platform
import subprocess
import sys

import pytest

from infinity.config import ConfigError, load_config
from infinity.engine import initialize, zero_init
from infinity.engine.memory import CONSTRUCTION
from infinity.models import GPT
from infinity.testing.parity import MODEL, engine_config

engine_module = importlib.import_module("infinity.engine.assemble")
zero_init_module = importlib.import_module("infinity.engine.zero_init")  # the package exports the function

# In a child: the threshold is process-wide, and the tests after this one must keep the default.
_FAULTS = """
import json, resource, sys, torch
from infinity.engine import initialize, zero_init
from infinity.models import GPT
from infinity.testing.parity import MODEL, engine_config, train_step
cfg = engine_config("cpu", **{"infinity.mmap_threshold": sys.argv[1]})
with zero_init(cfg):
    m = GPT(MODEL)
e = initialize(m, cfg)
train_step(e, 0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(16):
    torch.ones(1 << 20)  # 4 MiB: allocated, every page touched, freed
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
e.close()
"""


def _faults(threshold: str) -> int:
    out = subprocess.run([sys.executable, "-c", _FAULTS, threshold], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _thp_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt(M_MMAP_THRESHOLD) is glibc's")
@pytest.mark.skipif(_thp_always(), reason="transparent huge pages always on: a 4 MiB block faults in 2 MiB pages, "
                                          "so page faults no longer count its pages")
def test_a_threshold_above_the_blocks_reuses_their_pages_instead_of_faulting_them_in_again():
    pages = (4 << 20) // 4096
    mapped, heap = _faults("64KiB"), _faults("32MiB")
    assert mapped >= 12 * pages, mapped  # each of the 16 blocks a fresh mapping
    assert heap <= 4 * pages, (heap, mapped)  # the heap's pages, faulted in once


def test_setup_runs_at_64_KiB_and_the_steps_at_the_configured_threshold(monkeypatch):
    calls = []
    for module in (engine_module, zero_init_module):
        monkeypatch.setattr(module, "set_mmap_threshold", lambda t, m=module.__name__: calls.append((m, t)))
    monkeypatch.setattr(zero_init_module, "mmap_threshold", lambda: 2 << 20)  # an engine already running at 2 MiB
    cfg = engine_config("cpu", **{"infinity.mmap_threshold": "8MiB"})
    with zero_init(cfg):
        m = GPT(MODEL)
    e = initialize(m, cfg)
    try:
        assert calls == [("infinity.engine.zero_init", CONSTRUCTION), ("infinity.engine.zero_init", 2 << 20),
                         ("infinity.engine.assemble", CONSTRUCTION), ("infinity.engine.assemble", 8 << 20)]
    finally:
        e.close()


@pytest.mark.parametrize("value, message", [
    ("64MiB", "infinity.mmap_threshold: must be <= 33554432, got 67108864"),
    (1024, "infinity.mmap_threshold: must be >= 4096, got 1024"),
])
def test_a_threshold_out_of_range_is_refused(value, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"infinity": {"mmap_threshold": value}})
