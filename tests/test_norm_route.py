"""A MoE layer's norm, router GEMV and top-k softmax in one launch (moe_kernels.norm_route,
TritonOps.rms_norm_route) against the ops apart: the normed rows and the new residual as
rms_norm_kernel writes them (bit for bit), the routing against inferx_core.moe.route on float64
logits of those normed rows. On the CPU under the interpreter at small sizes; on the GPU at the
published shapes, eager and in a CUDA graph (whose replays find the counters at 0 again)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted, on_gpu  # noqa: E402

from inferx_core.interfaces import BuildContext, ExpertsSpec, LinearSpec, RouterSpec  # noqa: E402
from inferx_core.moe import FusedMoE, route  # noqa: E402
from inferx_core.ops_torch import TorchOps  # noqa: E402
from inferx_core.parallel import ParallelContext  # noqa: E402
from inferx_core.quant_none import DenseLinear, Unquantized  # noqa: E402
from inferx_kernels_cuda.moe_kernels import norm_route, route_counts  # noqa: E402
from inferx_kernels_cuda.ops import TritonOps  # noqa: E402

# (experts, top k, softmax after top-k, renormalize, scaling, shared, router bias)
ROUTERS = {
    "gpt-oss": (32, 4, True, False, 1.0, 0, True),
    "v2-lite": (64, 6, False, False, 1.0, 2, False),
    "qwen3-moe": (128, 8, False, True, 1.0, 0, False),
    "scaled": (6, 2, False, False, 2.5, 1, True),
}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def router(name: str, hidden: int, dtype: torch.dtype, device: torch.device, g: torch.Generator):
    e, k, after, renorm, scaling, shared, bias = ROUTERS[name]
    spec = RouterSpec(
        e, k, softmax_after_topk=after, renormalize=renorm, scaling=scaling, shared=shared
    )
    linear = DenseLinear(LinearSpec("mlp.gate", hidden, (e,), bias), dtype, device, None)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(e, hidden, generator=g) / hidden**0.5)
        if bias:
            linear.bias.copy_(torch.randn(e, generator=g) * 0.5)
    return spec, linear


def inputs(parts: int, rows: int, hidden: int, dtype: torch.dtype, g: torch.Generator):
    x = torch.randn(parts, rows, hidden, generator=g).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    return x, residual, weight


def check(got, x, residual, weight, linear, spec, ops) -> None:
    """got = (normed, residual, weights, ids) of norm_route: the norm as `ops`.rms_norm writes
    it, the routing as route() on float64 logits of that normed output."""
    h, new_residual, weights, ids = got
    want_h, want_residual = ops.rms_norm(x, weight, 1e-6, residual, parts=True)
    assert torch.equal(new_residual, want_residual)
    assert torch.equal(h, want_h)
    logits = h.double() @ linear.weight.double().t()
    if linear.bias is not None:
        logits = logits + linear.bias.double()
    want_w, want_ids = route(logits, spec)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(weights, want_w.to(weights.device), rtol=1e-5, atol=1e-6)


@interpreted
@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize(
    ("parts", "rows", "hidden"), [(1, 1, 64), (4, 3, 96), (2, 16, 200)]
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_route_matches_the_ops_apart(name, parts, rows, hidden, dtype):
    """Hidden sizes that are no power of two (96, 200: masked columns, several K slices),
    1-4 partial results, bias or none, shared slots, every softmax order."""
    g = gen(parts * 100 + rows + hidden)
    spec, linear = router(name, hidden, dtype, torch.device("cpu"), g)
    x, residual, weight = inputs(parts, rows, hidden, dtype, g)
    counts = route_counts(torch.device("cpu"))
    got = norm_route(x, residual, weight, 1e-6, linear.weight, linear.bias, spec, counts)
    check(got, x, residual, weight, linear, spec, TritonOps())
    assert not counts.any()  # left at 0 for the next launch
    # the same through TritonOps, and TorchOps' composition of the three ops
    ops = TritonOps()
    ops.norm_route_rows = ((1, 16),)
    fused = ops.rms_norm_route(x, weight, 1e-6, residual, linear, spec)
    for a, b in zip(fused, got, strict=True):
        assert torch.equal(a, b)
    if dtype == torch.float32:
        check(
            TorchOps().rms_norm_route(x, weight, 1e-6, residual, linear, spec),
            x, residual, weight, linear, spec, TorchOps(),
        )  # fmt: skip


@interpreted
def test_rms_norm_route_falls_back_outside_its_rows_and_routers():
    """Past norm_route_rows, with a selection bias (DeepSeek-V3 style) or group-limited
    routing, TritonOps runs the ops apart; the results are still the composition's."""
    g = gen(7)
    spec, linear = router("v2-lite", 64, torch.float32, torch.device("cpu"), g)
    x, residual, weight = inputs(2, 5, 64, torch.float32, g)
    ops = TritonOps()
    ops.norm_route_rows = ((1, 4),)
    check(
        ops.rms_norm_route(x, weight, 1e-6, residual, linear, spec),
        x, residual, weight, linear, spec, ops,
    )  # fmt: skip
    grouped = RouterSpec(64, 6, num_groups=8, topk_groups=3)
    h, r, w, ids = ops.rms_norm_route(x[:, :2], weight, 1e-6, residual[:2], linear, grouped)
    want = TorchOps().rms_norm_route(x[:, :2], weight, 1e-6, residual[:2], linear, grouped)
    assert torch.equal(ids, want[3])
    torch.testing.assert_close(w, want[2], rtol=1e-5, atol=1e-6)


@interpreted
def test_norm_route_rejects_mismatched_shapes():
    g = gen(3)
    spec, linear = router("gpt-oss", 64, torch.float32, torch.device("cpu"), g)
    x, residual, weight = inputs(1, 2, 64, torch.float32, g)
    counts = route_counts(torch.device("cpu"))
    with pytest.raises(ValueError, match="do not fit"):
        norm_route(x, residual[:1], weight, 1e-6, linear.weight, None, spec, counts)
    with pytest.raises(ValueError, match="at most"):
        big = inputs(1, 65, 64, torch.float32, g)
        norm_route(big[0], big[1], weight, 1e-6, linear.weight, None, spec, counts)


@interpreted
@pytest.mark.parametrize("name", ["gpt-oss", "v2-lite"])
def test_fused_moe_forward_normed_matches_torch_ops(name):
    """A whole FusedMoE layer's forward_normed under TritonOps (norm_route, then the grouped
    GEMMs) against TorchOps' (rms_norm, the router, route, the experts in torch), fp32."""
    e, k, after, renorm, scaling, shared, bias = ROUTERS[name]
    hidden, inter = 64, 32
    spec = RouterSpec(e, k, softmax_after_topk=after, renormalize=renorm, scaling=scaling)
    experts = ExpertsSpec("mlp.experts", e + shared, hidden, inter, shared=shared)
    outs = []
    fused = TritonOps()
    fused.norm_route_rows = ((1, 16),)
    for ops in (TorchOps(), fused):
        ctx = BuildContext(torch.float32, torch.device("cpu"), None, Unquantized(), ops,
                           ParallelContext())  # fmt: skip
        layer = FusedMoE(ctx, "mlp", hidden, spec, experts, router_bias=bias)
        g = gen(11)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        x, residual, weight = inputs(3, 4, hidden, torch.float32, g)
        norm = torch.nn.Module()
        norm.weight, norm.eps = weight, 1e-6
        outs.append(layer.forward_normed(x, residual, norm))
    (want, want_r), (got, got_r) = outs
    assert torch.equal(got_r, want_r)
    # TritonOps hands over the k (+ shared) weighted outputs as parts; TorchOps the sum
    assert want.shape == (1, 4, hidden) and got.shape == (k + shared, 4, hidden)
    torch.testing.assert_close(got.sum(0), want[0], rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("name", ["gpt-oss", "v2-lite"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_parts_sum_in_the_next_norm_as_the_sum_kernel_did(name, dtype):
    """moe_experts_parts' [k, T, H] view of the weighted expert outputs, summed by the next
    norm (rms_norm and norm_route, parts=True), gives the bits that moe_experts' sum kernel and
    the same norm over that one part give: the same fp32 order, one rounding."""
    e, k, after, renorm, scaling, shared, bias = ROUTERS[name]
    hidden, inter, rows = 64, 32, 5
    spec = RouterSpec(e, k, softmax_after_topk=after, renormalize=renorm, shared=shared)
    experts = ExpertsSpec("mlp.experts", e + shared, hidden, inter, shared=shared)
    ops = TritonOps()
    ctx = BuildContext(dtype, torch.device("cpu"), None, Unquantized(), ops, ParallelContext())
    layer = FusedMoE(ctx, "mlp", hidden, spec, experts, router_bias=bias)
    g = gen(13)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_((torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5).to(dtype))
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    weights, ids = ops.route_experts(ops.linear_parts(layer.gate, x), layer.router)
    parts = ops.moe_experts_parts(layer.experts, x, weights, ids)
    summed = ops.moe_experts(layer.experts, x, weights, ids)
    assert parts.shape == (k + shared, rows, hidden) and not parts[0].is_contiguous()
    _, residual, norm_w = inputs(1, rows, hidden, dtype, g)
    spec2, router2 = router(name, hidden, dtype, torch.device("cpu"), g)
    ops.norm_route_rows = ((1, 16),)
    for a, b in (
        (ops.rms_norm(parts, norm_w, 1e-6, residual, parts=True),
         ops.rms_norm(summed[None], norm_w, 1e-6, residual, parts=True)),
        (ops.rms_norm_route(parts, norm_w, 1e-6, residual, router2, spec2),
         ops.rms_norm_route(summed[None], norm_w, 1e-6, residual, router2, spec2)),
    ):  # fmt: skip
        for got, want in zip(a, b, strict=True):
            assert torch.equal(got, want)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gpt-oss", "v2-lite", "qwen3-moe"])
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_norm_route_on_the_gpu_in_a_graph(name, rows):
    """The published widths (gpt-oss 2880, V2-Lite 2048, Qwen3-30B-A3B 2048), bf16, four
    parts: eager against the ops apart, then three replays of a captured launch on fresh
    inputs (the counters reset by each launch's last program)."""
    cuda = torch.device("cuda")
    hidden = {"gpt-oss": 2880, "v2-lite": 2048, "qwen3-moe": 2048}[name]
    g = gen(rows + hidden)
    spec, linear = router(name, hidden, torch.bfloat16, cuda, g)
    x, residual, weight = (t.to(cuda) for t in inputs(4, rows, hidden, torch.bfloat16, g))
    ops = TritonOps()
    ops.norm_route_rows = ((1, 16),)
    check(ops.rms_norm_route(x, weight, 1e-6, residual, linear, spec),
          x, residual, weight, linear, spec, ops)  # fmt: skip
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.rms_norm_route(x, weight, 1e-6, residual, linear, spec)
    for _ in range(3):
        fresh = inputs(4, rows, hidden, torch.bfloat16, g)
        for t, f in zip((x, residual, weight), fresh, strict=True):
            t.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        check(out, x, residual, weight, linear, spec, ops)
    assert not route_counts(cuda).any()
