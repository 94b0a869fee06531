"""skinny_linear (the split-K Triton GEMV) against cuBLAS on the decode shapes of Qwen2.5-3B and
Llama-3.1-8B: one run gives the timings to tune inferx_kernels_cuda.gemv.pick_config from.

    python benchmarks/bench_gemv.py [--models qwen2.5-3b,llama-3.1-8b] [--m 1,2,4,8,16,64]
        [--shapes qkv,o,gate_up,down,lm_head,gate_up_silu] [--grid small|full|none] [--no-graph]
        [--budget-s 60] [--json OUT.json]

For every linear layer shape (bf16 weights [N, K], x [M, K]) and every M it times
torch.nn.functional.linear (cuBLAS) and skinny_linear under each candidate config (pick_config's
first, then a grid around it; `--grid full` for a wider one) two ways. gate_up_silu is gate_up
followed by SiLU-and-mul: cuBLAS plus TritonOps.silu_and_mul (two launches, as the model runs
it) against skinny_linear(gated=True) (one, with the activation in its epilogue).

- bench: triton.testing.do_bench, median µs of single calls with L2 flushed before each;
- graph: µs per call of 20 calls captured in one CUDA graph and replayed, cycling over enough
  copies of the weight (>= 256 MB in all) that every call reads its weights from HBM, as the
  layers of a decode step do. This is the decode-step proxy (it includes the in-graph launch
  gap, two of them for a split-K config) and picks the best config; --no-graph ranks by bench.

Each config's output is checked against cuBLAS first (max error over max |y| <= 1e-2); a config
that fails is reported and not ranked. TB/s = weight bytes / time. M runs in the outer loop, so
when --budget-s runs out (on a cold Triton cache the compiles take much of it) the rest is
timed with cuBLAS and pick_config only, and the small-M results are the complete ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing
from commit_id import commit_id

from inferx_kernels_cuda.gemv import MAX_ROWS, GemvConfig, pick_config, skinny_linear, split_for
from inferx_kernels_cuda.ops import TritonOps
from inferx_models.presets import preset

# Benchmark name -> the model preset (inferx_models.presets) whose exact shapes it uses.
MODELS = {"qwen2.5-3b": "qwen2.5-3b-instruct", "llama-3.1-8b": "llama-3.1-8b-instruct"}
GRAPH_CALLS = 20
# Weight copies a graph cycles over add up to at least this much, several times the H200's
# 50 MB L2, so no call finds its weights cached.
COLD_BYTES = 256 << 20
MAX_REL_ERR = 1e-2


@dataclass(frozen=True)
class Shape:
    """One linear layer: y [M, n] = x [M, k] @ W[n, k].T (+ bias)."""

    model: str
    name: str
    n: int
    k: int
    bias: bool
    gated: bool = False  # silu(gate) * up of the product (skinny_linear's gated=True)

    def weight_bytes(self, elem: int = 2) -> int:
        return (self.n * self.k + (self.n if self.bias else 0)) * elem


def linear_shapes(model: str) -> list[Shape]:
    """The five GEMMs of a decoder step: fused QKV, o_proj, fused gate_up, down_proj, lm_head;
    and gate_up_silu, gate_up with SiLU-and-mul after it (cuBLAS + silu_and_mul against the
    fused skinny_linear)."""
    c = preset(MODELS[model])
    h, i = c["hidden_size"], c["intermediate_size"]
    head_dim = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    qkv_bias = c["architectures"][0] == "Qwen2ForCausalLM" or bool(c.get("attention_bias"))
    return [
        Shape(model, "qkv", q + 2 * kv, h, qkv_bias),
        Shape(model, "o", h, q, False),
        Shape(model, "gate_up", 2 * i, h, False),
        Shape(model, "down", h, i, False),
        Shape(model, "lm_head", c["vocab_size"], h, False),
        Shape(model, "gate_up_silu", 2 * i, h, False, gated=True),
    ]


def candidate_configs(m: int, n: int, k: int, num_sms: int, grid: str) -> list[GemvConfig]:
    """pick_config's choice first. Grid "small" adds, each at split_for's split and at split 1:
    FMA tiles of 2048, 4096 and 8192 weights per row of x (8, 16, 32 x 256 at one row; up to 4
    rows) and tensor-core tiles 64x128 (at 2, 3 and 4 stages), 32x256 and 128x64, and each FMA
    tile at its split with prefetch (the next K block loaded before this one's products) at 4
    and 8 warps. "full" adds FMA 16x512 and 32x128 per row and up to 8 rows, dot 16x256 and
    64x256, half and double splits, num_warps 2 and 8. Duplicates dropped, order kept."""
    first = pick_config(m, n, k, num_sms)
    if grid == "none":
        return [first]
    full = grid == "full"
    rows = 1 << max(m - 1, 0).bit_length()
    tiles: list[GemvConfig] = []
    if m <= (8 if full else 4):
        shapes = [(8, 256), (16, 256), (32, 256)] + ([(16, 512), (32, 128)] if full else [])
        tiles += [GemvConfig(block_n=max(1, t // rows), block_k=bk) for t, bk in shapes]
    dot = [(64, 128), (32, 256), (128, 64)] + ([(16, 256), (64, 256)] if full else [])
    tiles += [GemvConfig(block_n=bn, block_k=bk, use_dot=True, num_stages=3) for bn, bk in dot]
    out = [first]
    for tile in tiles:
        split = split_for(-(-n // tile.block_n), k, tile.block_k, num_sms)
        splits = {split, 1} | ({2 * split, max(1, split // 2)} if full else set())
        for s in sorted(splits):
            base = replace(tile, split_k=s)
            out.append(base)
            if tile.use_dot and (tile.block_n, tile.block_k) == (64, 128) and s == split:
                out += [replace(base, num_stages=st) for st in (2, 4)]
            if not tile.use_dot and s == split:
                out += [replace(base, prefetch=True, num_warps=w) for w in (4, 8)]
            if full:
                out += [replace(base, num_warps=w) for w in (2, 8)]
    return list(dict.fromkeys(out))


def compile_key(shape: Shape, m: int, cfg: GemvConfig) -> tuple[Any, ...]:
    """What Triton compiles a separate variant of skinny_linear's kernels for, given that every
    benchmarked N and K is a multiple of 16 (m is not specialised on)."""
    rows = 1 << max(m - 1, 0).bit_length()
    block_m = max(16, rows) if cfg.use_dot else rows
    return (
        block_m,
        cfg.block_n,
        cfg.block_k,
        cfg.use_dot,
        cfg.num_warps,
        cfg.num_stages,
        cfg.prefetch,
        cfg.split_k > 1,
        shape.bias,
        shape.gated,
    )


def _compile_some(items: list[tuple[Shape, int, GemvConfig]]) -> None:
    """Pool worker: one call per (shape, m, config) on uninitialised tensors, which leaves the
    compiled kernels in Triton's on-disk cache for the timing process."""
    dev = torch.device("cuda")
    for shape, m, cfg in items:
        x = torch.empty(m, shape.k, dtype=torch.bfloat16, device=dev)
        w = torch.empty(shape.n, shape.k, dtype=torch.bfloat16, device=dev)
        b = torch.empty(shape.n, dtype=torch.bfloat16, device=dev) if shape.bias else None
        with contextlib.suppress(Exception):  # run_pair reports what fails
            skinny_linear(x, w, b, cfg, gated=shape.gated)
    torch.cuda.synchronize()


def precompile(jobs: list[tuple[Shape, int, GemvConfig]], workers: int) -> int:
    """Compile every kernel variant the jobs need in `workers` spawned processes at once (a
    compile takes ~0.5-1 s of one CPU core, and the small grid needs ~50 variants); returns
    how many variants there were."""
    reps: dict[tuple[Any, ...], tuple[Shape, int, GemvConfig]] = {}
    for shape, m, cfg in jobs:
        reps.setdefault(compile_key(shape, m, cfg), (shape, m, cfg))
    items = list(reps.values())
    chunks = [items[i::workers] for i in range(workers) if items[i::workers]]
    with ProcessPoolExecutor(len(chunks), mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile_some, chunks))
    return len(items)


def bench_us(fn: Callable[[], Any]) -> float:
    """Median µs of single calls, L2 flushed before each (triton.testing.do_bench)."""
    return triton.testing.do_bench(fn, warmup=5, rep=15, return_mode="median") * 1e3


def graph_us(call: Callable[[torch.Tensor], Any], weights: list[torch.Tensor]) -> float:
    """µs per call of GRAPH_CALLS calls captured in one CUDA graph, call i on weights[i % len]:
    median over 10 replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm outside the capture
        for w in weights:
            call(w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(GRAPH_CALLS):
            call(weights[i % len(weights)])
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
    del graph
    return sorted(times)[len(times) // 2]


def cold_weights(n: int, k: int) -> list[torch.Tensor]:
    """Copies of a random bf16 [n, k] weight (at least two) adding up to COLD_BYTES or more, for
    graph_us to cycle over so that no call finds its weight in L2."""
    copies = max(2, -(-COLD_BYTES // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def tbps(nbytes: int, us: float | None) -> float | None:
    return None if us is None or not us > 0 else nbytes / (us * 1e-6) / 1e12


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def run_pair(
    shape: Shape,
    m: int,
    grid: str,
    use_graph: bool,
    num_sms: int,
    log: Callable[[str], None],
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Time cuBLAS and every candidate config on one (shape, M); the row for the JSON."""
    dev = device or torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(m * 7919 + shape.n)
    x = torch.randn(m, shape.k, device=dev, generator=g).to(torch.bfloat16)
    bias = (torch.randn(shape.n, device=dev, generator=g) * 0.1).to(torch.bfloat16)
    bias = bias if shape.bias else None
    nbytes = shape.weight_bytes()
    copies = max(1, min(GRAPH_CALLS, math.ceil(COLD_BYTES / nbytes))) if use_graph else 1
    weights = [
        (torch.randn(shape.n, shape.k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        for _ in range(copies)
    ]
    w0 = weights[0]
    ops = TritonOps()

    def cublas(w: torch.Tensor) -> torch.Tensor:  # what the model runs today
        y = F.linear(x, w, bias)
        return ops.silu_and_mul(y) if shape.gated else y

    def ours(w: torch.Tensor, cfg: GemvConfig) -> torch.Tensor:
        return skinny_linear(x, w, bias, cfg, gated=shape.gated)

    ref = cublas(w0)
    row: dict[str, Any] = {**asdict(shape), "m": m, "weight_bytes": nbytes, "copies": copies}
    cublas_bench = bench_us(lambda: cublas(w0))
    cublas_graph = graph_us(cublas, weights) if use_graph else None
    row["cublas"] = {"bench_us": cublas_bench, "graph_us": cublas_graph}
    results = []
    for cfg in candidate_configs(m, shape.n, shape.k, num_sms, grid):
        res: dict[str, Any] = {"config": str(cfg), **asdict(cfg)}
        try:
            res["rel_err"] = err = rel_err(ours(w0, cfg), ref)
            if not err <= MAX_REL_ERR:
                raise AssertionError(f"max error {err:.2e} of max |y| against cuBLAS")
            res["bench_us"] = bench_us(lambda cfg=cfg: ours(w0, cfg))
            if use_graph:
                res["graph_us"] = graph_us(lambda w, cfg=cfg: ours(w, cfg), weights)
        except Exception as e:  # a config that does not compile or is wrong: report, go on
            res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            log(f"  {shape.model} {shape.name} M={m} {cfg}: {res['error']}")
        results.append(res)
    row["configs"] = results
    key = "graph_us" if use_graph else "bench_us"
    ok = [r for r in results if "error" not in r]
    row["heuristic"] = results[0]["config"]
    row["best"] = min(ok, key=lambda r: r[key])["config"] if ok else None
    row["rank_by"] = key
    return row


def fmt_row(row: dict[str, Any]) -> str:
    """One table line: cuBLAS, pick_config's config and the best, µs and TB/s, and speed-ups."""
    nbytes = row["weight_bytes"]
    by_name = {r["config"]: r for r in row["configs"]}

    def cell(r: dict[str, Any] | None) -> str:
        """'bench µs, its TB/s, graph µs' in 22 characters."""
        if r is None or "bench_us" not in r:
            return f"{'failed':>22}"
        g = r.get("graph_us")
        graph = f"{g:7.1f}" if g is not None else f"{'-':>7}"
        return f"{r['bench_us']:8.1f} {tbps(nbytes, r['bench_us']):5.2f} {graph}"

    heur, best = by_name[row["heuristic"]], by_name.get(row["best"] or "")
    cub = row["cublas"]
    key = row["rank_by"]
    speed = f"{cub[key] / best[key]:5.2f}x" if best else "    -"
    return (
        f"{row['model']:<13} {row['name']:<8} {row['n']:>6}x{row['k']:<6} {row['m']:>2} | "
        f"{cell(cub)} | {cell(heur)} {row['heuristic']:<26} | {cell(best)} "
        f"{(row['best'] or '-'):<26} | {speed}"
    )


HEADER = (
    f"{'model':<13} {'shape':<8} {'N x K':>13} {'M':>2} | "
    f"{'cuBLAS us TB/s graph':>22} | {'pick_config us TB/s graph':>22} {'config':<26} | "
    f"{'best us TB/s graph':>22} {'config':<26} | speed-up"
)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--m", default="1,2,4,8,16", help="rows of x, comma-separated, each <= 64")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head,gate_up_silu")
    ap.add_argument("--grid", choices=["none", "small", "full"], default="small")
    ap.add_argument("--no-graph", action="store_true", help="time with do_bench only")
    ap.add_argument("--budget-s", type=float, default=60.0, help="grid search time budget")
    ap.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="processes that compile the kernels before timing (0: compile while timing)",
    )
    ap.add_argument("--json", metavar="OUT", help="write the raw numbers here")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        raise SystemExit(
            "bench_gemv.py times GPU kernels: it needs a CUDA device and compiled Triton "
            f"(torch.cuda.is_available() is {torch.cuda.is_available()}, TRITON_INTERPRET="
            f"{os.environ.get('TRITON_INTERPRET', 'unset')})"
        )
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        ap.error(f"unknown models {sorted(unknown)}; known: {', '.join(MODELS)}")
    ms = [int(v) for v in args.m.split(",")]
    if not all(1 <= m <= MAX_ROWS for m in ms):
        ap.error(f"--m values must be 1..{MAX_ROWS}, got {ms}")
    names = args.shapes.split(",")
    shapes = [
        s for model in args.models.split(",") for s in linear_shapes(model) if s.name in names
    ]
    props = torch.cuda.get_device_properties(0)
    sha = commit_id()
    doc: dict[str, Any] = {
        "meta": {
            "commit": sha,
            "device": props.name,
            "sms": props.multi_processor_count,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "grid": args.grid,
            "graph_calls": GRAPH_CALLS,
            "budget_s": args.budget_s,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": ["bench_gemv.py", *(argv if argv is not None else sys.argv[1:])],
        },
        "rows": [],
    }
    print(
        f"{props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
        f"triton {triton.__version__}, commit {sha}; us = µs per call, TB/s of "
        f"weight bytes; ranked by {'bench' if args.no_graph else 'graph'}"
    )
    t0 = time.monotonic()
    if args.workers > 0:
        jobs = [
            (shape, m, cfg)
            for m in ms
            for shape in shapes
            for cfg in candidate_configs(
                m, shape.n, shape.k, props.multi_processor_count, args.grid
            )
        ]
        variants = precompile(jobs, args.workers)
        print(
            f"compiled {variants} kernel variants in {args.workers} processes: "
            f"{time.monotonic() - t0:.1f} s",
            flush=True,
        )
    print(HEADER, flush=True)
    for m in ms:
        for shape in shapes:
            over = time.monotonic() - t0 > args.budget_s
            grid = "none" if over and args.grid != "none" else args.grid
            row = run_pair(
                shape,
                m,
                grid,
                not args.no_graph,
                props.multi_processor_count,
                lambda s: print(s, file=sys.stderr, flush=True),
            )
            row["grid"] = grid
            doc["rows"].append(row)
            print(fmt_row(row) + ("  (over budget: pick_config only)" if over else ""), flush=True)
            if args.json:  # rewritten after every row, so a cut-off run still leaves its numbers
                Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    main()
