"""The W4A16 GEMM's main loop as the GPU would run it, counted without a GPU: w4a16_kernel
compiled for sm_90 at the configs w4a16.pick_config (tl.dot) and w4a16.fma_config (CUDA cores)
give Qwen2.5-3B's decode shapes, disassembled with the nvdisasm that triton ships, and the
instructions of its longest loop counted.

    PYTHONPATH=<triton 3.6>:packages/inferx-core/src:packages/inferx-kernels-cuda/src \\
        python benchmarks/w4a16_sass.py [--rows 1] [--act-order] [--model llama-3.1-8b] \
        [--shapes qkv,o]

Per shape and config: registers a thread and stack bytes (spills) from cuobjdump, the loop's
SASS instructions (one warp's pass), `ipb` = the thread-instructions the loop issues per byte
of 4-bit weight it reads (loop length x 32 x num_warps / (BLOCK_K x BLOCK_N / 2)), and its
commonest opcodes. The budget: an H100 SM issues at most 128 thread-instructions a clock and
must take ~14.5 weight bytes a clock (3.35 TB/s over 132 SMs at ~1.75 GHz) for the loop to
keep up with memory, so ~8.8 ipb at most, before latency or occupancy limits. Compiles arguments
that a launch passes divisible by 16 as such (pointers, N, K, strides), as Triton specialises them.
"""

from __future__ import annotations

import argparse
import inspect

import triton
from kernel_sass import H100_BYTES_PER_CLOCK, ISSUE_PER_CLOCK, loop_mix, resources
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from inferx_kernels_cuda import w4a16

# (K, N) of each decode GEMM: fused QKV, o_proj, fused gate_up, down_proj
MODELS = {
    "qwen2.5-3b": {"qkv": (2048, 2560), "o": (2048, 2048), "gate_up": (2048, 22016),
                   "down": (11008, 2048)},
    "llama-3.1-8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                     "down": (14336, 4096)},
}  # fmt: skip
GROUP = 128
H100_IPB = ISSUE_PER_CLOCK / H100_BYTES_PER_CLOCK


def compile_sm90(config: w4a16.W4Config, k: int, act_order: bool, split_out: bool):
    """w4a16_kernel for sm_90 as _launch would start it for a bf16 x at this config."""
    kernel = w4a16.w4a16_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    block_k = w4a16._block_k(config, GROUP, k)
    constexprs = dict(
        HAS_PERM=act_order, HAS_BIAS=False, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=block_k, PACKED=config.packed_loads, USE_DOT=config.use_dot, UPCAST=False,
        DOT_PRECISION="tf32",
    )  # fmt: skip
    types = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8"}
    types |= {"perm_ptr": "*i32", "bias_ptr": "*bf16"}
    types["out_ptr"] = "*fp32" if split_out else "*bf16"
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    unaligned = {"m", "group_shift"}  # m is never specialised; the shift is 7
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if n not in constexprs and n not in unaligned
    }
    src = ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options), block_k


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="qwen2.5-3b")
    p.add_argument("--rows", type=int, default=1, help="x's rows (1-4 for the CUDA-core path)")
    p.add_argument("--act-order", action="store_true", help="with the K permutation")
    p.add_argument("--shapes", default=None, help="comma-separated: qkv,o,gate_up,down")
    args = p.parse_args()
    print(
        f"# w4a16_kernel loop, sm_90, triton {triton.__version__}, {args.model}, "
        f"{args.rows} row(s), group {GROUP}, act-order {args.act_order}; "
        f"H100 budget ~{H100_IPB:.1f} ipb"
    )
    print(f"{'shape':<8} {'config':<38} {'regs':>4} {'stack':>5} {'loop':>5} {'ipb':>5}  opcodes")
    shapes = MODELS[args.model]
    for shape in args.shapes.split(",") if args.shapes else shapes:
        k, n = shapes[shape]
        for cfg in (
            w4a16.pick_config(args.rows, n, k),
            w4a16.fma_config(args.rows, n, k),
        ):
            compiled, block_k = compile_sm90(cfg, k, args.act_order, cfg.split_k > 1)
            regs, stack = resources(compiled)
            length, mix = loop_mix(compiled)
            ipb = length * 32 * cfg.num_warps / (block_k * cfg.block_n / 2)
            ops = " ".join(f"{op}:{count}" for op, count in mix.most_common(8))
            print(
                f"{shape:<8} {str(cfg):<38} {regs:>4} {stack:>5} {length:>5} {ipb:>5.1f}  {ops}",
                flush=True,
            )


if __name__ == "__main__":
    main()
