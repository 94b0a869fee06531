"""Instructions a weight byte in a decode kernel's main loop, from its sm_90 SASS, without a GPU.

A decode GEMV that dequantizes in registers is bound by its instruction issue before its memory:
an H100 SM issues at most 128 thread-instructions a clock and must take ~14.5 weight bytes a
clock (3.35 TB/s over 132 SMs at 1.755 GHz) to read at full bandwidth, so a loop spending more
than ~8.8 instructions a weight byte cannot reach the bandwidth. This compiles the kernel for
sm_90 with the installed Triton (its ptxas; nvdisasm, which Triton's wheel ships), finds the
longest loop in the SASS and prints its length, the instructions a weight byte and the opcode mix.

python benchmarks/kernel_sass.py [--kernels moe_gemv,moe_gemv_tma,moe_gemm,w4a16,split_k_reduce]
    [--block-n 8,16,32]
    [--warps 8] [--block-k 1024] [--stages 3]
    [--model qwen2.5-3b] [--rows 1] [--act-order] [--row-group] [--pdl]
    [--shapes qkv,o,gate_up,down]
    [--json OUT] [--dump DIR]

Per kernel and config: registers a thread and stack bytes (spills) from cuobjdump, shared
memory bytes a program (`smem`: moe_gemv_tma's pipeline buffers), the loop's
SASS instructions (one warp's pass), those over the weight bytes a thread takes a pass, and the
commonest opcodes; --dump writes each loop's SASS to a file.

moe_gemv: moe_gemv_kernel at gpt-oss-20b's one-token shapes (MXFP4, gate_up gated with the
clamped SwiGLU, down weighted), at the block_n given and the launch's warps and K columns a
step (GEMV_MXFP4_WARPS, GEMV_MXFP4_BLOCK_K; --warps, --block-k). moe_gemv_tma: the same
GEMV with its weight words by TMA bulk copies (moe_gemv_tma_kernel), at its defaults
(GEMV_MXFP4_TMA_GATE_UP / _DOWN) and the --block-n given (--block-k, --stages); the loop's
UTMALDG count is the `tma` column (a copy a tile a step, issued by one thread). moe_gemm:
moe_gemm_kernel's MXFP4 tiles at 8, 256 and 2048 tokens (gemm_configs' for bf16 activations,
swapped where it swaps), whose weight tile is dequantized once per M tile: its bytes a clock
then also feed the tensor cores; a loop with wgmma also prints its HGMMA count and its waits
for all of them (one a HGMMA: the tensor-core steps serialized). w4a16:
w4a16_kernel at a dense model's decode shapes (benchmarks/gemm_shapes.py; --model, --shapes),
--rows rows of bf16 x, group 128, at the configs w4a16.pick_config (tl.dot) and, up to 4 rows,
w4a16.fma_config (CUDA cores) give; --act-order with the K permutation; --row-group with it
and a group read per row (ROW_GROUP: act-order split along K over tensor-parallel ranks);
--pdl also fma_config's as w4a16.pdl_launch launches it on Hopper (pdl: the trigger at its
start, as QKV, o_proj and down get it; pdl late: after its K loop). split_k_reduce:
gemv.split_k_reduce_kernel as w4a16.w4a16_linear launches it (fp32 partials into bf16, plain
and gated; per thread the partial bytes a split in place of weight bytes); --pdl also with
PDL and TRIGGER, as it launches behind a W4A16 GEMV with PDL.

A kernel compiled with a grid-dependency wait (PDL; `griddepcontrol.wait` in the PTX, ACQBULK
in the SASS) also gets the loads issued before it: in the PTX by the function of the kernel's
source each comes from, and the SASS's LDG count before ACQBULK (the `pre-wait` column, and
`pre_wait` in the JSON), and its TMA copies (UTMALDG) there: what the kernel reads before the
kernel ahead has finished. The PTX's count is by text order, which for a wait inside a loop
need not be the order of execution; the SASS's is ptxas's layout.
"""

from __future__ import annotations

import argparse
import ast
import collections
import functools
import inspect
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Collection, Iterator
from typing import Any, NamedTuple

import triton
from gemm_shapes import MODELS  # this directory: sys.path[0] as a script or by sys.path.insert
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# bytes an SM must take a clock to read at the bandwidth, and thread-instructions it issues
H100_BYTES_PER_CLOCK = 3.35e12 / 132 / 1.755e9
ISSUE_PER_CLOCK = 128
# runtime arguments of the MoE kernels that a launch passes as other than multiples of 16 (the
# rest are specialised as Triton's launcher would), or floats
UNALIGNED = {"num_tokens", "num_pairs", "num_experts", "up_offset", "alpha", "limit", "scaling"}
UNALIGNED |= {"num_chunks", "max_blocks", "group_shift"}
W4A16_GROUP = 128
W4A16_UNALIGNED = {"m", "group_shift"}  # m is never specialised; the shift is 7


def compile_sm90(
    kernel: Any,
    types: dict[str, str],
    constexprs: dict[str, Any],
    warps: int,
    stages: int = 1,
    unaligned: Collection[str] = UNALIGNED,
):
    """kernel compiled for sm_90; types: each runtime argument's ("*bf16", "i32", ...); the
    runtime arguments outside `unaligned` and not floats are specialised as multiples of 16.
    Constexpr parameters left out of `constexprs` take their defaults, as a launch does."""
    params = inspect.signature(kernel.fn).parameters
    defaults = {
        n: p.default
        for n, p in params.items()
        if "constexpr" in str(p.annotation) and p.default is not inspect.Parameter.empty
    }
    constexprs = defaults | constexprs
    names = list(params)
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if n not in constexprs
        and n not in unaligned
        and not sig[n].startswith(("fp", "tensordesc"))
    }
    src = ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _tool(name: str, cubin: bytes, *flags: str) -> str:
    """stdout of one of the CUDA tools Triton's wheel ships (nvdisasm, cuobjdump) on a cubin."""
    binary = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run(
            [binary, *flags, f.name], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(f.name)


def resources(compiled: Any) -> tuple[int, int]:
    """(registers a thread, stack bytes a thread: spills) from cuobjdump -res-usage."""
    out = _tool("cuobjdump", compiled.asm["cubin"], "-res-usage")
    regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1


def loop_mix(body: list[str]) -> tuple[int, collections.Counter]:
    """(length, opcode counts) of a loop's instructions (loop_sass's)."""
    ops = collections.Counter(
        re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0] for ins in body
    )
    return len(body), ops


def loop_sass(compiled: Any) -> list[str]:
    """The instructions of the longest loop (a backward branch) in the SASS, in order. A
    backward branch over an unpredicated EXIT is no loop: ptxas places an mbarrier wait's
    retry (a TMA pipeline's) after the kernel's end, jumping back into the loop it serves."""
    instrs, labels, label = [], {}, None
    for line in _tool("nvdisasm", compiled.asm["cubin"], "-c").splitlines():
        if m := re.match(r"\s*\.L_x_(\d+):", line):
            label = m.group(1)
        elif m := re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line):
            addr = int(m.group(1), 16)
            if label is not None:
                labels[label], label = addr, None
            instrs.append((addr, m.group(2).strip()))
    loops = [
        (labels[m.group(1)], addr)
        for addr, ins in instrs
        if (m := re.search(r"BRA.*\.L_x_(\d+)", ins)) and labels.get(m.group(1), addr) < addr
    ]
    exits = [addr for addr, ins in instrs if ins.split()[0] == "EXIT"]
    loops = [(lo, hi) for lo, hi in loops if not any(lo < addr < hi for addr in exits)]
    if not loops:
        return []
    start, end = max(loops, key=lambda span: span[1] - span[0])
    return [ins for addr, ins in instrs if start <= addr <= end]


def wgmma_waits(body: list[str]) -> int:
    """A loop's waits for every wgmma in flight (WARPGROUP.DEPBAR.LE gsb0, 0x0) among its
    instructions (loop_sass's): one after each HGMMA means the tensor-core steps run one at a
    time (ptxas serialized them, or the code waits before reusing an operand)."""
    return sum(bool(re.match(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0\b", ins)) for ins in body)


def pre_wait_loads(compiled: Any) -> dict[str, Any] | None:
    """The global loads issued before the kernel's grid-dependency wait, None without one:
    {"ptx": {function: loads} by the kernel source's function each comes from (the innermost
    of its line info), "sass": LDGs before the first ACQBULK, "sass_128": those 128 bits
    wide, "tma": TMA copies (UTMALDG) before it}. A load ptxas moved across the wait shows as
    the two counts differing."""
    ptx = compiled.asm["ptx"]
    if "griddepcontrol.wait" not in ptx:
        return None
    files = dict(re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, re.M))
    by_function: collections.Counter = collections.Counter()
    where = None
    for line in ptx.splitlines():
        if m := re.match(r"\s*\.loc\s+(\d+)\s+(\d+)", line):
            where = (files.get(m.group(1), ""), int(m.group(2)))
        elif "griddepcontrol.wait" in line:
            break
        elif re.search(r"\bld\.global", line):
            by_function[_function_at(*where) if where else "?"] += 1
    sass, tma = [], 0
    for line in _tool("nvdisasm", compiled.asm["cubin"], "-c").splitlines():
        if m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
            if re.search(r"\bACQBULK\b", m.group(1)):
                break
            if re.search(r"\bLDG\b", m.group(1)):
                sass.append(m.group(1))
            tma += bool(re.search(r"\bUTMALDG\b", m.group(1)))
    wide = sum(".128" in ins for ins in sass)
    return {"ptx": dict(by_function), "sass": len(sass), "sass_128": wide, "tma": tma}


@functools.cache
def _functions(path: str) -> list[tuple[int, int, str]]:
    """(first line, last line, name) of each function in a Python file."""
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except OSError:
        return []
    return [
        (node.lineno, node.end_lineno or node.lineno, node.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
    ]


def _function_at(path: str, line: int) -> str:
    """The innermost function of a Python file holding that line ("?" if none)."""
    spans = [(lo, hi, name) for lo, hi, name in _functions(path) if lo <= line <= hi]
    return max(spans)[2] if spans else "?"


class Case(NamedTuple):
    """One compile: per_thread is the weight bytes a thread takes a loop iteration."""

    label: str
    kernel: Any
    types: dict[str, str]
    constexprs: dict[str, Any]
    warps: int
    per_thread: float
    stages: int = 1
    unaligned: Collection[str] = UNALIGNED


def moe_gemv_cases(args: argparse.Namespace) -> Iterator[Case]:
    """moe_gemv_kernel at gpt-oss-20b's one-token shapes, at each of --block-n."""
    from inferx_kernels_cuda import moe_kernels as mk

    types = {"a_ptr": "*bf16", "w_ptr": "*u8", "scale_ptr": "*u8", "bias_ptr": "*bf16"}
    types |= {"topk_w_ptr": "*fp32", "ids_ptr": "*i64", "out_ptr": "*bf16", "stride_we": "i64"}
    types |= {"alpha": "fp32", "limit": "fp32"}
    warps = args.warps or mk.GEMV_MXFP4_WARPS
    block_k = args.block_k or mk.GEMV_MXFP4_BLOCK_K
    for gated in (True, False):
        for block_n in _ints(args.block_n):
            constexprs = dict(
                A_ROW_DIV=4 if gated else 1, ACT=mk.ACT_SWIGLU_OAI if gated else mk.ACT_NONE,
                GATE_STRIDE=2 if gated else 1, MXFP4=True, ROW_SCALE=False, HAS_BIAS=True,
                WEIGHTED=not gated, ATOMIC_K=0, BLOCK_N=block_n, BLOCK_K=block_k, A_PAIRS=True,
            )  # fmt: skip
            if "ROWS" in inspect.signature(mk.moe_gemv_kernel.fn).parameters:
                constexprs["ROWS"] = mk.gemv_rows(block_n, block_k, warps)
            per_thread = block_n * block_k / 2 * (2 if gated else 1) / (32 * warps)
            label = (
                f"moe_gemv gpt-oss {'gate_up' if gated else 'down'} N{block_n} K{block_k}/{warps}"
            )
            yield Case(label, mk.moe_gemv_kernel, types, constexprs, warps, per_thread)


def moe_gemv_tma_cases(args: argparse.Namespace) -> Iterator[Case]:
    """moe_gemv_tma_kernel (MXFP4's GEMV, weight words by TMA) at gpt-oss-20b's one-token
    shapes: at its defaults (GEMV_MXFP4_TMA_GATE_UP / _DOWN) and at each of --block-n, with
    --block-k and --stages where given."""
    from inferx_kernels_cuda import moe_kernels as mk

    types = {"a_ptr": "*bf16", "scale_ptr": "*u8", "bias_ptr": "*bf16", "topk_w_ptr": "*fp32"}
    types |= {"ids_ptr": "*i64", "out_ptr": "*bf16", "alpha": "fp32", "limit": "fp32"}
    for gated, default in ((True, mk.GEMV_MXFP4_TMA_GATE_UP), (False, mk.GEMV_MXFP4_TMA_DOWN)):
        widths = [default[0]] + [n for n in _ints(args.block_n) if n != default[0]]
        for block_n in widths:
            block_k = args.block_k or default[1]
            warps = args.warps or default[2]
            stages = args.stages or default[3]
            rows = 2 * block_n if gated else block_n  # gate and up rows interleaved
            constexprs = dict(
                A_ROW_DIV=4 if gated else 1, ACT=mk.ACT_SWIGLU_OAI if gated else mk.ACT_NONE,
                GATE_STRIDE=2 if gated else 1, HAS_BIAS=True, WEIGHTED=not gated, ATOMIC_K=0,
                BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, A_PAIRS=True,
            )  # fmt: skip
            desc = {"w_desc": f"tensordesc<i32[1, {rows}, {block_k // 8}]>"}
            per_thread = rows * block_k / 2 / (32 * warps)
            label = (
                f"moe_gemv_tma gpt-oss {'gate_up' if gated else 'down'} N{block_n} "
                f"K{block_k}/{warps} st{stages}"
            )
            yield Case(
                label, mk.moe_gemv_tma_kernel, types | desc, constexprs, warps, per_thread, stages
            )


def moe_gemm_cases(args: argparse.Namespace) -> Iterator[Case]:
    """moe_gemm_kernel's MXFP4 tiles at gpt-oss-20b's shapes as gemm_configs picks them for 8,
    256 and 2048 tokens: a weight tile is dequantized once per M tile."""
    from inferx_kernels_cuda import moe_kernels as mk

    types = {"a_ptr": "*bf16", "w_ptr": "*u8", "scale_ptr": "*u8", "bias_ptr": "*bf16"}
    types |= {"topk_w_ptr": "*fp32", "out_ptr": "*bf16", "stride_we": "i64"}
    types |= {n: "*i32" for n in ("sorted_ptr", "block_expert_ptr", "num_padded_ptr")}
    types |= {"alpha": "fp32", "limit": "fp32"}
    for tokens in (8, 256, 2048):
        # bf16 activations: the prefill tiles may swap operands, as fused_experts lets them
        configs = mk.gemm_configs(tokens * 4, 32, 2880, 2880, "mxfp4", 132, swap_ab=True)
        for gated, cfg in zip((True, False), configs, strict=True):
            constexprs = dict(
                A_ROW_DIV=4 if gated else 1, ACT=mk.ACT_SWIGLU_OAI if gated else mk.ACT_NONE,
                GATE_STRIDE=2 if gated else 1, MXFP4=True, ROW_SCALE=False, K_SCALE=False,
                HAS_BIAS=True, WEIGHTED=not gated, ATOMIC_K=0, PER_PAIR=False, DOT_FP32=False,
                BF16_BITS=True, SWAP_AB=cfg.swap_ab, EVEN_K=2880 % cfg.block_k == 0,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            )  # fmt: skip
            per_thread = cfg.block_n * cfg.block_k / 2 * (2 if gated else 1) / (32 * cfg.num_warps)
            label = (
                f"moe_gemm gpt-oss {'gate_up' if gated else 'down'} {tokens} tok "
                f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/{cfg.num_warps}"
                + (" swap" if cfg.swap_ab else "")
            )
            yield Case(
                label, mk.moe_gemm_kernel, types, constexprs, cfg.num_warps, per_thread,
                cfg.num_stages,
            )  # fmt: skip


def w4a16_cases(args: argparse.Namespace) -> Iterator[Case]:
    """w4a16_kernel as w4a16._launch starts it for a bf16 x of --rows rows, at each shape, at
    pick_config's config and (1-4 rows) fma_config's; a split K writes fp32 partial sums."""
    from inferx_kernels_cuda import w4a16

    shapes = MODELS[args.model]
    pdl_launches = [
        (" pdl", {"PDL": True, "TRIGGER": True}),
        (" pdl late", {"PDL": True, "LATE": True}),
    ]
    for shape in args.shapes.split(",") if args.shapes else shapes:
        k, n = shapes[shape]
        configs = [w4a16.pick_config(args.rows, n, k)]
        configs = [(cfg, "", {}) for cfg in configs]
        if args.rows <= w4a16.MAX_FMA_ROWS:
            fma = w4a16.fma_config(args.rows, n, k)
            configs.append((fma, "", {}))
            if args.pdl:  # the PDL launches of w4a16.pdl_launch
                configs += [(fma, suffix, pdl) for suffix, pdl in pdl_launches]
        for cfg, suffix, pdl in configs:
            block_k = w4a16._block_k(cfg, k if args.row_group else W4A16_GROUP, k)
            constexprs = dict(
                HAS_PERM=args.act_order or args.row_group, HAS_BIAS=False, BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n, BLOCK_K=block_k, PACKED=cfg.packed_loads,
                USE_DOT=cfg.use_dot, UPCAST=False, DOT_PRECISION="tf32", **pdl,
            )  # fmt: skip
            if args.row_group:  # left at its default otherwise, as a launch without one does
                constexprs["ROW_GROUP"] = True
            types = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8"}
            types |= {"perm_ptr": "*i32", "bias_ptr": "*bf16", "rg_ptr": "*i32"}
            types["out_ptr"] = "*fp32" if cfg.split_k > 1 else "*bf16"
            per_thread = block_k * cfg.block_n / 2 / (32 * cfg.num_warps)
            yield Case(
                f"w4a16 {shape} {cfg}{suffix}", w4a16.w4a16_kernel, types, constexprs,
                cfg.num_warps, per_thread, cfg.num_stages, W4A16_UNALIGNED,
            )  # fmt: skip


def split_k_reduce_cases(args: argparse.Namespace) -> Iterator[Case]:
    """split_k_reduce_kernel as w4a16.w4a16_linear launches it after a split GEMV (4 warps,
    no bias): plain and gated, and with --pdl also as it launches with PDL (PDL, TRIGGER)."""
    from inferx_kernels_cuda import w4a16
    from inferx_kernels_cuda.gemv import split_k_reduce_kernel

    types = {"partial_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*bf16"}
    variants = [("", {})] + ([(" pdl", {"PDL": True, "TRIGGER": True})] if args.pdl else [])
    for gated in (False, True):
        for suffix, pdl in variants:
            constexprs = dict(HAS_BIAS=False, BLOCK=w4a16._REDUCE_BLOCK, GATED=gated, **pdl)
            per_thread = w4a16._REDUCE_BLOCK * 4 / (32 * 4)  # a loop: one half's partials
            label = f"split_k_reduce {'gated' if gated else 'plain'}{suffix}"
            yield Case(
                label, split_k_reduce_kernel, types, constexprs, 4, per_thread, 1,
                {"m", "split_k"},
            )  # fmt: skip


KERNELS = {
    "moe_gemv": moe_gemv_cases,
    "moe_gemv_tma": moe_gemv_tma_cases,
    "moe_gemm": moe_gemm_cases,
    "w4a16": w4a16_cases,
    "split_k_reduce": split_k_reduce_cases,
}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default=",".join(KERNELS), help=", ".join(KERNELS))
    parser.add_argument("--block-n", default="8,16,32", help="moe_gemv's columns a program")
    parser.add_argument("--block-k", type=int, help="moe_gemv's K columns a step (GEMV_BLOCK_K)")
    parser.add_argument("--warps", type=int, help="moe_gemv's warps (GEMV_MXFP4_WARPS)")
    parser.add_argument("--stages", type=int, help="moe_gemv_tma's pipeline stages")
    parser.add_argument("--model", choices=MODELS, default="qwen2.5-3b", help="w4a16's shapes")
    parser.add_argument("--rows", type=int, default=1, help="w4a16's rows of x")
    parser.add_argument("--act-order", action="store_true", help="w4a16 with the K permutation")
    parser.add_argument(
        "--row-group", action="store_true", help="w4a16 with the permutation and a group a row"
    )
    parser.add_argument(
        "--pdl", action="store_true", help="w4a16, split_k_reduce: also their PDL launches"
    )
    parser.add_argument("--shapes", help="w4a16's, comma-separated (default: all)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--dump", help="also write each loop's SASS to a file in this folder")
    args = parser.parse_args()
    if unknown := [k for k in args.kernels.split(",") if k not in KERNELS]:
        parser.error(f"unknown kernels {unknown}; known: {', '.join(KERNELS)}")
    if unknown := [s for s in (args.shapes or "").split(",") if s and s not in MODELS[args.model]]:
        parser.error(f"unknown shapes {unknown}; {args.model}'s: {', '.join(MODELS[args.model])}")
    if args.rows < 1:
        parser.error(f"--rows must be at least 1, not {args.rows}")
    return args


def main() -> None:
    args = _args()
    kernels = args.kernels.split(",")
    budget = ISSUE_PER_CLOCK / H100_BYTES_PER_CLOCK
    print(f"Triton {triton.__version__}, sm_90; at most {budget:.1f} instructions a weight byte")
    print("for an H100's bandwidth (the loop's only, one SM's issue rate)")
    if "w4a16" in kernels:
        print(
            f"w4a16: {args.model}, {args.rows} row(s), group {W4A16_GROUP}, "
            f"act-order {args.act_order}, row groups {args.row_group}"
        )
    print(
        f"{'kernel':60s} {'regs':>4s} {'stack':>5s} {'smem':>6s} {'loop':>5s} {'/byte':>6s} "
        f"{'pre-wait':>8s} {'tma':>3s}  top opcodes"
    )
    rows = []
    for name in kernels:
        for case in KERNELS[name](args):
            compiled = compile_sm90(
                case.kernel, case.types, case.constexprs, case.warps, case.stages, case.unaligned
            )
            regs, stack = resources(compiled)
            body = loop_sass(compiled)
            length, ops = loop_mix(body)
            tma = sum(n for op, n in ops.items() if op == "UTMALDG")
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                path = os.path.join(args.dump, re.sub(r"\W+", "_", case.label) + ".sass")
                with open(path, "w") as f:
                    f.write("\n".join(body) + "\n")
            per_byte = length / case.per_thread
            top = " ".join(f"{op} {n}" for op, n in ops.most_common(8))
            pre_wait = pre_wait_loads(compiled)
            loads = "-" if pre_wait is None else str(pre_wait["sass"])
            shared = compiled.metadata.shared
            print(
                f"{case.label:60s} {regs:4d} {stack:5d} {shared:6d} {length:5d} {per_byte:6.1f} "
                f"{loads:>8s} {tma:3d}  {top}",
                flush=True,
            )
            if pre_wait is not None:
                print(f"{'':60s} before the wait: {pre_wait}", flush=True)
            waits = wgmma_waits(body)
            if ops.get("HGMMA"):
                print(f"{'':60s} wgmma: {ops['HGMMA']} HGMMA, {waits} full waits", flush=True)
            rows.append(
                {"kernel": case.label, "regs": regs, "stack": stack, "loop": length}
                | {"per_byte": per_byte, "pre_wait": pre_wait, "shared": shared, "tma": tma}
                | {"ops": dict(ops), "wgmma_waits": waits}
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
