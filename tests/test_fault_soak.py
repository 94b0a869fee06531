"""The fault soak (benchmarks/fault_soak.py) at CI size: random disconnects and aborts under load
on the demo model, then nothing runs, waits or holds a KV block, and greedy output is unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

try:
    from inferx_models.gguf import find_demo_gguf

    find_demo_gguf()
except (ImportError, FileNotFoundError) as exc:
    pytest.skip(f"the demo model is not installed ({exc})", allow_module_level=True)

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parents[1] / "benchmarks" / "fault_soak.py"


def test_disconnects_and_aborts_leave_the_server_idle_and_unchanged() -> None:
    cmd = [sys.executable, str(SCRIPT), "--faults", "40", "--concurrency", "8", "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert run.returncode == 0, (result["problems"], run.stderr[-2000:])
    assert result["faults"] >= 40 and result["problems"] == []
    assert result["running"] == result["waiting"] == result["kv_usage"] == 0
    assert result["aborted"] >= result["faults"] // 2  # most dropped clients were still generating
    assert result["greedy_same"]
    assert result["outcomes"].get("bad_400", 0) + result["outcomes"].get("complete", 0) > 0
