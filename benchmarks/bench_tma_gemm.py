"""tma_gemm (our TMA GEMM for 65+ rows) against cuBLAS on the GEMMs of Qwen2.5-3B and
Llama-3.1-8B at the rows of big decode batches and prompt steps.

    python benchmarks/bench_tma_gemm.py [--models qwen2.5-3b,llama-3.1-8b] [--m 128,256]
        [--shapes qkv,o,gate_up_silu,down] [--grid small|full] [--budget-s 240] [--json OUT]

Per shape and M: F.linear (cuBLAS; gate_up_silu adds TritonOps.silu_and_mul, the two launches
the model runs) and tma_gemm / tma_gemm_silu_and_mul under each candidate config (tile, depth,
K-slices, one program a tile or a persistent grid). Timed as bench_gemv's graph_us: 20 calls in
one CUDA graph over copies of the weight too many for L2. Every config's output (its parts
summed) is checked against cuBLAS first (max error over max |y| <= 1e-2). A config with S > 1
K-slices leaves S parts for the next add + RMSNorm to sum: `+parts us` is what reading the
S - 1 extra [M, N] parts there would cost at 3.5 TB/s (written once here, read once there), and
`ours us` ranks configs with it added. A line per shape and M: cuBLAS, our best, TFLOPS.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_gemv import MAX_REL_ERR, cold_weights, graph_us, linear_shapes, rel_err
from commit_id import commit_id

from inferx_kernels_cuda.ops import TritonOps
from inferx_kernels_cuda.tma_gemm import TmaGemmConfig, tma_gemm, tma_gemm_silu_and_mul

MODELS = ("qwen2.5-3b", "llama-3.1-8b")
SMEM = 227 * 1024
PARTS_TBPS = 3.5


def candidates(gated: bool, m: int, grid: str, sms: int) -> list[tuple[TmaGemmConfig, int]]:
    """(config, K-slices) pairs that fit an SM's shared memory."""
    tiles = [(128, 128, 64), (128, 256, 64), (256, 128, 64), (64, 256, 64), (128, 64, 64)]
    if gated:
        tiles = [(128, 128, 64), (128, 64, 64), (64, 128, 64), (256, 64, 64), (128, 128, 32)]
    if grid == "full":
        tiles += [(64, 128, 64), (128, 128, 128), (64, 64, 128)]
    parts = [1] if gated else [1, 2, 4]
    out = []
    for bm, bn, bk in tiles:
        if bm > 2 * m:
            continue
        stage = (bm + (2 if gated else 1) * bn) * bk * 2
        acc_regs = bm * bn * (2 if gated else 1) // 128  # fp32 per thread at 4 warps
        warps = 8 if acc_regs > 128 else 4
        for stages in (3, 4) if grid == "small" else (2, 3, 4, 5):
            if stage * stages + bm * bn * 2 > SMEM:  # the epilogue's tile too
                continue
            for s in parts:
                for programs in (0, sms):
                    cfg = TmaGemmConfig(bm, bn, bk, 8, warps, stages, programs)
                    out.append((cfg, s))
    return out


def tflops(m: int, n: int, k: int, us: float | None) -> float | None:
    return None if not us else 2 * m * n * k / (us * 1e-6) / 1e12


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--m", default="128,256")
    ap.add_argument("--shapes", default="qkv,o,gate_up_silu,down")
    ap.add_argument("--grid", choices=["small", "full"], default="small")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        raise SystemExit("bench_tma_gemm.py times GPU kernels: it needs a CUDA device")
    torch.manual_seed(0)
    ops = TritonOps()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    deadline = time.monotonic() + args.budget_s
    rows: list[dict[str, Any]] = []
    print(f"{'model':<13}{'gemm':<13}{'M':>5} {'cuBLAS us':>9} {'TF':>5}  {'ours us':>8} "
          f"{'TF':>5} {'+parts':>6}  best config")  # fmt: skip
    for model in args.models.split(","):
        for shape in linear_shapes(model):
            if shape.name not in args.shapes.split(","):
                continue
            weights = cold_weights(shape.n, shape.k)
            for m in (int(v) for v in args.m.split(",")):
                x = torch.randn(m, shape.k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x, weights[0])
                if shape.gated:
                    ref = ops.silu_and_mul(ref)

                    def blas(w: torch.Tensor, x: torch.Tensor = x) -> Any:
                        return ops.silu_and_mul(F.linear(x, w))
                else:

                    def blas(w: torch.Tensor, x: torch.Tensor = x) -> Any:
                        return F.linear(x, w)

                n_out = shape.n // 2 if shape.gated else shape.n
                blas_us = graph_us(blas, weights)
                results = []
                for cfg, s in candidates(shape.gated, m, args.grid, sms):
                    if time.monotonic() > deadline:
                        break
                    try:
                        if shape.gated:

                            def ours(w: torch.Tensor, x=x, cfg=cfg) -> Any:
                                return tma_gemm_silu_and_mul(x, w, cfg)

                            err = rel_err(ours(weights[0]), ref)
                        else:

                            def ours(w: torch.Tensor, x=x, cfg=cfg, s=s) -> Any:
                                return tma_gemm(x, w, s, cfg)

                            err = rel_err(ours(weights[0]).float().sum(0), ref)
                        us = graph_us(ours, weights) if err <= MAX_REL_ERR else None
                    except Exception as e:  # noqa: BLE001 - a config the compiler refuses
                        results.append({"config": asdict(cfg), "parts": s, "error": repr(e)[:200]})
                        continue
                    extra = (s - 1) * 2 * m * n_out * 2 / (PARTS_TBPS * 1e12) * 1e6
                    results.append({"config": asdict(cfg), "name": str(cfg), "parts": s,
                                    "rel_err": err, "us": us, "parts_us": extra})  # fmt: skip
                timed = [r for r in results if r.get("us")]
                best = min(timed, key=lambda r: r["us"] + r["parts_us"], default=None)
                row = {"model": model, "name": shape.name, "n": shape.n, "k": shape.k, "m": m,
                       "cublas_us": blas_us, "results": results, "best": best}  # fmt: skip
                rows.append(row)
                bt = f"{best['us']:8.1f} {tflops(m, shape.n, shape.k, best['us']):5.0f} " \
                     f"{best['parts_us']:6.1f}  {best['name']} s{best['parts']}" if best else \
                     f"{'-':>8}"  # fmt: skip
                print(f"{model:<13}{shape.name:<13}{m:>5} {blas_us:9.1f} "
                      f"{tflops(m, shape.n, shape.k, blas_us):5.0f}  {bt}", flush=True)  # fmt: skip
                failed = [r for r in results if "error" in r]
                if failed:
                    print(f"  {len(failed)} configs failed, first: {failed[0]['error']}")
            del weights
    if args.json:
        meta = {"commit": commit_id(), "device": torch.cuda.get_device_name(0),
                "torch": torch.__version__}  # fmt: skip
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
