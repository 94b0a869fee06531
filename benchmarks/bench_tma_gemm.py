"""tma_gated_phases (gate_up + SiLU-and-mul in one launch, tiles balanced over the SMs) against
cuBLAS + silu_and_mul on the gate_up of Qwen2.5-3B and Llama-3.1-8B at big decode batches.

    python benchmarks/bench_tma_gemm.py [--models qwen2.5-3b,llama-3.1-8b] [--m 128,192,256]
        [--json OUT]

Per model and M: F.linear + TritonOps.silu_and_mul (the two launches the model runs past 64
rows), then tma_gated_phases with the plain plan (one phase of 128-column tiles) and the
balanced ones (128/64/32 and 128/64), at 3 and 4 stages. Timed as bench_gemv's graph_us (20
calls in one CUDA graph over copies of the weight too many for L2); each output checked against
cuBLAS's first (max error over max |y| <= 1e-2).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_gemv import MAX_REL_ERR, cold_weights, graph_us, linear_shapes, rel_err
from commit_id import commit_id

from inferx_kernels_cuda.ops import TritonOps
from inferx_kernels_cuda.tma_gemm import phases_for, tma_gated_phases

PLANS = {"plain": (128,), "128/64/32": (128, 64, 32), "128/64": (128, 64)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-3b,llama-3.1-8b")
    ap.add_argument("--m", default="128,192,256")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        raise SystemExit("bench_tma_gemm.py times GPU kernels: it needs a CUDA device")
    torch.manual_seed(0)
    ops = TritonOps()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows: list[dict[str, Any]] = []
    for model in args.models.split(","):
        shape = next(s for s in linear_shapes(model) if s.name == "gate_up_silu")
        weights = cold_weights(shape.n, shape.k)
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, shape.k, device="cuda", dtype=torch.bfloat16)
            ref = ops.silu_and_mul(F.linear(x, weights[0]))
            row: dict[str, Any] = {"model": model, "n": shape.n, "k": shape.k, "m": m,
                                   "cublas_us": graph_us(lambda w, x=x: ops.silu_and_mul(
                                       F.linear(x, w)), weights), "ours": []}  # fmt: skip
            for plan, widths in PLANS.items():
                for stages in (3, 4):

                    def ours(w: torch.Tensor, x=x, widths=widths, stages=stages) -> Any:
                        return tma_gated_phases(x, w, sms, widths, num_stages=stages)

                    err = rel_err(ours(weights[0]), ref)
                    us = graph_us(ours, weights) if err <= MAX_REL_ERR else None
                    phases = phases_for(m, shape.n // 2, sms, widths)
                    row["ours"].append({"plan": plan, "phases": phases, "stages": stages,
                                        "rel_err": err, "us": us})  # fmt: skip
            rows.append(row)
            tflops = 2 * m * shape.n * shape.k / 1e6
            cells = "  ".join(
                f"{o['plan']} st{o['stages']} "
                + (f"{o['us']:.1f} ({tflops / o['us']:.0f})" if o["us"] else "failed")
                for o in row["ours"]
            )
            print(f"{model:<13}M={m:<4} cuBLAS+silu {row['cublas_us']:.1f} "
                  f"({tflops / row['cublas_us']:.0f} TF)  {cells}", flush=True)  # fmt: skip
        del weights
    if args.json:
        meta = {"commit": commit_id(), "device": torch.cuda.get_device_name(0),
                "torch": torch.__version__, "sms": sms}  # fmt: skip
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
