#!/usr/bin/env bash
# Installs InferX with its test dependencies and runs the whole test suite (no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
INFERX_KERNELS=1 bash scripts/install.sh -e ".[dev]"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest "$@"
