"""benchmarks/gpu_table.py's plumbing on the CPU: --quick with the tiny-qwen2 preset and the Qwen
tokenizer produces every figure (offline child, inferx-server, the serve client), prints the
table, honours --only, and starts an engine again with kv_cache.num_blocks when it cannot start;
the tiny DeepSeek-V2-Lite with the tokenizer the run derives from Llama 3's does the same;
benchmarks/gpu_clocks.py, which samples the GPU's clocks beside each figure."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_table.py"
TOKENIZERS = FIXTURES / "tokenizers"


def run_table(tmp_path: Path, *extra: str, model: str = "tiny-qwen2") -> tuple[dict[str, Any], str]:
    out = tmp_path / "gpu-table.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--models", model, "--tokenizers",
           str(TOKENIZERS), "--budget-s", "100", "--json", str(out), *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


def errors(node: Any, path: str = "") -> list[str]:
    if isinstance(node, dict):
        found = [f"{path}: {node['error']}"] if "error" in node else []
        return found + [e for k, v in node.items() for e in errors(v, f"{path}.{k}")]
    return []


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    return run_table(tmp_path_factory.mktemp("table"), "--serve-rounds", "2")


def table_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    """gpu_table.py imported as a module."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its own imports (commit_id) live there
    spec = importlib.util.spec_from_file_location("gpu_table", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_table", mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_every_figure_is_measured(quick: tuple[dict[str, Any], str]) -> None:
    doc, _ = quick
    res = doc["models"]["tiny-qwen2"]
    assert errors(res) == []
    d = res["decode"]
    assert d["ms_per_token"] > 0 and d["floor_ms_per_token"] > 0 and len(d["runs_ms"]) == 2
    assert set(res["ttft"]) == {"64", "128", "seconds", "gpu_clocks"}
    assert all(res["ttft"][n]["ttft_ms"] > 0 and res["ttft"][n]["prefill_tok_s"] > 0
               for n in ("64", "128"))  # fmt: skip
    assert res["throughput"]["output_tok_s"] > 0 and res["throughput"]["num_prompts"] == 8
    for c, prompts in (("1", 4), ("4", 8)):
        r = res["serve"][c]
        assert r["completed"] == r["num_prompts"] == prompts and r["failed"] == 0
        assert r["server_input_tokens_per_request"] == 32  # token-exact text prompts
        assert r["total_output_tokens"] == prompts * 8
        assert r["output_throughput"] > 0 and r["ttft_ms"]["mean"] > 0 and r["itl_ms"]["p99"] > 0
        # --serve-rounds 2: both runs' throughputs kept, the lower (the median of two) reported
        assert len(r["rounds_tok_s"]) == 2 and r["output_throughput"] == min(r["rounds_tok_s"])
        # each run sampled the GPU's clocks, or says why not (no nvidia-smi on a CPU machine)
        assert len(r["rounds_gpu_clocks"]) == 2
        assert all("unavailable" in g or "busy_samples" in g for g in r["rounds_gpu_clocks"])
    off, server = res["startup"]["offline"], res["startup"]["server"]
    assert off["spawn_to_ready_s"] > off["engine_s"] > 0 and "weights" in off["parts_s"]
    assert isinstance(off["triton_compiled"], int) and off["triton_compiled"] >= 0
    assert off["overrides"]["scheduler.prefix_cache"] == "false"
    assert server["spawn_to_ready_s"] > 0 and server["exit_code"] == 0  # drained on SIGTERM
    assert doc["peers"]["qwen2.5-3b-instruct"]["decode"][0].startswith("2.975")


def test_the_table_prints(quick: tuple[dict[str, Any], str]) -> None:
    _, stdout = quick
    lines = stdout.splitlines()
    head = lines.index("| figure | InferX | vLLM 0.26.0 | goal |")
    rows = [line for line in lines[head + 2 :] if line.startswith("| ")]
    assert len(rows) == 9  # decode, 2 TTFT, offline, 2 online, 2 start-ups, KV cache
    assert all(row.split(" | ")[1].strip() for row in rows), rows  # every figure has a value
    assert "error" not in stdout and "unreadable" not in stdout
    assert "Triton kernels compiled" in stdout  # the offline engine's start-up compiles
    assert sum("(median of 2: " in row for row in rows) == 2  # the two online rows


def test_median_round(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = table_module(monkeypatch)
    runs = [{"output_throughput": t, "run": i} for i, t in enumerate([300.0, 100.0, 200.0])]
    r = mod.median_round(runs)
    assert (r["run"], r["output_throughput"], r["rounds_tok_s"]) == (2, 200.0, [300, 100, 200])
    assert "rounds_tok_s" not in mod.median_round(runs[:1])
    assert mod.median_round(runs[:2])["run"] == 1  # the lower middle of an even count
    served = {
        "output_throughput": 1234.0,
        "ttft_ms": {"mean": 40.0},
        "tpot_ms": {"mean": 2.3},
        "itl_ms": {"median": 2.2, "p99": 2.8},
        "failed": 0,
        "rounds_tok_s": [1234.0, 1300.0],
        "round_error": "TimeoutError: slow\nmore",
    }
    cell = mod._serve(served)
    assert "1,234 tok/s" in cell and "(median of 2: 1,234 / 1,300)" in cell
    assert cell.endswith("a later round failed: TimeoutError: slow")


def test_each_serve_round_has_fresh_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round that repeated the last one's prompts would find them in the prefix cache (on the
    H200, 3B c=64 read 14.7k tok/s on fresh prompts and 20.4k on the same ones again)."""
    mod = table_module(monkeypatch)
    args = argparse.Namespace(tokenizers=str(TOKENIZERS))
    sizes = dataclasses.replace(mod.QUICK, serve_rounds=3)
    run = mod.Run(args, sizes, ("serve",), Path("unused.json"), Path("."), 0.0)
    prompts = mod.serve_prompts(run, "tiny-qwen2")
    assert set(prompts) == set(sizes.concurrency)
    for c, rounds in prompts.items():
        assert len(rounds) == 3 and all(len(p) == sizes.num_prompts(c) for p in rounds)
        assert len({t for p in rounds for t in p}) == 3 * sizes.num_prompts(c)  # none repeats


def test_peers_and_errors_render(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = table_module(monkeypatch)
    res = {"decode": {"error": "RuntimeError: CUDA error: out of memory\nmore"},
           "serve": {"64": {"error": "skipped: the time budget was spent"}}}  # fmt: skip
    text = mod.table("qwen2.5-3b-instruct", res, mod.Sizes())
    assert (
        "| error: RuntimeError: CUDA error: out of memory | 2.975 (floor 1.437) | <= 2.0 |" in text
    )
    assert "skipped: the time budget was spent | 11,359 tok/s" in text
    assert "unreadable" not in text  # figures not measured are blank
    assert "6,371 tok/s" in mod.table("llama-3.1-8b-instruct", {}, mod.Sizes())


def test_quantized_runs_take_the_quantization_goals(monkeypatch: pytest.MonkeyPatch) -> None:
    """--set quantization.scheme=fp8 / kv_cache.dtype=fp8_e4m3 rows show the quantization
    issue's peers and goals, and a variant without any shows none of bf16's."""
    mod = table_module(monkeypatch)
    fp8 = ["quantization.scheme=fp8"]
    both = ["kv_cache.dtype=fp8_e4m3", "quantization.scheme=fp8", "model.dtype=bfloat16"]
    assert mod.variant_of(fp8) == "fp8" and mod.variant_of(both) == "fp8 + kv fp8"
    assert mod.variant_of(["kv_cache.dtype=auto"]) == ""
    text = mod.table("qwen2.5-3b-instruct", {"set": fp8}, mod.Sizes())
    assert "| 2.954 (H100, fp8) | <= 1.45 |" in text and "2.975" not in text
    text = mod.table("llama-3.1-8b-instruct", {"set": both}, mod.Sizes())
    assert ">= 10,000 tok/s (H200)" in text and ">= 14,000 (H200)" in text
    assert "6,371" not in text and "<= 4.3" not in text
    text = mod.table("llama-3.1-8b-instruct", {"set": fp8}, mod.Sizes())
    assert "6,371" not in text and "(H200)" not in text  # no goals named for FP8 weights alone


def test_only_and_a_second_start_with_fixed_blocks(tmp_path: Path) -> None:
    # A fraction of memory cannot size a cache on the CPU: the engine fails to start, and the
    # table starts it again with kv_cache.num_blocks, as it would after a fault on the GPU.
    doc, stdout = run_table(tmp_path, "--only", "startup", "--kv-cache-memory", "0.5")
    res = doc["models"]["tiny-qwen2"]
    assert set(res) == {"budget_s", "startup", "seconds"}
    off = res["startup"]["offline"]
    assert "kv_cache.memory as a fraction needs a GPU" in off["first_attempt"]["error"]
    assert off["overrides"]["kv_cache.num_blocks"] == str(1 << 16) and off["spawn_to_ready_s"] > 0
    assert "[second start, kv_cache.num_blocks]" in stdout


def test_deepseek_runs_with_a_derived_tokenizer(tmp_path: Path) -> None:
    """The tiny V2-Lite with DeepSeek's vocabulary: the run derives DeepSeek-V2's tokenizer
    from Llama 3's (the carried tokenizers have no DeepSeek one), and every figure is measured,
    with the MLA cache's bytes a token and the routed experts' share in the decode floor."""
    preset = "tiny-deepseek-v2-lite-vocab"
    doc, stdout = run_table(tmp_path, model=preset)
    res = doc["models"][preset]
    assert errors(res) == []
    assert doc["meta"]["tokenizers"][preset] == f"derived from {TOKENIZERS / 'llama3'}"
    off = res["startup"]["offline"]
    assert off["overrides"]["model.tokenizer"].endswith(preset)
    c = {"layers": 3, "latent": 32, "rope": 8, "moe_layers": 2, "experts": 8, "top_k": 3}
    per_token = c["layers"] * (c["latent"] + c["rope"]) * 4  # float32 on the CPU
    assert off["kv_bytes_per_block"] == per_token * off["kv_block_size"]
    assert off["kv_groups"] == 1
    tokens = off["num_kv_blocks"] * off["kv_block_size"]
    assert f"= {tokens:,} tokens, {per_token:,} B/token" in stdout
    # decode's floor reads a token's share (top_k / experts) of the routed experts' weights
    experts_bytes = c["moe_layers"] * c["experts"] * 3 * 64 * 32 * 4
    d = res["decode"]
    unread = experts_bytes * (1 - c["top_k"] / c["experts"])
    assert (d["all_weight_gb"] - d["weight_gb"]) * 1e9 == pytest.approx(unread, abs=1)
    for c_ in ("1", "4"):
        assert res["serve"][c_]["server_input_tokens_per_request"] == 32  # token-exact prompts
    assert "error" not in stdout and "unreadable" not in stdout


def test_deepseek_tiny_preset_without_the_vocabulary_is_refused(tmp_path: Path) -> None:
    cmd = [sys.executable, str(SCRIPT), "--quick", "--models", "tiny-deepseek-v2-lite",
           "--tokenizers", str(TOKENIZERS), "--json", str(tmp_path / "t.json")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "past this model's vocab_size 320" in proc.stderr


def test_deepseek_peers_and_mla_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = table_module(monkeypatch)
    text = mod.table("deepseek-v2-lite", {}, mod.Sizes())
    assert "| 3.840 (H100) | <= 2.4 |" in text and "| 66.0 (H100) | <= 45 |" in text
    assert "| 11,104 (H100) | >= 14,000 |" in text and "| 105 (H100) | <= 30 |" in text
    assert "31,104 B/token (576 x 2 B x 27 layers)" in text
    assert mod.tokenizer_name("deepseek-v2-lite") == "deepseek-v2"
    # kv_cache.num_blocks of a second start: MLA's 576 values a token a layer, not K and V heads
    assert mod.fallback_blocks("deepseek-v2") == mod.FALLBACK_KV_BYTES // (60 * 576 * 2 * 16)
    per_block = 32 * 2 * 8 * 128 * 2 * 16  # Llama-3.1-8B: 8 KV heads of 128, K and V
    assert mod.fallback_blocks("llama-3.1-8b-instruct") == mod.FALLBACK_KV_BYTES // per_block
    st = {"num_kv_blocks": 1000, "kv_block_size": 16, "kv_bytes_per_block": 16 * 31_104}
    assert mod._memory(st) == "1,000 blocks = 16,000 tokens, 31,104 B/token"
    st |= {"kv_groups": 2}
    assert "16,000 token slots (2 KV groups share them)" in mod._memory(st)


def test_unknown_figure_is_refused() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", "decode,latency"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "unknown figure(s) latency" in proc.stderr


def test_serve_rounds_are_checked() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--serve-rounds", "0"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "--serve-rounds must be at least 1" in proc.stderr


def _smi_line(wall: float, sm: int, power: float, reasons: int, util: int) -> str:
    """One nvidia-smi --query-gpu=gpu_clocks.QUERY --format=csv,noheader line."""
    from datetime import datetime

    stamp = datetime.fromtimestamp(wall).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    return f"{stamp}, {sm} MHz, 3201 MHz, {power:.2f} W, 50, 0x{reasons:016x}, {util} %"


def test_gpu_clocks_summarizes_busy_samples_on_the_monotonic_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """benchmarks/gpu_clocks.py: samples land on time.monotonic() through the file's offset;
    the clock and power figures count busy samples only, the energy every sample's span."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from gpu_clocks import describe, parse, summarize

    offset = 1_700_000_000.0  # wall minus monotonic
    rows = [  # (monotonic s, SM MHz, W, reasons, utilization %)
        (10.0, 1980, 120.0, 0x0, 0),
        (10.1, 1500, 690.0, 0x4, 100),
        (10.2, 1600, 700.0, 0x4, 100),
        (10.3, 1900, 650.0, 0x0, 100),
        (10.4, 1980, 100.0, 0x1, 0),
    ]
    text = "\n".join(
        [f"offset {offset:.6f}", *(_smi_line(offset + t, *r) for t, *r in rows), "2026/12/0"]
    )
    samples = parse(text)
    assert len(samples) == 5  # the cut-off last line is skipped
    assert [s.monotonic for s in samples] == pytest.approx([r[0] for r in rows], abs=2e-3)
    got = summarize(samples)
    assert got["busy_samples"] == 3 and got["sm_mhz_median"] == 1600
    assert got["power_w_mean"] == pytest.approx(680.0)
    assert got["power_capped"] == pytest.approx(2 / 3)
    assert got["energy_j"] == pytest.approx(452.0 * 0.4, rel=1e-2)  # mean of all 5 x 0.4 s
    window = summarize(samples, 10.15, 10.35)
    assert window["busy_samples"] == 2 and window["power_capped"] == 0.5
    assert "1750 MHz" in describe(window) and "capped 50%" in describe(window)
    assert summarize(samples, 20.0, 21.0)["busy_samples"] == 0


def test_gpu_clocks_samples_beside_a_block_and_survives_no_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GpuClocks runs its command while the block runs and summarizes what it wrote; a missing
    command gives an error summary, not an exception."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from gpu_clocks import GpuClocks

    fake = (  # three busy samples of 1700-1702 MHz at the time it prints them, then waits
        "import time\n"
        "from datetime import datetime\n"
        "for i in range(3):\n"
        "    stamp = datetime.now().strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]\n"
        "    print(f'{stamp}, {1700 + i} MHz, 3201 MHz, 695.00 W, 50, 0x4, 100 %', flush=True)\n"
        "    time.sleep(0.05)\n"
        "time.sleep(30)\n"
    )
    clocks = GpuClocks(tmp_path / "c.csv", command=[sys.executable, "-c", fake])
    with clocks:
        deadline = time.monotonic() + 20
        while (tmp_path / "c.csv").read_text().count("MHz") < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert clocks.proc is not None and clocks.proc.poll() is not None  # stopped
    assert clocks.summary["busy_samples"] == 3 and clocks.summary["sm_mhz_median"] == 1701
    assert clocks.summary["power_capped"] == 1.0
    missing = GpuClocks(tmp_path / "m.csv", command=["no-such-nvidia-smi"])
    with missing:
        pass
    assert "not found" in missing.summary["unavailable"] and not (tmp_path / "m.csv").exists()


def test_a_w4a16_checkpoint_of_the_preset_runs_from_disk(tmp_path: Path) -> None:
    """--set model.path: the table runs a checkpoint on disk (here tiny-qwen2 rounded to GPTQ,
    group 32, by benchmarks/w4a16_checkpoint.py) in place of the preset's random weights."""
    dense, gptq = tmp_path / "dense", tmp_path / "gptq"
    cli = [sys.executable, "-m", "inferx_core.cli", "checkpoint", "--preset", "tiny-qwen2"]
    subprocess.run([*cli, "--tokenizer", str(TOKENIZERS / "qwen"), str(dense)], check=True)
    writer = SCRIPT.parent / "w4a16_checkpoint.py"
    args = [str(dense), str(gptq), "--method", "gptq", "--group", "32"]
    subprocess.run([sys.executable, str(writer), *args], check=True)
    assert json.loads((gptq / "config.json").read_text())["quantization_config"]["bits"] == 4
    doc, _ = run_table(tmp_path, "--only", "decode", "--set", f"model.path={gptq}")
    res = doc["models"]["tiny-qwen2"]
    assert not errors(res), errors(res)
    assert res["decode"]["ms_per_token"] > 0
    overrides = res["startup"]["offline"]["overrides"]
    assert overrides["model.path"] == str(gptq) and "model.preset" not in overrides


def test_patch_sets_attributes_in_the_offline_engine(tmp_path: Path) -> None:
    """--patch: a module global and a per-instance attribute set in the offline child before
    its engine starts, read back there; refused where a server would run without it."""
    patches = [
        "inferx_kernels_cuda.moe_kernels.GEMV_DOWN_SPLIT_K=3",
        "inferx_kernels_cuda.ops.TritonOps().tma_gemv_max_rows=24",
    ]
    extra = [a for p in patches for a in ("--patch", p)]
    doc, stdout = run_table(tmp_path, "--only", "decode", *extra)
    res = doc["models"]["tiny-qwen2"]
    assert not errors(res), errors(res)
    assert res["startup"]["offline"]["patched"] == {
        "inferx_kernels_cuda.moe_kernels.GEMV_DOWN_SPLIT_K": "3",
        "inferx_kernels_cuda.ops.TritonOps().tma_gemv_max_rows": "24",
    }
    assert "GEMV_DOWN_SPLIT_K=3" in stdout  # the table's heading names them
    cmd = [sys.executable, str(SCRIPT), "--quick", "--patch", patches[0]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--patch applies to the offline engine only" in proc.stderr


def test_serve_chat_with_a_response_format_reaches_the_server(tmp_path: Path) -> None:
    """--serve-endpoint chat --response-format: every serve request carries it (an invalid
    schema comes back as the server's 400 naming it, for every request); refused without
    chat or with a format that is not JSON."""
    bad = '{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}'
    doc, stdout = run_table(
        tmp_path, "--only", "serve", "--serve-endpoint", "chat", "--response-format", bad
    )
    res = doc["models"]["tiny-qwen2"]
    assert res["serve_requests"] == {"endpoint": "chat", "response_format": bad}
    for run in res["serve"].values():
        assert run["completed"] == 0 and run["failed"] == run["num_prompts"] > 0
        assert "invalid_schema" in run["errors"][0]
    assert "serve: chat, response_format" in stdout
    for extra in (
        ["--response-format", "{}"],
        ["--serve-endpoint", "chat", "--response-format", "{"],
    ):
        cmd = [sys.executable, str(SCRIPT), "--quick", "--only", "serve", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "--response-format" in proc.stderr, proc.stderr


class _NeedsArgs:
    def __init__(self, size: int) -> None:
        self.rows = ((1, size),)


def test_instance_patch_of_a_class_that_takes_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """--patch MODULE.CLASS().NAME where the class cannot be built without arguments (the
    attention backends): set after every __init__, and a name the instance lacks is refused
    at its first build."""
    mod = table_module(monkeypatch)
    monkeypatch.setattr(_NeedsArgs, "__init__", _NeedsArgs.__init__)  # restored after the test
    here = __name__
    applied = mod.apply_patches([f"{here}._NeedsArgs().rows=()"])
    assert applied == {f"{here}._NeedsArgs().rows": "()"}
    assert _NeedsArgs(4).rows == ()
    mod.apply_patches([f"{here}._NeedsArgs().rowz=1"])
    with pytest.raises(AttributeError, match="rowz"):
        _NeedsArgs(4)
