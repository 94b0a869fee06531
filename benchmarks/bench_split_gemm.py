"""Would splitting a decode GEMM along K (and summing the parts in the next fused kernel) beat
cuBLAS's own choice? Times, inside CUDA graphs with cold weights (bench_gemv's graph_us), per
decode GEMM shape of Qwen2.5-3B and Llama-3.1-8B and per batch M:

- linear: F.linear, what the model runs now (cuBLAS picks tiles, and split-K with its own
  reduce kernel where it likes);
- bmm sS: torch.bmm over S slices of K, x [S, M, K/S] @ W-slices [S, K/S, N] -> [S, M, N]
  partial outputs (no reduce: the consumer, add + RMSNorm, would sum them for free);
- bmm sS+sum: the same plus .sum(0), the price of a separate reduce.

    python benchmarks/bench_split_gemm.py [--models qwen2.5-3b,llama-3.1-8b] [--m 1,8,64]
        [--shapes o,down,qkv,gate_up] [--splits 2,4,8] [--json OUT.json]

gate_up is there to see whether its GEMM (~86 thread blocks at M=1 on 3B) would gain too: its
consumer, SiLU-and-mul, could sum the parts as the norm does. Each split result is checked
against F.linear (max error over max |y| <= 1e-2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_gemv import MAX_REL_ERR, cold_weights, linear_shapes, rel_err, tbps
from bench_gemv import graph_us as graph_us_of
from commit_id import commit_id

from inferx_core.quant_none import split_k_bmm as split_bmm  # what DenseLinear.forward_parts runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2.5-3b,llama-3.1-8b")
    ap.add_argument("--m", default="1,8,64")
    ap.add_argument("--shapes", default="o,down,qkv,gate_up")
    ap.add_argument("--splits", default="2,4,8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    print(f"{'model':<13}{'gemm':<8}{'M':>4} {'linear us':>10}  split results (us, TB/s)")
    for model in args.models.split(","):
        for shape in linear_shapes(model):
            if shape.name not in args.shapes.split(","):
                continue
            weights = cold_weights(shape.n, shape.k)
            for m in (int(v) for v in args.m.split(",")):
                x = torch.randn(m, shape.k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x, weights[0])
                row = {
                    "model": model,
                    "name": shape.name,
                    "n": shape.n,
                    "k": shape.k,
                    "m": m,
                    "linear_us": graph_us_of(lambda w, x=x: F.linear(x, w), weights),
                    "splits": [],
                }
                cells = []
                for s in (int(v) for v in args.splits.split(",")):
                    if shape.k % s:
                        continue
                    err = rel_err(split_bmm(x, weights[0], s).float().sum(0), ref)
                    if err > MAX_REL_ERR:
                        row["splits"].append({"splits": s, "error": err})
                        continue
                    parts = graph_us_of(lambda w, x=x, s=s: split_bmm(x, w, s), weights)
                    summed = graph_us_of(lambda w, x=x, s=s: split_bmm(x, w, s).sum(0), weights)
                    row["splits"].append(
                        {"splits": s, "rel_err": err, "bmm_us": parts, "bmm_sum_us": summed}
                    )
                    cells.append(
                        f"s{s} {parts:.2f} ({tbps(shape.weight_bytes(), parts):.2f}) "
                        f"+sum {summed:.2f}"
                    )
                rows.append(row)
                print(
                    f"{model:<13}{shape.name:<8}{m:>4} {row['linear_us']:>10.2f}  "
                    f"({tbps(shape.weight_bytes(), row['linear_us']):.2f})  " + " | ".join(cells),
                    flush=True,
                )
            del weights
            torch.cuda.empty_cache()
    if args.json:
        doc = {"commit": commit_id(), "device": torch.cuda.get_device_name(), "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
