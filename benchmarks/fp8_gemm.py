"""FP8 linear layers on the GPU against bf16: which GEMM to run per shape (fp8_gemm.pick_gemm),
and with --act the activation quantization fused into RMSNorm / SiLU-and-mul against unfused.

Per shape and row count: bf16 F.linear (cuBLAS), FP8 per-channel weights with per-token
activations through torch._scaled_mm (cuBLASLt), through the Triton kernel, through the TMA
decode GEMM (`tma`: one [M, N] result, K-slices summed by split_sum_kernel; `tma parts`: the
K-slice parts a decode layer hands its norm, fp8_linear(parts=True); both up to 64 rows on
Hopper, "-" elsewhere) and weight-only through the TMA GEMM (`tma w8a16`), and block FP8
(128x128 weight blocks, activations per token per 128 columns, Triton): each including its
activation quantization, as a layer runs it. Times are one call's GPU time in µs
(benchmarks/graph_timing.py: calls captured in a CUDA graph, as the decode step runs them,
cycling over weight copies that exceed the L2 cache). `floor` is the FP8 weight bytes at --tbps.

--act times, per model width and row count, what runs between the GEMMs of an FP8 layer:
the post-attention norm (down_proj's output as 4 K-slice parts plus the residual, as a decode
step hands them over) and SiLU-and-mul, each unfused (TritonOps with fuse_act_quant off: the
op's kernel, then fp8_gemm.quantize_rows) and fused (fp8_act: one kernel), per token and per
128-column group (SiLU-and-mul per token also in its two-pass form, which rows past
fp8_act.SILU_ONE_TILE_MAX take); and the bf16 op alone (what an unquantized model runs).
µs a call, timed as above (graph_timing.time_calls; the inputs stay in L2, as the GEMM before
leaves them).

--sweep times the FP8 TMA decode GEMM (W8A8, one row by default: --rows) over its tile configs
and K-slice counts at each shape, the default (plain_config, fp8_parts) marked, beside the bf16
TMA GEMM at its own default and the floor: which tiles a decode shape should take.

--model-ab builds the configured model twice, fusion on then off, and runs inferx-bench
latency's measurements on each (bench_offline.run_latency: batch-1 decode ms/token, TTFT at
--ttft-lens): the end-to-end effect, CUDA graphs and all.

    python benchmarks/fp8_gemm.py             # on a GPU
    python benchmarks/fp8_gemm.py --act       # fused vs unfused activation quantization
    python benchmarks/fp8_gemm.py --sweep [--rows 1] [--shapes "3B qkv,3B down"]
    python benchmarks/fp8_gemm.py --model-ab --config examples/qwen2.5-3b-dummy-gpu.toml \
        --quantization-scheme fp8 --kv-cache-memory 0.4   # an FP8 model, fused vs unfused
    TRITON_INTERPRET=1 python benchmarks/fp8_gemm.py --smoke [--act]   # tiny, on the CPU
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch
import triton

from inferx_core.cli import add_config_flags
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
# --act: name -> (hidden, intermediate)
WIDTHS = {"3B": (2048, 11008), "8B": (4096, 14336)}
ACT_ROWS = [1, 4, 16, 64, 256, 2048]


def two_pass(ops, x: torch.Tensor, spec) -> object:  # noqa: ANN001
    """silu_and_mul_quant per token with fp8_act's one-tile path off (SILU_ONE_TILE_MAX 0)."""
    from inferx_kernels_cuda import fp8_act

    limit, fp8_act.SILU_ONE_TILE_MAX = fp8_act.SILU_ONE_TILE_MAX, 0
    try:
        return ops.silu_and_mul_quant(x, spec)
    finally:
        fp8_act.SILU_ONE_TILE_MAX = limit


def act_table(smoke: bool) -> None:
    """--act: fused vs unfused activation quantization (the module docstring)."""
    from inferx_core.interfaces.quant import ActivationQuant
    from inferx_kernels_cuda.ops import TritonOps

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16
    widths = {"tiny": (256, 384)} if smoke else WIDTHS
    rows_list = [1, 20] if smoke else ACT_ROWS
    fused, unfused = TritonOps(), TritonOps()
    unfused.fuse_act_quant = False
    specs = {"token": ActivationQuant("token"), "group": ActivationQuant("group", 128)}
    print(f"device: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}")
    print("| width | rows | op | bf16 op | token unfused | token fused | token fused 2-pass | "
          "group unfused | group fused |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (hidden, inter) in widths.items():
        weight = 1 + 0.1 * torch.randn(hidden, device=dev, dtype=dtype)
        for m in rows_list:
            parts = torch.randn(4, m, hidden, device=dev, dtype=dtype)
            residual = torch.randn(m, hidden, device=dev, dtype=dtype)
            gate_up = torch.randn(m, 2 * inter, device=dev, dtype=dtype)
            variants = [(f"{key} {label}", spec, ops) for key, spec in specs.items()
                        for label, ops in (("unfused", unfused), ("fused", fused))]  # fmt: skip
            norm_args = (parts, weight, 1e-6)
            runs = {
                "norm": {"bf16": partial(fused.rms_norm, *norm_args, residual, True)},
                "silu": {"bf16": partial(fused.silu_and_mul, gate_up)},
            }
            for key, spec, ops in variants:
                runs["norm"][key] = partial(ops.rms_norm_quant, *norm_args, spec, residual, True)
                runs["silu"][key] = partial(ops.silu_and_mul_quant, gate_up, spec)
            # per token in two passes over 4096-column tiles instead of the row in one tile
            runs["silu"]["2-pass"] = partial(two_pass, fused, gate_up, specs["token"])
            runs["norm"]["2-pass"] = lambda: None
            for op, fns in runs.items():
                us = {}
                for key, fn in fns.items():
                    fn()
                    us[key] = float("nan") if smoke else time_calls([fn], True)
                two = "-" if op == "norm" else f"{us['2-pass']:.1f}"
                print(f"| {name} | {m} | {op} | {us['bf16']:.1f} | {us['token unfused']:.1f} | "
                      f"{us['token fused']:.1f} | {two} | {us['group unfused']:.1f} | "
                      f"{us['group fused']:.1f} |")  # fmt: skip


def model_ab(args: argparse.Namespace) -> None:
    """--model-ab: the configured model's batch-1 decode and TTFT, fusion on and off."""
    import gc

    from inferx_core import bench_offline
    from inferx_core.cli import config_from_args
    from inferx_core.engine import LLM
    from inferx_kernels_cuda.ops import TritonOps

    init = TritonOps.__init__
    results = {}
    try:
        for fused in (True, False):

            def set_fusion(self: TritonOps, on: bool = fused) -> None:
                init(self)
                self.fuse_act_quant = on

            TritonOps.__init__ = set_fusion  # type: ignore[method-assign]
            llm = LLM(config_from_args(args))
            results["fused" if fused else "unfused"] = bench_offline.run_latency(llm, args)
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        TritonOps.__init__ = init  # type: ignore[method-assign]
    print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
    print("| figure | fused | unfused |")
    print("|---|---|---|")
    for key, value in results["fused"].items():
        print(f"| {key} | {value:.3f} | {results['unfused'][key]:.3f} |")


def sweep(args: argparse.Namespace) -> None:
    """--sweep: the FP8 TMA decode GEMM's configs and K-slices per shape (module docstring)."""
    from inferx_kernels_cuda import tma_gemv

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16
    smoke = args.smoke or dev != "cuda"
    names = [s.strip() for s in args.shapes.split(",")] if args.shapes else list(SHAPES)
    shapes = {"tiny": (128, 256)} if smoke else {name: SHAPES[name] for name in names}
    sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 132
    grid = [
        tma_gemv.TmaGemvConfig(bn, bk, warps, stages)
        for bn in (32, 64, 128)
        for bk in (128, 256)
        for warps in (4,)
        for stages in (3, 4, 6)
    ]
    print(f"device: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, rows {args.rows}")
    print("| shape | parts | config | fp8 TMA µs | floor | %floor | default |")
    print("|---|---|---|---|---|---|---|")
    for name, (n, k) in shapes.items():
        layers = []
        for _ in range(copies_for(n * k, not smoke)):
            w = torch.randn(n, k, device=dev, dtype=dtype) * 0.02
            ws = (w.float().abs().amax(1) / kern.FP8_MAX).clamp(min=1e-12)
            layers.append((w, (w.float() / ws[:, None]).to(kern.FP8), ws))
        x = torch.randn(args.rows, k, device=dev, dtype=dtype)
        xq, xs = kern.quantize_rows(x)
        floor = n * k / (args.tbps * 1e12) * 1e6
        base = tma_gemv.fp8_parts(n, k, args.rows, sms)
        default = (base, tma_gemv.plain_config(n, base, sms, args.rows, elem_bytes=1))
        dense = layers[: copies_for(n * k * 2, not smoke)]
        cfg16 = tma_gemv.plain_config(n, base, sms, args.rows)
        bf16 = [partial(tma_gemv.tma_linear_parts, x, w, base, cfg16) for w, _, _ in dense]
        us = float("nan") if smoke else time_calls(bf16, True)
        print(f"| {name} | {base} | bf16 TMA default | {us:.1f} | {2 * floor:.1f} | "
              f"{200 * floor / us:.0f}% | |")  # fmt: skip
        rows = []
        for parts in sorted({max(1, base // 2), base, min(16, base * 2)}):
            if k < parts * 128:
                continue
            for cfg in grid[:2] if smoke else grid:
                fns = [
                    partial(
                        tma_gemv.tma_fp8_linear_parts, xq, xs, w8, ws, None, parts, cfg, dtype
                    )  # fmt: skip
                    for _, w8, ws in layers
                ]
                try:
                    if smoke:
                        fns[0]()
                        t = float("nan")
                    else:
                        t = time_calls(fns, True)
                except Exception as exc:  # a config past the SM's shared memory: skipped
                    print(f"<!-- {name} parts {parts} {cfg}: {type(exc).__name__} -->")
                    continue
                rows.append((t, parts, cfg))
        rows.sort(key=lambda r: (r[0] != r[0], r[0]))
        for t, parts, cfg in rows[: args.top]:
            mark = "default" if (parts, cfg) == default else ""
            print(f"| {name} | {parts} | {cfg} | {t:.1f} | {floor:.1f} | {100 * floor / t:.0f}% | "
                  f"{mark} |")  # fmt: skip
        hit = [r for r in rows if (r[1], r[2]) == default]
        if hit and hit[0] not in rows[: args.top]:
            t = hit[0][0]
            print(f"| {name} | {base} | {default[1]} | {t:.1f} | {floor:.1f} | "
                  f"{100 * floor / t:.0f}% | default |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any device, no timing")
    ap.add_argument("--tbps", type=float, default=3.35, help="memory bandwidth for the floor")
    ap.add_argument("--act", action="store_true", help="fused vs unfused activation quantization")
    ap.add_argument("--model-ab", action="store_true", help="a model's latency, fused vs unfused")
    ap.add_argument("--sweep", action="store_true", help="the FP8 TMA decode GEMM's configs")
    ap.add_argument("--rows", type=int, default=1, help="--sweep: rows of x")
    ap.add_argument("--shapes", default="", help="--sweep: comma-separated SHAPES names")
    ap.add_argument("--top", type=int, default=6, help="--sweep: fastest configs a shape")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--ttft-lens", type=int, nargs="*", default=[2048])
    ap.add_argument("--runs", type=int, default=3)
    add_config_flags(ap)
    args = ap.parse_args()
    if args.act:
        act_table(args.smoke)
        return
    if args.model_ab:
        model_ab(args)
        return
    if args.sweep:
        sweep(args)
        return
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = {"tiny": (128, 256)} if args.smoke else SHAPES
    rows = [1, 20] if args.smoke else ROWS
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16
    print(f"device: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}")
    print("| shape | rows | bf16 | fp8 cuBLASLt | fp8 Triton | fp8 TMA | fp8 TMA parts | "
          "w8a16 TMA | block fp8 Triton | floor | best |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
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
            xq, xs = kern.quantize_rows(x)
            readable = kern.tma_readable(xq, xs, layers[0][1], layers[0][2])
            if m <= kern.TMA_MAX_ROWS and (readable or os.environ.get("TRITON_INTERPRET") == "1"):
                tma = partial(kern.fp8_linear, gemm="tma")
                runs["tma"] = [partial(tma, x, w8, ws) for _, w8, ws, _ in layers]
                runs["tma parts"] = [partial(tma, x, w8, ws, parts=True) for _, w8, ws, _ in layers]
                runs["w8a16"] = [
                    partial(tma, x, w8, ws, activations="none") for _, w8, ws, _ in layers
                ]
            if args.smoke:
                for fns in runs.values():
                    fns[0]()
                us = {key: float("nan") for key in runs}
            else:
                us = {key: time_calls(fns, True) for key, fns in runs.items()}
            floor = n * k / (args.tbps * 1e12) * 1e6
            fp8 = {key: us[key] for key in ("cublas", "triton", "tma") if key in us}
            best = min(fp8, key=fp8.get)
            tma = " | ".join(
                f"{us[key]:.1f}" if key in us else "-" for key in ("tma", "tma parts", "w8a16")
            )
            print(f"| {name} | {m} | {us['bf16']:.1f} | {us['cublas']:.1f} | "
                  f"{us['triton']:.1f} | {tma} | {us['block']:.1f} | {floor:.1f} | "
                  f"{best} |")  # fmt: skip


if __name__ == "__main__":
    main()
