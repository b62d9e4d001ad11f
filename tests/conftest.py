import os

import pytest

from infinity._native_loader import native
from infinity.io import available_backends

BACKENDS = available_backends()
NATIVE_BACKENDS = [b for b in BACKENDS if b != "python"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(params=NATIVE_BACKENDS or [pytest.param("none", marks=pytest.mark.skip(
    reason="native extension not built: no native backend to test"))])
def native_backend(request):
    return request.param


@pytest.fixture
def needs_native():
    if native is None:
        pytest.skip("native extension not built")
    return native


@pytest.fixture(autouse=True)
def _no_leftover_fault():
    yield
    if native is not None:
        native.clear_fault()


@pytest.fixture
def disk_dir(tmp_path):
    """A directory on a filesystem with O_DIRECT (tmp_path unless it is tmpfs without it)."""
    if native is not None and native.direct_alignment(str(tmp_path)) == 0:
        pytest.skip(f"{tmp_path} does not support O_DIRECT; set TMPDIR to a disk-backed directory")
    return tmp_path


def pytest_report_header(config):
    return f"infinity backends: {BACKENDS}; native: {'yes' if native else 'no'}; pid {os.getpid()}"
