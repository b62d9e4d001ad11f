#!/usr/bin/env bash
# The engine on a CUDA machine (CI does not need this): fp32 parity against torch on the GPU (offload none, cpu
# and nvme: NVMe shards reach the GPU from page-locked pool buffers on a side stream), then a short
# training-speed run (parameters and optimizer on NVMe vs in RAM) with the model computing on the GPU.
# Run from the repository root after `make build`; it prints PASS/FAIL and the bench table.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -m infinity.testing.parity
python3 -m infinity bench train --steps 5 --warmup 2 --rounds 1
