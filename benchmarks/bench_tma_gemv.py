"""tma_linear_parts (the weight read through TMA tensor descriptors) against what a decode step
runs, on the decode GEMM shapes of Qwen2.5-3B and Llama-3.1-8B:

- linear: F.linear (cuBLAS), no bias;
- bmm4: DenseLinear.forward_parts' split (4 K-slices in one torch.bmm), what o_proj, down_proj
  and a 3B QKV run at decode sizes;
- tma sS: tma_linear_parts with S parts, under each config of a grid; the best per S.

    python benchmarks/bench_tma_gemv.py [--models qwen2.5-3b,llama-3.1-8b] [--m 1,8]
        [--shapes qkv,o,gate_up,down] [--parts 1,2,4] [--grid small|full] [--json OUT.json]

µs per call of 20 calls captured in one CUDA graph and replayed, cycling over enough weight
copies that every call reads its weights from HBM (bench_gemv's graph_us). TB/s = weight bytes
/ time. Each result is checked against F.linear first (the parts' sum, max error over max |y|
<= 1e-2). If tma beats linear and bmm4 here, the fusions that need a GEMV of our own (the MLP in
one launch, the norm folded into the next GEMM) are worth another try (BENCHMARKS.md, session
12).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_gemv import MAX_REL_ERR, cold_weights, graph_us, linear_shapes, rel_err, tbps
from commit_id import commit_id

from inferx_core.quant_none import SPLIT_PARTS, split_k_bmm
from inferx_kernels_cuda.tma_gemv import TmaGemvConfig, tma_linear_parts


def configs(grid: str) -> list[TmaGemvConfig]:
    if grid == "small":
        axes = dict(block_n=[64, 128], block_k=[64, 128], num_warps=[4], num_stages=[4, 6])
    else:
        axes = dict(block_n=[32, 64, 128, 256], block_k=[64, 128, 256], num_warps=[4, 8],
                    num_stages=[3, 4, 6, 8])  # fmt: skip
    return [
        TmaGemvConfig(**dict(zip(axes, v, strict=True))) for v in itertools.product(*axes.values())
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2.5-3b,llama-3.1-8b")
    ap.add_argument("--m", default="1,8")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--parts", default="1,2,4")
    ap.add_argument("--grid", default="small", choices=["small", "full"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_tma_gemv needs a CUDA GPU")
    torch.manual_seed(0)
    rows = []
    for model in args.models.split(","):
        for shape in linear_shapes(model):
            if shape.name not in args.shapes.split(",") or shape.gated:
                continue
            nbytes = shape.n * shape.k * 2
            weights = cold_weights(shape.n, shape.k)
            for m in (int(v) for v in args.m.split(",")):
                x = torch.randn(m, shape.k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x, weights[0])
                row = {
                    "model": model, "name": shape.name, "n": shape.n, "k": shape.k, "m": m,
                    "weight_bytes": nbytes,
                    "linear_us": graph_us(lambda w, x=x: F.linear(x, w), weights),
                    "bmm4_us": graph_us(lambda w, x=x: split_k_bmm(x, w, SPLIT_PARTS), weights),
                    "tma": [],
                }  # fmt: skip
                for parts, cfg in itertools.product(
                    (int(p) for p in args.parts.split(",")), configs(args.grid)
                ):
                    try:
                        err = rel_err(tma_linear_parts(x, weights[0], parts, cfg).sum(0), ref)
                    except Exception as e:  # e.g. more shared memory than an SM has
                        print(f"  {model} {shape.name} M={m} s{parts} {cfg}: {e}"[:160])
                        continue
                    us = None
                    if err <= MAX_REL_ERR:
                        us = graph_us(
                            lambda w, x=x, p=parts, c=cfg: tma_linear_parts(x, w, p, c), weights
                        )
                    row["tma"].append(
                        {"parts": parts, "config": str(cfg), "rel_err": err, "us": us}
                    )
                best = {}
                for r in row["tma"]:
                    if r["us"] and (r["parts"] not in best or r["us"] < best[r["parts"]]["us"]):
                        best[r["parts"]] = r
                row["best"] = best
                line = (
                    f"{model:<13}{shape.name:<8}M={m:<3} linear {row['linear_us']:6.2f} "
                    f"({tbps(nbytes, row['linear_us']):.2f} TB/s)  bmm4 {row['bmm4_us']:6.2f}"
                )
                for p, r in sorted(best.items()):
                    line += (
                        f"  tma s{p} {r['us']:6.2f} ({tbps(nbytes, r['us']):.2f}) [{r['config']}]"
                    )
                print(line, flush=True)
                rows.append(row)
    if args.json:
        meta = {"commit": commit_id(), "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "args": vars(args)}  # fmt: skip
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
