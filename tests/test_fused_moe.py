"""The Triton MoE kernels (inferx_kernels_cuda.moe_kernels) against the torch reference: routing
against inferx_core.moe.route, the grouping of (token, expert) pairs by expert, the grouped GEMMs
against float64 on the dense and the exactly dequantized MXFP4 weights, and whole FusedMoE layers
(Qwen3-MoE, gpt-oss, DeepSeek-style) under TritonOps against TorchOps. On the CPU under the
interpreter at small sizes; on the GPU at the published shapes, under CUDA graphs, and in tiny
models on the cuda executor."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted, on_gpu  # noqa: E402

from inferx_core.interfaces import (  # noqa: E402
    BuildContext,
    ExpertsSpec,
    ExpertWeights,
    RouterSpec,
)
from inferx_core.moe import FusedMoE, UnquantizedExperts, route  # noqa: E402
from inferx_core.ops_torch import TorchOps  # noqa: E402
from inferx_core.parallel import ParallelContext  # noqa: E402
from inferx_core.quant_none import Unquantized  # noqa: E402
from inferx_kernels_cuda import moe_kernels  # noqa: E402
from inferx_kernels_cuda.moe_kernels import (  # noqa: E402
    GemmConfig,
    fused_experts,
    group_by_expert,
    max_padded,
    topk_softmax,
)
from inferx_kernels_cuda.ops import TritonOps  # noqa: E402
from inferx_quant.mxfp4 import Mxfp4, Mxfp4Experts, dequant_mxfp4  # noqa: E402

CPU = torch.device("cpu")
# Largest |ours - float64| over the largest |float64|. fp32: summation order only (~1e-6 seen).
# fp16: x and the weights are exact in fp16; the activation between the GEMMs and each expert's
# weighted output are rounded to fp16 (2**-11 each) before the fp32 sum: 2e-3 bounds it.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


# --- routing -------------------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize(
    ("experts", "k", "after", "renormalize", "scaling", "shared"),
    [
        (8, 2, False, True, 1.0, 0),  # Qwen3-MoE (norm_topk_prob)
        (8, 3, False, False, 1.0, 0),  # Qwen2-MoE: not renormalized
        (32, 4, True, False, 1.0, 0),  # gpt-oss
        (6, 4, False, False, 2.5, 0),  # experts not a power of two, a scaling factor
        (64, 6, False, False, 1.0, 2),  # DeepSeek-V2-Lite, its 2 shared experts appended
        (6, 3, False, False, 2.5, 1),  # shared unscaled; 3 + 1 columns, no padding
        (8, 2, False, True, 2.5, 3),  # 2 + 3 columns padded to 8
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_softmax_matches_route(experts, k, after, renormalize, scaling, shared, dtype):
    spec = RouterSpec(
        experts,
        k,
        softmax_after_topk=after,
        renormalize=renormalize,
        scaling=scaling,
        shared=shared,
    )
    g = gen(experts + k)
    logits = torch.randn(37, experts, generator=g) * 2
    if dtype == torch.bfloat16:  # no ties after rounding: distinct multiples of 1/4 per row
        perms = torch.stack([torch.randperm(experts, generator=g) for _ in range(37)])
        logits = perms * 0.25 - 1 + 0.125 * torch.randint(0, 2, (37, 1), generator=g)
    logits = logits.to(dtype)
    weights, ids = topk_softmax(logits, spec)
    want_w, want_ids = route(logits, spec)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (37, k + shared)
    # both largest first; the logits have no ties
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-6)
    if shared:  # the kernel's own columns: ids E.., weight exactly 1 (not scaled)
        assert torch.equal(ids[:, k:], torch.arange(experts, experts + shared).expand(37, -1))
        assert torch.equal(weights[:, k:], torch.ones(37, shared))


@interpreted
@pytest.mark.parametrize("parts", [1, 3])
def test_topk_softmax_sums_partial_logits(parts):
    """[S, T, E] partial logits (linear_parts' K-slices of the router GEMM, each rounded to
    bf16) are summed in fp32 before the routing: route on the fp32 sum; TritonOps and the
    core's route_experts take the parts alike. The parts' sums are distinct multiples of 1/4
    per row (no ties)."""
    spec = RouterSpec(32, 4, softmax_after_topk=True)
    g = gen(parts + 90)
    perms = torch.stack([torch.randperm(32, generator=g) for _ in range(9)])
    total = perms * 0.25 - 4
    split = torch.randint(-8, 9, (parts, 9, 32), generator=g) * 0.125
    split[-1] = total - split[:-1].sum(0)  # exact in bf16: multiples of 1/8 up to 16
    logits = split.to(torch.bfloat16)
    want_w, want_ids = route(total, spec)
    for weights, ids in (
        topk_softmax(logits, spec),
        TritonOps().route_experts(logits, spec),
        TorchOps().route_experts(logits, spec),
    ):
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="parts, tokens, 32"):
        topk_softmax(logits[..., :31], spec)


@interpreted
def test_topk_softmax_sums_partial_logits_beside_shared_experts():
    """DeepSeek-V2-Lite's routing (64 experts, top 6, softmax over all) with 2 shared experts,
    from 4 bf16 partial logits: route on their fp32 sum, the shared pairs after the picks."""
    spec = RouterSpec(64, 6, shared=2)
    g = gen(95)
    total = torch.stack([torch.randperm(64, generator=g) for _ in range(5)]) * 0.25 - 8
    split = torch.randint(-8, 9, (4, 5, 64), generator=g) * 0.125
    split[-1] = total - split[:-1].sum(0)
    want_w, want_ids = route(total, spec)
    assert want_ids.shape == (5, 8) and torch.equal(want_ids[:, 6:], torch.tensor([[64, 65]] * 5))
    for weights, ids in (
        topk_softmax(split.to(torch.bfloat16), spec),
        TritonOps().route_experts(split.to(torch.bfloat16), spec),
    ):
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-6)


@interpreted
def test_triton_ops_routes_deepseek_on_the_torch_reference():
    logits = torch.randn(9, 16, generator=gen(3))
    bias = torch.randn(16, generator=gen(4)) * 0.3
    grouped = RouterSpec(16, 3, num_groups=4, topk_groups=2, scaling=2.5)
    biased = RouterSpec(16, 4, scoring="sigmoid", renormalize=True, selection_bias=True)
    grouped_shared = RouterSpec(16, 3, num_groups=4, topk_groups=2, scaling=2.5, shared=2)
    for spec, b in ((grouped, None), (biased, bias), (grouped_shared, None)):
        got = TritonOps().route_experts(logits, spec, b)
        want = route(logits, spec, b)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# --- grouping ------------------------------------------------------------------------------------


def check_grouping(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    """The grouping's invariants, from the ids alone: every pair once, expert by expert in
    their own order, each segment padded with the sentinel to whole tiles, the tiles' experts,
    -1 for the tiles past the padded total, which is within the host's bound."""
    g = group_by_expert(ids, num_experts, block_m)
    flat = ids.flatten()
    pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(g.num_padded.item())
    assert total == int(padded.sum()) <= max_padded(pairs, num_experts, block_m)
    assert g.sorted_ids.numel() >= total
    want_sorted, want_blocks = [], []
    for e in range(num_experts):
        mine = (flat == e).nonzero().flatten().tolist()
        want_sorted += mine + [pairs] * (int(padded[e]) - len(mine))
        want_blocks += [e] * (int(padded[e]) // block_m)
    assert g.sorted_ids[:total].tolist() == want_sorted
    blocks = g.block_expert.tolist()
    assert blocks[: len(want_blocks)] == want_blocks
    assert all(b == -1 for b in blocks[len(want_blocks) :])


def grouping_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """ "one": the one-program grouping in one chunk; "one-looped": over several chunks of 16
    pairs; "three": the three-launch path of large steps, at sizes the interpreter runs
    quickly (chunks of 16 pairs)."""
    if path != "one":
        monkeypatch.setattr(moe_kernels, "ALIGN_CHUNK_ENTRIES", 128)  # 16 pairs a chunk
        monkeypatch.setattr(moe_kernels, "ALIGN_ONE_MAX_CHUNKS", 0 if path == "three" else 99)


@interpreted
@pytest.mark.parametrize("path", ["one", "one-looped", "three"])
@pytest.mark.parametrize("block_m", [16, 64])
def test_grouping_by_expert(path, block_m, monkeypatch):
    grouping_path(path, monkeypatch)
    for tokens, experts, k, seed in ((1, 8, 2, 0), (13, 8, 4, 1), (50, 6, 3, 2), (40, 32, 4, 3)):
        scores = torch.rand(tokens, experts, generator=gen(seed))
        check_grouping(scores.topk(k, dim=1).indices, experts, block_m)


@interpreted
@pytest.mark.parametrize("path", ["one", "one-looped", "three"])
def test_grouping_skewed(path, monkeypatch):
    """Every token picks expert 5 (several tiles of it), experts 0-3 get nothing."""
    grouping_path(path, monkeypatch)
    tokens = 40
    ids = torch.stack([torch.full((tokens,), 5), 4 + torch.arange(tokens) % 2 * 2], dim=1)
    check_grouping(ids, 8, 16)


# --- the grouped GEMMs ---------------------------------------------------------------------------


def reference_experts(x, topk_weights, topk_ids, gate_up, gate_up_bias, down, down_bias, spec):
    """Pair by pair in float64 from [E, 2n, H] / [E, H, n] weights in the activation's layout."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    n = gate_up.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = gate_up[e].double() @ x[t].double()
            if gate_up_bias is not None:
                h = h + gate_up_bias[e].double()
            if spec.activation == "silu":
                a = torch.nn.functional.silu(h[:n]) * h[n:]
            else:
                gate = h[0::2].clamp(max=spec.limit)
                up = h[1::2].clamp(-spec.limit, spec.limit)
                a = gate * torch.sigmoid(spec.alpha * gate) * (up + 1)
            y = down[e].double() @ a
            if down_bias is not None:
                y = y + down_bias[e].double()
            out[t] += topk_weights[t, j].double() * y
    return out


def random_routing(tokens, experts, k, seed):
    logits = torch.randn(tokens, experts, generator=gen(seed))
    return route(logits, RouterSpec(experts, k, renormalize=True))


def dense_experts(spec: ExpertsSpec, dtype: torch.dtype, seed: int) -> UnquantizedExperts:
    experts = UnquantizedExperts(spec, dtype, CPU)
    g = gen(seed)
    # gate_up large enough for swiglu_oai's clamps at 7 to bite on some rows
    scale = 0.6 if spec.activation == "swiglu_oai" else 0.2
    for p in experts.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * scale)
    return experts


def mxfp4_experts(spec: ExpertsSpec, dtype: torch.dtype, seed: int) -> Mxfp4Experts:
    """Random e2m1 codes (every one of the 16) and scales 2**-5 .. 2**-1."""
    experts = Mxfp4Experts(spec, dtype, CPU)
    g = gen(seed)
    for name, buf in experts.named_buffers():
        if name.endswith("blocks"):
            buf.copy_(torch.randint(0, 256, buf.shape, generator=g))
        else:
            buf.copy_(torch.randint(122, 127, buf.shape, generator=g))
    for p in experts.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g))
    return experts


def dequantized(w: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up, down) exactly dequantized (float32) for mxfp4 and fp8; dense ones as they are."""
    if w.format == "mxfp4":
        return dequant_mxfp4(w.gate_up, w.gate_up_scales), dequant_mxfp4(w.down, w.down_scales)
    if w.format == "fp8":
        return (
            w.gate_up.float() * w.gate_up_scales[..., None],
            w.down.float() * w.down_scales[..., None],
        )
    return w.gate_up, w.down


def check_experts(experts, fmt, spec, dtype, tokens, k, seed, ids=None, **kw):
    x = torch.randn(tokens, spec.hidden_size, generator=gen(seed)).to(dtype)
    weights, routed = random_routing(tokens, spec.num_experts, k, seed + 1)
    ids = routed if ids is None else ids
    w = experts.expert_weights()
    assert w.format == fmt
    gate_up, down = dequantized(w)
    want = reference_experts(x, weights, ids, gate_up, w.gate_up_bias, down, w.down_bias, spec)
    got = fused_experts(x, weights, ids, w, spec, **kw)
    assert got.shape == x.shape and got.dtype == dtype
    assert rel(got, want) < TOL[dtype]
    return want


class Fp8Experts:
    """Random experts quantized to FP8 e4m3 per output row, as ExpertWeights("fp8")."""

    def __init__(self, spec: ExpertsSpec, dtype: torch.dtype, seed: int) -> None:
        dense = dense_experts(spec, torch.float32, seed)
        parts = {}
        for name in ("gate_up", "down"):
            weight = getattr(dense, name).data
            scale = weight.abs().amax(-1) / 448.0
            parts[name] = ((weight / scale[..., None]).to(torch.float8_e4m3fn), scale)
        bias = {
            name: None if b is None else b.data.to(dtype)
            for name, b in (("gate_up", dense.gate_up_bias), ("down", dense.down_bias))
        }
        self.weights = ExpertWeights(
            "fp8", parts["gate_up"][0], parts["down"][0], parts["gate_up"][1],
            parts["down"][1], bias["gate_up"], bias["down"],
        )  # fmt: skip

    def expert_weights(self) -> ExpertWeights:
        return self.weights


SPECS = {
    # Qwen3-MoE: SiLU on gate rows then up rows, no biases
    "qwen3": ExpertsSpec("mlp.experts", 8, 64, 32),
    # gpt-oss: interleaved gate/up, clamped SwiGLU, biases
    "gpt-oss": ExpertsSpec("mlp.experts", 4, 64, 96, activation="swiglu_oai", bias=True),
}


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(SPECS))
def test_grouped_gemm_dense(name, dtype):
    spec = SPECS[name]
    experts = dense_experts(spec, dtype, seed=10)
    want = check_experts(experts, "dense", spec, dtype, tokens=11, k=2, seed=11)
    if spec.activation == "swiglu_oai":  # the clamps were exercised
        x = torch.randn(11, spec.hidden_size, generator=gen(11))
        assert (experts.gate_up.float() @ x.T).abs().max() > spec.limit
    assert want.abs().max() > 0


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(SPECS))
def test_grouped_gemm_mxfp4(name, dtype):
    """bf16 and float32 tiles hold the weights 2 ** -64 times theirs, fp16 tiles at theirs."""
    spec = SPECS[name]
    check_experts(mxfp4_experts(spec, dtype, seed=12), "mxfp4", spec, dtype, 9, 3, seed=13)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SPECS))
def test_grouped_gemm_mxfp4_swapped_operands(name, dtype):
    """SWAP_AB (W @ A^T, transposed after the K loop) against the reference, in tiles wider
    than tall and taller than wide; fp16 activations and other formats are refused."""
    spec = SPECS[name]
    experts = mxfp4_experts(spec, dtype, seed=14)
    for tiles in ((16, 32, 32), (32, 16, 64)):
        cfg = GemmConfig(*tiles, num_warps=4, num_stages=1, swap_ab=True)
        check_experts(experts, "mxfp4", spec, dtype, 9, 3, seed=15, configs=(cfg, cfg))
    cfg = GemmConfig(16, 32, 32, swap_ab=True)
    x = torch.randn(3, spec.hidden_size, dtype=torch.float16)
    weights, ids = random_routing(3, spec.num_experts, 2, seed=16)
    half = mxfp4_experts(spec, torch.float16, seed=14).expert_weights()
    with pytest.raises(ValueError, match="swapped"):
        fused_experts(x, weights, ids, half, spec, configs=(cfg, cfg))
    dense = dense_experts(spec, torch.float32, seed=17).expert_weights()
    with pytest.raises(ValueError, match="swapped"):
        fused_experts(x.float(), weights, ids, dense, spec, configs=(cfg, cfg))


def wide_mxfp4(spec: ExpertsSpec, dtype: torch.dtype) -> tuple[Mxfp4Experts, torch.Tensor]:
    """MXFP4 experts with group scales across 2 ** -100 .. 2 ** 10 and two tokens whose
    activations run from 1e-3 to 1e3 in magnitude."""
    experts = mxfp4_experts(spec, dtype, 50)
    g = gen(51)
    for buf_name, buf in experts.named_buffers():
        if buf_name.endswith("scales"):
            buf.copy_(torch.randint(27, 138, buf.shape, generator=g))
    magnitude = 10.0 ** (torch.rand(2, spec.hidden_size, generator=g) * 6 - 3)
    return experts, magnitude * torch.randn(2, spec.hidden_size, generator=g).sign()


@interpreted
@pytest.mark.parametrize("name", list(SPECS))
def test_grouped_gemm_mxfp4_scale_range(name):
    """The grouped GEMM's float32 tiles of weights 2 ** -64 times theirs, against the float64
    reference to float32 rounding across wide scales and activations."""
    spec = SPECS[name]
    experts, x = wide_mxfp4(spec, torch.float32)
    weights, ids = random_routing(2, spec.num_experts, 2, 52)
    w = experts.expert_weights()
    gate_up, down = dequantized(w)
    want = reference_experts(x, weights, ids, gate_up, w.gate_up_bias, down, w.down_bias, spec)
    assert rel(fused_experts(x, weights, ids, w, spec, gemv=False), want) < TOL[torch.float32]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(SPECS))
def test_grouped_gemm_fp8(name, dtype):
    """FP8 e4m3 weights with a float32 scale per output row, against their exact dequantized
    values (weight-only: the activations stay in their dtype)."""
    spec = SPECS[name]
    check_experts(Fp8Experts(spec, dtype, seed=19), "fp8", spec, dtype, 9, 2, seed=20)


@interpreted
@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
def test_grouped_gemm_skewed_routing(fmt):
    """Every token's first pick is expert 2 (three tiles of it), the others 0 or 3: experts 1,
    4-7 get no token."""
    spec = SPECS["qwen3"]
    tokens = 40
    ids = torch.stack([torch.full((tokens,), 2), torch.arange(tokens) % 2 * 3], dim=1)
    experts = (dense_experts if fmt == "dense" else mxfp4_experts)(spec, torch.float32, 14)
    check_experts(experts, fmt, spec, torch.float32, tokens, 2, seed=15, ids=ids)


@interpreted
@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
def test_grouped_gemm_atomic_sum(fmt):
    """The top-k sum by atomics in the down GEMM, instead of the sum kernel."""
    spec = SPECS["gpt-oss"]
    experts = (dense_experts if fmt == "dense" else mxfp4_experts)(spec, torch.float16, 17)
    check_experts(experts, fmt, spec, torch.float16, 10, 3, seed=18, atomic_sum=True)


@interpreted
@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
def test_one_token_skips_the_grouping(fmt, monkeypatch):
    """One token: a tile per pair, no grouping launch; the same bits as the grouped tiles."""
    spec = SPECS["gpt-oss"]
    experts = (dense_experts if fmt == "dense" else mxfp4_experts)(spec, torch.float32, 28)
    x = torch.randn(1, spec.hidden_size, generator=gen(29))
    weights, ids = random_routing(1, spec.num_experts, 3, 30)
    w = experts.expert_weights()

    def grouped(*args, **kw):
        raise AssertionError("grouped one token")

    with monkeypatch.context() as m:
        m.setattr(moe_kernels, "group_by_expert", grouped)
        per_pair = check_experts(experts, fmt, spec, torch.float32, 1, 3, seed=29, gemv=False)
        got = fused_experts(x, weights, ids, w, spec, gemv=False)
    monkeypatch.setattr(moe_kernels, "PER_PAIR_MAX_TOKENS", 0)
    assert torch.equal(fused_experts(x, weights, ids, w, spec, gemv=False), got)
    assert per_pair.abs().max() > 0


def experts_of(fmt: str, spec: ExpertsSpec, dtype: torch.dtype, seed: int):
    """Random experts of a format: "dense", "mxfp4" or "fp8" (per output row)."""
    if fmt == "fp8":
        return Fp8Experts(spec, dtype, seed=seed)
    return (dense_experts if fmt == "dense" else mxfp4_experts)(spec, dtype, seed)


def gemv_grids(monkeypatch) -> list:
    """The grids moe_gemv_kernel launches with from now on, in order (it still runs)."""
    grids = []
    real = moe_kernels.moe_gemv_kernel

    class Counted:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(moe_kernels, "moe_gemv_kernel", Counted())
    return grids


@interpreted
@pytest.mark.parametrize("atomic_sum", [False, True])
@pytest.mark.parametrize("fmt", ["dense", "mxfp4", "fp8"])
@pytest.mark.parametrize("name", list(SPECS))
def test_gemv_matches_the_reference(name, fmt, atomic_sum, monkeypatch):
    """moe_gemv_kernel (MXFP4's decode path: one token by default; here any format's, one
    token and three) against the float64 reference on the exact weights; the grouped path
    never runs."""
    spec = SPECS[name]
    dtype = torch.float16
    experts = experts_of(fmt, spec, dtype, 40)

    def grouped(*args, **kw):
        raise AssertionError("grouped")

    monkeypatch.setattr(moe_kernels, "group_by_expert", grouped)
    calls = gemv_grids(monkeypatch)
    # MXFP4 without gemv_tma=False takes the GEMV's TMA variant (test_moe_mxfp4_tma.py)
    kw = dict(atomic_sum=atomic_sum, gemv_tma=False)
    check_experts(experts, fmt, spec, dtype, 1, 2, seed=41, **kw)
    by_default = 2 if fmt == "mxfp4" else 0  # gate_up and down for one MXFP4 token
    assert len(calls) == by_default
    check_experts(experts, fmt, spec, dtype, 1, 2, seed=43, gemv=True, **kw)
    check_experts(experts, fmt, spec, dtype, 3, 2, seed=42, gemv=True, **kw)
    assert len(calls) == by_default + 4


@interpreted
@pytest.mark.parametrize(("split", "atomic_sum"), [(2, False), (3, False), (2, True)])
@pytest.mark.parametrize("fmt", ["dense", "mxfp4", "fp8"])
@pytest.mark.parametrize("name", list(SPECS))
def test_gemv_split_k_down_matches_the_reference(name, fmt, split, atomic_sum, monkeypatch):
    """The down GEMV's K in `split` runs of whole tiles (GemmConfig.split_k: partial sums in
    float32 summed by moe_sum_kernel, or atomics): the float64 reference on the exact weights,
    one run's bias only, the runs' launch axis; gpt-oss's K of 96 splits over two 64-column
    tiles under the interpreter, a third run (and qwen3's second) has no tile and adds 0.
    Splitting gate_up, or the grouped GEMM's down, is refused."""
    spec = SPECS[name]
    dtype = torch.float16
    experts = experts_of(fmt, spec, dtype, 50)
    grids = gemv_grids(monkeypatch)
    cfgs = (GemmConfig(16, 32, 64), GemmConfig(16, 32, 64, split_k=split))
    kw = dict(atomic_sum=atomic_sum, gemv=True, configs=cfgs)
    check_experts(experts, fmt, spec, dtype, 1, 2, seed=51, **kw)
    check_experts(experts, fmt, spec, dtype, 3, 2, seed=52, **kw)
    assert [g[2] for g in grids] == [1, split] * 2
    if not atomic_sum:  # a fixed order of sums: the same bits every run
        x = torch.randn(2, spec.hidden_size, generator=gen(53)).to(dtype)
        weights, ids = random_routing(2, spec.num_experts, 2, 54)
        w = experts.expert_weights()
        first = fused_experts(x, weights, ids, w, spec, **kw)
        assert torch.equal(first, fused_experts(x, weights, ids, w, spec, **kw))
    x = torch.randn(1, spec.hidden_size, generator=gen(55)).to(dtype)
    weights, ids = random_routing(1, spec.num_experts, 2, 56)
    w = experts.expert_weights()
    for gemv, bad in ((True, (cfgs[1], cfgs[1])), (False, cfgs)):
        with pytest.raises(ValueError, match="only the down projection's GEMV splits K"):
            fused_experts(x, weights, ids, w, spec, gemv=gemv, configs=bad)


def test_mxfp4_word_bits_in_torch():
    """moe_gemv_kernel's MXFP4 words (_mxfp4_word_dot) done in torch with the kernel's
    constants: every code at each of a word's 8 places, among random neighbours, becomes the
    float32 2 ** -126 times its value (the code 0.5 a subnormal), bit for bit."""
    g = gen(62)
    codes = torch.arange(16, dtype=torch.int64).repeat_interleave(64)
    words = torch.randint(-(2**31), 2**31, (codes.numel(),), generator=g, dtype=torch.int64)
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    want = torch.where(codes >= 8, -e2m1[codes % 8], e2m1[codes % 8]) * 2.0**-126
    m = -2118123520  # 0x81C00000
    for j in range(8):
        w = (words & ~(15 << (4 * j))) | (codes << (4 * j))
        w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
        u = w << 6
        d = u ^ ((u ^ w) & 0x00770077)
        e = u ^ ((u ^ w) & 0x00007700)
        src = (d << 22, d << 18, e << 14, e << 10, d << 6, d << 2, (w << 4) >> 6, w >> 6)[j]
        got = (src & m).view(torch.float32).double()
        assert torch.equal(got, want), j


@interpreted
@pytest.mark.parametrize(("block_n", "warps", "rows"), [(32, 1, 2), (64, 1, 4)])
def test_gemv_mxfp4_columns_per_thread(block_n, warps, rows, monkeypatch):
    """moe_gemv_kernel's MXFP4 tiles with ROWS columns a thread (gemv_rows: more columns of
    groups than threads) against the float64 reference, bf16 pairs and float16 rows, the
    columns past n_out masked (gpt-oss's 96 in tiles of 64)."""
    spec = SPECS["gpt-oss"]
    assert moe_kernels.gemv_rows(block_n, 64, warps) == rows
    seen = []
    real = moe_kernels.moe_gemv_kernel

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw["ROWS"])
                return real[grid](*args, **kw)

            return launch

    monkeypatch.setattr(moe_kernels, "moe_gemv_kernel", Recorded())
    cfg = GemmConfig(16, block_n, 64, warps)
    for dtype, seed in ((torch.bfloat16, 63), (torch.float16, 65)):
        experts = mxfp4_experts(spec, dtype, seed)
        check_experts(experts, "mxfp4", spec, dtype, 2, 2, seed + 1, gemv=True, configs=(cfg, cfg))
    assert seen == [rows] * 4


def test_mxfp4_bf16_bits_in_torch():
    """The grouped GEMM's GPU dequantization (_mxfp4_rows_bf16 with BF16_BITS, PTX the
    interpreter cannot run) done in torch with the kernel's constants: a byte times 4097,
    shifted and masked, is the pair's bf16 bits 2 ** -126 times the codes; times the bf16
    2 ** (scale - 65) (mul.bf16x2 rounds to nearest; the products are exact) the values 2 ** -64
    times the exactly dequantized weights, for every byte and scale bytes 66..192."""
    g = gen(61)
    blocks = torch.randint(0, 256, (64, 2, 16), generator=g, dtype=torch.uint8)
    blocks[0, 0] = torch.arange(16, dtype=torch.uint8)  # every code, both nibbles
    blocks[1, 0] = torch.arange(16, dtype=torch.uint8) * 16
    scales = torch.randint(66, 193, (64, 2), generator=g, dtype=torch.uint8)
    scales[2] = torch.tensor([66, 192], dtype=torch.uint8)
    spread = blocks.to(torch.int32) * 4097
    bits = ((spread << 6) & 0x01C001C0) | ((spread << 12) & -2147450880)
    halves = torch.stack((bits & 0xFFFF, (bits >> 16) & 0xFFFF), dim=-1).flatten(-2)
    codes = halves.to(torch.int16).view(torch.bfloat16).double()
    scale = (((scales.to(torch.int32) + 62) << 7).to(torch.int16)).view(torch.bfloat16).double()
    got = (codes * scale[..., None]).to(torch.bfloat16).double() * 2.0**64
    assert torch.equal(got.flatten(-2), dequant_mxfp4(blocks, scales, torch.float64))


@interpreted
@pytest.mark.parametrize("name", list(SPECS))
def test_gemv_mxfp4_scale_range_and_bf16_pairs(name, monkeypatch):
    """moe_gemv_kernel's MXFP4 arithmetic (codes 2 ** -126 times their value, activations 2 **
    64 times theirs, group sums scaled once): float32 activations against the float64
    reference to float32 rounding, with group scales across 2 ** -100 .. 2 ** 10 and
    activations from 1e-3 to 1e3; bf16 rows read as int32 pairs give bit for bit what the
    same rows read one by one give (a view of odd row stride), and the reference to bf16's."""
    spec = SPECS[name]
    experts, x = wide_mxfp4(spec, torch.float32)
    weights, ids = random_routing(2, spec.num_experts, 2, 52)
    w = experts.expert_weights()
    gate_up, down = dequantized(w)
    bias = (w.gate_up_bias, w.down_bias)
    want = reference_experts(x, weights, ids, gate_up, bias[0], down, bias[1], spec)
    got = fused_experts(x, weights, ids, w, spec, gemv=True, gemv_tma=False)
    assert rel(got, want) < TOL[torch.float32]

    pairs: list[bool] = []
    real = moe_kernels.moe_gemv_kernel

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                pairs.append(kw["A_PAIRS"])
                return real[grid](*args, **kw)

            return launch

    monkeypatch.setattr(moe_kernels, "moe_gemv_kernel", Recorded())
    xb = (x / 100).to(torch.bfloat16)
    wb = mxfp4_experts(spec, torch.bfloat16, 50)
    for buf_name, buf in wb.named_buffers():
        buf.copy_(dict(experts.named_buffers())[buf_name])
    for p_name, p in wb.named_parameters():
        p.data.copy_(dict(experts.named_parameters())[p_name].data)
    wbw = wb.expert_weights()
    paired = fused_experts(xb, weights, ids, wbw, spec, gemv=True, gemv_tma=False)
    odd = torch.zeros(2, spec.hidden_size + 1, dtype=torch.bfloat16)
    odd[:, : spec.hidden_size] = xb
    one_by_one = fused_experts(
        odd[:, : spec.hidden_size], weights, ids, wbw, spec, gemv=True, gemv_tma=False
    )
    # gate_up reads x (pairs, then not); down reads the intermediate, contiguous both times
    assert pairs == [True, True, False, True]
    assert torch.equal(paired, one_by_one)
    want_b = reference_experts(xb.float(), weights, ids, gate_up, bias[0], down, bias[1], spec)
    assert rel(paired, want_b) < TOL[torch.bfloat16]


@interpreted
def test_no_tokens():
    spec = SPECS["qwen3"]
    experts = dense_experts(spec, torch.float32, 16)
    x = torch.zeros(0, spec.hidden_size)
    ids = torch.zeros(0, 2, dtype=torch.int64)
    out = fused_experts(x, torch.zeros(0, 2), ids, experts.expert_weights(), spec)
    assert out.shape == (0, spec.hidden_size)


# --- whole layers: TritonOps against TorchOps ----------------------------------------------------


def context(ops, scheme, dtype=torch.float32, device=CPU) -> BuildContext:
    return BuildContext(dtype, device, None, scheme, ops, ParallelContext())


def fill(module: torch.nn.Module, seed: int) -> None:
    """Random parameters, and random MXFP4 codes and scales where the experts have them."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in module.named_parameters():
        scale = 0.6 if "gate_up" in name else 0.2
        p.data.copy_((torch.randn(p.shape, generator=g) * scale).to(p.device, p.dtype))
    for name, b in module.named_buffers():
        if name.endswith("blocks"):
            b.copy_(torch.randint(0, 256, b.shape, generator=g).to(b.device))
        elif name.endswith("scales"):
            b.copy_(torch.randint(121, 126, b.shape, generator=g).to(b.device))


def layer_pair(kind: str, dtype=torch.float32, device=CPU, hidden=64, inter=32, experts=8, k=2):
    """The same FusedMoE layer under TorchOps and TritonOps. kind: "qwen3" (softmax, top-k,
    renormalize; SiLU), "gpt-oss" / "gpt-oss-mxfp4" (softmax over the top-k logits, router
    bias; clamped SwiGLU with biases), "deepseek" (group-limited routing, shared experts)."""
    if kind == "qwen3":
        router = RouterSpec(experts, k, renormalize=True)
        spec = ExpertsSpec("mlp.experts", experts, hidden, inter)
        extra: dict = {}
    elif kind.startswith("gpt-oss"):
        router = RouterSpec(experts, k, softmax_after_topk=True)
        spec = ExpertsSpec("mlp.experts", experts, hidden, inter, "swiglu_oai", bias=True)
        extra = {"router_bias": True}
    else:
        router = RouterSpec(experts, k, num_groups=4, topk_groups=2, scaling=2.5)
        spec = ExpertsSpec("mlp.experts", experts, hidden, inter)
        extra = {}
    scheme = Mxfp4() if kind == "gpt-oss-mxfp4" else Unquantized()
    layers = []
    for ops in (TorchOps(), TritonOps()):
        if kind == "deepseek":
            shared = torch.nn.Linear(hidden, hidden, bias=False, device=device, dtype=dtype)
            extra = {"shared": shared}
        layers.append(
            FusedMoE(context(ops, scheme, dtype, device), "mlp", hidden, router, spec, **extra)
        )
    fill(layers[0], seed=20)
    layers[1].load_state_dict(layers[0].state_dict())
    return layers


@interpreted
@pytest.mark.parametrize("kind", ["qwen3", "gpt-oss", "gpt-oss-mxfp4", "deepseek"])
def test_layer_matches_torch_ops(kind):
    torch_layer, triton_layer = layer_pair(kind, experts=8 if kind != "deepseek" else 16)
    x = torch.randn(13, 64, generator=gen(21))
    with torch.no_grad():
        want, got = torch_layer(x), triton_layer(x)
    assert rel(got, want) < 2e-5


def deepseek_layers(ops_list, dtype, device, hidden, inter, experts, k, shared=2, **cfg):
    """One DeepSeek-V2 MoE layer per KernelOps of ops_list, built by the model's build_mlp
    (shared experts as expert slots where the ops' fuse_shared_experts is on, else a
    SharedExperts MLP) from the same random weights in `dtype` on `device`: the router, the
    routed experts and a shared MLP of shared * inter, whose slots are slices of it."""
    from inferx_models.deepseek_v2 import DeepseekV2ForCausalLM

    config = {
        "hidden_size": hidden, "moe_intermediate_size": inter, "n_routed_experts": experts,
        "num_experts_per_tok": k, "n_shared_experts": shared, "first_k_dense_replace": 0,
    } | cfg  # fmt: skip
    g = torch.Generator(device=device).manual_seed(50)

    def randn(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device) / fan_in**0.5).to(dtype)

    router = randn(experts, hidden, fan_in=hidden)
    gate_up, down = (
        randn(experts, 2 * inter, hidden, fan_in=hidden),
        randn(experts, hidden, inter, fan_in=inter),
    )
    s_gate, s_up = (
        randn(shared * inter, hidden, fan_in=hidden),
        randn(shared * inter, hidden, fan_in=hidden),
    )
    s_down = randn(hidden, shared * inter, fan_in=inter)
    # slot i: gate and up rows, down columns [i * inter, (i + 1) * inter) of the shared MLP
    slots = [slice(i * inter, (i + 1) * inter) for i in range(shared)]
    gate_up_all = torch.cat([gate_up, *(torch.cat([s_gate[r], s_up[r]])[None] for r in slots)])
    down_all = torch.cat([down, *(s_down[:, r][None] for r in slots)])
    layers = []
    for ops in ops_list:
        layer = DeepseekV2ForCausalLM.build_mlp(
            config, 0, context(ops, Unquantized(), dtype, device)
        )
        layer.gate.load("weight", router)
        fused = layer.experts.spec.shared == shared
        assert fused == ops.fuse_shared_experts and (layer.shared is None) == fused
        layer.experts.load("gate_up.weight", gate_up_all if fused else gate_up)
        layer.experts.load("down.weight", down_all if fused else down)
        if not fused:
            layer.shared.gate_up_proj.load("weight", s_gate, 0)
            layer.shared.gate_up_proj.load("weight", s_up, 1)
            layer.shared.down_proj.load("weight", s_down)
        layer.experts.finish_loading()
        layers.append(layer)
    return layers


@interpreted
@pytest.mark.parametrize("tokens", [1, 13])
@pytest.mark.parametrize(
    "routing",
    [
        {"routed_scaling_factor": 2.5},  # V2-Lite's greedy routing: topk_softmax
        {
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
        },  # V2's group-limited routing: route() in torch
    ],
)
def test_deepseek_layer_with_fused_shared_experts_matches_torch_ops(tokens, routing):
    """A DeepSeek-V2 MoE layer with its shared experts as slots of the grouped GEMMs
    (TritonOps) against the torch reference's layer with the shared MLP apart (TorchOps),
    fp32: one token (a tile per pair) and 13 (grouped); TritonOps with fusion off agrees
    too."""
    unfused = TritonOps()
    unfused.fuse_shared_experts = False
    torch_layer, fused_layer, unfused_layer = deepseek_layers(
        [TorchOps(), TritonOps(), unfused], torch.float32, CPU, 64, 32, 16, 3, **routing
    )
    x = torch.randn(tokens, 64, generator=gen(51))
    with torch.no_grad():
        want = torch_layer(x)
        assert rel(fused_layer(x), want) < 2e-5
        assert rel(unfused_layer(x), want) < 2e-5


@interpreted
@pytest.mark.parametrize("variant", ["lite", "v2"])
def test_tiny_deepseek_logits_with_fused_shared_experts_match_torch_ops(variant, monkeypatch):
    """The tiny DeepSeek-V2 of test_deepseek_v2 (8 routed experts, top 3, 2 shared) with
    TritonOps, whose MoE layers run the shared experts as slots 8 and 9 of the fused kernels,
    against TorchOps (shared MLP apart), fp32, over test_kernel_ops' three steps."""
    from test_deepseek_v2 import hf_config
    from test_kernel_ops import assert_steps_match_torch_ops, model_weights, run_model

    import inferx_kernels_cuda.ops as ops_module

    cfg = hf_config(variant).to_dict()
    weights = model_weights(cfg, seed=4)
    widths = []

    def counted(*args, **kw):
        widths.append(args[2].shape[1])  # topk_ids [T, k + shared]
        return fused_experts(*args, **kw)

    monkeypatch.setattr(ops_module, "fused_experts", counted)
    ours = run_model(cfg, TritonOps(), weights, torch.float32, CPU)
    assert widths and set(widths) == {3 + 2}
    assert_steps_match_torch_ops(cfg, weights, ours)


@interpreted
@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
def test_tensor_parallel_slices_sum_to_the_whole(fmt):
    """Each rank's experts (a slice of the intermediate size, the down bias on rank 0) through
    the fused kernels add up to the whole layer's. MXFP4: 3 scale groups over 2 ranks, one
    rank's 1 group zero-padded to 2."""
    spec = SPECS["gpt-oss"]
    make, cls = (
        (dense_experts, UnquantizedExperts) if fmt == "dense" else (mxfp4_experts, Mxfp4Experts)
    )
    whole = make(spec, torch.float32, 25)
    x = torch.randn(7, spec.hidden_size, generator=gen(26))
    weights, ids = random_routing(7, spec.num_experts, 2, 27)
    total = torch.zeros_like(x)
    for rank in range(2):
        part = cls(spec, torch.float32, CPU, ParallelContext(rank, 2, group=object()))
        for name, t in [*whole.named_parameters(), *whole.named_buffers()]:
            # "gate_up" -> "gate_up.weight", "down_blocks" -> "down.blocks", ...
            proj = "gate_up" if name.startswith("gate_up") else "down"
            part.load(f"{proj}.{name.removeprefix(proj).lstrip('_') or 'weight'}", t.data)
        total += fused_experts(x, weights, ids, part.expert_weights(), spec)
    want = fused_experts(x, weights, ids, whole.expert_weights(), spec)
    assert rel(total, want) < 2e-5


class OwnForward(UnquantizedExperts):
    """Experts that keep their tensors to themselves: the fused path must call forward."""

    calls = 0

    def expert_weights(self):
        return None

    def forward(self, x, topk_weights, topk_ids):
        OwnForward.calls += 1
        return super().forward(x, topk_weights, topk_ids)


@interpreted
def test_experts_without_weights_run_their_forward():
    spec = SPECS["qwen3"]
    OwnForward.calls = 0
    experts = OwnForward(spec, torch.float32, CPU)
    fill(experts, 22)
    x = torch.randn(5, spec.hidden_size, generator=gen(23))
    weights, ids = random_routing(5, spec.num_experts, 2, 24)
    got = TritonOps().moe_experts(experts, x, weights, ids)
    assert OwnForward.calls == 1
    assert torch.equal(got, UnquantizedExperts.forward(experts, x, weights, ids))


def tiny_moe_config(arch: str) -> dict:
    """The tiny Qwen3-MoE (layers 0 and 2 routed, 8 experts, top-2) and gpt-oss (4 experts,
    top-2, sliding and full layers with sinks) configs of test_qwen3 and test_gptoss."""
    if arch == "qwen3-moe":
        from test_qwen3 import hf_config

        return hf_config("qwen3-moe").to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]}
    from test_gptoss import hf_model

    return hf_model().config.to_dict() | {"architectures": ["GptOssForCausalLM"]}


@interpreted
@pytest.mark.parametrize("arch", ["qwen3-moe", "gpt-oss"])
def test_tiny_moe_model_logits_match_torch_ops(arch, monkeypatch):
    """The whole model with TritonOps (the MoE layers on the fused kernels) against TorchOps,
    fp32, over test_kernel_ops' three steps (packed prefill, mixed, decode)."""
    from test_kernel_ops import assert_steps_match_torch_ops, model_weights, run_model

    import inferx_kernels_cuda.ops as ops_module

    cfg = tiny_moe_config(arch)
    weights = model_weights(cfg, seed=3)
    calls = []

    def counted(*args, **kw):
        calls.append(args[0].shape[0])
        return fused_experts(*args, **kw)

    monkeypatch.setattr(ops_module, "fused_experts", counted)
    ours = run_model(cfg, TritonOps(), weights, torch.float32, CPU)
    assert calls  # the MoE layers took the fused path
    assert_steps_match_torch_ops(cfg, weights, ours)


# --- compiled for sm_90 without a GPU ------------------------------------------------------------

SM90_MAX_SHARED_PER_PROGRAM = 232_448


def test_kernels_compile_for_sm90():
    """Every kernel at the tiles gemm_configs picks for gpt-oss-20b and Qwen3-30B-A3B (decode
    and prefill, each weight format; gpt-oss-20b's MXFP4 prefill also with swapped operands;
    W4A16 act-order's down with row groups, as tensor-parallel ranks run it) compiles for
    sm_90 within a program's shared memory, and the grouped GEMMs' loads pipeline
    through cp.async. Compiled by Triton without a GPU, in a process of its own (this one may
    run Triton under the interpreter)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).parent / "sm90_moe.py"
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    kernels = json.loads(out.stdout.splitlines()[-1])
    assert len(kernels) == 105
    for label, shared, pipelined, serialized in kernels:
        assert shared <= SM90_MAX_SHARED_PER_PROGRAM, (label, shared)
        if label.endswith(("gate_up", "down", "swap_ab")):  # the grouped GEMMs, not the GEMV
            assert pipelined, label
        assert not serialized, label  # ptxas kept the wgmma asynchronous


# --- GPU: compiled kernels at the published shapes, CUDA graphs, tiny models --------------------

GPU = torch.device("cuda")


@functools.cache  # one pair per shape for all the GPU tests: filling them takes seconds
def gpu_layers(kind: str, hidden: int, inter: int, experts: int, k: int):
    torch_layer, triton_layer = layer_pair(
        kind, torch.bfloat16, GPU, hidden=hidden, inter=inter, experts=experts, k=k
    )
    return torch_layer, triton_layer


SHAPES = {  # (kind, hidden, intermediate, experts, top_k)
    "gpt-oss-20b": ("gpt-oss-mxfp4", 2880, 2880, 32, 4),
    "gpt-oss-20b-bf16": ("gpt-oss", 2880, 2880, 32, 4),
    "qwen3-30b-a3b": ("qwen3", 2048, 768, 128, 8),
}


def ops_router_logits(layer: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """The router's logits [T, E] in float32 as the layer's ops compute them (linear_parts:
    K-slice parts on the TMA GEMV, each rounded to x's dtype, summed here)."""
    return layer.ops.linear_parts(layer.gate, x).float().sum(0)


def torch_reference(
    torch_layer: FusedMoE, x: torch.Tensor, triton_layer: FusedMoE | None = None
) -> torch.Tensor:
    """The torch path's output on topk_softmax's routing, after checking that routing against
    `route` in a way that bf16 logits' ties cannot fail: the picked logits, largest first, and
    their weights agree (on a tie either expert is a right pick, and the two may differ).
    triton_layer: route the logits that layer computes (its router GEMM may run on the TMA
    GEMV in K-slices, whose bf16 parts round otherwise than F.linear: near-ties may pick other
    experts), after checking them against F.linear's to bf16 rounding."""
    with torch.no_grad():
        logits = torch_layer.gate(x)
        if triton_layer is not None:
            summed = ops_router_logits(triton_layer, x)
            assert (summed - logits.float()).abs().max() <= 2**-6 * logits.float().abs().max()
            logits = summed
        weights, ids = TritonOps().route_experts(logits, torch_layer.router)
        want_w, want_ids = route(logits, torch_layer.router)
        assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids))
        torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
        return torch_layer.experts(x, weights, ids)


def row_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Each row's largest error over its largest value."""
    return (got.float() - want.float()).abs().amax(1) / want.float().abs().amax(1)


# bf16: the torch path rounds each expert's GEMM outputs to bf16 and ours the activation
# between the GEMMs and each expert's weighted output: a few bf16 ulps (2**-8) of a row's max.
GPU_ROW_TOL = 3e-2


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 2048])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_layer_matches_torch_ops(shape, tokens):
    torch_layer, triton_layer = gpu_layers(*SHAPES[shape])
    x = torch.randn(tokens, SHAPES[shape][1], device=GPU, dtype=torch.bfloat16)
    with torch.no_grad():
        got = triton_layer(x)
    err = row_errors(got, torch_reference(torch_layer, x, triton_layer))
    assert err.max() < GPU_ROW_TOL, err.max()


@functools.cache
def gpu_expert_weights(fmt: str, spec: ExpertsSpec) -> ExpertWeights:
    """Random experts of `spec` on the GPU as ExpertWeights of `fmt` (bf16 activations)."""
    if fmt == "fp8":
        w = Fp8Experts(spec, torch.bfloat16, seed=30).expert_weights()
        tensors = (w.gate_up, w.down, w.gate_up_scales, w.down_scales, w.gate_up_bias, w.down_bias)
        return ExpertWeights("fp8", *(None if t is None else t.to(GPU) for t in tensors))
    experts = (mxfp4_experts if fmt == "mxfp4" else dense_experts)(spec, torch.bfloat16, 31)
    return experts.to(GPU).expert_weights()


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("atomic_sum", [False, True])
@pytest.mark.parametrize("tokens", [1, 4, 8, 64, 2048])
@pytest.mark.parametrize("fmt", ["dense", "mxfp4", "fp8"])
@pytest.mark.parametrize("shape", ["gpt-oss-20b", "qwen3-30b-a3b"])
def test_gpu_grouped_gemm_formats(shape, fmt, tokens, atomic_sum):
    """The compiled kernels at the published shapes, bf16 activations, against float32 torch
    on the exactly dequantized weights."""
    from inferx_core.moe import expert_mlp, run_experts

    kind, hidden, inter, experts, k = SHAPES[shape]
    act, bias = ("swiglu_oai", True) if kind.startswith("gpt-oss") else ("silu", False)
    spec = ExpertsSpec("mlp.experts", experts, hidden, inter, act, bias=bias)
    w = gpu_expert_weights(fmt, spec)
    gate_up, down = (t.float() for t in dequantized(w))
    x = torch.randn(tokens, hidden, device=GPU).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, device=GPU)
    weights, ids = route(logits, RouterSpec(experts, k, renormalize=True))

    def one(e: int, rows: torch.Tensor) -> torch.Tensor:
        b13 = None if w.gate_up_bias is None else w.gate_up_bias[e].float()
        b2 = None if w.down_bias is None else w.down_bias[e].float()
        return expert_mlp(rows, gate_up[e], b13, down[e], b2, spec)

    want = run_experts(x.float(), weights, ids, experts, one)
    got = fused_experts(x, weights, ids, w, spec, atomic_sum=atomic_sum)
    torch.cuda.synchronize()
    # bf16: the activation between the GEMMs and each expert's output are rounded to bf16
    assert rel(got, want) < 2e-2


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [(64, 64, 64, 4), (128, 64, 64, 4), (128, 128, 64, 8)])
@pytest.mark.parametrize("tokens", [64, 256, 2048])
def test_gpu_mxfp4_swapped_operands(tokens, tiles):
    """gpt-oss-20b's MXFP4 experts through SWAP_AB tiles (compiled: the weight in registers
    as wgmma's first operand) against the unswapped kernel's output, to bf16 rounding."""
    kind, hidden, inter, experts, k = SHAPES["gpt-oss-20b"]
    spec = ExpertsSpec("mlp.experts", experts, hidden, inter, "swiglu_oai", bias=True)
    w = gpu_expert_weights("mxfp4", spec)
    x = torch.randn(tokens, hidden, device=GPU).to(torch.bfloat16)
    weights, ids = route(torch.randn(tokens, experts, device=GPU), RouterSpec(experts, k))
    bm, bn, bk, warps = tiles
    plain = GemmConfig(bm, bn, bk, warps, 3)
    swapped = GemmConfig(bm, bn, bk, warps, 3, swap_ab=True)
    want = fused_experts(x, weights, ids, w, spec, configs=(plain, plain))
    got = fused_experts(x, weights, ids, w, spec, configs=(swapped, swapped))
    torch.cuda.synchronize()
    assert rel(got, want) < 1e-2


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("split", [2, 3, 4])
@pytest.mark.parametrize("tokens", [1, 4])
def test_gpu_mxfp4_gemv_split_down(tokens, split):
    """gpt-oss-20b's MXFP4 experts through the GEMV with down's K in runs (compiled; partial
    sums in float32 summed in a fixed order) against the unsplit GEMV, to bf16 rounding, and
    bit for bit on a second call."""
    kind, hidden, inter, experts, k = SHAPES["gpt-oss-20b"]
    spec = ExpertsSpec("mlp.experts", experts, hidden, inter, "swiglu_oai", bias=True)
    w = gpu_expert_weights("mxfp4", spec)
    x = torch.randn(tokens, hidden, device=GPU).to(torch.bfloat16)
    weights, ids = route(torch.randn(tokens, experts, device=GPU), RouterSpec(experts, k))
    plain = moe_kernels.GemmConfig(16, 16, 256, 8)
    split_cfg = moe_kernels.GemmConfig(16, 16, 256, 8, split_k=split)
    want = fused_experts(x, weights, ids, w, spec, gemv=True, configs=(plain, plain))
    got = fused_experts(x, weights, ids, w, spec, gemv=True, configs=(plain, split_cfg))
    again = fused_experts(x, weights, ids, w, spec, gemv=True, configs=(plain, split_cfg))
    torch.cuda.synchronize()
    assert rel(got, want) < 1e-2
    assert torch.equal(got, again)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_gpu_mxfp4_rank_shards_sum_to_the_whole(tokens):
    """gpt-oss-20b's MXFP4 experts split over 4 ranks in whole scale groups (22 or 23 of 90,
    held as 23: down's K is 736, an odd number of groups, and two ranks' last is padding)
    through the compiled kernels: the ranks' outputs summed against float32 torch on the
    whole, exactly dequantized weights."""
    from inferx_core.moe import expert_mlp, run_experts

    _, hidden, inter, experts, k = SHAPES["gpt-oss-20b"]
    spec = ExpertsSpec("mlp.experts", experts, hidden, inter, "swiglu_oai", bias=True)
    whole = mxfp4_experts(spec, torch.bfloat16, 31)
    shards = []
    for rank in range(4):
        part = Mxfp4Experts(spec, torch.bfloat16, CPU, ParallelContext(rank, 4, group=object()))
        for proj in ("gate_up", "down"):
            for what in ("blocks", "scales", "bias"):
                part.load(f"{proj}.{what}", getattr(whole, f"{proj}_{what}").data)
        assert part.down_blocks.shape[2] == 23
        shards.append(part.to(GPU).expert_weights())
    gate_up = dequant_mxfp4(whole.gate_up_blocks, whole.gate_up_scales).to(GPU)
    down = dequant_mxfp4(whole.down_blocks, whole.down_scales).to(GPU)
    x = torch.randn(tokens, hidden, device=GPU).to(torch.bfloat16)
    weights, ids = route(
        torch.randn(tokens, experts, device=GPU), RouterSpec(experts, k, renormalize=True)
    )

    def one(e: int, rows: torch.Tensor) -> torch.Tensor:
        b13, b2 = whole.gate_up_bias[e].float().to(GPU), whole.down_bias[e].float().to(GPU)
        return expert_mlp(rows, gate_up[e], b13, down[e], b2, spec)

    want = run_experts(x.float(), weights, ids, experts, one)
    got = sum(fused_experts(x, weights, ids, w, spec).float() for w in shards)
    torch.cuda.synchronize()
    assert rel(got, want) < 2e-2


# DeepSeek-V2-Lite's MoE layer: hidden 2048, 64 routed experts of 1408, top 6, 2 shared
V2_LITE = (2048, 1408, 64, 6)


def routed_alike(layer: FusedMoE, reference: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """The rows for which `layer` (its router GEMM as its ops run it, in x's dtype) and the
    float32 `reference` pick the same routed experts: bf16 logits' near-ties may pick another
    expert, and such a row then differs by a whole expert's share, not by rounding."""
    with torch.no_grad():
        logits = ops_router_logits(layer, x)
        want = reference.gate(x.float()).float()
    k = layer.router.top_k
    ids = route(logits, layer.router)[1][:, :k].sort(1).values
    want_ids = route(want, reference.router)[1][:, :k].sort(1).values
    return (ids == want_ids).all(1)


@on_gpu
@pytest.mark.gpu
def test_gpu_v2_lite_fused_shared_experts_match_the_shared_mlp():
    """V2-Lite's MoE layer in bf16, shared experts as slots 64 and 65 of the grouped GEMMs
    (TritonOps' default) against the shared MLP apart (fuse_shared_experts off), both
    eager and in a CUDA graph at 1, 8, 64 and 256 tokens: the routing is the same (the same
    router kernels), so the outputs differ by rounding only (the fused layer sums the 8
    experts in fp32 and rounds once; apart, the routed sum and the MLP are rounded to bf16,
    then added). Both are checked against the unfused layer in float32 on the same bf16
    weights too, on the rows whose routed experts it picks alike (routed_alike; at least 90%
    of them)."""
    unfused = TritonOps()
    unfused.fuse_shared_experts = False
    fused_layer, unfused_layer = deepseek_layers(
        [TritonOps(), unfused], torch.bfloat16, GPU, *V2_LITE
    )
    (reference,) = deepseek_layers([TorchOps()], torch.float32, GPU, *V2_LITE)
    reference.load_state_dict({k: v.float() for k, v in unfused_layer.state_dict().items()})
    for tokens in (1, 8, 64, 256):
        x = torch.randn(tokens, V2_LITE[0], device=GPU, dtype=torch.bfloat16)
        with torch.no_grad():
            want = reference(x.float())
            got, apart = fused_layer(x), unfused_layer(x)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            static_x = x.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                fused_layer(static_x)  # compiled outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                static_out = fused_layer(static_x)
            graph.replay()
            torch.cuda.synchronize()
        assert torch.equal(static_out, got), tokens
        err = row_errors(got, apart).max()
        assert err < GPU_ROW_TOL, (tokens, err)
        alike = routed_alike(fused_layer, reference, x)
        assert int(alike.sum()) >= tokens - max(1, tokens // 10), (tokens, int(alike.sum()))
        if alike.any():
            fused_err = row_errors(got, want)[alike].max()
            apart_err = row_errors(apart, want)[alike].max()
            assert fused_err < GPU_ROW_TOL and apart_err < GPU_ROW_TOL, (fused_err, apart_err)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_layer_in_cuda_graph(shape):
    """Captured once per batch size, replayed on fresh inputs: equal to the eager fused layer
    bit for bit (same kernels, same grid) and close to the torch path."""
    torch_layer, triton_layer = gpu_layers(*SHAPES[shape])
    hidden = SHAPES[shape][1]
    for tokens in (1, 8, 64):
        static_x = torch.randn(tokens, hidden, device=GPU, dtype=torch.bfloat16)
        with torch.no_grad():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                triton_layer(static_x)  # compile outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = triton_layer(static_x)
            for _ in range(3):
                x = torch.randn(tokens, hidden, device=GPU, dtype=torch.bfloat16)
                static_x.copy_(x)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(static_out, triton_layer(x))
                err = row_errors(static_out, torch_reference(torch_layer, x, triton_layer))
                assert err.max() < GPU_ROW_TOL, (tokens, err.max())


def write_tiny_moe_model(arch: str, path) -> None:  # noqa: ANN001
    """A tiny gpt-oss (bf16 or MXFP4 experts: arch gpt-oss-mxfp4) or Qwen3-MoE checkpoint at
    path. Qwen3-MoE gets head_dim 32 (test_qwen3's 24 is no power of two, which the triton
    attention backend refuses)."""
    from test_gptoss import NOT_CONVERT, random_mxfp4
    from test_gptoss import hf_model as gptoss_model
    from test_qwen3 import hf_model as qwen3_model

    model = qwen3_model("qwen3-moe", head_dim=32) if arch == "qwen3-moe" else gptoss_model()
    model.save_pretrained(path)
    if arch == "gpt-oss-mxfp4":
        import json

        from safetensors.torch import load_file, save_file

        g = torch.Generator().manual_seed(1)
        tensors = {}
        for name, t in load_file(path / "model.safetensors").items():
            if name.endswith(("gate_up_proj", "down_proj")):
                experts, cols, rows = t.shape
                for what, q in random_mxfp4(g, rows, cols, experts).items():
                    tensors[f"{name}_{what}"] = q
            else:
                tensors[name] = t
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": NOT_CONVERT,
        }
        (path / "config.json").write_text(json.dumps(config))


def tiny_moe_llm(path, device: str, kernels: str, attention: str, graphs: bool):  # noqa: ANN001, ANN201
    from inferx_core.config import load_config
    from inferx_core.engine import LLM

    return LLM(
        load_config(
            None,
            {
                "model.path": str(path),
                "model.dtype": "float32",
                "engine.device": device,
                "engine.kernels": kernels,
                "engine.attention_backend": attention,
                "engine.cuda_graphs": graphs,
                "kv_cache.memory": "1GiB",
            },
        )
    )


@interpreted
def test_tiny_qwen3_moe_model_on_triton_kernels_and_attention_matches_torch(tmp_path):
    """The GPU test below's Qwen3-MoE on the CPU: the engine builds it with engine.kernels and
    engine.attention_backend triton (the triton backend takes its head_dim), and its greedy
    tokens agree with the torch ops' and backend's in the top-5 sense."""
    import test_gpu_correctness as gc

    from inferx_kernels_cuda.triton_attention import TritonAttention

    write_tiny_moe_model("qwen3-moe", tmp_path)
    prompts = [[5, 9, 17, 33, 65, 129, 200], [7] * 3]
    runs = []
    for kernels in ("torch", "triton"):
        llm = tiny_moe_llm(tmp_path, "cpu", kernels, kernels, False)
        assert isinstance(llm.engine.executor.attention, TritonAttention) == (kernels == "triton")
        runs.append(gc.ours_greedy(llm, prompts))
    for ref, ours in zip(*runs, strict=True):
        gc.check_close(ours, ref, "qwen3-moe")


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gpt-oss", "gpt-oss-mxfp4", "qwen3-moe"])
def test_gpu_tiny_model_with_graphs_matches_torch_path(arch, tmp_path):
    """A tiny gpt-oss (bf16 or MXFP4 experts) or Qwen3-MoE on the cuda executor, fp32, the
    Triton ops with CUDA graphs against the torch ops eagerly: greedy tokens equal up to the
    first divergence, and there each side's token in the other's top-5. gpt-oss needs an
    attention backend with sinks and windows for graphs: while the triton one lacks them, its
    Triton-ops run is eager on the torch backend."""
    import test_gpu_correctness as gc

    from inferx_kernels_cuda.triton_attention import TritonAttention

    write_tiny_moe_model(arch, tmp_path)
    prompts = [list(range(3, 40)), [5, 9, 17, 33, 65, 129, 200], [7] * 3]
    graphs_ok = arch == "qwen3-moe" or {"sinks", "sliding"} <= TritonAttention.features
    runs = []
    for kernels, graphs in (("torch", False), ("triton", graphs_ok)):
        llm = tiny_moe_llm(tmp_path, "cuda", kernels, "triton" if graphs else "torch", graphs)
        assert (llm.engine.executor.graphs is not None) == graphs
        runs.append(gc.ours_greedy(llm, prompts))
        del llm
        torch.cuda.empty_cache()
    for ref, ours in zip(*runs, strict=True):
        gc.check_close(ours, ref, arch)
