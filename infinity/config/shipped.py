"""The shipped swap configs, wherever infinity is installed from.

`swap_configs/` at the top of the source tree is their source. A wheel or a
`pip install .` copies them into the package as `infinity/swap_configs/`
(setup.py's build_py); an editable install reads them from the source tree.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGED = Path(__file__).resolve().parents[1] / "swap_configs"
_SOURCE = Path(__file__).resolve().parents[2] / "swap_configs"


def shipped_config(name: str) -> Path:
    """The path of a shipped config (e.g. "nvme_offload.json"), or FileNotFoundError naming both places."""
    for root in (_PACKAGED, _SOURCE):
        path = root / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"the shipped config {name} is neither in {_PACKAGED} (an installed package) nor in "
                            f"{_SOURCE} (a source tree); reinstall infinity, or pass --config")
