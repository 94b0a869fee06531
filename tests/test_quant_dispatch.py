"""Kernel fusions reach a layer's weight only through its quant method: a layer whose method
keeps no dense weight runs its own forward / forward_parts / forward_split in every fused op of
TorchOps and TritonOps, and gives the reference result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inferx_core.interfaces.attention import SplitAttention
from inferx_core.interfaces.ops import KernelOps
from inferx_core.interfaces.quant import LinearSpec, QuantLinear
from inferx_core.ops_torch import TorchOps
from inferx_core.quant_none import DenseLinear

ROWS, K, N = 3, 16, 8
EPS = 1e-6


class OpaqueLinear(QuantLinear):
    """A method that stores its weight its own way (here: transposed) and hands out no dense
    weight; it counts which of its entry points ran."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.spec = LinearSpec("layer", K, (N,), bias)
        self._wt = torch.randn(K, N, generator=g)
        self.bias = torch.randn(N, generator=g) if bias else None
        self.calls: list[str] = []

    def load(self, kind: str, tensor: torch.Tensor, part: int = 0) -> None:
        raise NotImplementedError

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._wt.t(), self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("forward")
        return self.reference(x)

    def forward_parts(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("forward_parts")
        return self.reference(x).unsqueeze(0)

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.calls.append("forward_split")
        return (x @ self._wt).unsqueeze(0), self.bias


def _ops(name: str) -> KernelOps:
    if name == "torch":
        return TorchOps()
    pytest.importorskip("triton", reason="the triton package is not installed")
    from inferx_kernels_cuda.ops import TritonOps

    ops = TritonOps()
    # Every device gate open, as on a Hopper GPU: only the layer's method may turn a fused path
    # down. The unfused norm and activation run in torch (no kernel needs to run here).
    ops._interpret = True
    reference = TorchOps()
    ops.rms_norm = reference.rms_norm  # type: ignore[method-assign]
    ops.silu_and_mul = reference.silu_and_mul  # type: ignore[method-assign]
    return ops


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    parts = torch.randn(2, ROWS, K, generator=g)
    return parts, torch.randn(ROWS, K, generator=g), 1 + 0.1 * torch.randn(K, generator=g)


@pytest.mark.parametrize("ops_name", ["torch", "triton"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_ops_run_the_methods_own_forward(ops_name: str, bias: bool) -> None:
    ops, layer = _ops(ops_name), OpaqueLinear(bias)
    ref_ops = TorchOps()
    parts, residual, norm_w = _inputs()
    x = parts.sum(0)
    if ops_name == "triton":  # an unquantized layer of this shape would take the TMA GEMM
        dense = DenseLinear(LinearSpec("dense", K, (N,)), torch.float32, torch.device("cpu"))
        assert ops._takes_tma(dense, x)  # type: ignore[attr-defined]
    normed, summed = ref_ops.rms_norm(parts, norm_w, EPS, residual, parts=True)

    def silu_mul(y: torch.Tensor) -> torch.Tensor:
        return ref_ops.silu_and_mul(y)

    torch.testing.assert_close(ops.linear_silu_and_mul(layer, x), silu_mul(layer.reference(x)))
    assert layer.calls == ["forward"]

    layer.calls.clear()
    torch.testing.assert_close(ops.linear_parts(layer, x).sum(0), layer.reference(x))
    assert layer.calls == ["forward_parts"]

    layer.calls.clear()
    out, b = ops.linear_split(layer, x)
    torch.testing.assert_close(out.sum(0) + (0 if b is None else b), layer.reference(x))
    assert layer.calls == ["forward_split"]

    layer.calls.clear()
    out, b, new_residual = ops.rms_norm_linear_split(parts, norm_w, EPS, residual, layer)
    torch.testing.assert_close(out.sum(0) + (0 if b is None else b), layer.reference(normed))
    torch.testing.assert_close(new_residual, summed)
    assert layer.calls == ["forward_split"]

    layer.calls.clear()
    act, new_residual = ops.rms_norm_linear_silu_and_mul(parts, norm_w, EPS, residual, layer)
    torch.testing.assert_close(act, silu_mul(layer.reference(normed)))
    torch.testing.assert_close(new_residual, summed)
    assert layer.calls == ["forward"]

    # o_proj handed an attention output still split along the context: combined, then the
    # method's own forward_parts
    layer.calls.clear()
    heads, head_dim = 2, K // 2
    attn = torch.randn(ROWS, heads, head_dim, generator=torch.Generator().manual_seed(3))
    splits = SplitAttention(
        part_o=attn.reshape(-1, head_dim),
        part_lse=torch.zeros(ROWS * heads),
        context_len=torch.full((ROWS,), 4, dtype=torch.int32),
        rows=ROWS,
        heads=heads,
        head_dim=head_dim,
        splits=1,
        split_len=4,
        seq_split=False,
        tile=4,
        reduce=lambda: attn,
    )
    out = ops.linear_parts(layer, splits)
    torch.testing.assert_close(out.sum(0), layer.reference(attn.flatten(1)))
    assert layer.calls == ["forward_parts"]
