"""Sweep the Triton decode attention's launch options inside CUDA graphs, per batch and context.

    python benchmarks/tune_decode_attention.py [--batches 1,8,64,256] [--contexts 192,1024,4096]
        [--layers 8] [--heads 16,2] [--grid KEY=V1,V2 ...] [--json OUT.json]

The decode step's attention is a decode kernel plus (when the context is split) a reduce
kernel per layer; at batch 1 they cost ~6 us a layer on an H200, at batch 64 ~11 us (profile
in docs/BENCHMARKS.md), mostly latency. For each (batch, context) this captures `--layers`
layers of attention (one cache each, the shapes of Qwen2.5-3B: 16 query heads, 2 KV heads,
head dim 128, bf16, block size 16; `--heads 32,8` for Llama-3.1-8B's) as the decode graphs
do, for every combination of the decode kernel's num_warps, the reduce kernel's num_warps,
min_split_len and target_programs, and prints µs per layer: the default's (and the KV bytes it
reads per second), the best's, and which that is. Outputs are checked against the default's on
the way (a config that changes results is an error, not a winner).
`--grid KEY=V1,V2` (repeatable) sweeps only the keys it names, the others at their default;
decode_stages (the decode kernel's num_stages: Triton's software pipelining of its KV tile
loads), block_n (context tokens per tile), reduce_heads (query heads per reduce program) and
block_size (the cache's tokens a block; its outputs are not compared, the random cache lies
differently), kv_layout (1: each block's tokens of one KV head contiguous, [block, head, token,
dim] under the same logical view; outputs not compared either) and maxnreg (registers a thread
at most, 0: the compiler's choice) are swept only that way.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import torch
from commit_id import commit_id

from inferx_core.batch import make_attention_batch
from inferx_core.interfaces.kv import KVLayerSpec
from inferx_kernels_cuda.triton_attention import TritonAttention

DEFAULT = {
    "decode_warps": 4,
    "reduce_warps": 4,
    "min_split_len": 64,
    "target_x": 2,
    "decode_stages": 1,
    "block_n": 64,
    "reduce_heads": 2,
    "block_size": 16,
    "kv_layout": 0,
    "maxnreg": 0,
}
GRID = {
    "decode_warps": (2, 4, 8),
    "reduce_warps": (1, 2, 4),
    "min_split_len": (64, 128, 256),
    "target_x": (1, 2, 4),  # target_programs = this x the SM count
}


def parse_grid(items: list[str]) -> dict[str, tuple[int, ...]]:
    """--grid KEY=V1,V2 items -> the grid: the named keys swept, every other at its default."""
    if not items:
        return {**{k: (v,) for k, v in DEFAULT.items()}, **GRID}
    grid = {k: (v,) for k, v in DEFAULT.items()}
    for item in items:
        key, _, values = item.partition("=")
        if key not in DEFAULT or not values:
            raise SystemExit(f"--grid {item!r}: expected KEY=V1,V2 with KEY one of {list(DEFAULT)}")
        grid[key] = tuple(int(v) for v in values.split(","))
    return grid


def build(
    cfg: dict[str, int],
    spec: KVLayerSpec,
    layers: int,
    batch: int,
    context: int,
    sms: int,
    device: torch.device | None = None,
) -> TritonAttention:
    """A backend of `layers` random caches with a decode batch of `batch` x `context` tokens
    laid out in its graph buffers, ready to capture."""
    device = device or torch.device("cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    block = cfg["block_size"]
    backend = TritonAttention(
        [spec] * layers,
        block,
        dtype,
        device,
        min_split_len=cfg["min_split_len"],
        target_programs=cfg["target_x"] * sms,
    )
    backend.decode_block_n = cfg["block_n"]
    backend.decode_launch = {"num_warps": cfg["decode_warps"], "num_stages": cfg["decode_stages"]}
    backend.reduce_launch = {"num_warps": cfg["reduce_warps"]}
    backend.reduce_heads = cfg["reduce_heads"]
    blocks_per_seq = -(-context // block)
    backend.allocate(batch * blocks_per_seq + 1)
    if cfg["kv_layout"]:
        # Same logical [2, block, token, head, dim] view, storage [2, block, head, token, dim]:
        # the kernels read through strides (this script's writes land elsewhere: timing only).
        backend.caches = [c.transpose(2, 3).contiguous().transpose(2, 3) for c in backend.caches]
    if cfg["maxnreg"]:
        backend.decode_launch["maxnreg"] = cfg["maxnreg"]
    gen = torch.Generator(device=device).manual_seed(0)
    for cache in backend.caches:
        cache.normal_(generator=gen)
    backend.init_graph_buffers(batch, blocks_per_seq)
    backend.prepare_for_capture(batch)
    tables = [
        list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(batch)
    ]
    layout = make_attention_batch([1] * batch, [context] * batch, tables, block)
    backend.prepare_for_replay(layout, batch)
    return backend


def measure(
    backend: TritonAttention, spec: KVLayerSpec, batch: int, layers: int
) -> tuple[float, torch.Tensor]:
    """µs per layer of a captured step, and the last layer's output."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim, generator=gen, device="cuda")
    k = torch.randn(batch, spec.num_kv_heads, spec.head_dim, generator=gen, device="cuda")
    q, k = q.bfloat16(), k.bfloat16()
    v = k.clone()
    scale = spec.head_dim**-0.5
    outs: list[torch.Tensor] = []

    def step() -> None:
        outs.clear()
        for layer in range(layers):
            outs.append(backend.forward(layer, q, k, v, scale))

    step()  # compile and set up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * layers), outs[-1].float().clone()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--contexts", default="192,1024,4096")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", default="16,2", help="query heads,KV heads (head dim 128)")
    ap.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("tune_decode_attention.py times CUDA graphs: it needs a GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q_heads, kv_heads = (int(h) for h in args.heads.split(","))
    spec = KVLayerSpec(q_heads, kv_heads, 128)
    grid = parse_grid(args.grid)
    names = list(grid)
    configs = [
        dict(zip(names, values, strict=True)) for values in itertools.product(*grid.values())
    ]
    rows = []
    print(f"{'batch':>5} {'ctx':>5} | {'default us':>10} {'TB/s':>5} | {'best us':>8}  best config")
    for batch, context in itertools.product(
        [int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")]
    ):
        base_us, base_out = measure(
            build(DEFAULT, spec, args.layers, batch, context, sms), spec, batch, args.layers
        )
        # K and V of every context token, bf16: what a layer must read at least.
        kv_bytes = batch * context * spec.num_kv_heads * spec.head_dim * 2 * 2
        tb_s = kv_bytes / base_us / 1e6
        results = []
        for cfg in configs:
            backend = build(cfg, spec, args.layers, batch, context, sms)
            us, out = measure(backend, spec, batch, args.layers)
            err = (out - base_out).abs().max().item() / max(base_out.abs().max().item(), 1e-6)
            # another block size lays the random cache out differently: nothing to compare
            same_cache = cfg["block_size"] == DEFAULT["block_size"] and not cfg["kv_layout"]
            if err > 2e-2 and same_cache:
                raise SystemExit(
                    f"batch {batch}, context {context}, {cfg}: output differs ({err:.2e})"
                )
            results.append((us, cfg))
            torch.cuda.empty_cache()
        best_us, best = min(results, key=lambda r: r[0])
        rows.append(
            {
                "batch": batch,
                "context": context,
                "default_us": base_us,
                "default_tb_s": tb_s,
                "best_us": best_us,
                "best": best,
                "all": [{"us": u, **c} for u, c in results],
            }
        )
        print(f"{batch:>5} {context:>5} | {base_us:10.2f} {tb_s:5.2f} | {best_us:8.2f}  {best}")
    if args.json:
        meta = {
            "commit": commit_id(),
            "device": torch.cuda.get_device_name(),
            "layers": args.layers,
            "heads": [q_heads, kv_heads],
        }
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
