"""A MoE layer inside a model (FusedMoE.forward_normed): the norm before it, its routing and its
experts, handing the k weighted expert outputs to the next norm as parts
(KernelOps.moe_experts_parts), against TorchOps' layer, and the parts' sum in that norm against
the sum kernel's bits. On the CPU under the interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted  # noqa: E402

from inferx_core.interfaces import BuildContext, ExpertsSpec, RouterSpec  # noqa: E402
from inferx_core.moe import FusedMoE  # noqa: E402
from inferx_core.ops_torch import TorchOps  # noqa: E402
from inferx_core.parallel import ParallelContext  # noqa: E402
from inferx_core.quant_none import Unquantized  # noqa: E402
from inferx_kernels_cuda.ops import TritonOps  # noqa: E402

# (experts, top k, softmax after top-k, renormalize, shared, router bias)
ROUTERS = {"gpt-oss": (32, 4, True, False, 0, True), "v2-lite": (64, 6, False, False, 2, False)}


def layer_and_inputs(name: str, ops, dtype: torch.dtype, seed: int, hidden=64, inter=32):
    e, k, after, renorm, shared, bias = ROUTERS[name]
    spec = RouterSpec(e, k, softmax_after_topk=after, renormalize=renorm, shared=shared)
    experts = ExpertsSpec("mlp.experts", e + shared, hidden, inter, shared=shared)
    ctx = BuildContext(dtype, torch.device("cpu"), None, Unquantized(), ops, ParallelContext())
    layer = FusedMoE(ctx, "mlp", hidden, spec, experts, router_bias=bias)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_((torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5).to(dtype))
    return layer, g


@interpreted
@pytest.mark.parametrize("name", list(ROUTERS))
def test_fused_moe_forward_normed_matches_torch_ops(name):
    """A whole FusedMoE layer's forward_normed under TritonOps (rms_norm over 3 parts, the
    router's GEMV, topk_softmax, the grouped GEMMs) against TorchOps' (the same in torch),
    fp32: the same new residual, the parts summing to TorchOps' output."""
    _, k, _, _, shared, _ = ROUTERS[name]
    outs = []
    for ops in (TorchOps(), TritonOps()):
        layer, g = layer_and_inputs(name, ops, torch.float32, 11)
        x = torch.randn(3, 4, 64, generator=g)
        residual = torch.randn(4, 64, generator=g)
        norm = torch.nn.Module()
        norm.weight, norm.eps = 1 + 0.1 * torch.randn(64, generator=g), 1e-6
        outs.append(layer.forward_normed(x, residual, norm))
    (want, want_r), (got, got_r) = outs
    assert torch.equal(got_r, want_r)
    # TritonOps hands over the k (+ shared) weighted outputs as parts; TorchOps the sum
    assert want.shape == (1, 4, 64) and got.shape == (k + shared, 4, 64)
    torch.testing.assert_close(got.sum(0), want[0], rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_parts_sum_in_the_next_norm_as_the_sum_kernel_did(name, dtype):
    """moe_experts_parts' [k, T, H] view of the weighted expert outputs, summed by the next
    norm (rms_norm, parts=True), gives the bits that moe_experts' sum kernel and the same norm
    over that one part give: the same fp32 order, one rounding."""
    _, k, _, _, shared, _ = ROUTERS[name]
    rows = 5
    ops = TritonOps()
    layer, g = layer_and_inputs(name, ops, dtype, 13)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    weights, ids = ops.route_experts(ops.linear_parts(layer.gate, x), layer.router)
    parts = ops.moe_experts_parts(layer.experts, x, weights, ids)
    summed = ops.moe_experts(layer.experts, x, weights, ids)
    assert parts.shape == (k + shared, rows, 64) and not parts[0].is_contiguous()
    residual = torch.randn(rows, 64, generator=g).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype)
    got = ops.rms_norm(parts, norm_w, 1e-6, residual, parts=True)
    want = ops.rms_norm(summed[None], norm_w, 1e-6, residual, parts=True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
