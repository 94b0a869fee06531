"""fused_mlp (gate_up, SiLU-and-mul and down_proj in one persistent launch) against what a decode
step runs now, on the MLP shapes of Qwen2.5-3B and Llama-3.1-8B:

- unfused: cuBLAS gate_up, TritonOps.silu_and_mul, down_proj as DenseLinear.forward_parts runs
  it at up to 64 rows (4 K-slices in one torch.bmm; the next norm adds the parts up);
- unfused-linear: the same with down_proj as one F.linear;
- fused: fused_mlp under each config of a grid (tiles, warps, programs per SM).

    python benchmarks/bench_fused_mlp.py [--models qwen2.5-3b,llama-3.1-8b] [--m 1,2,4]
        [--grid small|full] [--json OUT.json]

µs per call of 20 calls captured in one CUDA graph and replayed, cycling over enough weight
copies that every call reads its weights from HBM (bench_gemv's graph_us, the decode-step
proxy). TB/s = the MLP's weight bytes / time. Each fused config is first checked against the
unfused path (max error over max |y| <= 1e-2).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_gemv import COLD_BYTES, MAX_REL_ERR, MODELS, graph_us, rel_err, tbps
from commit_id import commit_id

from inferx_core.quant_none import SPLIT_PARTS, split_k_bmm
from inferx_kernels_cuda.fused_mlp import MAX_ROWS, MlpConfig, fused_mlp
from inferx_kernels_cuda.ops import TritonOps
from inferx_models.presets import preset


def configs(grid: str) -> list[MlpConfig]:
    if grid == "small":
        axes = dict(rows_up=[8, 16], rows_down=[8], block_k=[256], num_warps=[4, 8],
                    programs_per_sm=[1, 2, 3])  # fmt: skip
    else:
        axes = dict(rows_up=[8, 16], rows_down=[4, 8], block_k=[256, 512], num_warps=[4, 8],
                    programs_per_sm=[1, 2, 3, 4])  # fmt: skip
    return [MlpConfig(**dict(zip(axes, v, strict=True))) for v in itertools.product(*axes.values())]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2.5-3b,llama-3.1-8b")
    ap.add_argument("--m", default="1,2,4")
    ap.add_argument("--grid", default="small", choices=["small", "full"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fused_mlp needs a CUDA GPU")
    torch.manual_seed(0)
    ops = TritonOps()
    rows = []
    for model in args.models.split(","):
        c = preset(MODELS[model])
        hidden, inter = c["hidden_size"], c["intermediate_size"]
        nbytes = 3 * hidden * inter * 2
        copies = max(2, -(-COLD_BYTES // nbytes))
        weights = [
            (
                torch.randn(2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02,
                torch.randn(hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02,
            )
            for _ in range(copies)
        ]
        for m in (int(v) for v in args.m.split(",")):
            if m > MAX_ROWS:
                continue
            x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(ops.silu_and_mul(F.linear(x, weights[0][0])), weights[0][1])
            base = graph_us(
                lambda w, x=x: split_k_bmm(
                    ops.silu_and_mul(torch.mm(x, w[0].t())), w[1], SPLIT_PARTS
                ),
                weights,
            )
            linear = graph_us(
                lambda w, x=x: F.linear(ops.silu_and_mul(torch.mm(x, w[0].t())), w[1]), weights
            )
            row = {"model": model, "m": m, "hidden": hidden, "inter": inter,
                   "weight_bytes": nbytes, "unfused_us": base, "unfused_linear_us": linear,
                   "configs": []}  # fmt: skip
            for cfg in configs(args.grid):
                err = rel_err(fused_mlp(x, *weights[0], cfg), ref)
                us = None
                if err <= MAX_REL_ERR:
                    us = graph_us(lambda w, x=x, cfg=cfg: fused_mlp(x, w[0], w[1], cfg), weights)
                row["configs"].append({"config": str(cfg), **vars(cfg), "rel_err": err, "us": us})
                print(f"  {model} M={m} {cfg}: {us if us is None else round(us, 2)} us, "
                      f"err {err:.1e}", flush=True)  # fmt: skip
            ranked = sorted((r for r in row["configs"] if r["us"]), key=lambda r: r["us"])
            best = ranked[0] if ranked else None
            row["best"] = best
            print(
                f"{model:<13} M={m}  unfused {base:7.2f} us ({tbps(nbytes, base):.2f} TB/s)  "
                f"unfused-linear {linear:7.2f}  fused "
                + (f"{best['us']:7.2f} us ({tbps(nbytes, best['us']):.2f} TB/s) [{best['config']}]"
                   if best else "none passed"),
                flush=True,
            )  # fmt: skip
            rows.append(row)
    if args.json:
        meta = {"commit": commit_id(), "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "args": vars(args)}  # fmt: skip
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
