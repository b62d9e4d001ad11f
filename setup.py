"""Builds infinity and its native extension `infinity._native`.

The extension is plain C++17 over raw buffers: it never includes torch
headers, so it builds in seconds and survives torch ABI changes. Optional
backends are compiled in only when their headers and libraries link:
libaio (libaio-dev) and io_uring (liburing-dev). If the extension cannot be
built at all, the install still succeeds and `import infinity` falls back to
the pure-Python I/O backend with one warning.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from glob import glob

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def _links(header: str, lib: str, snippet: str) -> bool:
    """True when a tiny program using `header` compiles and links with -l`lib`."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    src = f"#include <{header}>\nint main(void) {{ {snippet} return 0; }}\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.c")
        with open(path, "w") as f:
            f.write(src)
        cmd = cc.split() + [path, "-o", os.path.join(tmp, "probe"), f"-l{lib}"]
        return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def _native_extension():
    from pybind11.setup_helpers import Pybind11Extension

    macros, libs = [], []
    # (header, library, probe snippet, macro, apt package) per optional backend.
    optional = [("libaio.h", "aio", "io_context_t c = 0; (void)c;", "INFINITY_HAVE_LIBAIO", "libaio-dev"),
                ("liburing.h", "uring", "struct io_uring r; (void)r;", "INFINITY_HAVE_URING", "liburing-dev")]
    for header, lib, snippet, macro, package in optional:
        if _links(header, lib, snippet):
            macros.append((macro, "1"))
            libs.append(lib)
        else:
            print(f"infinity: {header} not found, building without that backend (apt-get install {package})",
                  file=sys.stderr)

    # -ffp-contract=off: the SIMD Adam paths must round exactly like the
    # scalar reference (see [Note: matching torch bit for bit]).
    # -fno-math-errno: otherwise every sqrt of a negative number takes a
    # libm call just to set errno, which makes NaN-laden steps 2x slower.
    extra = ["-O3", "-fvisibility=hidden", "-Wall", "-Wextra", "-ffp-contract=off", "-fno-math-errno"]
    link = []
    sanitize = os.environ.get("INFINITY_SANITIZE")  # e.g. "address,undefined" (make asan)
    if sanitize:
        extra = ["-O1", "-g", "-fno-omit-frame-pointer", "-ffp-contract=off", "-fno-math-errno",
                 f"-fsanitize={sanitize}"]
        link = [f"-fsanitize={sanitize}"]
    sources = sorted(glob("native/**/*.cpp", recursive=True))
    sources = [s for s in sources if "/tests/" not in s]
    return Pybind11Extension(
        "infinity._native",
        sources,
        include_dirs=["native"],
        define_macros=macros,
        libraries=libs,
        extra_compile_args=extra,
        extra_link_args=link,
        cxx_std=17,
    )


class BuildPyWithConfigs(build_py):
    """The shipped swap configs go into the package (infinity/swap_configs/), so an installed package has them;
    swap_configs/ at the top of the tree stays their source (see infinity/config/shipped.py)."""

    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, "infinity", "swap_configs")
        os.makedirs(dst, exist_ok=True)
        configs = sorted(glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "swap_configs", "*.json")))
        if not configs:
            raise RuntimeError("setup.py: swap_configs/*.json not found; an sdist needs MANIFEST.in to include them")
        for src in configs:
            shutil.copy(src, dst)


class OptionalBuildExt(build_ext):
    """A failed native build leaves a working pure-Python package."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler failure
            print(f"infinity: native extension not built ({exc}); the pure-Python backend will be used",
                  file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"infinity: native extension not built ({exc}); the pure-Python backend will be used",
                  file=sys.stderr)


def _extensions():
    try:
        from pybind11.setup_helpers import ParallelCompile

        # Compile the sources on every core (set INFINITY_BUILD_JOBS to cap it).
        ParallelCompile("INFINITY_BUILD_JOBS", default=0).install()
        return [_native_extension()]
    except ImportError:
        print("infinity: pybind11 is not installed; building without the native extension", file=sys.stderr)
        return []


setup(
    name="infinity",
    version="0.1.0",
    description="Memory-offload engine for training PyTorch models larger than device and host memory",
    packages=find_packages(include=["infinity", "infinity.*"]),
    ext_modules=_extensions(),
    cmdclass={"build_ext": OptionalBuildExt, "build_py": BuildPyWithConfigs},
    python_requires=">=3.9",
    install_requires=["torch>=2.1", "numpy"],
    extras_require={"test": ["pytest", "pytest-xdist", "hypothesis", "safetensors", "zarr>=3"], "plot": ["matplotlib"],
                    "hf": ["transformers>=5.24,<6", "accelerate>=1.16", "peft>=0.21", "datasets>=5.2",
                           "tokenizers", "safetensors", "tqdm", "trl>=1.16,<2"],
                    "zarr": ["zarr>=3"]},
    entry_points={"console_scripts": ["infinity=infinity.tools.cli:main"]},
    zip_safe=False,
)
