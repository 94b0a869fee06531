"""FP8 linear layers on the GPU against bf16: which GEMM to run per shape (fp8_gemm.pick_gemm).

Per shape and row count: bf16 F.linear (cuBLAS), FP8 per-channel weights with per-token
activations through torch._scaled_mm (cuBLASLt) and through the Triton kernel, and block FP8
(128x128 weight blocks, activations per token per 128 columns, Triton): each including its
activation quantization, as a layer runs it. Times are one call's GPU time in µs
(benchmarks/graph_timing.py: calls captured in a CUDA graph, as the decode step runs them,
cycling over weight copies that exceed the L2 cache). `floor` is the FP8 weight bytes at --tbps.

    python benchmarks/fp8_gemm.py             # on a GPU
    TRITON_INTERPRET=1 python benchmarks/fp8_gemm.py --smoke   # tiny, on the CPU: runs, no times
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch
import triton

from inferx_kernels_cuda import fp8_gemm as kern

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_timing import copies_for, time_calls  # noqa: E402

SHAPES = {  # name: (N, K)
    "3B qkv": (2560, 2048),
    "3B o": (2048, 2048),
    "3B gate_up": (22016, 2048),
    "3B down": (2048, 11008),
    "8B qkv": (6144, 4096),
    "8B gate_up": (28672, 4096),
    "8B down": (4096, 14336),
}
ROWS = [1, 4, 16, 32, 64, 256, 2048]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any device, no timing")
    ap.add_argument("--tbps", type=float, default=3.35, help="memory bandwidth for the floor")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = {"tiny": (128, 256)} if args.smoke else SHAPES
    rows = [1, 20] if args.smoke else ROWS
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16
    print(f"device: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}")
    print("| shape | rows | bf16 | fp8 cuBLASLt | fp8 Triton | block fp8 Triton | floor | best |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (n, k) in shapes.items():
        layers = []
        for _ in range(copies_for(n * k, dev == "cuda")):
            w16 = torch.randn(n, k, device=dev, dtype=dtype) * 0.02
            ws = (w16.float().abs().amax(1) / kern.FP8_MAX).clamp(min=1e-12)
            w8 = (w16.float() / ws[:, None]).to(kern.FP8)
            wb = torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device=dev) * 1e-3
            layers.append((w16, w8, ws, wb))
        dense = layers[: copies_for(n * k * 2, dev == "cuda")]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            runs = {
                "bf16": [partial(torch.nn.functional.linear, x, w16) for w16, *_ in dense],
                "cublas": [
                    partial(kern.fp8_linear, x, w8, ws, gemm="cublas") for _, w8, ws, _ in layers
                ],
                "triton": [
                    partial(kern.fp8_linear, x, w8, ws, gemm="triton") for _, w8, ws, _ in layers
                ],
                "block": [
                    partial(kern.fp8_linear, x, w8, wb, activations="group", block=(128, 128))
                    for _, w8, _, wb in layers
                ],
            }
            if args.smoke:
                for fns in runs.values():
                    fns[0]()
                us = {key: float("nan") for key in runs}
            else:
                us = {key: time_calls(fns, True) for key, fns in runs.items()}
            floor = n * k / (args.tbps * 1e12) * 1e6
            fp8 = {key: us[key] for key in ("cublas", "triton")}
            best = min(fp8, key=fp8.get)
            print(f"| {name} | {m} | {us['bf16']:.1f} | {us['cublas']:.1f} | "
                  f"{us['triton']:.1f} | {us['block']:.1f} | {floor:.1f} | {best} |")  # fmt: skip


if __name__ == "__main__":
    main()
