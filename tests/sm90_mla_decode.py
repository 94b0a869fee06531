"""mla_decode_absorbed's fused kernels (mla_absorb_q_kernel, mla_reduce_uv_kernel) compiled for
sm_90 without a GPU (test_mla_decode runs this in a process of its own, outside the
interpreter): at DeepSeek-V2-Lite's widths (16 heads, nope 128, v 128, latent 512) in bf16, with
the tiles mla_decode_absorbed picks for each [batch, splits] of argv[1] (a JSON list). Pointers
and strides are compiled divisible by 16, as Triton's specialisation would. Prints one JSON
line: per case [[tiles], [registers, spilled bytes] of mla_absorb_q_kernel, the same of
mla_reduce_uv_kernel, the same of its MERGE variant (a mixed graph's chunk rows)], then
[registers, spilled bytes] of mla_decode_kernel and of its ROW_SEQ variant."""

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
UNALIGNED = {"batch", "min_split_len", "stride_table", "scale_log2"}
INT_PTRS = {"context_len_ptr", "block_table_ptr", "row_seq_ptr", "merge_row_ptr"}


def compile_sm90(kernel, constexprs: dict, warps: int):
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n.startswith(("part_", "piece_")):
            sig[n] = "*fp32"
        elif n in INT_PTRS:
            sig[n] = "*i32"
        elif n.endswith("_ptr"):
            sig[n] = "*bf16"
        else:
            sig[n] = "fp32" if n == "scale_log2" else "i32"
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
    uv_constexprs = {
        "RANK": RANK,
        "V": V,
        "SPLITS": splits,
        "SPLITS_PAD": max(2, triton.next_power_of_2(splits)),
        "BLOCK_N": 32,
        "BLOCK_B": bb,
        "BLOCK_V": bv,
        "BLOCK_R": br,
    } | common
    uv = compile_sm90(m.mla_reduce_uv_kernel, uv_constexprs | {"MERGE": False}, m._UV_WARPS)
    merge = compile_sm90(m.mla_reduce_uv_kernel, uv_constexprs | {"MERGE": True}, m._UV_WARPS)
    return [list(tiles), *(list(registers_and_spills(k)) for k in (uk, uv, merge))]


def decode_kernels() -> list:
    """mla_decode_kernel as _split_parts launches it (16-token blocks), plain and ROW_SEQ."""
    constexprs = {
        "RANK": RANK,
        "ROPE": 64,
        "ROPE_PAD": 64,
        "BLOCK_H": 16,
        "BLOCK_N": 32,
        "BLOCK_SIZE": 16,
        "UPCAST": False,
        "DOT_PRECISION": "tf32",
        "KV_FP8": False,
    }
    return [
        list(
            registers_and_spills(compile_sm90(m.mla_decode_kernel, constexprs | {"ROW_SEQ": r}, 4))
        )
        for r in (False, True)
    ]


if __name__ == "__main__":
    print(json.dumps([[case(b, s) for b, s in json.loads(sys.argv[1])], decode_kernels()]))
