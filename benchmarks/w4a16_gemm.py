"""The W4A16 Triton GEMM (inferx_kernels_cuda.w4a16) against bf16 torch.matmul at Llama-3.1-8B's
linear shapes (fused QKV 4096 -> 6144, o_proj 4096 -> 4096, fused gate_up 4096 -> 28672,
down_proj 14336 -> 4096; `--model qwen2.5-3b`: 2048 -> 2560, 2048 -> 2048, 2048 -> 22016,
11008 -> 2048) and 1, 4, 16, 64, 256 rows, group size 128.

    python benchmarks/w4a16_gemm.py                 # on a GPU: the table
    python benchmarks/w4a16_gemm.py --act-order     # weights with an act-order permutation
    python benchmarks/w4a16_gemm.py --fma           # up to 4 rows also the CUDA-core path
    python benchmarks/w4a16_gemm.py --sweep         # also the best of a few configs a shape
    python benchmarks/w4a16_gemm.py --smoke         # CPU: tiny shapes under the interpreter

`--fma` times the CUDA-core path (W4Config.use_dot=False at w4a16.fma_config) in the same
process, beside the picked config, checked the same way (`python benchmarks/kernel_sass.py
--kernels w4a16` counts the loops' instructions).

Each figure is one call's time in µs, from a CUDA graph of `--calls` calls replayed `--reps`
times (the decode step runs in CUDA graphs, so launch gaps are not counted), the calls cycling
over enough copies of the weights to exceed the L2 cache twice over (cold weights, as in a
model's forward pass). A split-K call is its two launches. `floor` is the bytes the call must
read and write (weights, scales, zeros, x, y) at `--bandwidth` (3.35 TB/s: the H100 SXM's
HBM3), for each of the two. The W4A16 column is also checked against the exact dequantized
weights (bf16 tolerance) before timing.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import replace

from gemm_shapes import MODELS  # this directory: sys.path[0] when run as a script

SMOKE_SHAPES = {"qkv": (256, 96), "down": (512, 64)}
BATCHES = (1, 4, 16, 64, 256)
SMOKE_BATCHES = (1, 17)
GROUP = 128


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    p.add_argument("--act-order", action="store_true", help="weights with a K permutation")
    p.add_argument("--sweep", action="store_true", help="time a few configs a shape too")
    p.add_argument("--fma", action="store_true", help="up to 4 rows, the CUDA-core path too")
    p.add_argument("--model", choices=MODELS, default="llama-3.1-8b", help="the shapes")
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--reps", type=int, default=20, help="graph replays timed")
    p.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s for the floor")
    p.add_argument("--batches", default=None, help="comma-separated row counts")
    return p.parse_args()


ARGS = _args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

from inferx_kernels_cuda.w4a16 import (  # noqa: E402
    MAX_FMA_ROWS,
    W4Config,
    fma_config,
    pick_config,
    w4a16_linear,
)
from inferx_quant.w4a16 import unpack_rows  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_timing import copies_for  # noqa: E402
from graph_timing import time_calls as _time_calls  # noqa: E402


def time_calls(fns: list[Callable[[], object]], cuda: bool) -> float:
    return _time_calls(fns, cuda, ARGS.calls, ARGS.reps)


def random_layer(k: int, n: int, act_order: bool, device: torch.device, seed: int = 0):
    """Random kernel operands of an [N, K] layer, group 128: (qweight, scales, zeros, group,
    perm) and the layer's bf16 dense weight [N, K] (the exact weight rounded once)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    info = torch.iinfo(torch.int32)
    qweight = torch.randint(info.min, info.max, (k // 8, n), generator=gen, device=device)
    qweight = qweight.to(torch.int32)
    scales = (torch.rand(k // GROUP, n, generator=gen, device=device) * 2**-6).half()
    zeros = torch.randint(0, 16, (k // GROUP, n), generator=gen, device=device).to(torch.uint8)
    perm = torch.randperm(k, generator=gen, device=device).to(torch.int32) if act_order else None
    rows = torch.arange(k, device=device) // GROUP
    w = (unpack_rows(qweight).float() - zeros.float()[rows]) * scales.float()[rows]
    if perm is not None:
        w = torch.empty_like(w).index_copy_(0, perm.long(), w)
    return (qweight, scales, zeros, GROUP, perm), w.t().contiguous().bfloat16()


def w4_bytes(m: int, k: int, n: int) -> int:
    return k * n // 2 + (k // GROUP) * n * 3 + (m * k + m * n) * 2


def bf16_bytes(m: int, k: int, n: int) -> int:
    return (k * n + m * k + m * n) * 2


def sweep_configs(m: int) -> list[W4Config]:
    """Configs --sweep times: block_n, split and loads for the GEMV (and the CUDA-core path
    up to 4 rows); tiles for the GEMM."""
    if m <= 16:
        base = W4Config(block_m=16, block_k=128, num_stages=4)
        configs = [
            replace(base, block_n=bn, split_k=s, packed_loads=p)
            for bn in (32, 64, 128)
            for s in (1, 2, 4, 8)
            for p in (True, False)
        ]
        if m <= MAX_FMA_ROWS:  # the CUDA-core path, m rows a program
            rows = 1 << (m - 1).bit_length()
            configs += [
                W4Config(
                    block_m=rows, block_n=bn, block_k=128, split_k=s, num_warps=w,
                    num_stages=1, use_dot=False,
                )
                for bn, w in ((64, 4), (64, 2), (128, 4))
                for s in (2, 4, 8, 16, 32)
            ]  # fmt: skip
        return configs
    return [
        W4Config(block_m=bm, block_n=bn, block_k=64, split_k=1, num_warps=w, num_stages=st)
        for bm, w in ((64, 4), (128, 8))
        for bn in (64, 128)
        for st in (3, 4)
    ]


def best_of(configs: list[W4Config], layers, x, cuda: bool) -> tuple[float, W4Config] | None:
    """The fastest of configs (µs, config), each timed as the columns are; None if none ran."""
    best = None
    for c in configs:
        try:
            us = time_calls(
                [lambda a=a, c=c, x=x: w4a16_linear(x, *a, config=c) for a, _ in layers], cuda
            )
        except Exception as exc:  # a config the GPU cannot run (shared memory)
            print(f"#   {c}: {type(exc).__name__}", file=sys.stderr)
            continue
        if best is None or us < best[0]:
            best = (us, c)
    return best


def check(shape: str, m: int, x, args, want, cfg: W4Config | None) -> None:
    """The call's output within 2^-7 of float64's over the bf16 weight, at the output's scale."""
    got = w4a16_linear(x, *args, config=cfg).double()
    err = (got - want).abs().max().item() / want.abs().max().item()
    if err > 2**-7:
        raise SystemExit(f"{shape} M={m} {cfg}: relative error {err:.2e} past 2^-7")


def main() -> None:
    cuda = torch.cuda.is_available() and not ARGS.smoke
    device = torch.device("cuda" if cuda else "cpu")
    shapes = SMOKE_SHAPES if ARGS.smoke else MODELS[ARGS.model]
    batches = SMOKE_BATCHES if ARGS.smoke else BATCHES
    if ARGS.batches:
        batches = tuple(int(b) for b in ARGS.batches.split(","))
    name = torch.cuda.get_device_name() if cuda else "CPU (interpreter: timings mean nothing)"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 132
    print(
        f"# W4A16 GEMM vs bf16 torch.matmul, {'smoke' if ARGS.smoke else ARGS.model} shapes, "
        f"group {GROUP}, "
        f"act-order {ARGS.act_order}, {name}"
    )
    print(f"# floor: bytes / {ARGS.bandwidth / 1e12:.2f} TB/s")
    head = f"{'shape':<8} {'K->N':>12} {'M':>4} {'w4a16 µs':>9} {'floor':>7} {'%floor':>6} "
    head += f"{'bf16 µs':>8} {'floor':>7} {'speedup':>7}  config"
    if ARGS.fma:
        head += f"  | {'fma µs':>7} {'%floor':>6}  config"
    if ARGS.sweep:
        head += "  | best swept config (µs)"
    print(head)
    for shape, (k, n) in shapes.items():
        copies = copies_for(k * n // 2, cuda)
        layers = [random_layer(k, n, ARGS.act_order, device, seed) for seed in range(copies)]
        dense_copies = copies_for(k * n * 2, cuda)
        dense = [layers[i % copies][1] for i in range(dense_copies)]
        if cuda:  # distinct bf16 copies, not views of one
            dense = [d.clone() for d in dense]
        for m in batches:
            x = torch.randn(m, k, device=device).bfloat16()
            cfg = None if cuda else pick_config(m, n, k)
            args0, w0 = layers[0]
            want = x.double() @ w0.double().t()
            check(shape, m, x, args0, want, cfg)
            w4_us = time_calls(
                [lambda a=a, x=x, c=cfg: w4a16_linear(x, *a, config=c) for a, _ in layers], cuda
            )
            bf_us = time_calls([lambda w=w, x=x: torch.matmul(x, w.t()) for w in dense], cuda)
            w4_floor = w4_bytes(m, k, n) / ARGS.bandwidth * 1e6
            bf_floor = bf16_bytes(m, k, n) / ARGS.bandwidth * 1e6
            picked = pick_config(m, n, k, sms)
            line = (
                f"{shape:<8} {f'{k}->{n}':>12} {m:>4} {w4_us:>9.2f} {w4_floor:>7.2f} "
                f"{100 * w4_floor / w4_us:>5.0f}% {bf_us:>8.2f} {bf_floor:>7.2f} "
                f"{bf_us / w4_us:>6.2f}x  {picked}"
            )
            if ARGS.fma and m <= MAX_FMA_ROWS:
                fma = fma_config(m, n, k, sms)
                check(shape, m, x, args0, want, fma)
                fma_us = time_calls(
                    [lambda a=a, x=x, c=fma: w4a16_linear(x, *a, config=c) for a, _ in layers],
                    cuda,
                )
                line += f"  | {fma_us:>7.2f} {100 * w4_floor / fma_us:>5.0f}%  {fma}"
            if ARGS.sweep and cuda:
                best = best_of(sweep_configs(m), layers, x, cuda)
                if best:
                    line += f"  | {best[1]} ({best[0]:.2f})"
            print(line, flush=True)


if __name__ == "__main__":
    main()
