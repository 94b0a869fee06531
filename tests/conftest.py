"""Shared test settings: where the fixtures live, and GPU tests skip without CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Before any test imports triton: @triton.jit picks the interpreter when a kernel is defined,
    # so without a GPU the Triton kernels run (slowly) on the CPU and CI checks them.
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(
    not INTERPRET, reason="CPU tests run the kernels under TRITON_INTERPRET=1; set it to run them"
)
on_gpu = pytest.mark.skipif(
    INTERPRET or not torch.cuda.is_available(), reason="needs CUDA and compiled Triton kernels"
)

# The steering repo's shared/ sits beside the checkout, in a session and in CI alike.
FIXTURES = Path(
    os.environ.get("INFERX_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures")
)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
