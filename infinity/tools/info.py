"""`infinity info`: what this build and this machine can do."""

from __future__ import annotations

import os
import shutil

from infinity import __version__
from infinity._native_loader import native, reason
from infinity.io.handle import _PREFERENCE, available_backends


def collect(directory: str) -> dict:
    usable = available_backends()
    backends = {}
    for name in _PREFERENCE:
        if name in usable:
            backends[name] = "ok"
        elif native is None:
            backends[name] = "native extension missing"
        elif name not in native.compiled_backends():
            backends[name] = "not compiled in (headers missing at build time)"
        else:
            backends[name] = native.probe_backend(name)
    info = {
        "version": __version__,
        "native": "built" if native is not None else f"missing ({reason})",
        "backends": backends,
        "simd": native.cpu_simd_level() if native else "unknown (no native extension)",
        "simd_active": native.simd_level() if native else "scalar",
        "avx512_bf16": bool(native.cpu_has_avx512_bf16()) if native else False,
        "page_size": os.sysconf("SC_PAGE_SIZE"),
        "dir": os.path.abspath(directory),
    }
    if native is not None:
        try:
            info["direct_alignment"] = native.direct_alignment(directory)
        except OSError as exc:
            info["direct_alignment"] = f"unknown ({exc.strerror})"
    usage = shutil.disk_usage(directory)
    info["free_bytes"] = usage.free
    info["total_bytes"] = usage.total
    return info


def add_arguments(p) -> None:
    p.add_argument("--dir", default=".", help="directory whose alignment and free space to report")
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    if not os.path.isdir(args.dir):
        raise SystemExit(f"info: --dir {args.dir} is not a directory")
    info = collect(args.dir)
    if args.json:
        import json

        print(json.dumps(info))
        return 0
    print(f"infinity {info['version']}  (native extension: {info['native']})")
    print("I/O backends:     " + ", ".join(f"{k}={'ok' if v == 'ok' else 'no: ' + v}"
                                           for k, v in info["backends"].items()))
    print(f"CPU SIMD level:   {info['simd']} (active {info['simd_active']}, "
          f"avx512_bf16={'yes' if info['avx512_bf16'] else 'no'})")
    print(f"page size:        {info['page_size']} B")
    da = info.get("direct_alignment", "unknown (no native extension)")
    da_text = "not supported by this filesystem" if da == 0 else (f"{da} B" if isinstance(da, int) else da)
    print(f"O_DIRECT align:   {da_text}  ({info['dir']})")
    print(f"free space:       {info['free_bytes'] / 1e9:.1f} GB of {info['total_bytes'] / 1e9:.1f} GB "
          f"({info['dir']})")
    return 0
