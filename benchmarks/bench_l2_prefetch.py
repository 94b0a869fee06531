"""Would pulling a GEMM's first weight bytes into L2 while the small kernels before it run make
a decode layer faster? Times, inside one CUDA graph, a chain of decoder layers of Qwen2.5-3B's
(or Llama-3.1-8B's) shapes at M rows, each with its own weights (cold in L2, as in a step):

    add + RMSNorm -> QKV (bias) -> o_proj (4 K-parts) -> add + RMSNorm -> gate_up -> SiLU-and-mul
    -> down_proj (4 K-parts)

with the attention left out (QKV feeds o_proj directly), and the same chain with Hopper's bulk
L2 prefetch (`cp.async.bulk.prefetch.L2`) of the next GEMM's weights issued ahead of the
latency-bound kernel before it: QKV's whole weight before the first norm, the first FRACTION of
every gate_up row (what each of cuBLAS's thread blocks reads first) before the second norm,
and the first FRACTION of every K-part row of down_proj before SiLU-and-mul. The prefetch runs
as its own launch in the chain here, so the figure includes its launch; fused into the kernels
before (extra programs of the norm and SiLU launches) it would cost less.

    python benchmarks/bench_l2_prefetch.py [--models qwen2.5-3b,llama-3.1-8b] [--m 1,64]
        [--fractions 0.0625,0.125,0.25] [--layers 12] [--json OUT.json]

Prints µs per layer for each variant; the outputs are checked against the chain without
prefetch (the prefetch is a hint: results must be identical).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from commit_id import commit_id

from inferx_core.quant_none import split_k_bmm
from inferx_kernels_cuda.ops import TritonOps
from inferx_models.presets import preset

MODELS = {"qwen2.5-3b": "qwen2.5-3b-instruct", "llama-3.1-8b": "llama-3.1-8b-instruct"}
SEGMENTS = int(os.environ.get("L2_PREFETCH_SEGMENTS", "256"))  # requests per program


@triton.jit(do_not_specialize=["rows", "row_bytes", "seg_bytes", "nseg", "seg_stride"])
def l2_prefetch_rows_kernel(
    addr, rows, row_bytes, seg_bytes, nseg, seg_stride, BLOCK: tl.constexpr
):
    """Program p asks L2 for BLOCK (row, segment) ranges of seg_bytes each: segment s of row r
    starts at addr + r * row_bytes + s * seg_stride. No waiting: the kernel exits at once."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row = idx // nseg
    seg = idx % nseg
    start = addr + row * row_bytes + seg * seg_stride
    size = tl.where(row < rows, seg_bytes, 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def prefetch_rows(w: torch.Tensor, fraction: float, parts: int = 1) -> None:
    """The first `fraction` of each of w's rows (of each of its `parts` K-slices), 16-byte
    multiples, into L2."""
    n, k = w.shape
    row_bytes = k * w.element_size()
    slice_bytes = row_bytes // parts
    seg = max(16, int(slice_bytes * fraction) // 16 * 16)
    seg = min(seg, slice_bytes // 16 * 16)
    count = n * parts
    l2_prefetch_rows_kernel[(triton.cdiv(count, SEGMENTS),)](
        w.data_ptr(), n, row_bytes, seg, parts, slice_bytes, BLOCK=SEGMENTS, num_warps=4
    )


class Layer:
    def __init__(self, cfg: dict, device: torch.device) -> None:
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        d = h // heads
        qkv = (heads + 2 * kv) * d

        def w(n: int, k: int) -> torch.Tensor:
            return (torch.randn(n, k, device=device) * k**-0.5).bfloat16()

        self.qkv = w(qkv, h)
        self.qkv_bias = (torch.randn(qkv, device=device) * 0.1).bfloat16()
        self.o = w(h, heads * d)
        self.gate_up = w(2 * i, h)
        self.down = w(h, i)
        self.norm1 = torch.ones(h, device=device, dtype=torch.bfloat16)
        self.norm2 = torch.ones(h, device=device, dtype=torch.bfloat16)
        self.q_size = heads * d


def run_chain(
    layers: list[Layer], x: torch.Tensor, ops: TritonOps, fraction: float, prefetch_qkv: bool
) -> torch.Tensor:
    parts = x.unsqueeze(0)
    residual = torch.zeros_like(x)
    for layer in layers:
        if prefetch_qkv:
            prefetch_rows(layer.qkv, 1.0)
        h, residual = ops.rms_norm(parts, layer.norm1, 1e-6, residual=residual, parts=True)
        qkv = F.linear(h, layer.qkv, layer.qkv_bias)
        parts = split_k_bmm(qkv[:, : layer.q_size].contiguous(), layer.o, 4)
        if fraction:
            prefetch_rows(layer.gate_up, fraction)
        h, residual = ops.rms_norm(parts, layer.norm2, 1e-6, residual=residual, parts=True)
        act = F.linear(h, layer.gate_up)
        if fraction:
            prefetch_rows(layer.down, fraction, parts=4)
        act = ops.silu_and_mul(act)
        parts = split_k_bmm(act, layer.down, 4)
    return parts.float().sum(0) + residual.float()


def time_chain(call, reps: int = 10) -> tuple[float, torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2], out.clone()


def measure_model(name: str, ms: list[int], fractions: list[float], num_layers: int) -> list[dict]:
    """The rows of one model: per M, the chain without prefetch and each variant."""
    device = torch.device("cuda")
    cfg = preset(MODELS[name])
    layers = [Layer(cfg, device) for _ in range(num_layers)]
    ops = TritonOps()
    variants = [("qkv only", 0.0, True)]
    variants += [(f"qkv + first {f:g}", f, True) for f in fractions]
    variants += [(f"first {f:g}, no qkv", f, False) for f in fractions]
    rows = []
    for m in ms:
        x = torch.randn(m, cfg["hidden_size"], device=device).bfloat16()
        base_us, base_out = time_chain(lambda x=x: run_chain(layers, x, ops, 0.0, False))
        base = base_us / num_layers
        result = {"model": name, "m": m, "base_us": base, "variants": []}
        print(f"{name:<14} {m:>3} {'no prefetch':<22} {base:9.2f}")
        for label, f, pq in variants:
            us, out = time_chain(lambda x=x, f=f, pq=pq: run_chain(layers, x, ops, f, pq))
            if not torch.equal(out, base_out):
                raise SystemExit(f"{name} M={m} {label}: the output changed")
            per = us / num_layers
            result["variants"].append({"label": label, "fraction": f, "qkv": pq, "us": per})
            print(f"{name:<14} {m:>3} {label:<22} {per:9.2f} {per - base:+8.2f}")
        rows.append(result)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2.5-3b,llama-3.1-8b")
    ap.add_argument("--m", default="1,64")
    ap.add_argument("--fractions", default="0.0625,0.125,0.25")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    fractions = [float(v) for v in args.fractions.split(",")]
    rows = []
    print(f"{'model':<14} {'M':>3} {'variant':<22} {'us/layer':>9} {'vs base':>8}")
    for name in args.models.split(","):
        rows += measure_model(name, ms, fractions, args.layers)
        torch.cuda.empty_cache()
    if args.json:
        meta = {"commit": commit_id(), "device": torch.cuda.get_device_name(), "args": vars(args)}
        Path(args.json).write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
