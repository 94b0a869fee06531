"""The commit a benchmark ran at, for its raw JSON: INFERX_COMMIT (the device's copy of the tree
has no git metadata, so scripts/gpu_run.sh callers pass it), else git's short HEAD."""

from __future__ import annotations

import contextlib
import os
import subprocess


def commit_id() -> str:
    sha = os.environ.get("INFERX_COMMIT", "")
    if not sha:
        with contextlib.suppress(OSError):
            git = ["git", "rev-parse", "--short", "HEAD"]
            sha = subprocess.run(git, capture_output=True, text=True).stdout.strip()
    return sha or "unknown"
