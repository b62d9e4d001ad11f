#!/usr/bin/env bash
# Installed the way users install: build the wheel, install it with its [hf] extra into a fresh venv, and from outside the
# repo run `infinity info` and a short `infinity train` on the shipped default config. The venv sees the
# system's site-packages for torch (a second torch install would cost a minute and a GB); the check below
# makes sure `infinity` itself is the wheel's, not the source tree's editable install.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d /var/tmp/infinity-wheel.XXXXXX)
trap 'rm -rf "$work"' EXIT
python3 -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$work/dist" .
python3 -m venv --system-site-packages "$work/venv"
# With the [hf] extra and dependency resolution on, as a user's pip resolves it (what the system already has
# satisfies it here, so nothing is downloaded unless the pins stopped agreeing with the tested versions).
wheel=$(ls "$work"/dist/infinity-*.whl)
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check "${wheel}[hf]"
cd "$work"
"$work/venv/bin/python" - <<'PY'
import sys, infinity
assert infinity.__file__.startswith(sys.prefix), f"imported {infinity.__file__}, not the wheel in {sys.prefix}"
from infinity.config.shipped import shipped_config
assert str(shipped_config("nvme_offload.json")).startswith(sys.prefix)
from infinity.integrations.transformers import InfinityTrainer  # the [hf] extra's transformers 5 and accelerate
print("wheel check: infinity", infinity.__version__, "from", infinity.__file__)
PY
"$work/venv/bin/infinity" info --dir "$work"
"$work/venv/bin/infinity" train --model gpt-tiny --steps 3 --seq 32 --out "$work/run"
test -s "$work/run/metrics.jsonl"
echo "wheel check: passed"
