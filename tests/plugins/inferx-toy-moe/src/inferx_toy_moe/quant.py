"""int8 weight-only quantization per output channel, applied at load to an unquantized
checkpoint: scale = absmax(row) / 127, q = round(w / scale); layers multiply by q * scale."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferx_core.interfaces import ExpertsSpec, LinearSpec, QuantExperts, QuantLinear, QuantScheme
from inferx_core.moe import UnquantizedExperts, expert_mlp, run_experts
from inferx_core.parallel import ParallelContext
from inferx_core.quant_none import DenseLinear


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., rows, cols] -> (q int8, scale float32 [..., rows, 1]), one scale per row."""
    w = w.float()
    # an all-zero row keeps a nonzero scale so that q stays 0 instead of NaN
    scale = (w.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


class Int8Linear(QuantLinear):
    """Loads whole-precision tensors through DenseLinear (which shards them), quantizes them in
    finish_loading and keeps only q and the scales."""

    def __init__(
        self, spec: LinearSpec, dtype: torch.dtype, device: torch.device, parallel: ParallelContext
    ) -> None:
        super().__init__()
        self.spec = spec
        self.staged: DenseLinear | None = DenseLinear(spec, dtype, device, parallel)
        self.bias = self.staged.bias
        self.register_buffer("qweight", None)
        self.register_buffer("scale", None)

    def load(self, kind: str, tensor: torch.Tensor, part: int = 0) -> None:
        if self.staged is None:
            raise ValueError(f"{self.spec.prefix}: {kind} loaded after finish_loading")
        self.staged.load(kind, tensor, part)

    def finish_loading(self) -> None:
        self.qweight, self.scale = quantize_rows(self.staged.weight)
        self.staged = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(self.qweight, self.scale, x.dtype), self.bias)


class Int8Experts(QuantExperts):
    """The routed experts, quantized like Int8Linear: every expert's gate_up and down rows."""

    def __init__(
        self, spec: ExpertsSpec, dtype: torch.dtype, device: torch.device, parallel: ParallelContext
    ) -> None:
        super().__init__()
        self.spec = spec
        self.staged: UnquantizedExperts | None = UnquantizedExperts(spec, dtype, device, parallel)
        for name in ("gate_up_q", "gate_up_scale", "down_q", "down_scale"):
            self.register_buffer(name, None)

    def load(self, kind: str, tensor: torch.Tensor, expert: int | None = None) -> None:
        if self.staged is None:
            raise ValueError(f"{self.spec.prefix}: {kind} loaded after finish_loading")
        self.staged.load(kind, tensor, expert)

    def finish_loading(self) -> None:
        staged = self.staged
        staged.finish_loading()
        self.gate_up_q, self.gate_up_scale = quantize_rows(staged.gate_up)
        self.down_q, self.down_scale = quantize_rows(staged.down)
        self.gate_up_bias, self.down_bias = staged.gate_up_bias, staged.down_bias
        self.staged = None

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = dequantize(self.gate_up_q[e], self.gate_up_scale[e], x.dtype)
        down = dequantize(self.down_q[e], self.down_scale[e], x.dtype)
        b13 = None if self.gate_up_bias is None else self.gate_up_bias[e]
        b2 = None if self.down_bias is None else self.down_bias[e]
        return expert_mlp(x, gate_up, b13, down, b2, self.spec)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return run_experts(x, topk_weights, topk_ids, self.spec.num_experts, self._expert)


class Int8WeightOnly(QuantScheme):
    """Quantizes an unquantized checkpoint at load (online). MoE routers (FusedMoE names them
    "{prefix}.gate") stay in the serving dtype: a rounded router logit can flip a token's choice
    of expert, which changes its whole output."""

    name = "int8wo"
    online = True

    def linear(
        self, spec: LinearSpec, dtype: torch.dtype, device: torch.device, parallel: ParallelContext
    ) -> QuantLinear:
        if spec.prefix.endswith(".gate"):
            return DenseLinear(spec, dtype, device, parallel)
        return Int8Linear(spec, dtype, device, parallel)

    def experts(
        self, spec: ExpertsSpec, dtype: torch.dtype, device: torch.device, parallel: ParallelContext
    ) -> QuantExperts:
        return Int8Experts(spec, dtype, device, parallel)
