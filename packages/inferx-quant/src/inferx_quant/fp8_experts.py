"""FP8 MoE experts: e4m3 weights with float32 scales per output row (or per row per block of
columns), the "fp8" ExpertWeights the fused MoE kernels read (weight-only: activations stay in
the serving dtype).

Reads per-channel checkpoints (compressed-tensors FP8 / FP8_DYNAMIC: `{e}.gate_proj.weight`
e4m3 with `weight_scale` [rows, 1]), per-tensor ones (a scale [1] per projection, expanded
over its rows) and block ones (Hugging Face's `weight_scale_inv` [rows / bn, cols / bk], each
block's scale repeated over its rows), per expert or stacked over the experts; online, it
quantizes unquantized weights per row at load.
"""

from __future__ import annotations

import math

import torch

from inferx_core.interfaces.moe import ExpertsSpec, ExpertWeights, QuantExperts
from inferx_core.moe import (
    check_experts_loaded,
    expert_mlp,
    expert_rows,
    gate_and_up,
    run_experts,
)
from inferx_core.parallel import SINGLE, ParallelContext
from inferx_quant.fp8 import FP8, Fp8Format, quantize_weight_rows

_PARTS = ("gate", "up", "down")


class Fp8Experts(QuantExperts):
    """A MoE layer's experts in e4m3: gate_up [E, 2n, H] (gate and up rows in the activation's
    layout, as UnquantizedExperts stacks them) and down [E, H, n], n this rank's share of the
    intermediate size; float32 scales per output row gate_up_scale [E, 2n] and down_scale
    [E, H], or for block checkpoints (bn, bk) per row per bk columns, [E, 2n, ceil(H / bk)]
    and [E, H, ceil(n / bk)] (a rank's columns must start on a block); optional biases
    [E, 2n] / [E, H] in the serving dtype (the down bias on rank 0).

    load() kinds: "gate", "up", "down" or "gate_up" followed by ".weight", the format's scale
    (".weight_scale", or ".weight_scale_inv" for Hugging Face's block checkpoints) or ".bias";
    per expert (expert=e) or stacked (expert=None, leading [E]). A scale is per row ([rows, 1]
    or [rows]), per tensor ([1] or []) or per block ([ceil(rows / bn), ceil(cols / bk)]).
    Online (no checkpoint scales) a weight in any float dtype is quantized per row of the whole
    projection, then sliced, so every tensor parallel size holds the same values.

    forward (the reference, any device): each expert with tokens dequantized exactly to
    float32 and run on the float32 activations, summed in float32; the kernels' "fp8" path
    computes the same products with the weights widened in registers."""

    def __init__(
        self,
        spec: ExpertsSpec,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext = SINGLE,
        fmt: Fp8Format | None = None,
        online: bool = False,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.online = online
        self.fmt = fmt or Fp8Format()
        self.block = self.fmt.block if self.fmt.weights == "block" else None
        if online and self.block:
            raise ValueError("online FP8 quantizes expert weights per row only")
        e, h = spec.num_experts, spec.hidden_size
        self.start, n = parallel.shard(spec.intermediate_size, f"{spec.prefix}'s intermediate size")
        self.n = n
        bk = self.block[1] if self.block else 0
        if bk and self.start % bk:
            raise ValueError(
                f"{spec.prefix}: this rank's share of the intermediate size starts at "
                f"{self.start}, not on a weight_block_size block of {bk} columns"
            )
        # the scale columns of gate_up and down (none: one scale per row)
        cols = (math.ceil(h / bk), math.ceil(n / bk)) if bk else ()

        def param(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
            t = torch.zeros(*shape, dtype=dtype, device=device)
            return torch.nn.Parameter(t, requires_grad=False)

        self.gate_up = param(e, 2 * n, h, dtype=FP8)
        self.down = param(e, h, n, dtype=FP8)
        self.gate_up_scale = param(e, 2 * n, *cols[:1], dtype=torch.float32)
        self.down_scale = param(e, h, *cols[1:], dtype=torch.float32)
        self.gate_up_bias = param(e, 2 * n, dtype=dtype) if spec.bias else None
        self.down_bias = param(e, h, dtype=dtype) if spec.bias and parallel.rank == 0 else None
        self._loaded: dict[str, set[int]] = {}

    def _rows(self, part: str) -> int:
        inter = self.spec.intermediate_size
        return {"gate_up": 2 * inter, "down": self.spec.hidden_size}.get(part, inter)

    def load(self, kind: str, tensor: torch.Tensor, expert: int | None = None) -> None:
        spec = self.spec
        part, _, what = kind.partition(".")
        whats = ("weight", "bias") if self.online else ("weight", self.fmt.scale_kind, "bias")
        if part not in (*_PARTS, "gate_up") or what not in whats:
            layout = "online FP8" if self.online else "FP8"
            raise ValueError(f"{spec.prefix}: {layout} experts have no {kind!r} tensor")
        if what == "bias" and not spec.bias:
            raise ValueError(f"{spec.prefix}: the experts have no biases ({kind!r})")
        rows = self._rows(part)
        cols = spec.intermediate_size if part == "down" else spec.hidden_size
        scale: torch.Tensor | None = None
        if what == "weight":
            experts, tensor = expert_rows(spec, kind, tensor, expert, (rows, cols))
            tensor, scale = self._weight(kind, tensor)
        elif what == self.fmt.scale_kind:
            what = "weight_scale"  # one name for either
            experts, tensor = self._scale(kind, tensor, expert, rows, cols)
        else:
            experts, tensor = expert_rows(spec, kind, tensor, expert, (rows,))
        index = slice(experts.start, experts.stop)
        if part == "gate_up":
            inter = spec.intermediate_size
            pieces = gate_and_up(tensor, spec, inter)
            scales = (None, None) if scale is None else gate_and_up(scale, spec, inter)
            parts: tuple[str, ...] = ("gate", "up")
        else:
            pieces, scales, parts = (tensor,), (scale,), (part,)
        for p, piece, piece_scale in zip(parts, pieces, scales, strict=True):
            self._copy(p, what, piece, index)
            if piece_scale is not None:  # online: the scales computed from the weight
                self._copy(p, "weight_scale", piece_scale, index)
            done = [what] if scale is None else [what, "weight_scale"]
            for w in done:
                self._loaded.setdefault(f"{p}.{w}", set()).update(experts)

    def _weight(self, kind: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Checks the dtype; online, quantizes [E', rows, cols] per row -> (e4m3, scales)."""
        if not self.online:
            if tensor.dtype != FP8:
                raise ValueError(
                    f"{self.spec.prefix}: {kind} is {tensor.dtype}, expected float8_e4m3fn "
                    "(the checkpoint's quantization_config says it is FP8)"
                )
            return tensor, None
        if tensor.dtype == FP8:
            raise ValueError(
                f"{self.spec.prefix}: {kind} is float8_e4m3fn, but the checkpoint has no "
                "quantization_config saying how it is scaled"
            )
        q, scale = quantize_weight_rows(tensor.flatten(0, 1))
        return q.view(tensor.shape), scale.view(tensor.shape[:2])

    def _scale(
        self, kind: str, tensor: torch.Tensor, expert: int | None, rows: int, cols: int
    ) -> tuple[range, torch.Tensor]:
        """The scales of each expert covered -> (experts, float32 [E', rows] per row, or
        [E', rows, ceil(cols / bk)] per row per block of columns)."""
        count = self.spec.num_experts if expert is None else 1
        which = "all" if expert is None else expert
        if self.block:
            bn, bk = self.block
            want: tuple[int, ...] = (math.ceil(rows / bn), math.ceil(cols / bk))
            got = tuple(tensor.shape)[0 if expert is not None else 1 :]
            if got != want or (expert is None and tensor.shape[0] != count):
                raise ValueError(
                    f"{self.spec.prefix}: {kind} of expert {which} has shape "
                    f"{tuple(tensor.shape)}, expected {list(want)} per expert ({bn}x{bk} blocks)"
                )
            scale = tensor.float().reshape(count, *want).repeat_interleave(bn, dim=1)[:, :rows]
            shape: tuple[int, ...] = (rows, want[1])
        else:
            flat = tensor.float().reshape(count, -1) if tensor.numel() % count == 0 else None
            if flat is None or flat.shape[1] not in (1, rows):
                raise ValueError(
                    f"{self.spec.prefix}: {kind} of expert {which} has shape "
                    f"{tuple(tensor.shape)}, expected [{rows}, 1] or [1] per expert"
                )
            scale, shape = flat.expand(count, rows), (rows,)
        return expert_rows(self.spec, kind, scale if expert is None else scale[0], expert, shape)

    def _copy(self, part: str, what: str, tensor: torch.Tensor, index: slice) -> None:
        """This rank's share of a whole gate / up / down tensor [E', rows, ...] to `index`."""
        if part == "down":
            if what == "weight":
                self.down.data[index].copy_(tensor.narrow(2, self.start, self.n))
            elif what == "weight_scale":  # per row of H: every rank keeps all rows
                if self.block:  # and the column blocks of its own columns
                    bk = self.block[1]
                    tensor = tensor.narrow(2, self.start // bk, self.down_scale.shape[2])
                self.down_scale.data[index].copy_(tensor)
            elif self.down_bias is not None:  # rank 0's
                self.down_bias.data[index].copy_(tensor)
            return
        name = {"weight": "gate_up", "weight_scale": "gate_up_scale", "bias": "gate_up_bias"}
        gate, up = gate_and_up(getattr(self, name[what]).data[index], self.spec, self.n)
        (gate if part == "gate" else up).copy_(tensor.narrow(1, self.start, self.n))

    def finish_loading(self) -> None:
        names = {"weight": "weight"}
        if not self.online:
            names["weight_scale"] = self.fmt.scale_kind
        if self.spec.bias:
            names["bias"] = "bias"
        check_experts_loaded(self.spec, self._loaded, names)

    def expert_weights(self) -> ExpertWeights:
        return ExpertWeights(
            "fp8",
            self.gate_up,
            self.down,
            self.gate_up_scale,
            self.down_scale,
            self.gate_up_bias,
            self.down_bias,
            self.block[1] if self.block else 0,
        )

    def weight(self, part: str, e: int) -> torch.Tensor:
        """Expert e's gate_up or down weight, [out, in] float32: e4m3 values times row scales."""
        w = getattr(self, part)[e].float()
        scale = getattr(self, f"{part}_scale")[e]
        if self.block:  # per row per bk columns
            return w * scale.repeat_interleave(self.block[1], dim=1)[:, : w.shape[1]]
        return w * scale[:, None]

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        b13 = None if self.gate_up_bias is None else self.gate_up_bias[e].float()
        b2 = None if self.down_bias is None else self.down_bias[e].float()
        w13, w2 = self.weight("gate_up", e), self.weight("down", e)
        return expert_mlp(x.float(), w13, b13, w2, b2, self.spec)  # summed in float32

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return run_experts(x, topk_weights, topk_ids, self.spec.num_experts, self._expert)
