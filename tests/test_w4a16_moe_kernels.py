"""The fused MoE kernels' "w4a16" path (moe_kernels: moe_gemm_kernel and moe_gemv_kernel with
W4) under TRITON_INTERPRET=1: random packed 4-bit experts (every nibble value, zero points or
not, act-order perms or not, groups of 32 / 64 / 128 or one over K) against float64 on the
weights dequantized here from the layout's definition; fp32 and fp16 activations (the
interpreter's bf16 tl.dot is wrong: docs/ARCHITECTURE.md's Triton notes); the layer's
ExpertWeights through TritonOps.moe_experts; a malformed layout refused, naming the tensor."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from conftest import interpreted  # noqa: E402

from inferx_core.interfaces.moe import ExpertsSpec, ExpertWeights, RouterSpec  # noqa: E402
from inferx_core.moe import route  # noqa: E402
from inferx_kernels_cuda.moe_kernels import fused_experts  # noqa: E402

SPEC = ExpertsSpec("mlp.experts", 4, 128, 128)
SWIGLU = ExpertsSpec("mlp.experts", 4, 128, 128, "swiglu_oai", bias=True)
# fp32: summation order only. fp16: the weights rounded to fp16 in the tile ((q - z) * s needs
# up to 15 bits), the activation between the GEMMs and each expert's output rounded to fp16.
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}
# (group size, zero points, act-order)
LAYOUTS = {
    "g32-zeros": (32, True, False),
    "g64-sym": (64, False, False),
    "g128-zeros": (128, True, False),
    "per-channel-sym": (-1, False, False),
    "g32-act-order": (32, False, True),
    "g128-zeros-act-order": (128, True, True),
}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_w4(spec: ExpertsSpec, group: int, zeros: bool, act_order: bool, seed: int):
    """ExpertWeights "w4a16" of random words (all 32 bits), fp16 scales of either sign in
    [2^-9, 2^-6], random zero points and per-expert permutations where asked."""
    g = gen(seed)
    e, h, n = spec.num_experts, spec.hidden_size, spec.intermediate_size

    def proj(k: int, rows: int):
        groups = 1 if group == -1 else k // group
        words = torch.randint(-(2**31), 2**31, (e, k // 8, rows), generator=g, dtype=torch.int64)
        sign = torch.randint(0, 2, (e, groups, rows), generator=g) * 2 - 1
        scale = (torch.rand(e, groups, rows, generator=g) * 7 + 1) / 512 * sign
        zero = torch.randint(0, 16, (e, groups, rows), generator=g).to(torch.uint8)
        perm = torch.stack([torch.randperm(k, generator=g) for _ in range(e)]).to(torch.int32)
        return (
            words.to(torch.int32),
            scale.half(),
            zero if zeros else None,
            perm if act_order else None,
        )

    gu, dn = proj(h, 2 * n), proj(n, h)
    bias = spec.bias
    return ExpertWeights(
        "w4a16",
        gu[0],
        dn[0],
        gu[1],
        dn[1],
        torch.randn(e, 2 * n, generator=g) if bias else None,
        torch.randn(e, h, generator=g) if bias else None,
        gate_up_zeros=gu[2],
        down_zeros=dn[2],
        gate_up_perm=gu[3],
        down_perm=dn[3],
        group_size=group,
    )


def dense(qweight, scales, zeros, perm, group, row_group=None) -> torch.Tensor:
    """[E, K / 8, N] words -> [E, N, K] float64 weights, from the definition: input row 8i + j
    of output c is nibble j (bits 4j..4j+3) of word [i, c]; (q - zero) * scale of its group
    (stored row i's: row_group[e, i] where given); with perm, stored row i is input row
    perm[i]."""
    e, kw, n = qweight.shape
    k = kw * 8
    shifts = 4 * torch.arange(8)
    q = ((qweight.long()[:, :, None, :] >> shifts[None, None, :, None]) & 15).reshape(e, k, n)
    group_of = (torch.arange(k) // (k if group == -1 else group)).expand(e, k)
    if row_group is not None:
        group_of = row_group.long()
    rows = group_of[:, :, None].expand(e, k, n)
    zero = 8 if zeros is None else zeros.long().gather(1, rows)
    w = (q - zero).double() * scales.double().gather(1, rows)
    if perm is not None:
        w = torch.zeros_like(w).scatter_(1, perm.long()[:, :, None].expand(-1, -1, n), w)
    return w.transpose(1, 2)


def reference(x, topk_weights, topk_ids, w: ExpertWeights, spec: ExpertsSpec) -> torch.Tensor:
    gate_up = dense(w.gate_up, w.gate_up_scales, w.gate_up_zeros, w.gate_up_perm, w.group_size)
    down = dense(w.down, w.down_scales, w.down_zeros, w.down_perm, w.group_size, w.down_row_group)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = gate_up[e] @ x[t].double()
            if w.gate_up_bias is not None:
                h = h + w.gate_up_bias[e].double()
            if spec.activation == "silu":
                gate, up = h.chunk(2)
                a = torch.nn.functional.silu(gate) * up
            else:
                gate = h[0::2].clamp(max=spec.limit)
                up = h[1::2].clamp(-spec.limit, spec.limit)
                a = gate * torch.sigmoid(spec.alpha * gate) * (up + 1)
            y = down[e] @ a
            if w.down_bias is not None:
                y = y + w.down_bias[e].double()
            out[t] += topk_weights[t, j].double() * y
    return out


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def check(w, spec, tokens: int, dtype: torch.dtype, seed: int, gemv: bool) -> None:
    x = torch.randn(tokens, spec.hidden_size, generator=gen(seed)).to(dtype)
    logits = torch.randn(tokens, spec.num_experts, generator=gen(seed + 1))
    topk_weights, topk_ids = route(logits, RouterSpec(spec.num_experts, 2, renormalize=True))
    want = reference(x.float(), topk_weights, topk_ids, w, spec)
    got = fused_experts(x, topk_weights, topk_ids, w, spec, gemv=gemv)
    assert got.shape == x.shape and got.dtype == dtype
    assert rel(got, want) < TOL[dtype], (tokens, gemv)


@interpreted
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_gemm_and_gemv_equal_float64(layout: str, tokens: int) -> None:
    """The grouped GEMM (one token: a tile per pair; 9: grouped by expert; gate_up gated with
    SiLU, down not, weighted) and the GEMV on the same weights and inputs, fp32 activations,
    within 2e-5 of float64's largest output."""
    group, zeros, act_order = LAYOUTS[layout]
    w = random_w4(SPEC, group, zeros, act_order, seed=tokens + len(layout))
    for gemv in (False, True):
        check(w, SPEC, tokens, torch.float32, seed=100 + tokens, gemv=gemv)


def with_down_row_groups(w: ExpertWeights, groups: int, seed: int) -> ExpertWeights:
    """w with down as a tensor-parallel rank holds an act-order split: `groups` rows of scales
    (and zeros) an expert, each stored row's group in down_row_group [E, n], sorted (as the
    layer sorts them), runs of every length from 0 up."""
    g = gen(seed)
    e, h = w.down.shape[0], w.down.shape[2]
    n = w.down.shape[1] * 8
    sign = torch.randint(0, 2, (e, groups, h), generator=g) * 2 - 1
    scales = ((torch.rand(e, groups, h, generator=g) * 7 + 1) / 512 * sign).half()
    zeros = torch.randint(0, 16, (e, groups, h), generator=g).to(torch.uint8)
    row_group = torch.randint(0, groups, (e, n), generator=g).sort(1).values.to(torch.int32)
    return ExpertWeights(
        **{
            **w.__dict__,
            "down_scales": scales,
            "down_zeros": zeros if w.down_zeros is not None else None,
            "down_row_group": row_group,
        }
    )


@interpreted
@pytest.mark.parametrize("zeros", [False, True], ids=["sym", "zeros"])
@pytest.mark.parametrize("tokens", [1, 3, 9, 20])
def test_down_row_groups_equal_float64(tokens: int, zeros: bool) -> None:
    """ROW_GROUP: down's scales and zeros read by each stored row's group (an act-order split
    over ranks: groups cut anywhere, tiles crossing them), the grouped GEMM and the GEMV, fp32
    activations, within 2e-5 of float64's largest output."""
    w = random_w4(SPEC, 32, zeros, True, seed=tokens)
    w = with_down_row_groups(w, 7, seed=tokens + 50)
    for gemv in (False, True):
        check(w, SPEC, tokens, torch.float32, seed=400 + tokens, gemv=gemv)
    # the same weights read as runs of 32 rows (no row_group): another result
    plain = ExpertWeights(
        **{**w.__dict__, "down_row_group": None, "down_scales": w.down_scales[:, :4].contiguous()}
        | ({"down_zeros": w.down_zeros[:, :4].contiguous()} if zeros else {})
    )
    x = torch.randn(3, SPEC.hidden_size, generator=gen(5))
    topk_weights, topk_ids = route(torch.randn(3, 4, generator=gen(6)), RouterSpec(4, 2))
    want = reference(x, topk_weights, topk_ids, w, SPEC)
    assert rel(fused_experts(x, topk_weights, topk_ids, plain, SPEC), want) > 1e-3


@interpreted
@pytest.mark.parametrize("layout", ["g32-zeros", "g128-zeros-act-order"])
def test_fp16_activations(layout: str) -> None:
    group, zeros, act_order = LAYOUTS[layout]
    w = random_w4(SPEC, group, zeros, act_order, seed=7)
    for tokens, gemv in ((2, True), (5, False)):
        check(w, SPEC, tokens, torch.float16, seed=200 + tokens, gemv=gemv)


@interpreted
def test_interleaved_swiglu_with_biases() -> None:
    """gate and up columns interleaved (GATE_STRIDE 2) with biases, both kernels."""
    w = random_w4(SWIGLU, 64, True, False, seed=8)
    check(w, SWIGLU, 1, torch.float32, seed=300, gemv=False)
    check(w, SWIGLU, 3, torch.float32, seed=301, gemv=True)
    check(w, SWIGLU, 6, torch.float32, seed=302, gemv=False)


@interpreted
def test_the_layers_weights_through_triton_ops() -> None:
    """A GPTQ act-order layer's ExpertWeights through TritonOps.moe_experts (the GEMV at 2
    tokens, grouped tiles at 7) against the layer's own reference forward."""
    from test_w4a16_experts import FORMATS, loaded, random_experts

    from inferx_kernels_cuda.ops import TritonOps

    spec = ExpertsSpec("model.layers.0.mlp.experts", 4, 64, 64)
    fmt = FORMATS["gptq-asym-act-order-g32"]
    weights, biases = random_experts(spec, fmt, seed=9)
    experts = loaded(spec, fmt, weights, biases)
    for tokens in (2, 7):
        x = torch.randn(tokens, 64, generator=gen(tokens))
        logits = torch.randn(tokens, 4, generator=gen(tokens + 1))
        topk_weights, topk_ids = route(logits, RouterSpec(4, 2, renormalize=True))
        want = experts(x, topk_weights, topk_ids)
        got = TritonOps().moe_experts(experts, x, topk_weights, topk_ids)
        assert rel(got, want.double()) < 2e-5


@interpreted
@pytest.mark.parametrize("ranks", [2, 4])
def test_split_act_order_layers_through_triton_ops(ranks: int) -> None:
    """A GPTQ act-order layer over 2 and 4 ranks (its down split along K, with row groups):
    each rank's ExpertWeights through TritonOps.moe_experts (the GEMV at 2 tokens, grouped
    tiles at 7), summed over the ranks, against the whole layer's reference forward."""
    from test_w4a16_experts import FORMATS, loaded, random_experts

    from inferx_core.parallel import ParallelContext
    from inferx_kernels_cuda.ops import TritonOps

    spec = ExpertsSpec("model.layers.0.mlp.experts", 4, 64, 64)
    fmt = FORMATS["gptq-asym-act-order-g32"]
    weights, biases = random_experts(spec, fmt, seed=11)
    whole = loaded(spec, fmt, weights, biases)
    shards = [
        loaded(spec, fmt, weights, biases, ParallelContext(r, ranks, group=object()))
        for r in range(ranks)
    ]
    assert all(r.expert_weights().down_row_group is not None for r in shards)
    for tokens in (2, 7):
        x = torch.randn(tokens, 64, generator=gen(tokens))
        logits = torch.randn(tokens, 4, generator=gen(tokens + 1))
        topk_weights, topk_ids = route(logits, RouterSpec(4, 2, renormalize=True))
        want = whole(x, topk_weights, topk_ids)
        got = sum(TritonOps().moe_experts(r, x, topk_weights, topk_ids) for r in shards)
        assert rel(got, want.double()) < 2e-5


@interpreted
def test_a_malformed_layout_is_refused() -> None:
    w = random_w4(SPEC, 32, True, False, seed=10)
    x = torch.randn(1, 128)
    ids = torch.tensor([[0, 1]])
    bad = ExpertWeights(**{**w.__dict__, "down_zeros": w.down_zeros.float()})
    with pytest.raises(ValueError, match=r"w4a16 down_zeros must be torch.uint8 \(4, 4, 128\)"):
        fused_experts(x, torch.ones(1, 2), ids, bad, SPEC)
    odd = ExpertWeights(**{**w.__dict__, "group_size": 48})
    with pytest.raises(ValueError, match="group_size 32, 64, 128 or -1"):
        fused_experts(x, torch.ones(1, 2), ids, odd, SPEC)
    rows = torch.zeros(4, 64, dtype=torch.int32)  # down's K is 128
    short = ExpertWeights(**{**w.__dict__, "down_row_group": rows})
    with pytest.raises(ValueError, match=r"w4a16 down_row_group must be torch.int32 \(4, 128\)"):
        fused_experts(x, torch.ones(1, 2), ids, short, SPEC)
