"""Helpers shared by the test suite, the benchmarks and bench/gpu_check.sh (importable by spawned ranks)."""
