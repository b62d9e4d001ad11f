"""Shared by the CPU Adam tests: a fixture that runs a test once per SIMD path this CPU has."""

import pytest

from infinity._native_loader import native

LEVELS = ["scalar", "avx2", "avx512", "avx512_bf16"]


@pytest.fixture(params=LEVELS)
def simd(request, monkeypatch):
    """The code path (INFINITY_SIMD) the test runs on; skipped where the CPU lacks it."""
    if native is None:
        pytest.skip("the SIMD paths need the native extension")
    if LEVELS.index(request.param) > LEVELS.index(native.cpu_simd_level()):
        pytest.skip(f"this CPU has no {request.param} (it has {native.cpu_simd_level()})")
    monkeypatch.setenv("INFINITY_SIMD", request.param)
    assert native.simd_level() == request.param
    return request.param
