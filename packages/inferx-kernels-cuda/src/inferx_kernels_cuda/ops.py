"""The `triton` KernelOps: one launch each for add + RMSNorm, SiLU-and-mul and q/k rotary; the
greedy argmax in two."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton

from inferx_core.interfaces.attention import SplitAttention
from inferx_core.interfaces.moe import ExpertWeights, QuantExperts, RouterSpec
from inferx_core.interfaces.ops import KernelOps, check_mla_rope_norm, check_parts
from inferx_core.interfaces.quant import ActivationQuant, QuantizedActivation, QuantLinear
from inferx_core.quant_none import SPLIT_PARTS
from inferx_kernels_cuda import fp8_act
from inferx_kernels_cuda import fused_kernels as kernels
from inferx_kernels_cuda.fp8_gemm import quantize_rows
from inferx_kernels_cuda.gemv import skinny_linear
from inferx_kernels_cuda.moe_kernels import fusable_router, fused_experts, topk_softmax
from inferx_kernels_cuda.pdl import (
    attention_early,
    between_launch,
    in_ranges,
    norm_early,
)
from inferx_kernels_cuda.tma_gemv import (
    TmaGemvConfig,
    norm_config,
    plain_config,
    reduce_config,
    reduce_input_problem,
    tma_linear_parts,
    tma_linear_silu_and_mul,
    tma_norm_linear,
    tma_reduce_linear,
)
from inferx_kernels_cuda.tma_gemv import has_tma as _has_tma
from inferx_kernels_cuda.tma_gemv import input_problem as tma_input_problem

# Elements of x1 (and of x2) one rotary loop iteration holds: enough for all query heads of
# common models in one pass at head dim 128, small enough to stay in registers.
_ROTARY_TILE = 2048
_SILU_BLOCK = 1024
_EMBED_BLOCK = 1024


def _dense(linear: torch.nn.Module) -> bool:
    """Whether the layer's quant method hands its weight out as a plain tensor for the fused
    kernels (QuantLinear.dense_weight); others run their own forward methods."""
    return isinstance(linear, QuantLinear) and linear.dense_weight() is not None


def _activation_rows(x: object) -> Any:
    """x's rows as a tensor: a QuantizedActivation's e4m3 data, else x."""
    return x.data if isinstance(x, QuantizedActivation) else x


def _takes_trigger(linear: torch.nn.Module, x: object) -> bool:
    """Whether the layer's forward_parts / forward_split take `trigger` (QuantLinear.
    takes_trigger) for x: rows of activations, plain or quantized."""
    data = _activation_rows(x)
    return (
        isinstance(linear, QuantLinear)
        and linear.takes_trigger
        and isinstance(data, torch.Tensor)
        and data.dim() == 2
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with a unit stride along the last dim (a view when possible)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def _norm_warps(block: int) -> int:
    """Warps of rms_norm_kernel's one program a row. Past 1024 columns 16: at batch 1 a norm is
    one program, and more threads with fewer elements each made 3B's norm faster (8B's level)
    than 8 warps; measured in docs/BENCHMARKS.md."""
    return 4 if block <= 1024 else 16


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def fused_norm_max_rows(k: int) -> int:
    """The default row limit of the post-attention norm inside gate_up (tma_norm_linear), by the
    hidden size k; past it the norm runs alone and gate_up as tma_gated. Every fused program
    re-reads all the rows' fp32 parts and residual from L2, which past these rows costs more
    than the norm's launch (at k 2048 from 2 rows; past 2048 a limit of 1 lost at 4 rows, so 4
    there); measured in docs/BENCHMARKS.md."""
    return 1 if k <= 2048 else 4


def filled_slices(
    parts: int, n: int, rows: int, num_sms: int, double_rows: tuple[tuple[int, int], ...]
) -> int:
    """A split GEMM's K-slices: `parts`, doubled at double_rows rows where `parts` slices of n
    output rows are fewer programs than SMs: Qwen2.5-3B's down_proj (N 2048: 128 programs in 4
    slices, 256 in 8) is faster in 8 at 4-16 rows, slower at 1-2 and level at 32-64;
    Llama-3.1-8B's (N 4096, 256 programs in 4) lost at every row count in 8. Measured in
    docs/BENCHMARKS.md."""
    block_n = plain_config(n, parts, num_sms, rows).block_n
    if in_ranges(rows, double_rows) and triton.cdiv(n, block_n) * parts < num_sms:
        return 2 * parts
    return parts


class TritonOps(KernelOps):
    """Fused Triton kernels with the torch reference's numerics (inferx_core.ops_torch).

    Differences from TorchOps a caller can see: `rotary` rotates q and k in place and returns
    them (they are views of the step's fresh QKV output, so nothing else reads the unrotated
    values; this saves a copy of q and k), and positions are not range-checked against the
    cos/sin table (that would cost a device sync).
    """

    # fuse_shared_experts (KernelOps'): models build MoE shared experts as always-on slots of
    # the routed experts (DeepSeek-V2-Lite's 2 x 1408: two more experts of 1408), so
    # topk_softmax appends them in its launch and the grouped gate_up and down GEMMs run them
    # with the routed ones: no shared MLP's GEMMs and add a layer. Off: the shared MLP apart,
    # for A/B (benchmarks/moe_layer.py's deepseek-v2-lite-shared rows, decode_profile.py
    # --shared-experts-apart); awaiting that GPU measurement (docs/ARCHITECTURE.md's decision
    # register). A class attribute, so that a script can switch it for the engines it builds;
    # an instance may set its own.
    fuse_shared_experts = True

    def __init__(self) -> None:
        # Each setting below is an attribute with its default, which tests and benchmarks may
        # set on an instance; the reasons are rows of docs/ARCHITECTURE.md's decision register.
        # Steps of lo..hi rows run an unquantized gate_up and its SiLU-and-mul as one
        # skinny_linear(gated=True) launch: 5-32 (graphs pad them to 8, 16 or 32), and only
        # where the GEMM's K (the hidden size) is at most gated_gemv_max_k. It ties at 1 row,
        # loses at 2-4 (the FMA path) and from 64, and gains nothing at larger K.
        # On a Hopper or newer GPU the TMA form (tma_gated below) takes these rows first.
        # (lo, hi); (1, 0) never.
        self.gated_gemv_rows = (5, 32)
        self.gated_gemv_max_k = 2048
        self._interpret = os.environ.get("TRITON_INTERPRET") == "1"
        # Columns per program of argmax's first pass (a power of two).
        self.argmax_segment = 4096
        # tma_gemv: unquantized decode GEMMs of 1..tma_gemv_max_rows rows (o_proj, down_proj,
        # a decode step's QKV as K-slice parts; gate_up whole) on tma_linear_parts instead of
        # cuBLAS / torch.bmm. Descriptors are built on the host per call, so it is meant for
        # CUDA-graph steps. tma_norm_linear: the post-attention norm inside gate_up (SiLU-and-mul
        # after) at 1..norm_max_rows(K) rows; the input norm inside the QKV GEMM only with
        # tma_norm_qkv (slower than the norm and the GEMM apart). Both faster at decode sizes;
        # the row limits are what has been measured (the norm fusion past 8 rows loses).
        self.tma_gemv = True
        # (65-128 rows unmeasured.)
        self.tma_gemv_max_rows = 64
        # tma_gated: gate_up and SiLU-and-mul as one tma_linear_silu_and_mul launch where the
        # norm is not fused (past the norm's row limit, to tma_gemv_max_rows rows), ahead of
        # the gated GEMV: faster than the GEMM and silu_and_mul apart.
        self.tma_gated = True
        self.tma_norm = True
        self.tma_norm_qkv = False
        # None: fused_norm_max_rows(K) by the model's hidden size; an int sets one limit for
        # every shape.
        self.tma_norm_max_rows: int | None = None
        # K-slices of the split TMA GEMMs (o_proj, down_proj, QKV): 4 as DenseLinear's split
        # (2 and 8 were slower).
        self.tma_parts = SPLIT_PARTS
        # The QKV GEMM (linear_split) in half the tma_parts K-slices at these rows, at every
        # width (faster from 8 rows, level at 2-4; 4 slices at 1 row). Row ranges ((lo, hi),
        # inclusive; () never).
        self.qkv_half_rows: tuple[tuple[int, int], ...] = ((2, 64),)
        # down_proj (a linear_parts GEMM whose K exceeds its N; o_proj too where heads x
        # head_dim exceed the hidden size) in twice tma_parts K-slices at these rows where
        # tma_parts slices leave SMs without a program (filled_slices). Row ranges.
        self.down_double_rows: tuple[tuple[int, int], ...] = ((4, 16),)
        # Not for o_proj (K at most N), though 3B's is 128 programs in 4 slices too: at 4-16
        # rows in 8 it lost.
        # embed_triton: the embedding lookup as embedding_kernel (BLOCK columns a program)
        # instead of F.embedding, whose index_select was slower in the decode graph
        # (weight[ids], the index kernel, was level).
        self.embed_triton = True
        # fuse_act_quant: where the next layer takes e4m3 input (FP8 W8A8, its input_quant),
        # RMSNorm and SiLU-and-mul write it themselves (fp8_act) instead of the op and then
        # the layer's own quantization kernel: one launch and one round trip of the
        # activations fewer. Off: the two launches (for A/B).
        self.fuse_act_quant = True
        # moe_atomic_sum: the MoE layer's top-k sum by float32 atomics inside the down GEMM
        # instead of the sum kernel (moe_kernels.fused_experts); off: the sum kernel's fixed
        # order gives the same bits on every run, atomics do not.
        self.moe_atomic_sum = False
        # q heads per program of mla_rope_norm_kernel (a power of two; unmeasured).
        self.mla_heads_block = 4

    def embedding(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if not (
            self.embed_triton
            and (ids.is_cuda or self._interpret)
            and ids.dim() == 1
            and weight.dim() == 2
            and weight.stride(1) == 1
        ):
            return super().embedding(weight, ids)
        ids = ids.contiguous()  # the kernel reads ids[r] at r (a no-op for a step's ids)
        rows, hidden = ids.shape[0], weight.shape[1]
        out = torch.empty((rows, hidden), dtype=weight.dtype, device=weight.device)
        if rows and hidden:
            block = min(_EMBED_BLOCK, triton.next_power_of_2(hidden))
            grid = (rows, triton.cdiv(hidden, block))
            kernels.embedding_kernel[grid](
                ids, weight, out, weight.stride(0), out.stride(0), hidden, BLOCK=block,
                num_warps=4,
            )  # fmt: skip
        return out

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
        parts: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._rms_norm(x, weight, eps, residual, parts, None)

    def rms_norm_quant(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        quant: ActivationQuant,
        residual: torch.Tensor | None = None,
        parts: bool = False,
    ) -> QuantizedActivation | tuple[QuantizedActivation, torch.Tensor]:
        """The norm and the quantization in one launch (fp8_act.rms_norm_quant_kernel) where
        fuse_act_quant is on; else the norm, then the layer's own quantization kernel."""
        if self.fuse_act_quant and self._quantizes(x, quant) and x.dtype == weight.dtype:
            return self._rms_norm(x, weight, eps, residual, parts, quant)
        out = self.rms_norm(x, weight, eps, residual, parts)
        if isinstance(out, tuple):
            return self._quantize(out[0], quant), out[1]
        return self._quantize(out, quant)

    def _quantizes(self, x: torch.Tensor, quant: ActivationQuant) -> bool:
        """Whether the Triton kernels quantize x this way (else the torch reference does)."""
        return (x.is_cuda or self._interpret) and fp8_act.fusable(quant.granularity, quant.group)

    def _quantize(self, h: torch.Tensor, quant: ActivationQuant) -> QuantizedActivation:
        """h quantized by fp8_gemm.quantize_rows, as an FP8 layer would quantize it itself."""
        if not self._quantizes(h, quant):
            return quant.quantize(h)
        q, scale = quantize_rows(_rows(h), quant.group, quant.static_scale)
        return QuantizedActivation(q.view(h.shape), scale, h.dtype, quant)

    def _rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        parts: bool,
        quant: ActivationQuant | None,
    ) -> Any:
        """rms_norm_kernel, or with `quant` rms_norm_quant_kernel writing e4m3 and scales."""
        n = x.shape[-1]
        if weight.shape != (n,):
            raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({n},)")
        num_parts, stride_part = 1, 0
        if parts:
            check_parts(x, residual)
            num_parts = x.shape[0]
            # parts [S, T, n] may be strided along S and T (moe_experts_parts' [k, T, n] view)
            if num_parts > 1 and (x.stride(-1) != 1 or (x.dim() != 3 and not x[0].is_contiguous())):
                x = x.contiguous()
            stride_part = x.stride(0) if num_parts > 1 else 0
            x = x[0]  # part 0; the kernel finds the others stride_part further
        x2 = _rows(x)
        if residual is not None:
            if residual.shape != x.shape:
                raise ValueError(
                    f"rms_norm: residual has shape {tuple(residual.shape)}, "
                    f"expected x's {tuple(x.shape)}"
                )
            r2 = _rows(residual)
            summed = torch.empty_like(x, memory_format=torch.contiguous_format)
            s2 = summed.view(-1, n)
        else:
            # Never read: HAS_RESIDUAL=False compiles the residual path away.
            r2 = s2 = x2
        rows = x2.shape[0]
        block = triton.next_power_of_2(n)
        if quant is not None:
            out: Any = self._norm_quant_launch(x, x2, r2, s2, weight, eps, quant, stride_part,
                                               num_parts, residual is not None)  # fmt: skip
            return out if residual is None else (out, summed)
        out = torch.empty(
            x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device
        )
        out2 = out.view(-1, n)
        if rows:
            kernels.rms_norm_kernel[(rows,)](
                x2,
                r2,
                weight.contiguous(),
                out2,
                s2,
                x2.stride(0),
                r2.stride(0),
                out2.stride(0),
                s2.stride(0),
                stride_part,
                n,
                eps,
                BLOCK=block,
                HAS_RESIDUAL=residual is not None,
                PARTS=num_parts,
                **between_launch(x.device, rows, n, norm=True),
                num_warps=_norm_warps(block),
            )
        return out if residual is None else (out, summed)

    def _norm_quant_launch(
        self,
        x: torch.Tensor,
        x2: torch.Tensor,
        r2: torch.Tensor,
        s2: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        quant: ActivationQuant,
        stride_part: int,
        num_parts: int,
        has_residual: bool,
    ) -> QuantizedActivation:
        rows, n = x2.shape
        q = torch.empty(x.shape, dtype=fp8_act.FP8, device=x.device)
        q2 = q.view(-1, n)
        group = quant.group if quant.granularity == "group" else 0
        scale, stride_s = fp8_act.scales_for(
            rows, n, quant.granularity, group, quant.static_scale, x.device
        )
        block = max(triton.next_power_of_2(n), group)
        if rows:
            fp8_act.rms_norm_quant_kernel[(rows,)](
                x2, r2, weight.contiguous(), q2, scale, scale, s2,
                x2.stride(0), r2.stride(0), q2.stride(0), stride_s, s2.stride(0), stride_part,
                n, eps, BLOCK=block, HAS_RESIDUAL=has_residual, PARTS=num_parts, GROUP=group,
                STATIC=quant.granularity == "static", HAND_ROUND=self._interpret,
                **between_launch(x.device, rows, n, norm=True), num_warps=_norm_warps(block),
            )  # fmt: skip
        return QuantizedActivation(q, scale, x.dtype, quant)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"silu_and_mul: last dim {x.shape[-1]} is not gate + up (even)")
        half = x.shape[-1] // 2
        x2 = _rows(x)
        out = torch.empty((*x.shape[:-1], half), dtype=x.dtype, device=x.device)
        out2 = out.view(-1, half)
        rows = x2.shape[0]
        if rows and half:
            block = min(_SILU_BLOCK, triton.next_power_of_2(half))
            # Rows on grid axis 0: it allows 2**31 - 1 programs, axis 1 only 65535.
            grid = (rows, triton.cdiv(half, block))
            # TRIGGER where the decode GEMVs launch with PDL: down_proj's when it is not fused
            # with gate_up (W4A16's) may then launch early.
            kernels.silu_and_mul_kernel[grid](
                x2, out2, x2.stride(0), out2.stride(0), half, BLOCK=block,
                TRIGGER=between_launch(x.device, rows, half)["TRIGGER"], num_warps=4,
            )  # fmt: skip
        return out

    def silu_and_mul_quant(self, x: torch.Tensor, quant: ActivationQuant) -> QuantizedActivation:
        """SiLU-and-mul and the quantization in one launch (fp8_act.silu_and_mul_quant) where
        fuse_act_quant is on; else silu_and_mul, then the layer's own quantization kernel."""
        if not (self.fuse_act_quant and self._quantizes(x, quant)):
            return self._quantize(self.silu_and_mul(x), quant)
        if x.shape[-1] % 2:
            raise ValueError(f"silu_and_mul: last dim {x.shape[-1]} is not gate + up (even)")
        x2 = _rows(x)
        # TRIGGER as silu_and_mul's: down_proj's FP8 GEMV may launch early
        trigger = between_launch(x.device, x2.shape[0], x2.shape[1] // 2)["TRIGGER"]
        q, scale = fp8_act.silu_and_mul_quant(
            x2, quant.granularity, quant.group, quant.static_scale, self._interpret, trigger
        )
        return QuantizedActivation(q.view(*x.shape[:-1], -1), scale, x.dtype, quant)

    def linear_silu_and_mul(
        self, linear: torch.nn.Module, x: torch.Tensor, quant: ActivationQuant | None = None
    ) -> torch.Tensor | QuantizedActivation:
        if quant is not None:
            return self.silu_and_mul_quant(linear(x), quant)
        fused = linear.forward_silu_and_mul(x) if isinstance(linear, QuantLinear) else None
        if fused is not None:
            return fused
        if self.tma_gated and linear.bias is None and self._takes_tma(linear, x):
            cfg = self._tma_config(x, linear.dense_weight().shape[0] // 2, 1, gated=True)
            return tma_linear_silu_and_mul(x, linear.dense_weight(), cfg)
        if (
            _dense(linear)
            and x.dim() == 2
            and self.gated_gemv_rows[0] <= x.shape[0] <= self.gated_gemv_rows[1]
            and x.shape[1] <= self.gated_gemv_max_k
            and (x.is_cuda or self._interpret)
            and x.dtype == linear.dense_weight().dtype
            and x.stride(1) == 1
        ):
            return skinny_linear(x, linear.dense_weight(), linear.bias, gated=True)
        if linear.bias is None and self._takes_tma(linear, x):
            return self.silu_and_mul(self._tma(x, linear.dense_weight(), 1)[0])
        return self.silu_and_mul(linear(x))

    def _takes_tma(self, linear: torch.nn.Module, x: torch.Tensor) -> bool:
        """Whether tma_linear_parts runs this layer's GEMM: switched on, an unquantized layer,
        [rows <= tma_gemv_max_rows, K] on a Hopper or newer GPU (or under the interpreter), rows
        TMA can address."""
        return (
            self.tma_gemv
            and _dense(linear)
            and self._tma_device(x)
            and x.dim() == 2
            and x.shape[0] <= self.tma_gemv_max_rows
            and tma_input_problem(x, linear.dense_weight()) is None
        )

    def _tma_device(self, x: torch.Tensor) -> bool:
        return self._interpret or (x.is_cuda and _has_tma(x.device))

    def _tma(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        parts: int,
        trigger: bool = False,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cfg = self._tma_config(x, weight.shape[0], parts)
        return tma_linear_parts(x, weight, parts, cfg, trigger, bias)

    def _tma_config(
        self, x: torch.Tensor, n: int, parts: int, gated: bool = False
    ) -> TmaGemvConfig:
        """plain_config for x's rows and element size and this GPU's SMs (_sms)."""
        return plain_config(n, parts, self._sms(x), x.shape[0], gated, x.element_size())

    def _sms(self, x: torch.Tensor) -> int:
        """The SMs of x's GPU (an H200's 132 under the interpreter)."""
        return 132 if self._interpret else _num_sms(x.device)

    def norm_max_rows(self, k: int) -> int:
        """Rows up to which a norm runs inside the GEMM after it, for a hidden size of k."""
        if self.tma_norm_max_rows is not None:
            return self.tma_norm_max_rows
        return fused_norm_max_rows(k)

    def _fuses_norm(self, linear: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether tma_norm_linear can run this norm and GEMM: an unquantized layer, x
        [S, rows <= norm_max_rows(K), K] parts on a Hopper or newer GPU (or under the
        interpreter)."""
        return (
            _dense(linear)
            and self._tma_device(x)
            and x.dim() == 3
            and x.shape[1] <= self.norm_max_rows(x.shape[-1])
            and x.dtype == linear.dense_weight().dtype
            and tma_input_problem(residual, linear.dense_weight()) is None
        )

    def rms_norm_linear_split(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor,
        linear: torch.nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        if not (self.tma_norm_qkv and self._fuses_norm(linear, x, residual)):
            return super().rms_norm_linear_split(x, weight, eps, residual, linear)
        check_parts(x, residual)
        cfg = norm_config(x.shape[1], self.tma_parts, gated=False)
        out, residual = tma_norm_linear(
            x, residual, weight, eps, linear.dense_weight(), self.tma_parts, False, cfg
        )
        return out, linear.bias, residual

    def rms_norm_linear_silu_and_mul(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor,
        linear: torch.nn.Module,
        quant: ActivationQuant | None = None,
    ) -> tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
        if not (
            quant is None
            and self.tma_norm
            and linear.bias is None
            and self._fuses_norm(linear, x, residual)
        ):
            return super().rms_norm_linear_silu_and_mul(x, weight, eps, residual, linear, quant)
        check_parts(x, residual)
        cfg = norm_config(x.shape[1], 1, gated=True)
        return tma_norm_linear(x, residual, weight, eps, linear.dense_weight(), 1, True, cfg)

    def linear_parts(
        self, linear: torch.nn.Module, x: torch.Tensor | SplitAttention
    ) -> torch.Tensor:
        if isinstance(x, SplitAttention):
            if self._takes_reduce(linear, x):
                return tma_reduce_linear(x, linear.dense_weight(), self.tma_parts)
            x = x.reduce().flatten(1)
        if self._takes_tma(linear, x):
            parts = self.tma_parts
            n, k = linear.dense_weight().shape
            if k > n and self.down_double_rows:
                parts = filled_slices(parts, n, x.shape[0], self._sms(x), self.down_double_rows)
            # where pdl.NORM_ROWS takes the rows, the norm after it launches early; a bias
            # (gpt-oss's o_proj) goes into part 0
            trigger = norm_early(x.device, x.shape[0])
            return self._tma(x, linear.dense_weight(), parts, trigger, linear.bias)
        if _takes_trigger(linear, x):  # the same rule for a method's own GEMV (W4A16's, FP8's)
            rows = _activation_rows(x)
            return linear.forward_parts(x, trigger=norm_early(rows.device, rows.shape[0]))
        return linear.forward_parts(x)

    def _takes_reduce(self, linear: torch.nn.Module, splits: SplitAttention) -> bool:
        """Whether tma_reduce_linear combines these splits inside this layer's GEMM: an
        unquantized layer without bias on the TMA path, at up to MAX_REDUCE_ROWS rows, each of
        its tma_parts K-slices narrow enough to load whole before the wait (Qwen2.5-3B's
        o_proj; not Llama-3.1-8B's: at 8 slices, narrow enough, its batch-1 step was much
        slower)."""
        return (
            self.tma_gemv
            and _dense(linear)
            and linear.bias is None
            and self._tma_device(splits.part_o)
            and splits.rows <= self.tma_gemv_max_rows
            and reduce_input_problem(splits, linear.dense_weight(), self.tma_parts) is None
            and reduce_config(splits, linear.dense_weight(), self.tma_parts).block_k
            == splits.heads // self.tma_parts * splits.head_dim
        )

    def linear_split(
        self, linear: torch.nn.Module, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._takes_tma(linear, x):
            # The QKV GEMM of a decode-only step: where pdl.ATTENTION_ROWS takes the rows it
            # lets the decode kernel launch early (inferx_kernels_cuda.pdl).
            trigger = attention_early(x.device, x.shape[0])
            parts = self.tma_parts
            if in_ranges(x.shape[0], self.qkv_half_rows):
                parts = max(1, parts // 2)
            return self._tma(x, linear.dense_weight(), parts, trigger), linear.bias
        if _takes_trigger(linear, x):  # the same rule for a method's own GEMV (W4A16's, FP8's)
            rows = _activation_rows(x)
            return linear.forward_split(x, trigger=attention_early(rows.device, rows.shape[0]))
        return linear.forward_split(x)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Two launches: each row's maximum and first index per segment of argmax_segment
        columns, then per row the first segment holding the row's maximum. torch's argmax runs
        one block of threads a row, several times slower at a 128-152k vocabulary
        (bench_argmax).
        NaN logits give an unspecified token (torch's would be the NaN's)."""
        if x.dim() != 2:
            raise ValueError(f"argmax: logits must be [rows, vocab], got {tuple(x.shape)}")
        rows, n = x.shape
        if not (x.is_cuda or self._interpret) or not rows or not n:
            return x.argmax(dim=1)
        if x.stride(1) != 1:
            x = x.contiguous()
        block = min(self.argmax_segment, triton.next_power_of_2(n))
        segments = triton.cdiv(n, block)
        seg_max = torch.empty(rows, segments, dtype=torch.float32, device=x.device)
        seg_arg = torch.empty(rows, segments, dtype=torch.int32, device=x.device)
        out = torch.empty(rows, dtype=torch.int64, device=x.device)
        kernels.segment_argmax_kernel[(rows, segments)](
            x, seg_max, seg_arg, x.stride(0), n, BLOCK=block, num_warps=4
        )
        kernels.argmax_kernel[(rows,)](
            seg_max, seg_arg, out, segments, SEGMENTS_PAD=triton.next_power_of_2(segments),
            num_warps=1,
        )  # fmt: skip
        return out

    def route_experts(
        self, logits: torch.Tensor, spec: RouterSpec, selection_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax routings (either order) in one topk_softmax launch, which also sums
        linear_parts' partial logits (the router GEMM on the TMA GEMV in K-slices) and writes
        the spec's shared experts after the picks; group-limited, sigmoid and biased ones
        (DeepSeek) on the torch reference."""
        if (logits.is_cuda or self._interpret) and fusable_router(spec, selection_bias):
            return topk_softmax(logits, spec)
        return super().route_experts(logits, spec, selection_bias)

    def moe_experts(
        self,
        experts: QuantExperts,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The routed experts as grouped Triton GEMMs (moe_kernels.fused_experts) where the
        method hands out its tensors (QuantExperts.expert_weights); no host synchronisation, so
        CUDA graphs capture it."""
        weights = self._expert_weights(experts, x)
        if weights is None:
            return super().moe_experts(experts, x, topk_weights, topk_ids)
        return fused_experts(
            x, topk_weights, topk_ids, weights, experts.spec, atomic_sum=self.moe_atomic_sum
        )

    def moe_experts_parts(
        self,
        experts: QuantExperts,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """moe_experts' weighted top-k outputs unsummed, [k, T, H] (fused_experts(parts=True)):
        the norm after the layer sums them in the order moe_sum_kernel would, rounding once,
        so the result is the same and the sum launch is saved."""
        weights = self._expert_weights(experts, x)
        if weights is None:
            return super().moe_experts_parts(experts, x, topk_weights, topk_ids)
        return fused_experts(
            x, topk_weights, topk_ids, weights, experts.spec, atomic_sum=self.moe_atomic_sum,
            parts=True,
        )  # fmt: skip

    def _expert_weights(self, experts: QuantExperts, x: torch.Tensor) -> ExpertWeights | None:
        """The tensors fused_experts runs (QuantExperts.expert_weights) where it can run on x
        ([T, H] on a GPU or under the interpreter); None: the method's own forward."""
        if x.dim() != 2 or not (x.is_cuda or self._interpret):
            return None
        return experts.expert_weights()

    def mla_rope_norm(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One mla_rope_norm_kernel launch: every head's q and the k row of all tokens (summing
        the GEMM's K-slice parts where q and kv come as parts); the torch reference where the
        dtypes differ or a last dim is strided."""
        nope, rank = check_mla_rope_norm(q, kv, norm_weight, cos_sin)
        if not (
            (q.is_cuda or self._interpret)
            and q.dtype == kv.dtype == norm_weight.dtype
            and cos_sin.dtype == torch.float32
            and q.stride(-1) == 1
            and kv.stride(-1) == 1
        ):
            return super().mla_rope_norm(q, kv, norm_weight, eps, positions, cos_sin)
        num_parts = q.shape[0] if q.dim() == 4 else 1
        stride_qs = q.stride(0) if q.dim() == 4 else 0
        stride_kvs = kv.stride(0) if kv.dim() == 3 else 0
        tokens, heads, width = q.shape[-3:]
        half = cos_sin.shape[1] // 2
        q_out = torch.empty((tokens, heads, width), dtype=q.dtype, device=q.device)
        k = torch.empty((tokens, 1, kv.shape[-1]), dtype=kv.dtype, device=kv.device)
        if tokens:
            heads_block = min(triton.next_power_of_2(heads), self.mla_heads_block)
            cos_sin = cos_sin.contiguous()
            grid = (tokens, 1 + triton.cdiv(heads, heads_block))
            kernels.mla_rope_norm_kernel[grid](
                q, kv, norm_weight.contiguous(), positions.contiguous(), cos_sin, q_out, k,
                stride_qs, q.stride(-3), q.stride(-2), stride_kvs, kv.stride(-2),
                cos_sin.stride(0), k.stride(0), heads, eps, NOPE=nope,
                NOPE_PAD=triton.next_power_of_2(max(nope, 1)), HALF=half,
                HALF_PAD=triton.next_power_of_2(max(half, 1)), RANK=rank,
                RANK_PAD=triton.next_power_of_2(rank), HEADS_BLOCK=heads_block, PARTS=num_parts,
                num_warps=4,
            )  # fmt: skip
        return q_out, k

    def rotary(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, _, dim = q.shape
        if k.shape[0] != tokens or k.shape[2] != dim or q.dtype != k.dtype:
            raise ValueError(
                f"rotary: q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} must "
                "agree on tokens, head dim and dtype"
            )
        if q.stride(2) != 1 or k.stride(2) != 1:
            raise ValueError(
                "rotary: q and k need a contiguous head dim (strided tokens and heads are fine); "
                f"strides are {q.stride()} and {k.stride()}"
            )
        if dim % 2:
            raise ValueError(f"rotary: head dim {dim} is odd; rotate-half needs an even one")
        if cos_sin.shape[-1] != dim or cos_sin.dtype != torch.float32:
            raise ValueError(
                f"rotary: cos_sin must be [positions, {dim}] float32, got "
                f"{tuple(cos_sin.shape)} {cos_sin.dtype}"
            )
        if tokens:
            half = dim // 2
            half_pad = triton.next_power_of_2(half)
            most_heads = max(q.shape[1], k.shape[1])
            heads_block = min(triton.next_power_of_2(most_heads), max(1, _ROTARY_TILE // half_pad))
            cos_sin = cos_sin.contiguous()
            kernels.rotary_kernel[(tokens,)](
                q,
                k,
                positions.contiguous(),
                cos_sin,
                q.stride(0),
                q.stride(1),
                k.stride(0),
                k.stride(1),
                cos_sin.stride(0),
                q.shape[1],
                k.shape[1],
                HALF=half,
                HALF_PAD=half_pad,
                HEADS_BLOCK=heads_block,
                num_warps=4,
            )
        return q, k
