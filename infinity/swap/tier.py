"""The tiers of training state (defined with the config that names them), and the host device."""

from __future__ import annotations

import torch

from infinity.config.tier import Tier

HOST = torch.device("cpu")
"""The host: where CPU and NVMe tiers hand their data over, and the compute device of a CPU-only machine."""

__all__ = ["HOST", "Tier"]
