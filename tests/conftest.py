"""Shared test settings: where the fixtures live, and GPU tests skip without CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The steering repo's shared/ sits beside the checkout, in a session and in CI alike.
FIXTURES = Path(
    os.environ.get("INFERX_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures")
)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
