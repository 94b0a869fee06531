"""mla_prefill_kernel compiled for sm_90 without a GPU (test_mla_prefill runs this in a process of
its own, outside the interpreter): at DeepSeek-V2's widths (nope 128, rope 64, v 128, latent
512) in bf16, for each [block_m, block_n, num_warps, num_stages, tma] of argv[1] (a JSON list).
Arguments that a launch passes divisible by 16 (pointers, strides) are compiled as such, as
Triton's specialisation would. Prints one JSON line: [shared memory bytes, registers, spilled
bytes (stores + loads, from ptxas -v)] per case."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from inferx_kernels_cuda.mla_prefill import mla_prefill_kernel

NOPE, ROPE, V, RANK = 128, 64, 128, 512
UNALIGNED = {"scale_log2", "num_rows", "num_tokens"}


def compile_sm90(block_m: int, block_n: int, warps: int, stages: int, tma: bool):
    constexprs = dict(
        NOPE=NOPE, ROPE=ROPE, V=V, NOPE_PAD=NOPE, ROPE_PAD=ROPE, V_PAD=V, PE_COL=RANK,
        BLOCK_M=block_m, BLOCK_N=block_n, TMA=tma, UPCAST=False, DOT_PRECISION="tf32",
    )  # fmt: skip
    blocks = {
        "q_nope_src": (block_m, NOPE),
        "q_pe_src": (block_m, ROPE),
        "k_src": (block_n, NOPE),
        "v_src": (block_n, V),
        "pe_src": (block_n, ROPE),
    }
    names = list(inspect.signature(mla_prefill_kernel.fn).parameters)
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in blocks:
            rows, cols = blocks[n]
            sig[n] = f"tensordesc<bf16[{rows}, {cols}]>" if tma else "*bf16"
        elif n == "out_ptr":
            sig[n] = "*bf16"
        elif n.startswith("part_"):
            sig[n] = "*fp32"
        elif n.endswith("_ptr"):
            sig[n] = "*i32"
        else:
            sig[n] = "fp32" if n == "scale_log2" else "i32"
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if sig[n] in ("*bf16", "*fp32", "*i32", "i32") and n not in UNALIGNED
    }
    src = ASTSource(mla_prefill_kernel, sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_log(kernel) -> str:
    """What ptxas -v says over the kernel's PTX (Triton's compile keeps it to itself)."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas(90)
    except TypeError:  # older Triton: no arch argument
        ptxas = get_ptxas()
    path = getattr(ptxas, "path", None) or ptxas[0]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        cmd = [path, "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return log.stdout + log.stderr


def registers_and_spills(kernel) -> tuple[int, int]:
    """ptxas -v over the kernel's PTX: (registers, spill store + load bytes)."""
    text = ptxas_log(kernel)
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    spills = sum(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", text))
    return regs, spills


def wgmma_serialized(kernel) -> bool:
    """Whether ptxas serialized the kernel's wgmma (C7515: a wait after each, the tensor
    cores' steps no longer overlapping the loads and the dequantization around them)."""
    return "wgmma.mma_async" in kernel.asm["ptx"] and "C7515" in ptxas_log(kernel)


if __name__ == "__main__":
    out = []
    for *config, tma in json.loads(sys.argv[1]):
        k = compile_sm90(*config, bool(tma))
        out.append([k.metadata.shared, *registers_and_spills(k)])
    print(json.dumps(out))
