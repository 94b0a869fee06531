"""The reference KernelOps in plain torch: what every fused kernel is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferx_core.interfaces.ops import KernelOps, check_parts


class TorchOps(KernelOps):
    # MoE shared experts stay a separate MLP here: the unfused layer the fused one (a kernel
    # package's, or a test's) is checked against.
    fuse_shared_experts = False

    def __init__(self) -> None:
        # Every layer of a step rotates by the same positions tensor: look cos/sin up once. The
        # key holds the tensors themselves (not addresses, which the allocator reuses).
        self._rotary_key: tuple | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
        parts: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if parts:
            check_parts(x, residual)
            x = x[0] if x.shape[0] == 1 else x.float().sum(0).to(x.dtype)
        if residual is not None:
            x = x + residual
        # Normalise in float32, cast back, then scale: Hugging Face's order, which matters for
        # bit-closeness in half precision.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        normed = weight * h.to(x.dtype)
        return normed if residual is None else (normed, x)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Memo only on the CPU: a graph captured on a GPU must do the lookup itself.
        memo = positions.device.type == "cpu"
        old = self._rotary_key
        if memo and old and old[0] is positions and old[1] is cos_sin and old[2] == q.dtype:
            cos, sin = self._cos_sin  # type: ignore[misc]
        else:
            cos, sin = cos_sin[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
            if memo:  # positions is made fresh each step and never mutated
                self._rotary_key, self._cos_sin = (positions, cos_sin, q.dtype), (cos, sin)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotate_interleaved(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, rope] by its tokens' rows of the rotary table, cos_sin [T, rope]
    (cos then sin, as RotaryEmbedding tabulates them), pairing dimensions (2i, 2i + 1) as
    DeepSeek does (not Llama's halves). In float32, cast back to x's dtype."""
    cos, sin = cos_sin[:, None].chunk(2, dim=-1)
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)
