"""The benchmark table in one run (docs/BENCHMARKS.md): per model, decode, TTFT, offline and
online throughput and start-up, beside vLLM 0.26.0's figures and the goals; raw results as JSON.
Runs on an H100 or an H200 (the vLLM column holds its H200 figures; its H100 figures are in
docs/BENCHMARKS.md).

    python3 benchmarks/gpu_table.py                        # both models, all figures
    python3 benchmarks/gpu_table.py --models qwen2.5-3b-instruct --only decode,serve
    python3 benchmarks/gpu_table.py --quick --models tiny-qwen2 --tokenizers DIR  # CPU plumbing
    python3 benchmarks/gpu_table.py --quick --models tiny-deepseek-v2-lite-vocab --tokenizers DIR
    python3 benchmarks/gpu_table.py --models gpt-oss-20b --only decode \
        --patch inferx_kernels_cuda.moe_kernels.GEMV_DOWN_SPLIT_K=2     # A/B of a kernel default
    python3 benchmarks/gpu_table.py --models qwen2.5-3b-instruct --only serve --concurrency 64 \
        --serve-endpoint chat [--response-format '{"type": "json_object"}']  # structured output

Models are presets (random bf16 weights, exact shapes) with their real tokenizers, looked up
under --tokenizers (default .carry/tok/tokenizers): `qwen/` for Qwen, `llama3/` for Llama,
`gpt-oss/` for gpt-oss. DeepSeek-V2's is not at hand: `deepseek-v2/` if there, else derived at
the start of the run from `llama3/` into a temporary directory (inferx_models.derived_tokenizers:
Llama 3's BPE cut to DeepSeek's 102,400 ids, its BOS / EOS at 100,000 / 100,001 and its chat
template). `--set model.path=DIR` runs a checkpoint of the preset's shapes from disk instead
(the preset names its tokenizer and peers): W4A16, which a preset's random weights cannot be,
written by `inferx checkpoint --preset P DIR` then benchmarks/w4a16_checkpoint.py. Before the
device call pack them as docs/CONTRIBUTING.md says (.carry/tokxz;
scripts/gpu_run.sh table unpacks them and runs this script).

Figures (--only picks some): decode (batch 1, 128 in / 256 out, median of 3 after a whole warm-up
request, the weight-bandwidth floor measured beside it), ttft (2048 and 8192-token prompts, fresh
each run, median of 5 after a warm-up of the same length), throughput (256 prompts, 512 in /
256 out, after a warm-up batch), serve (`inferx-server` in a child process, loaded through HTTP
by `inferx-bench serve`'s client at concurrency 1, 8, 64, 256 with 512-token text prompts that
the model's tokenizer encodes to exactly 512 tokens, 256 out, ignore_eos; --serve-rounds N
runs each concurrency N times on the one server, each round on fresh prompts (a repeated
prompt would hit the prefix cache), and reports the run of median throughput, with every
run's beside it), startup (spawn to ready of both processes, and the engine's own
report of where the time and memory went).

Engine settings, the same for every figure of a model: bf16, attention `triton` (`auto` would
pick FlashInfer once installed, whose first JIT compile alone takes minutes on a fresh machine;
--attention-backend to choose), kv_cache.memory 0.9 (the profiled sizing), max_batched_tokens =
prefill_chunk = 8192, CUDA graphs on; prefix caching off offline and on (the default) when
serving, as the peer was measured.

Clocks: every offline figure and every serve run samples the GPU's SM clock and power with
nvidia-smi every 100 ms (benchmarks/gpu_clocks.py; the CSVs in gpu-table-logs/), and the table
gives each throughput's median clock, mean power and power-capped share beside it: held at its
700 W limit, an H200 runs compute-bound steps well under its 1980 MHz boost.

Isolation: this process never touches the GPU (nvidia-smi reads it without a CUDA context).
Per model, one child process builds the engine once and measures the offline figures, writing
each to JSON as soon as it is done; then the server starts in another child. A figure that
raises is recorded as its error and the next one runs; a child that dies or overruns is killed
and what it finished is kept; an engine that cannot start with kv_cache.memory is started once
more with a fixed kv_cache.num_blocks (40 GiB worth, at most 65,536), so a fault in the
profiled sizing costs one start-up, not the table.

Time: --budget-s (default 450) bounds the whole run. Each model gets an equal share of what is
left when it starts; its offline child at most 45% of that share; the server at most 240 s to
get ready and each serve run at most 100 s; what has no time left is recorded as skipped. The
JSON (--json, default $OUT/gpu-table.json; logs beside it in gpu-table-logs/) is rewritten
after every figure and each model's table is printed when that model is done, so a run stopped
from outside keeps what it measured. Expected on an H200: ~1.5 min for the 3B, ~2.5 min for the
8B, plus Triton compiling its kernels on a fresh machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from commit_id import commit_id
from gpu_clocks import GpuClocks, describe

FIGURES = ("decode", "ttft", "throughput", "serve", "startup")
OFFLINE = ("decode", "ttft", "throughput")
MODELS = ("qwen2.5-3b-instruct", "llama-3.1-8b-instruct")
# Tokenizers derived at the start of a run when --tokenizers lacks them: name -> source name.
DERIVED_TOKENIZERS = {"deepseek-v2": "llama3"}
GiB = 1 << 30
SERVE_RUN_CAP_S = 100.0
SERVER_START_CAP_S = 240.0
FALLBACK_KV_BYTES = 40 * GiB

# vLLM 0.26.0 on the same H200 kind (2026-11-29; random bf16 checkpoints of the exact shapes,
# greedy, ignore_eos, CUDA graphs + torch.compile, FlashAttention 3) and InferX's goals, as
# issue 4 states them (section "Benchmarks"). figure key -> (vLLM 0.26.0, InferX goal).
PEERS: dict[str, dict[str, tuple[str, str]]] = {
    "qwen2.5-3b-instruct": {
        "decode": ("2.975 (floor 1.437)", "<= 2.0"),
        "ttft_2048": ("47.8", "<= 40"),
        "throughput": ("18,588", ">= 20,000"),
        "serve_1": ("329 tok/s, TTFT 22.9, TPOT 2.96", "TPOT <= 2.1"),
        "serve_8": ("2,411 tok/s, TTFT 71, TPOT 3.06", ">= 3,400 tok/s"),
        "serve_64": ("11,359 tok/s, TTFT 282, TPOT 4.54, ITL p99 35", ">= 15,000 tok/s"),
        "serve_256": ("11,440 tok/s, TTFT 750, TPOT 19.3, ITL p99 81", ">= 18,000 tok/s"),
        "startup_offline": ("~88 (27 of it torch.compile)", "<= 20"),
        "startup_server": ("~100 (`vllm serve`)", "<= 20"),
    },
    "llama-3.1-8b-instruct": {
        "decode": ("4.97 (floor 3.74)", "<= 4.3"),
        "throughput": ("9,513", ">= 10,500"),
        "serve_64": ("6,371 tok/s, TTFT 592, TPOT 7.77", ">= 8,000 tok/s"),
    },
    # vLLM on an H100 (2026-12-05, ../shared/LESSONS.md; FA3 with sinks, Triton MXFP4 MoE);
    # goals: the MoE issue's
    "gpt-oss-20b": {
        "decode": ("3.215 (H100)", "<= 1.8"),
        "ttft_2048": ("80.8 (H100)", "<= 45"),
        "throughput": ("9,451 (H100)", ">= 12,500"),
        "startup_server": ("161 (H100)", "<= 30"),
    },
    # vLLM on an H100 (2026-12-05, ../shared/LESSONS.md; FLASH_ATTN_MLA decode, Triton MoE);
    # goals: the MLA issue's (49)
    "deepseek-v2-lite": {
        "decode": ("3.840 (H100)", "<= 2.4"),
        "ttft_2048": ("66.0 (H100)", "<= 45"),
        "throughput": ("11,104 (H100)", ">= 14,000"),
        "startup_server": ("105 (H100)", "<= 30"),
        "kv": ("", "31,104 B/token (576 x 2 B x 27 layers); report the tokens"),
    },
}

# The quantization issue's (47) peers and goals for a model run with FP8 weights and / or an
# FP8 KV cache (--set quantization.scheme=fp8, --set kv_cache.dtype=fp8_e4m3), keyed by
# (preset, variant_of(--set)): vLLM 0.26 `--quantization fp8` on an H100 (2026-12-05); the 8B
# goals are the H200's. A variant without an entry shows no peers: bf16's would mislead.
VARIANT_PEERS: dict[tuple[str, str], dict[str, tuple[str, str]]] = {
    ("qwen2.5-3b-instruct", "fp8"): {
        "decode": ("2.954 (H100, fp8)", "<= 1.45"),
        "ttft_2048": ("28.0 (H100, fp8)", "<= 20"),
        "throughput": ("20,473 (H100, fp8)", ">= 27,000"),
    },
    ("qwen2.5-3b-instruct", "kv fp8"): {"kv": ("", "2x the bf16 cache's blocks")},
    ("llama-3.1-8b-instruct", "kv fp8"): {
        "serve_64": ("", ">= 8,000 tok/s (H200)"),
        "kv": ("", "2x the bf16 cache's blocks"),
    },
    ("llama-3.1-8b-instruct", "fp8 + kv fp8"): {
        "serve_64": ("", ">= 10,000 tok/s (H200)"),
        "throughput": ("", ">= 14,000 (H200)"),
    },
}


def variant_of(sets: list[str]) -> str:
    """The quantization variant that --set overrides make ("" for none): "fp8" (FP8
    weights), "kv fp8" (an e4m3 KV cache) or both, "fp8 + kv fp8"."""
    given = dict(item.split("=", 1) for item in sets if "=" in item)
    parts = []
    if given.get("quantization.scheme") == "fp8":
        parts.append("fp8")
    if given.get("kv_cache.dtype") == "fp8_e4m3":
        parts.append("kv fp8")
    return " + ".join(parts)


def peers_for(preset: str, sets: list[str]) -> dict[str, tuple[str, str]]:
    """The peer and goal of each figure for a run of `preset` with these --set overrides."""
    variant = variant_of(sets)
    if variant:
        return VARIANT_PEERS.get((preset, variant), {})
    return PEERS.get(preset, {})


@dataclass(frozen=True)
class Sizes:
    decode_in: int = 128
    decode_out: int = 256
    decode_runs: int = 3
    ttft_lens: tuple[int, ...] = (2048, 8192)
    ttft_runs: int = 5
    tput_prompts: int = 256
    tput_in: int = 512
    tput_out: int = 256
    serve_in: int = 512
    serve_out: int = 256
    concurrency: tuple[int, ...] = (1, 8, 64, 256)
    serve_rounds: int = 1  # runs at each concurrency, on one server; the median's figures
    max_batched_tokens: int = 8192  # = prefill_chunk: an 8k prompt is one step

    def num_prompts(self, concurrency: int) -> int:
        """Two waves (at least 4 requests): a steady state, each run well under a minute."""
        return max(4, 2 * concurrency)


QUICK = Sizes(
    decode_in=16,
    decode_out=16,
    decode_runs=2,
    ttft_lens=(64, 128),
    ttft_runs=2,
    tput_prompts=8,
    tput_in=32,
    tput_out=16,
    serve_in=32,
    serve_out=8,
    concurrency=(1, 4),
    max_batched_tokens=512,
)


def tokenizer_name(preset: str) -> str:
    if "gpt-oss" in preset:
        return "gpt-oss"
    if "deepseek-v2" in preset:
        return "deepseek-v2"
    return "llama3" if "llama" in preset else "qwen"


# -- the offline child: one engine, the offline figures ------------------------------------------


def decode_read_bytes(model: Any) -> tuple[int, int]:
    """(weight bytes, the bytes of them one batch-1 decode step reads): every parameter once
    (a tied head is the embedding), but a MoE layer's routed experts, parameters and buffers
    (MXFP4 blocks are buffers), at (top_k + shared) / (num_experts + shared) of their size:
    one token's share (shared experts held as expert slots are read by every token)."""
    from inferx_core.moe import FusedMoE

    share: dict[int, float] = {}
    tensors = list(model.parameters())
    for m in model.modules():
        if isinstance(m, FusedMoE):
            ts = [*m.experts.parameters(), *m.experts.buffers()]
            r = m.router
            share |= {t.data_ptr(): (r.top_k + r.shared) / (r.num_experts + r.shared) for t in ts}
            tensors += ts
    seen: set[int] = set()
    total = read = 0.0
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            nbytes = t.numel() * t.element_size()
            total += nbytes
            read += nbytes * share.get(t.data_ptr(), 1.0)
    return int(total), int(read)


def fig_decode(llm: Any, s: Sizes) -> dict[str, Any]:
    from inferx_core.bench_offline import copy_bandwidth, random_prompt
    from inferx_core.sequence import SamplingParams

    ex = llm.engine.executor
    prompt = random_prompt(int(ex.hf_config["vocab_size"]), s.decode_in, random.Random(0))
    params = SamplingParams(max_tokens=s.decode_out, temperature=0, ignore_eos=True)
    llm.generate(prompt, params)  # warm-up: the same request, whole
    runs = []
    for _ in range(s.decode_runs):
        stamps = [time.perf_counter() for _ in llm.stream(prompt, params)]
        runs.append((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3)
    all_bytes, wbytes = decode_read_bytes(ex.model)
    bandwidth = copy_bandwidth(ex.device)
    decode = statistics.median(runs)
    floor = wbytes / bandwidth * 1e3
    return {
        "ms_per_token": decode,
        "runs_ms": runs,
        "weight_gb": wbytes / 1e9,  # read a step (routed experts: one token's share)
        "all_weight_gb": all_bytes / 1e9,
        "copy_bandwidth_tb_s": bandwidth / 1e12,
        "floor_ms_per_token": floor,
        "floor_fraction": floor / decode,
    }


def fig_ttft(llm: Any, s: Sizes) -> dict[str, Any]:
    from inferx_core.bench_offline import random_prompt
    from inferx_core.sequence import SamplingParams

    vocab = int(llm.engine.executor.hf_config["vocab_size"])
    rng = random.Random(1)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    out: dict[str, Any] = {}
    for n in s.ttft_lens:
        try:
            if n + 1 > llm.engine.max_model_len:
                raise ValueError(f"{n} tokens exceed max_model_len {llm.engine.max_model_len}")
            llm.generate(random_prompt(vocab, n, rng), one)  # warm-up: compiles this shape
            times = []
            for _ in range(s.ttft_runs):
                prompt = random_prompt(vocab, n, rng)  # fresh: no prefix to reuse
                t0 = time.perf_counter()
                llm.generate(prompt, one)
                times.append(time.perf_counter() - t0)
            median = statistics.median(times)
            out[str(n)] = {
                "ttft_ms": median * 1e3,
                "prefill_tok_s": n / median,
                "runs_ms": [t * 1e3 for t in times],
            }
        except Exception as exc:  # one length failing keeps the other
            out[str(n)] = error_of(exc)
    return out


def fig_throughput(llm: Any, s: Sizes) -> dict[str, Any]:
    from inferx_core.bench_offline import random_prompt
    from inferx_core.sequence import SamplingParams

    vocab = int(llm.engine.executor.hf_config["vocab_size"])
    rng = random.Random(2)
    prompts = [random_prompt(vocab, s.tput_in, rng) for _ in range(s.tput_prompts)]
    warm = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate(prompts[:16], warm)
    params = SamplingParams(max_tokens=s.tput_out, temperature=0, ignore_eos=True)
    kernels = triton_kernels()
    t0 = time.perf_counter()
    done = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(d.token_ids) for d in done)
    return {
        "num_prompts": s.tput_prompts,
        "input_len": s.tput_in,
        "output_len": s.tput_out,
        "elapsed_s": elapsed,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (out_tokens + s.tput_prompts * s.tput_in) / elapsed,
        "triton_compiled": sorted(triton_kernels() - kernels),  # mid-run compiles stall steps
    }


def error_of(exc: BaseException) -> dict[str, Any]:
    tb = traceback.format_exception(exc)
    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": "".join(tb)[-3000:]}


def write_json(path: Path, doc: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def apply_patches(patches: list[str]) -> dict[str, str]:
    """--patch NAME=VALUE, each in this process: MODULE.NAME (a module global),
    MODULE.CLASS.NAME (a class attribute) or MODULE.CLASS().NAME (set on every instance after
    its __init__, for attributes __init__ sets), VALUE a Python literal. Returns each name's
    value as read back (repr)."""
    import ast
    import importlib

    def owner_of(path: str) -> Any:
        try:
            return importlib.import_module(path)
        except ImportError:
            module, _, name = path.rpartition(".")
            return getattr(importlib.import_module(module), name)

    applied = {}
    for item in patches:
        name, value = item.split("=", 1)
        owner, _, attr = name.rpartition(".")
        val = ast.literal_eval(value)
        if owner.endswith("()"):
            cls = owner_of(owner[:-2])
            init = cls.__init__

            def patched(
                self: Any, *a: Any, _init=init, _attr=attr, _val=val, _name=name, **k: Any
            ) -> None:
                _init(self, *a, **k)
                if not hasattr(self, _attr):  # a typo must not pass as a measured variant
                    raise AttributeError(f"--patch {_name}: the instance has no {_attr!r}")
                setattr(self, _attr, _val)

            cls.__init__ = patched
            try:  # read back where the class builds without arguments; else at its first build
                applied[name] = repr(getattr(cls(), attr))
            except TypeError:
                applied[name] = repr(val)
        else:
            target = owner_of(owner)
            if not hasattr(target, attr):
                raise AttributeError(f"--patch {name}: {owner} has no {attr!r}")
            setattr(target, attr, val)
            applied[name] = repr(getattr(owner_of(owner), attr))
    return applied


def offline_child(spec_path: str) -> int:
    """`_offline SPEC.json`: build one engine, write its start-up, then each figure, to the
    spec's `out` as each is done. The spec: overrides, figures, sizes, out, spawned_at."""
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    sizes = Sizes(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["sizes"].items()})
    result: dict[str, Any] = {}
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        import torch

        from inferx_core.config import load_config
        from inferx_core.engine import LLM

        patched = apply_patches(spec.get("patches", []))
        imported = time.time()
        cached = triton_kernels()
        t0 = time.perf_counter()
        llm = LLM(load_config(None, spec["overrides"]))
        engine_s = time.perf_counter() - t0
        compiled = len(triton_kernels() - cached)  # kernels start-up compiled (cache misses)
    except Exception as exc:
        result["startup"] = error_of(exc)
        write_json(out, result)
        traceback.print_exc()
        return 1
    ex = llm.engine.executor
    report = ex.report
    on_gpu = ex.device.type == "cuda"
    result["startup"] = {
        "spawn_to_ready_s": time.time() - spec["spawned_at"],
        "imports_s": imported - spec["spawned_at"],
        "engine_s": engine_s,
        "parts_s": dict(report.seconds),
        "triton_compiled": compiled,
        "compiles": getattr(report, "compiles", {}),  # the dry run's (jit_compile.summarize)
        "memory_gib": {k: v / GiB for k, v in getattr(report, "memory", {}).items()},
        "num_kv_blocks": ex.num_kv_blocks,
        "kv_block_size": ex.block_size,
        "kv_bytes_per_block": ex.attention.bytes_per_block(),  # every layer's
        "kv_groups": len(ex.kv_groups),
        "attention_backend": type(ex.attention).__name__,
        "cuda_graph_sizes": len(ex.graphs.sizes) if getattr(ex, "graphs", None) else 0,
        "eager_reason": getattr(ex, "eager_reason", None),
        "device": torch.cuda.get_device_name(ex.device) if on_gpu else "cpu",
        "dtype": str(ex.dtype).removeprefix("torch."),
        "torch": torch.__version__,
    }
    if patched:
        result["startup"]["patched"] = patched
    write_json(out, result)
    print(f"ready in {result['startup']['spawn_to_ready_s']:.1f} s", flush=True)
    figures = {"decode": fig_decode, "ttft": fig_ttft, "throughput": fig_throughput}
    for name in spec["figures"]:
        t0 = time.perf_counter()
        clocks = GpuClocks(out.with_name(f"clocks-{out.stem}-{name}.csv"))
        try:
            with clocks:
                result[name] = figures[name](llm, sizes)
        except Exception as exc:
            result[name] = error_of(exc)
            traceback.print_exc()
        result[name]["seconds"] = time.perf_counter() - t0
        result[name]["gpu_clocks"] = clocks.summary
        write_json(out, result)
        print(
            f"{name} done in {result[name]['seconds']:.1f} s; {describe(clocks.summary)}",
            flush=True,
        )
    return 0


# -- the conductor -------------------------------------------------------------------------------


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def stop(proc: subprocess.Popen, grace: float) -> int | None:
    """SIGTERM (the server drains), then SIGKILL to the child's own process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        kill(proc)
    return proc.returncode


def kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # started with start_new_session: its own group
    proc.wait()


def fallback_blocks(preset: str, block_size: int = 16) -> int:
    """kv_cache.num_blocks worth FALLBACK_KV_BYTES of bf16 KV for the preset's shapes, and no
    more than 65,536 (a million tokens, plenty for these loads; tiny models on a CPU)."""
    from inferx_models.presets import preset as preset_config

    c = preset_config(preset)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * c["num_key_value_heads"] * head_dim  # a key and a value a head
    if "kv_lora_rank" in c:  # MLA (DeepSeek-V2): one latent and one rope key a token
        per_token = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    per_block = c["num_hidden_layers"] * per_token * 2 * block_size
    return min(FALLBACK_KV_BYTES // per_block, 1 << 16)


def exact_prompts(tokenizer_dir: Path, n: int, count: int, seed: int) -> list[str]:
    """Texts of exactly n tokens as the server counts them (inferx-bench serve's own way)."""
    from inferx_core.tokenizer import Tokenizer
    from inferx_server.bench import exact_texts

    return exact_texts(Tokenizer.from_dir(tokenizer_dir), n, count, random.Random(seed))


@dataclass
class Run:
    """One invocation: options, the JSON document and where it goes, the clock."""

    args: argparse.Namespace
    sizes: Sizes
    only: tuple[str, ...]
    out: Path
    logs: Path
    deadline: float
    doc: dict[str, Any] = field(default_factory=dict)
    tokenizers: dict[str, Path] = field(default_factory=dict)  # derived ones, by preset

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        write_json(self.out, self.doc)


def tokenizer_dir(run: Run, preset: str) -> Path:
    """The preset's tokenizer: under --tokenizers, or the one derived for this run."""
    return run.tokenizers.get(preset) or Path(run.args.tokenizers) / tokenizer_name(preset)


def derive_tokenizers(root: Path, presets: list[str], scratch: Path) -> dict[str, Path | str]:
    """For each preset whose tokenizer --tokenizers lacks but can derive (DERIVED_TOKENIZERS):
    the directory it was derived into under scratch, or why it could not be."""
    from inferx_models.derived_tokenizers import BY_MODEL_TYPE
    from inferx_models.presets import preset as preset_config

    made: dict[str, Path | str] = {}
    for preset in presets:
        name = tokenizer_name(preset)
        if name not in DERIVED_TOKENIZERS or (root / name / "tokenizer.json").is_file():
            continue
        source = root / DERIVED_TOKENIZERS[name]
        if not (source / "tokenizer.json").is_file():
            made[preset] = f"no {root / name} nor {source}/tokenizer.json to derive it from"
            continue
        c = preset_config(preset)
        try:
            made[preset] = BY_MODEL_TYPE[c["model_type"]].write(
                source, scratch / preset, int(c["vocab_size"])
            )
        except (ValueError, KeyError) as exc:
            made[preset] = f"no {name} tokenizer derived from {source}: {exc}"
    return made


def overrides_for(run: Run, preset: str, server: bool, fallback: bool) -> dict[str, str]:
    a = run.args
    o = {
        "model.preset": preset,
        "model.tokenizer": str(tokenizer_dir(run, preset)),
        "model.dtype": a.dtype,
        "engine.device": a.device,
        "engine.attention_backend": a.attention_backend,
        "kv_cache.memory": a.kv_cache_memory,
        "scheduler.max_batched_tokens": str(run.sizes.max_batched_tokens),
        "scheduler.prefill_chunk": str(run.sizes.max_batched_tokens),
        # As the peer was measured: prefix caching off offline, the default (on) when serving.
        "scheduler.prefix_cache": "true" if server else "false",
    }
    o |= dict(kv.split("=", 1) for kv in a.set)
    if o.get("model.path"):  # a checkpoint of the preset's shapes on disk (e.g. W4A16's)
        del o["model.preset"]
    if fallback:
        del o["kv_cache.memory"]
        o["kv_cache.num_blocks"] = str(fallback_blocks(preset))
    if server:
        o |= {"server.host": "127.0.0.1", "server.port": "0", "server.drain_timeout": "5"}
    return o


def run_offline(
    run: Run, preset: str, figures: list[str], timeout: float, fallback: bool, tag: str
) -> dict[str, Any]:
    """The offline child, killed after `timeout` s; returns what it wrote, missing figures
    (and start-up, if it never got there) as errors that say why."""
    out = run.logs / f"offline-{preset}{tag}.json"
    log = run.logs / f"offline-{preset}{tag}.log"
    out.unlink(missing_ok=True)
    overrides = overrides_for(run, preset, server=False, fallback=fallback)
    spec = {
        "overrides": overrides,
        "figures": figures,
        "sizes": asdict(run.sizes),
        "patches": list(run.args.patch),
        "out": str(out),
        "spawned_at": time.time(),
    }
    spec_path = run.logs / f"offline-{preset}{tag}.spec.json"
    write_json(spec_path, spec)
    cmd = [sys.executable, str(Path(__file__).resolve()), "_offline", str(spec_path)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout)
            why = f"the offline process exited with {rc}"
        except subprocess.TimeoutExpired:
            kill(proc)
            rc = None
            why = f"the offline process was stopped at its {timeout:.0f} s limit"
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        result = {}
    if "error" in result.get("startup", {}):
        why = "the engine did not start: " + result["startup"]["error"].splitlines()[0]
    for name in ["startup", *figures]:
        if name not in result:
            result[name] = {"error": f"not measured: {why} (log {log}):\n{log_tail(log)}"}
    result["startup"]["overrides"] = overrides
    return result


def wait_ready(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    """The server's URL once /health answers 200; raises if it exits or `timeout` passes."""
    t_end = time.monotonic() + timeout
    url = None
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            tail = log_tail(log)
            last = tail.splitlines()[-1] if tail else ""
            raise RuntimeError(f"inferx-server exited with {proc.returncode}: {last}\n{tail}")
        if url is None:
            m = re.search(r"listening on (http://\S+)", log.read_text(errors="replace"))
            url = m.group(1) if m else None
        if url is not None:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return url
            except OSError:
                pass
        time.sleep(0.2)
    raise TimeoutError(f"inferx-server was not ready within {timeout:.0f} s:\n{log_tail(log)}")


def served_model(url: str, fallback: str) -> str:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            return json.loads(r.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        return fallback


def load(
    url: str,
    model: str,
    prompts: list[str],
    concurrency: int,
    s: Sizes,
    timeout: float,
    endpoint: str = "completions",
    response_format: str | None = None,
) -> dict[str, Any]:
    """One `inferx-bench serve` run (its client and summary) over our exact prompts; chat: each
    prompt as a user message (its template's tokens added), with response_format if given."""
    from inferx_server import bench

    ns = argparse.Namespace(
        base_url=url,
        model=model,
        api_key=None,
        endpoint=endpoint,
        response_format=response_format,
        output_len=s.serve_out,
        concurrency=concurrency,
        request_rate=0.0,
        seed=0,
        timeout=timeout,
        no_keep_alive=False,
    )

    async def go() -> tuple[list[Any], float]:
        return await asyncio.wait_for(bench.run_load(ns, prompts), timeout)

    results, duration = asyncio.run(go())
    summary = bench.summarize(results, duration)
    done = summary["completed"]
    summary |= {
        "concurrency": concurrency,
        "num_prompts": len(prompts),
        "input_len": s.serve_in,
        "output_len": s.serve_out,
        "server_input_tokens_per_request": summary["total_input_tokens"] / done if done else 0,
    }
    return summary


def serve_prompts(run: Run, preset: str) -> dict[int, list[list[str]]]:
    """Each concurrency's prompts, one fresh set a round: the server caches prefixes, so a round
    that repeated the last one's prompts would skip their prefill."""
    s = run.sizes
    tok_dir = tokenizer_dir(run, preset)
    return {
        c: [
            exact_prompts(tok_dir, s.serve_in, s.num_prompts(c), seed=c + 1000 * i)
            for i in range(s.serve_rounds)
        ]
        for c in s.concurrency
    }


def triton_kernels() -> set[str]:
    """The compiled kernels in Triton's on-disk cache (one <hash>/<name>.json each): what a
    server compiles while serving shows up as new entries between two calls."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    if not root.is_dir():
        return set()
    return {
        f"{f.parent.name[:8]}/{f.stem}"
        for f in root.glob("*/*.json")
        if not f.name.startswith("__grp__")
    }


def run_serve(
    run: Run,
    preset: str,
    prompts: dict[int, list[list[str]]],
    deadline: float,
    fallback: bool,
    serve: dict[str, Any],
    startup: dict[str, Any],
) -> None:
    """Start inferx-server, load it at each concurrency, SIGTERM it. Fills `serve` (results by
    concurrency) and `startup` (the server's) in place, so each save has them."""
    s = run.sizes
    log = run.logs / f"server-{preset}{'-fallback' if fallback else ''}.log"
    overrides = overrides_for(run, preset, server=True, fallback=fallback)
    from inferx_core.config import flag_name

    cmd = [sys.executable, "-m", "inferx_server.cli"]
    for key, value in overrides.items():
        cmd += [f"--{flag_name(key)}", value]
    startup["overrides"] = overrides
    startup["log"] = str(log)
    with open(log, "w") as f:
        t0 = time.monotonic()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        try:
            url = wait_ready(proc, log, min(SERVER_START_CAP_S, deadline - time.monotonic()))
        except Exception as exc:
            startup |= error_of(exc)
            startup["exit_code"] = stop(proc, grace=10)
            return
        try:
            ready = time.monotonic() - t0
            m = re.search(r"loaded in ([\d.]+) s", log.read_text(errors="replace"))
            startup["spawn_to_ready_s"] = ready
            startup["loaded_in_s"] = float(m.group(1)) if m else None
            run.save()
            print(f"[{preset}] inferx-server ready in {ready:.1f} s", flush=True)
            model = served_model(url, preset)
            skip = ""
            for c in s.concurrency:
                left = deadline - time.monotonic() - 10  # room to stop the server
                if not skip and left < 10:
                    skip = "skipped: the time budget was spent"
                if skip:
                    serve[str(c)] = {"error": skip}
                    continue
                try:
                    rounds = []
                    for i in range(s.serve_rounds):
                        left = deadline - time.monotonic() - 10
                        if i and left < 10:
                            break  # the rounds done so far stand
                        kernels = triton_kernels()
                        clocks = GpuClocks(run.logs / f"clocks-{preset}-c{c}-{i + 1}.csv")
                        with clocks:
                            r = load(
                                url, model, prompts[c][i], c, s, min(SERVE_RUN_CAP_S, left),
                                run.args.serve_endpoint, run.args.response_format,
                            )  # fmt: skip
                        r["gpu_clocks"] = clocks.summary
                        # Kernels compiled mid-run: start-up's warm-up should have done them all.
                        r["triton_compiled"] = sorted(triton_kernels() - kernels)
                        rounds.append(r)
                        print(
                            f"[{preset}] serve c={c}: {r['output_throughput']:.0f} tok/s, "
                            f"{r['completed']}/{r['num_prompts']} done; Triton kernels compiled "
                            f"during the run: {r['triton_compiled'] or 'none'}; "
                            f"{describe(r['gpu_clocks'])}",
                            flush=True,
                        )
                    serve[str(c)] = median_round(rounds)
                except Exception as exc:
                    failed = error_of(exc)
                    if isinstance(exc, TimeoutError):  # larger loads would overrun too
                        skip = f"skipped: the run at {c} clients overran its time"
                    if proc.poll() is not None:
                        failed["error"] += f"\nserver log:\n{log_tail(log)}"
                        skip = "skipped: the server died"
                    serve[str(c)] = failed
                    if rounds:  # the rounds done before the failure stand, the failure beside
                        serve[str(c)] = {**median_round(rounds), "round_error": failed["error"]}
                run.save()
        finally:
            startup["exit_code"] = stop(proc, grace=30)


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median output throughput (the lower middle of an even count), with every
    run's throughput in run order as `rounds_tok_s` when there was more than one."""
    ranked = sorted(rounds, key=lambda r: r["output_throughput"])
    r = dict(ranked[(len(ranked) - 1) // 2])
    if len(rounds) > 1:
        r["rounds_tok_s"] = [x["output_throughput"] for x in rounds]
        r["rounds_gpu_clocks"] = [x.get("gpu_clocks") for x in rounds]
    return r


def run_model(run: Run, preset: str, models_left: int) -> None:
    start = time.monotonic()
    share = run.left() / models_left
    deadline = start + share
    res: dict[str, Any] = run.doc["models"].setdefault(preset, {})
    res["budget_s"] = share
    if run.args.set or run.args.patch:
        res["set"] = list(run.args.set) + list(run.args.patch)
    if run.args.serve_endpoint != "completions" or run.args.response_format:
        res["serve_requests"] = {
            "endpoint": run.args.serve_endpoint,
            "response_format": run.args.response_format,
        }
    if share < 20:
        for name in run.only:
            res[name] = {"error": "skipped: the time budget was spent"}
        return
    figures = [f for f in OFFLINE if f in run.only]
    fallback = False
    if figures or "startup" in run.only:
        offline_deadline = start + share * (0.45 if "serve" in run.only else 1.0)
        got = run_offline(run, preset, figures, offline_deadline - time.monotonic(), False, "")
        retry_left = offline_deadline - time.monotonic()
        if "error" in got["startup"] and retry_left > 30:
            print(
                f"[{preset}] the engine did not start; again with kv_cache.num_blocks", flush=True
            )
            fallback = True
            first = got["startup"]
            got = run_offline(run, preset, figures, retry_left, True, "-fallback")
            got["startup"]["first_attempt"] = first
        res["startup"] = {"offline": got.pop("startup")}
        res.update(got)
        run.save()
        print(f"[{preset}] offline figures done in {time.monotonic() - start:.0f} s", flush=True)
    if "serve" in run.only:
        serve: dict[str, Any] = {}
        server: dict[str, Any] = {}
        res["serve"] = serve
        res.setdefault("startup", {})["server"] = server
        try:
            prompts = serve_prompts(run, preset)
        except Exception as exc:
            server |= error_of(exc)
            server["error"] = f"no prompts, so no server: {server['error']}"
        else:
            run_serve(run, preset, prompts, deadline, fallback, serve, server)
            if "error" in server and not fallback and deadline - time.monotonic() > 60:
                print(
                    f"[{preset}] the server did not start; again with kv_cache.num_blocks",
                    flush=True,
                )
                first = dict(server)
                server.clear()
                server["first_attempt"] = first
                run_serve(run, preset, prompts, deadline, True, serve, server)
        if "error" in server:
            why = server["error"].splitlines()[0]
            for c in run.sizes.concurrency:
                serve.setdefault(str(c), {"error": f"not measured: {why}"})
        run.save()
    res["seconds"] = time.monotonic() - start
    run.save()


# -- the table -----------------------------------------------------------------------------------


def _num(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


def _cell(fig: Any, render: Any) -> str:
    if not isinstance(fig, dict) or not fig:  # not measured
        return ""
    if "error" in fig:
        return "error: " + fig["error"].splitlines()[0][:120].replace("|", "/")
    try:
        return render(fig)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        return f"unreadable result ({exc})"


def _startup(st: dict[str, Any]) -> str:
    parts = ", ".join(f"{k} {v:.1f}" for k, v in st.get("parts_s", {}).items())
    text = f"{st['spawn_to_ready_s']:.1f}"
    if "imports_s" in st:
        text += f" (imports {st['imports_s']:.1f}; {parts})"
        if "triton_compiled" in st:
            text += f", {st['triton_compiled']} Triton kernels compiled"
    elif st.get("loaded_in_s") is not None:
        text += f" (engine and transport {st['loaded_in_s']:.1f})"
    if "first_attempt" in st:
        text += " [second start, kv_cache.num_blocks]"
    return text


def _memory(st: dict[str, Any]) -> str:
    m = st.get("memory_gib") or {}
    text = f"{st['num_kv_blocks']:,} blocks"
    if "kv_bytes_per_block" in st:
        size, groups = st["kv_block_size"], st.get("kv_groups", 1)
        slots = "tokens" if groups == 1 else f"token slots ({groups} KV groups share them)"
        text += (
            f" = {st['num_kv_blocks'] * size:,} {slots}, "
            f"{st['kv_bytes_per_block'] / size:,.0f} B/token"
        )
    if m:
        text += (
            f", {m['kv_cache']:.1f} GiB (weights {m['weights']:.2f}, activation peak "
            f"{m['activations']:.2f}, graphs ~{m['cuda_graphs']:.2f}, other "
            f"{m['other']:.2f} of {m['total']:.1f})"
        )
    return text


def _decode(d: dict[str, Any]) -> str:
    read = f"{d['weight_gb']:.2f} GB"
    if d.get("all_weight_gb", d["weight_gb"]) > d["weight_gb"] * 1.001:  # MoE: a token's share
        read += f" of {d['all_weight_gb']:.2f}"
    return (
        f"{d['ms_per_token']:.3f} (floor {d['floor_ms_per_token']:.3f}: {read}"
        f" at {d['copy_bandwidth_tb_s']:.2f} TB/s; {d['floor_fraction']:.0%} of it)"
    )


def _ttft(t: dict[str, Any]) -> str:
    return f"{t['ttft_ms']:.1f} ({_num(t['prefill_tok_s'], 0)})"


def _clocks(fig: dict[str, Any]) -> str:
    """'; GPU 1,740 MHz, 695 W, capped 98%' for a figure whose run sampled busy clocks."""
    c = fig.get("gpu_clocks") or {}
    if not c.get("busy_samples"):
        return ""
    return (
        f"; GPU {_num(c['sm_mhz_median'], 0)} MHz, {c['power_w_mean']:.0f} W, "
        f"capped {c['power_capped']:.0%}"
    )


def _throughput(t: dict[str, Any]) -> str:
    return _num(t["output_tok_s"], 0) + _clocks(t)


def _serve(r: dict[str, Any]) -> str:
    text = (
        f"{_num(r['output_throughput'], 0)} tok/s, TTFT {r['ttft_ms']['mean']:.1f}, "
        f"TPOT {r['tpot_ms']['mean']:.2f}, ITL {r['itl_ms']['median']:.2f} / "
        f"{r['itl_ms']['p99']:.1f}"
    )
    rounds = r.get("rounds_tok_s") or []
    if len(rounds) > 1:
        text += f" (median of {len(rounds)}: {' / '.join(_num(t, 0) for t in rounds)})"
    if "round_error" in r:
        text += f"; a later round failed: {r['round_error'].splitlines()[0]}"
    return text + (f"; {r['failed']} failed" if r["failed"] else "") + _clocks(r)


def table(preset: str, res: dict[str, Any], s: Sizes) -> str:
    """One model's markdown table: our figures beside the peer's and the goals."""
    peers = peers_for(preset, res.get("set") or [])
    st = res.get("startup", {})
    off = st.get("offline", {})
    head = f"### {preset}"
    if "device" in off:
        graphs = off["cuda_graph_sizes"]
        mode = f"CUDA graphs ({graphs} sizes)" if graphs else f"eager ({off['eager_reason']})"
        head += f" ({off['device']}, {off['dtype']}, {off['attention_backend']}, {mode})"
    if res.get("set"):
        head += f" [{', '.join(res['set'])}]"
    if req := res.get("serve_requests"):
        head += f" [serve: {req['endpoint']}, response_format {req['response_format']}]"
    rows = [head, "", "| figure | InferX | vLLM 0.26.0 | goal |", "|---|---:|---:|---|"]

    def row(label: str, key: str, value: str) -> None:
        peer, goal = peers.get(key, ("", ""))
        rows.append(f"| {label} | {value} | {peer} | {goal} |")

    decode = f"batch-1 decode, {s.decode_in} in / {s.decode_out} out, ms/token"
    row(decode, "decode", _cell(res.get("decode"), _decode))
    ttft = res.get("ttft") or {}
    for n in s.ttft_lens:
        label = f"TTFT, {n}-token prompt, ms (prefill tok/s)"
        row(label, f"ttft_{n}", _cell(ttft if "error" in ttft else ttft.get(str(n)), _ttft))
    label = f"offline {s.tput_prompts} x {s.tput_in} in / {s.tput_out} out, output tok/s"
    row(label, "throughput", _cell(res.get("throughput"), _throughput))
    serve = res.get("serve", {})
    for c in s.concurrency:
        label = f"online, concurrency {c}: output tok/s, mean TTFT, TPOT, ITL p50 / p99 (ms)"
        row(label, f"serve_{c}", _cell(serve.get(str(c)), _serve))
    row("start to ready, offline engine, s", "startup_offline", _cell(off, _startup))
    row("start to ready, inferx-server, s", "startup_server", _cell(st.get("server"), _startup))
    row("KV cache (profiled at start-up)", "kv", _cell(off, _memory))
    if "error" in res:
        rows.append(f"\nerror: {res['error']}")
    return "\n".join(rows)


# -- main ----------------------------------------------------------------------------------------


def _list(value: str) -> list[str]:
    return [v for v in value.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_offline"]:
        return offline_child(argv[1])
    ap = argparse.ArgumentParser(prog="gpu_table.py", description=__doc__.split("\n")[0])
    ap.add_argument("--models", type=_list, help=f"presets, comma-separated (default: {MODELS})")
    ap.add_argument("--only", type=_list, default=list(FIGURES), help=",".join(FIGURES))
    ap.add_argument("--quick", action="store_true", help="tiny sizes: the plumbing, on a CPU")
    ap.add_argument(
        "--tokenizers",
        default=".carry/tok/tokenizers",
        help="directory holding qwen/, llama3/, gpt-oss/ (deepseek-v2/ is derived from llama3/)",
    )
    ap.add_argument("--budget-s", type=float, default=450.0, help="wall-clock bound of the run")
    ap.add_argument("--json", help="default: $OUT/gpu-table.json, else ./gpu-table.json")
    ap.add_argument("--dtype", help="default: bfloat16 (auto with --quick)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention-backend", help="default: triton (auto with --quick)")
    ap.add_argument("--kv-cache-memory", help="default: 0.9 (256MiB with --quick)")
    ap.add_argument("--concurrency", type=lambda v: tuple(int(c) for c in _list(v)))
    ap.add_argument(
        "--serve-rounds", type=int, default=1, help="runs at each concurrency (the median's)"
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every engine, e.g. quantization.scheme=fp8 (repeatable)",
    )
    ap.add_argument(
        "--serve-endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="serve's requests: completions (the table's) or chat (the prompt as a user message)",
    )
    ap.add_argument(
        "--response-format",
        metavar="JSON",
        help="serve: every request's response_format (needs --serve-endpoint chat), e.g. "
        '\'{"type": "json_object"}\': structured output\'s cost against plain chat',
    )
    ap.add_argument(
        "--patch",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set a module or class attribute in the offline engine's process, for A/B of a "
        "kernel default: MODULE.NAME, MODULE.CLASS.NAME or MODULE.CLASS().NAME (per instance), "
        "e.g. inferx_kernels_cuda.moe_kernels.GEMV_DOWN_SPLIT_K=2 (repeatable; not with serve)",
    )
    args = ap.parse_args(argv)
    bad = [kv for kv in args.set + args.patch if "=" not in kv]
    if bad:
        ap.error(f"--set and --patch take KEY=VALUE, got {', '.join(bad)}")
    unknown = [f for f in args.only if f not in FIGURES]
    if unknown:
        ap.error(f"--only: unknown figure(s) {', '.join(unknown)}; known: {', '.join(FIGURES)}")
    if args.response_format is not None:
        if args.serve_endpoint != "chat":
            ap.error("--response-format needs --serve-endpoint chat")
        try:
            json.loads(args.response_format)
        except ValueError as exc:
            ap.error(f"--response-format is not JSON: {exc}")
    if args.patch and {"serve", "startup"} & set(args.only):
        ap.error("--patch applies to the offline engine only: leave serve and startup out (--only)")
    q = args.quick
    args.models = args.models or (["tiny-qwen2"] if q else list(MODELS))
    args.dtype = args.dtype or ("auto" if q else "bfloat16")
    args.attention_backend = args.attention_backend or ("auto" if q else "triton")
    args.kv_cache_memory = args.kv_cache_memory or ("256MiB" if q else "0.9")
    sizes = QUICK if q else Sizes()
    if args.concurrency:
        sizes = replace(sizes, concurrency=args.concurrency)
    if args.serve_rounds < 1:
        ap.error(f"--serve-rounds must be at least 1, got {args.serve_rounds}")
    sizes = replace(sizes, serve_rounds=args.serve_rounds)
    scratch = tempfile.TemporaryDirectory(prefix="gpu-table-tokenizers-")
    derived = derive_tokenizers(Path(args.tokenizers), args.models, Path(scratch.name))
    missing = {p: why for p, why in derived.items() if isinstance(why, str)}
    for preset in args.models:
        tok = Path(args.tokenizers) / tokenizer_name(preset) / "tokenizer.json"
        if preset not in derived and not tok.is_file():
            missing[preset] = f"no {tok}: copy ../shared/fixtures/tokenizers/ there"
    if len(missing) == len(args.models):
        ap.error("; ".join(missing.values()))
    out = Path(args.json or Path(os.environ.get("OUT", ".")) / "gpu-table.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.parent / "gpu-table-logs"
    logs.mkdir(exist_ok=True)
    sha = commit_id()
    run = Run(args, sizes, tuple(args.only), out, logs, time.monotonic() + args.budget_s)
    run.tokenizers = {p: d for p, d in derived.items() if isinstance(d, Path)}
    run.doc = {
        "meta": {
            "commit": sha,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": [Path(sys.argv[0]).name, *argv],
            "budget_s": args.budget_s,
            "sizes": asdict(sizes),
            "tokenizers": {
                p: f"derived from {Path(args.tokenizers) / DERIVED_TOKENIZERS[tokenizer_name(p)]}"
                if p in run.tokenizers
                else str(tokenizer_dir(run, p))
                for p in args.models
            },
        },
        "peers": PEERS,
        "variant_peers": {f"{p} [{v}]": peers for (p, v), peers in VARIANT_PEERS.items()},
        "models": {},
    }
    run.save()
    t0 = time.monotonic()
    for i, preset in enumerate(args.models):
        print(f"[{preset}] start ({run.left():.0f} s of the budget left)", flush=True)
        try:
            if preset in missing:  # the other models still run
                print(f"[{preset}] skipped: {missing[preset]}", flush=True)
                run.doc["models"][preset] = {"error": missing[preset]}
            else:
                run_model(run, preset, len(args.models) - i)
        except Exception as exc:  # the conductor's own bug: keep the other models
            run.doc["models"].setdefault(preset, {})["error"] = error_of(exc)["error"]
            traceback.print_exc()
        run.save()
        print("\n" + table(preset, run.doc["models"][preset], sizes) + "\n", flush=True)
    run.doc["meta"]["seconds"] = time.monotonic() - t0
    run.save()
    scratch.cleanup()
    print(f"raw results: {out} ({run.doc['meta']['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
