"""tma_linear_parts (the weight read through TMA tensor descriptors) against what a decode step
runs, on the decode GEMM shapes of Qwen2.5-3B and Llama-3.1-8B:

- linear: F.linear (cuBLAS), no bias;
- bmm4: DenseLinear.forward_parts' split (4 K-slices in one torch.bmm), what o_proj, down_proj
  and a 3B QKV run at decode sizes;
- tma sS: tma_linear_parts with S parts, under each config of a grid; the best per S.

With --norm instead: the norm before QKV and gate_up, unfused (rms_norm_kernel, then cuBLAS or
tma_linear_parts) against tma_norm_linear (one launch; norm_rows below). With --gated: gate_up
and SiLU-and-mul, cuBLAS + silu_and_mul, the gated GEMV (skinny_linear), tma_linear_parts +
silu_and_mul and tma_linear_silu_and_mul (one launch; gated_rows below). (A --reduce mode,
the split reduce inside o_proj, was measured and dropped in session 15: BENCHMARKS.md.)

    python benchmarks/bench_tma_gemv.py [--models qwen2.5-3b,llama-3.1-8b] [--m 1,8]
        [--shapes qkv,o,gate_up,down] [--parts 1,2,4] [--grid small|medium|full]
        [--norm [--norm-qkv-parts 1,4] | --gated] [--json OUT.json]

µs per call of 20 calls captured in one CUDA graph and replayed, cycling over enough weight
copies that every call reads its weights from HBM (bench_gemv's graph_us). TB/s = weight bytes
/ time. Each result is checked against F.linear first (the parts' sum, max error over max |y|
<= 1e-2). Session 13 (BENCHMARKS.md) found tma ahead of both and chose the configs TritonOps
runs (tma_gemv.plain_config, norm_config) from these tables.
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_gemv import MAX_REL_ERR, cold_weights, graph_us, linear_shapes, rel_err, tbps
from commit_id import commit_id

from inferx_core.quant_none import SPLIT_PARTS, split_k_bmm
from inferx_kernels_cuda.gemv import MAX_ROWS as GEMV_MAX_ROWS
from inferx_kernels_cuda.gemv import skinny_linear
from inferx_kernels_cuda.ops import TritonOps
from inferx_kernels_cuda.tma_gemv import (
    TmaGemvConfig,
    TmaNormConfig,
    plain_config,
    tma_linear_parts,
    tma_linear_silu_and_mul,
    tma_norm_linear,
)


def configs(grid: str) -> list[TmaGemvConfig]:
    if grid == "small":
        axes = dict(block_n=[64, 128], block_k=[64, 128], num_warps=[4], num_stages=[4, 6])
    elif grid == "medium":
        axes = dict(block_n=[32, 64, 128], block_k=[64, 128, 256], num_warps=[4],
                    num_stages=[3, 4, 6])  # fmt: skip
    else:
        axes = dict(block_n=[32, 64, 128, 256], block_k=[64, 128, 256], num_warps=[4, 8],
                    num_stages=[3, 4, 6, 8])  # fmt: skip
    return [
        TmaGemvConfig(**dict(zip(axes, v, strict=True))) for v in itertools.product(*axes.values())
    ]


def norm_configs(gated: bool) -> list[TmaNormConfig]:
    # gated (one split): a program's own columns are the whole tile, select_own always
    axes = dict(block_n=[32, 64, 128], block_k=[64, 128], num_warps=[4, 8], num_stages=[3, 4],
                select_own=[True] if gated else [False, True])  # fmt: skip
    return [
        TmaNormConfig(**dict(zip(axes, v, strict=True))) for v in itertools.product(*axes.values())
    ]


def best_per_parts(entries: list[dict]) -> dict[int, dict]:
    """The fastest timed entry ({"parts", "config", "us", ...}) for each split count."""
    best: dict[int, dict] = {}
    for r in entries:
        if r["us"] and (r["parts"] not in best or r["us"] < best[r["parts"]]["us"]):
            best[r["parts"]] = r
    return best


def norm_rows(args: argparse.Namespace) -> list[dict]:
    """--norm: the input norm of QKV (4 parts out) and the post-attention norm of gate_up (SiLU
    after), each after a 4-part GEMM (x: 4 parts + residual), run three ways: rms_norm_kernel +
    cuBLAS (bmm4 / F.linear + silu_and_mul), rms_norm_kernel + tma_linear_parts (+ silu), and
    tma_norm_linear (one launch) under each config of norm_configs."""
    ops, eps, rows = TritonOps(), 1e-6, []

    def unfused(w, x, res, nw, gated, tma_cfg):
        h = ops.rms_norm(x, nw, eps, res, parts=True)[0]
        if tma_cfg is None:  # what the model runs by default
            return ops.silu_and_mul(F.linear(h, w)) if gated else split_k_bmm(h, w, SPLIT_PARTS)
        if gated:
            return ops.silu_and_mul(tma_linear_parts(h, w, 1, tma_cfg)[0])
        return tma_linear_parts(h, w, SPLIT_PARTS, tma_cfg)

    def fused(w, x, res, nw, gated, parts, cfg):
        out = tma_norm_linear(x, res, nw, eps, w, parts, gated, cfg)[0]
        return out if gated else out.sum(0)

    for model in args.models.split(","):
        for shape in linear_shapes(model):
            if shape.name not in ("qkv", "gate_up"):
                continue
            gated = shape.name == "gate_up"
            weights = cold_weights(shape.n, shape.k)
            nw = 1 + 0.1 * torch.randn(shape.k, device="cuda", dtype=torch.bfloat16)
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            tma_cfg = plain_config(shape.n, 1 if gated else SPLIT_PARTS, sms)
            for m in (int(v) for v in args.m.split(",")):
                x = torch.randn(SPLIT_PARTS, m, shape.k, device="cuda", dtype=torch.bfloat16)
                res = torch.randn(m, shape.k, device="cuda", dtype=torch.bfloat16)
                inputs = dict(x=x, res=res, nw=nw, gated=gated)
                ref = unfused(weights[0], tma_cfg=None, **inputs)
                if not gated:
                    ref = ref.sum(0)
                cublas_us = graph_us(partial(unfused, tma_cfg=None, **inputs), weights)
                tma_us = graph_us(partial(unfused, tma_cfg=tma_cfg, **inputs), weights)
                row = {"model": model, "name": shape.name, "n": shape.n, "k": shape.k, "m": m,
                       "norm_cublas_us": cublas_us, "norm_tma_us": tma_us, "fused": []}  # fmt: skip
                out_parts = [1] if gated else [int(p) for p in args.norm_qkv_parts.split(",")]
                for parts, cfg in itertools.product(out_parts, norm_configs(gated)):
                    call = partial(fused, parts=parts, cfg=cfg, **inputs)
                    try:
                        err = rel_err(call(weights[0]), ref)
                    except Exception as e:  # e.g. more shared memory than an SM has
                        print(f"  {model} {shape.name} M={m} {cfg}: {e}"[:160])
                        continue
                    us = graph_us(call, weights) if err <= MAX_REL_ERR else None
                    row["fused"].append(
                        {"parts": parts, "config": str(cfg), "rel_err": err, "us": us}
                    )
                row["best"] = best_per_parts(row["fused"])
                line = (
                    f"{model:<13}{shape.name:<8}M={m:<3} norm+cublas {row['norm_cublas_us']:6.2f}  "
                    f"norm+tma {row['norm_tma_us']:6.2f}"
                )
                for parts, best in row["best"].items():
                    line += f"  fused s{parts} {best['us']:6.2f} [{best['config']}]"
                print(line, flush=True)
                rows.append(row)
    return rows


def plain_rows(args: argparse.Namespace) -> list[dict]:
    """F.linear and the 4-part bmm against tma_linear_parts at each split count and config, and
    at plain_config's tiles for the rows (rule)."""
    rows, sms = [], torch.cuda.get_device_properties(0).multi_processor_count
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
                row["best"] = best = best_per_parts(row["tma"])
                row["rule"] = {}  # what TritonOps runs: plain_config's tiles for these rows
                for p in {int(v) for v in args.parts.split(",")}:
                    cfg = plain_config(shape.n, p, sms, m)
                    us = graph_us(lambda w, x=x, p=p, c=cfg: tma_linear_parts(x, w, p, c), weights)
                    row["rule"][p] = {"config": str(cfg), "us": us}
                line = (
                    f"{model:<13}{shape.name:<8}M={m:<3} linear {row['linear_us']:6.2f} "
                    f"({tbps(nbytes, row['linear_us']):.2f} TB/s)  bmm4 {row['bmm4_us']:6.2f}"
                )
                for p, r in sorted(best.items()):
                    line += (
                        f"  tma s{p} {r['us']:6.2f} ({tbps(nbytes, r['us']):.2f}) [{r['config']}]"
                    )
                for p, r in sorted(row["rule"].items()):
                    line += f"  rule s{p} {r['us']:6.2f} [{r['config']}]"
                print(line, flush=True)
                rows.append(row)
    return rows


def gated_rows(args: argparse.Namespace) -> list[dict]:
    """--gated: silu(gate) * up of x @ gate_up.T four ways (cuBLAS + silu_and_mul, the gated
    GEMV, tma_linear_parts + silu_and_mul, tma_linear_silu_and_mul at plain_config's tiles for
    the rows (rule) and under each config of the grid, the best of them)."""
    ops, sms, rows = TritonOps(), torch.cuda.get_device_properties(0).multi_processor_count, []
    for model in args.models.split(","):
        shape = next(s for s in linear_shapes(model) if s.name == "gate_up")
        weights = cold_weights(shape.n, shape.k)
        half = shape.n // 2
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, shape.k, device="cuda", dtype=torch.bfloat16)
            ref = ops.silu_and_mul(F.linear(x, weights[0]))
            plain = plain_config(shape.n, 1, sms, m)
            rule = plain_config(half, 1, sms, m, gated=True)
            row = {
                "model": model, "n": shape.n, "k": shape.k, "m": m,
                "cublas_us": graph_us(lambda w, x=x: ops.silu_and_mul(F.linear(x, w)), weights),
                "gemv_us": graph_us(lambda w, x=x: skinny_linear(x, w, None, gated=True), weights)
                if m <= GEMV_MAX_ROWS
                else None,  # the gated GEMV takes no more rows
                "tma_silu_us": graph_us(
                    lambda w, x=x, c=plain: ops.silu_and_mul(tma_linear_parts(x, w, 1, c)[0]),
                    weights,
                ),
                "rule": {"config": str(rule), "us": graph_us(
                    lambda w, x=x, c=rule: tma_linear_silu_and_mul(x, w, c), weights)},
                "gated": [],
            }  # fmt: skip
            for cfg in configs(args.grid):
                try:
                    err = rel_err(tma_linear_silu_and_mul(x, weights[0], cfg), ref)
                except Exception as e:  # e.g. more shared memory than an SM has
                    print(f"  {model} M={m} {cfg}: {e}"[:160])
                    continue
                us = None
                if err <= MAX_REL_ERR:
                    us = graph_us(lambda w, x=x, c=cfg: tma_linear_silu_and_mul(x, w, c), weights)
                row["gated"].append({"parts": 1, "config": str(cfg), "rel_err": err, "us": us})
            best = best_per_parts(row["gated"]).get(1)
            row["best"] = best
            print(
                f"{model:<13}M={m:<3} cublas+silu {row['cublas_us']:6.2f}  gemv "
                + (f"{row['gemv_us']:6.2f}" if row["gemv_us"] else "     -")
                + f"  tma+silu {row['tma_silu_us']:6.2f}  gated rule "
                f"{row['rule']['us']:6.2f} [{rule}]"
                + (f"  gated best {best['us']:6.2f} [{best['config']}]" if best else ""),
                flush=True,
            )
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2.5-3b,llama-3.1-8b")
    ap.add_argument("--m", default="1,8")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--parts", default="1,2,4")
    ap.add_argument("--grid", default="small", choices=["small", "medium", "full"])
    ap.add_argument("--norm", action="store_true", help="time tma_norm_linear instead")
    ap.add_argument("--norm-qkv-parts", default="4", help="--norm: the fused QKV's splits")
    ap.add_argument("--gated", action="store_true", help="time gate_up + SiLU-and-mul instead")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_tma_gemv needs a CUDA GPU")
    torch.manual_seed(0)
    if args.norm:
        rows = norm_rows(args)
    elif args.gated:
        rows = gated_rows(args)
    else:
        rows = plain_rows(args)
    if args.json:
        meta = {"commit": commit_id(), "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "args": vars(args)}  # fmt: skip
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
