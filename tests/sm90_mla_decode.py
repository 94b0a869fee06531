"""mla_decode_absorbed's fused kernels (mla_absorb_q_kernel, mla_reduce_uv_kernel) compiled for
sm_90 without a GPU (test_mla_decode runs this in a process of its own, outside the
interpreter): at DeepSeek-V2-Lite's widths (16 heads, nope 128, v 128, latent 512) in bf16, with
the tiles mla_decode_absorbed picks for each [batch, splits] of argv[1] (a JSON list). Pointers
and strides are compiled divisible by 16, as Triton's specialisation would. Prints one JSON
line: per case [[tiles], [registers, spilled bytes] of mla_absorb_q_kernel, the same of
mla_reduce_uv_kernel]."""

from __future__ import annotations

import inspect
import json
import sys

import triton
from sm90_mla import registers_and_spills
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from inferx_kernels_cuda import mla_decode as m

HEADS, NOPE, V, RANK = 16, 128, 128, 512
UNALIGNED = {"batch", "min_split_len"}


def compile_sm90(kernel, constexprs: dict, warps: int):
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n.startswith("part_"):
            sig[n] = "*fp32"
        elif n == "context_len_ptr":
            sig[n] = "*i32"
        elif n.endswith("_ptr"):
            sig[n] = "*bf16"
        else:
            sig[n] = "i32"
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if sig[n] != "constexpr" and n not in UNALIGNED
    }
    src = ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": warps, "num_stages": 3}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def case(batch: int, splits: int) -> list:
    common = {"UPCAST": False, "DOT_PRECISION": "tf32"}
    block_r = m._uk_block(HEADS, NOPE, RANK)
    uk = compile_sm90(
        m.mla_absorb_q_kernel,
        {"NOPE": NOPE, "NOPE_PAD": NOPE, "RANK": RANK, "BLOCK_R": block_r, "BLOCK_B": 16} | common,
        4,
    )
    tiles = m._uv_tiles(batch, HEADS, V, RANK, splits, 2)
    bb, bv, br, _ = tiles
    uv = compile_sm90(
        m.mla_reduce_uv_kernel,
        {
            "RANK": RANK,
            "V": V,
            "SPLITS": splits,
            "SPLITS_PAD": max(2, triton.next_power_of_2(splits)),
            "BLOCK_N": 32,
            "BLOCK_B": bb,
            "BLOCK_V": bv,
            "BLOCK_R": br,
        }
        | common,
        m._UV_WARPS,
    )
    return [list(tiles), list(registers_and_spills(uk)), list(registers_and_spills(uv))]


if __name__ == "__main__":
    print(json.dumps([case(b, s) for b, s in json.loads(sys.argv[1])]))
