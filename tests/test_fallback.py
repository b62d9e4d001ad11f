"""Without the native extension, `import infinity` works on the Python backend and warns once."""

import os
import subprocess
import sys

CODE = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import infinity
    import infinity.io as io
    import importlib; importlib.reload(io)
import numpy as np, sys
msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
print(len(msgs))
print(msgs[0])
print(io.available_backends())
with io.AsyncIO() as h:
    print(h.backend, h.direct)
    src = np.arange(9999, dtype=np.uint8)
    h.write(src, sys.argv[1], 5)
    dst = np.zeros_like(src)
    h.read(dst, sys.argv[1], 5)
    print(bool((src == dst).all()))
    try:
        h.read(np.zeros(10**6, np.uint8), sys.argv[1])
    except OSError as e:
        print(e.errno, e.offset)
t = io.aligned_empty(5000, 4096)
print(t.data_ptr() % 4096, t.numel())
"""


def test_import_without_native_extension(tmp_path):
    env = dict(os.environ, INFINITY_DISABLE_NATIVE="1")
    out = subprocess.run([sys.executable, "-c", CODE, str(tmp_path / "f.bin")], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "1", "exactly one warning"
    assert lines[1].startswith("infinity: native extension unavailable (disabled by INFINITY_DISABLE_NATIVE=1); "
                               "using the pure-Python I/O backend")
    assert lines[2:] == ["['python']", "python False", "True", "61 0", "0 5000"]
