"""Registers, spills and occupancy of the Triton decode kernel per launch option, compiled for
an sm_90 GPU (the H200) on any machine: no GPU needed, Triton's bundled ptxas and cuobjdump do
the work.

    python benchmarks/kernel_registers.py [--group 8] [--head-dim 128] [--warps 2,4]
        [--block-n 16,32,64] [--qkv-parts 4] [--preload] [--json OUT.json]

--qkv-parts: the QKV GEMM's partial results the kernel sums, with a bias (4: a 3B decode-only
step; 1: the unsplit path, an 8B one). --preload: the kernel as a batch-1 graph step launches
it, early behind QKV with its first K/V tile loaded before the wait (EARLY, PRELOAD).

A program that takes many registers or much shared memory leaves room for few others on an SM
(65,536 registers, allocated per warp in units of 8 a thread; 228 KB), so few tiles of K and V
are in flight at once. The arguments carry the divisibility a GPU launch specialises on
(aligned pointers, strides that are multiples of 16): without it Triton loads K and V one
element at a time and the counts double. The figures come from this machine's Triton, which
may be newer than the GPU box's: they rank options, the H200 decides.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).parent))
from commit_id import commit_id  # noqa: E402

from inferx_kernels_cuda import triton_kernels  # noqa: E402

SM_REGISTERS = 65_536
SM_SHARED_BYTES = 228 * 1024
MAX_PROGRAMS_PER_SM = 32
# The decode kernel's pointer arguments that are not the model dtype (bf16).
POINTER_TYPES = {
    "part_o_ptr": "*fp32",
    "part_lse_ptr": "*fp32",
    "cos_sin_ptr": "*fp32",
    "block_table_ptr": "*i32",
    "context_len_ptr": "*i32",
    "query_start_ptr": "*i32",
    "seq_ids_ptr": "*i32",
    "slot_ptr": "*i64",
    "positions_ptr": "*i64",
}


def decode_signature(constexprs: dict[str, Any]) -> dict[str, str]:
    """Triton's signature of decode_kernel: every argument's type, "constexpr" for those given."""
    sig = {}
    for name in inspect.signature(triton_kernels.decode_kernel.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = POINTER_TYPES.get(name, "*bf16")
        else:
            sig[name] = "fp32" if name == "scale_log2" else "i32"
    return sig


def aligned_args(signature: dict[str, str]) -> dict[tuple[int, ...], list]:
    """The divisibility a launch on the GPU specialises on: pointers 16-byte aligned and int
    arguments multiples of 16 (the model's strides are), except those not specialised on.
    Without it Triton cannot vectorise the K/V loads, and the count here would be wrong."""
    skip = set(triton_kernels.decode_kernel.do_not_specialize)
    attrs = {}
    for i, (name, kind) in enumerate(signature.items()):
        if kind.startswith("*") or (kind == "i32" and name not in skip):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def resources(cubin: bytes) -> dict[str, int]:
    """REG, STACK and SHARED of the one kernel in a cubin, as cuobjdump reports them."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        Path(path).write_bytes(cubin)
        out = subprocess.run([str(tool), "-res-usage", path], capture_output=True, text=True)
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out.stdout)
    if found is None:
        raise RuntimeError(f"cuobjdump gave no resource usage: {out.stdout}{out.stderr}")
    regs, stack, shared = (int(v) for v in found.groups())
    return {"registers": regs, "stack_bytes": stack, "shared_bytes": shared}


def programs_per_sm(registers: int, warps: int, shared_bytes: int = 0) -> int:
    """Programs an SM holds at once, by registers (allocated in units of 8 a thread) and by
    shared memory (each program also reserves 1 KB)."""
    per_program = -(-registers // 8) * 8 * 32 * warps
    by_shared = SM_SHARED_BYTES // (shared_bytes + 1024)
    return min(MAX_PROGRAMS_PER_SM, SM_REGISTERS // per_program, by_shared)


def decode_kernel_resources(
    group: int,
    head_dim: int,
    warps: int,
    block_n: int,
    rotary: bool = True,
    qkv_parts: int = 4,
    preload: bool = False,
) -> dict[str, Any]:
    """Compile decode_kernel for sm_90 as a decode-only graph step launches it (split context,
    all decodes, rotary inside, q/k/v as qkv_parts partial sums plus a bias unless 1) and report
    what one program takes. preload: launched early (PDL) with its first K/V tile loaded
    before the wait, as at batch 1."""
    constexprs = {
        "GROUP": group,
        "GROUP_PAD": max(16, triton.next_power_of_2(group)),
        "HEAD_DIM": head_dim,
        "BLOCK_SIZE": 16,
        "BLOCK_N": block_n,
        "SPLIT": True,
        "SEQ_SPLIT": True,
        "ALL_DECODE": True,
        "UPCAST": False,
        "DOT_PRECISION": "tf32",
        "ROTARY": rotary,
        "PARTS": qkv_parts,
        "HAS_BIAS": qkv_parts > 1,
        # it lets the kernel after it launch early; with preload it was launched early itself
        "PDL": preload,
        "TRIGGER": True,
        "EARLY": preload,
        "PRELOAD": preload,
    }
    signature = decode_signature(constexprs)
    src = ASTSource(
        fn=triton_kernels.decode_kernel,
        signature=signature,
        constexprs=constexprs,
        attrs=aligned_args(signature),
    )
    options = {"num_warps": warps, "num_stages": 1}
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    res = resources(kernel.asm["cubin"])
    res["shared_bytes"] = max(res["shared_bytes"], int(kernel.metadata.shared))  # dynamic
    programs = programs_per_sm(res["registers"], warps, res["shared_bytes"])
    return {
        "group": group,
        "head_dim": head_dim,
        "warps": warps,
        "block_n": block_n,
        **res,
        "programs_per_sm": programs,
        "warps_per_sm": programs * warps,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", type=int, default=8, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warps", default="2,4")
    ap.add_argument("--block-n", default="16,32,64")
    ap.add_argument("--qkv-parts", type=int, default=4)
    ap.add_argument("--preload", action="store_true", help="EARLY + PRELOAD (batch 1's form)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit(
            "kernel_registers: unset TRITON_INTERPRET (interpreted kernels do not compile)"
        )
    rows = []
    print(f"decode_kernel on sm_90, triton {triton.__version__}, group {args.group}, "
          f"head dim {args.head_dim}")  # fmt: skip
    print(f"{'warps':>5} {'block_n':>7} {'regs':>5} {'stack B':>7} {'shared B':>8} "
          f"{'programs/SM':>11} {'warps/SM':>8}")  # fmt: skip
    for warps in (int(w) for w in args.warps.split(",")):
        for block_n in (int(b) for b in args.block_n.split(",")):
            r = decode_kernel_resources(
                args.group, args.head_dim, warps, block_n, qkv_parts=args.qkv_parts,
                preload=args.preload,
            )  # fmt: skip
            rows.append(r)
            print(f"{warps:>5} {block_n:>7} {r['registers']:>5} {r['stack_bytes']:>7} "
                  f"{r['shared_bytes']:>8} {r['programs_per_sm']:>11} "
                  f"{r['warps_per_sm']:>8}")  # fmt: skip
    if args.json:
        doc = {"commit": commit_id(), "triton": triton.__version__, "args": vars(args)}
        doc["rows"] = rows
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
