"""FP8 linear layers on the GPU against bf16: which GEMM to run per shape (fp8_gemm.pick_gemm).

Per shape and row count: bf16 F.linear (cuBLAS), FP8 per-channel weights with per-token
activations through torch._scaled_mm (cuBLASLt) and through the Triton kernel, and block FP8
(128x128 weight blocks, activations per token per 128 columns, Triton): each including its
activation quantization, as a layer runs it. Times are triton.testing.do_bench's (L2 flushed
between calls, as a decode step's weights are not L2-resident), µs. `floor` is the FP8 weight
bytes at --tbps.

    python benchmarks/fp8_gemm.py             # on a GPU
    TRITON_INTERPRET=1 python benchmarks/fp8_gemm.py --smoke   # tiny, on the CPU: runs, no times
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import triton

from inferx_kernels_cuda import fp8_gemm as kern

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
        w16 = torch.randn(n, k, device=dev, dtype=dtype) * 0.02
        ws = (w16.float().abs().amax(1) / kern.FP8_MAX).clamp(min=1e-12)
        w8 = (w16.float() / ws[:, None]).to(kern.FP8)
        wb = torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device=dev) * 1e-3
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            runs = {
                "bf16": partial(torch.nn.functional.linear, x, w16),
                "cublas": partial(kern.fp8_linear, x, w8, ws, gemm="cublas"),
                "triton": partial(kern.fp8_linear, x, w8, ws, gemm="triton"),
                "block": partial(kern.fp8_linear, x, w8, wb, activations="group", block=(128, 128)),
            }
            if args.smoke:
                for fn in runs.values():
                    fn()
                us = {key: float("nan") for key in runs}
            else:
                us = {key: triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3
                      for key, fn in runs.items()}  # fmt: skip
            floor = n * k / (args.tbps * 1e12) * 1e6
            fp8 = {key: us[key] for key in ("cublas", "triton")}
            best = min(fp8, key=fp8.get)
            print(f"| {name} | {m} | {us['bf16']:.1f} | {us['cublas']:.1f} | "
                  f"{us['triton']:.1f} | {us['block']:.1f} | {floor:.1f} | {best} |")  # fmt: skip


if __name__ == "__main__":
    main()
