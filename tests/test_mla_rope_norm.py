"""KernelOps.mla_rope_norm, MLA's glue between its projections and attention: the torch
reference against float64, the Triton kernel (mla_rope_norm_kernel) against the reference
under TRITON_INTERPRET=1 at V2-Lite's widths and the tiny test ones, on strided views like the
GEMM's output, and the tiny DeepSeek models' logits with the kernel in their layers; on a GPU
the kernel against the reference in bf16 at V2-Lite's widths."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted, on_gpu  # noqa: E402

from inferx_core.interfaces import model as model_interfaces  # noqa: E402
from inferx_core.interfaces.ops import KernelOps, summed_parts  # noqa: E402
from inferx_core.ops_torch import TorchOps  # noqa: E402
from inferx_kernels_cuda.ops import TritonOps  # noqa: E402
from inferx_models.layers import RotaryEmbedding  # noqa: E402

CPU = torch.device("cpu")
EPS = 1e-6
MAX_POSITIONS = 4096
# (heads, nope, rope, rank): V2-Lite's (16 heads), the tiny test models' (test_deepseek_v2), and
# head counts that leave a head block part-empty (5) or fill one exactly (4).
WIDTHS = [(16, 128, 64, 512), (4, 16, 8, 32), (5, 16, 8, 32), (1, 16, 8, 24), (3, 0, 8, 32)]


def inputs(
    tokens: int,
    heads: int,
    nope: int,
    rope: int,
    rank: int,
    q_lora: int | None,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    parts: int = 0,
) -> tuple[torch.Tensor, ...]:
    """(q, kv, norm weight, positions, cos_sin) as MLAttention hands them over: q and kv split
    from one qkv_a_proj output row ([q_lora or heads * (nope + rope), rank + rope]); with q LoRA
    q comes from q_b_proj (a contiguous output of its own). parts > 0 (no q LoRA): that many
    K-slice partial sums of the GEMM, q [S, T, heads, nope + rope] and kv [S, T, rank + rope].
    cos_sin is a rotary table scaled as YaRN's attention factor scales it; positions are spread
    over it."""
    g = torch.Generator().manual_seed(seed)
    qk = nope + rope
    lead = (parts,) if parts else ()
    fused = torch.randn(*lead, tokens, (q_lora or heads * qk) + rank + rope, generator=g) * 2
    fused = fused.to(device, dtype)
    q_cols = q_lora or heads * qk
    kv = fused[..., q_cols:]
    if q_lora:
        assert not parts
        q = (torch.randn(tokens, heads * qk, generator=g) * 2).to(device, dtype)
    else:
        q = fused[..., :q_cols]
    weight = (1 + 0.3 * torch.randn(rank, generator=g)).to(device, dtype)
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=g).to(device)
    params = {"rope_type": "default", "rope_theta": 10000.0}
    cos_sin = RotaryEmbedding(rope, MAX_POSITIONS, params, device).cos_sin * 1.2
    return q.view(*lead, tokens, heads, qk), kv, weight, positions, cos_sin


def float64_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's definition in float64, written out pair by pair: dimensions (2i, 2i + 1) of
    each rope part rotated by angle i's cos and sin; the latent RMS-normed times the weight."""
    rope, rank = cos_sin.shape[1], weight.shape[0]
    nope = q.shape[-1] - rope
    rows = cos_sin[positions].double()
    cos, sin = rows[:, : rope // 2], rows[:, rope // 2 :]

    def rotate(x: torch.Tensor) -> torch.Tensor:  # [T, heads, rope]
        out = torch.empty_like(x)
        for i in range(rope // 2):
            a, b = x[..., 2 * i], x[..., 2 * i + 1]
            c, s = cos[:, None, i], sin[:, None, i]
            out[..., 2 * i], out[..., 2 * i + 1] = a * c - b * s, a * s + b * c
        return out

    q, kv = q.double(), kv.double()
    latent = kv[:, :rank]
    normed = weight.double() * latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + EPS)
    q_out = torch.cat([q[..., :nope], rotate(q[..., nope:])], dim=-1)
    return q_out, torch.cat([normed[:, None], rotate(kv[:, None, rank:])], dim=-1)


def ulps(ours: torch.Tensor, ref: torch.Tensor, floor: float = 2.0**-20) -> float:
    """The largest |ours - ref| in units of ref's dtype's last place at each element's
    magnitude (2 ** (exponent - mantissa bits)), less `floor` times the largest |ref|: the
    rotation's difference of two fp32 products can cancel to far below them, and there the
    products' own fp32 roundings (or an FMA on the GPU) outweigh the result's last place."""
    info = torch.finfo(ref.dtype)
    ref64 = ref.double()
    mag = ref64.abs().clamp(min=info.tiny)
    ulp = torch.exp2(torch.floor(torch.log2(mag))) * info.eps
    slack = floor * ref64.abs().max().item() if ref.numel() else 0.0
    return (((ours.double() - ref64).abs() - slack).clamp(min=0) / ulp).max().item()


def run(ops: KernelOps, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    q, kv, weight, positions, cos_sin = args
    return ops.mla_rope_norm(q, kv, weight, EPS, positions, cos_sin)


# fp32: the kernel and torch differ only in the norm's summation order (~1e-7); fp16 and bf16:
# at most one ulp where a rounding flips, two in the normed latent (rounded, then times the
# weight and rounded again). The interpreter rounds fp32 -> bf16 toward zero (triton 3.9, see
# test_kernel_ops), not to nearest, so there bf16 is off by up to an ulp at every rounding:
# three in the latent.
ULPS = {torch.float32: 16.0, torch.float16: 2.0, torch.bfloat16: 2.0}
INTERPRETED_BF16_ULPS = 3.0


def check_against_torch(
    tokens: int,
    widths: tuple[int, int, int, int],
    q_lora: int | None,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    ops: TritonOps | None = None,
    parts: int = 0,
) -> None:
    heads, nope, rope, rank = widths
    args = inputs(tokens, heads, nope, rope, rank, q_lora, dtype, device, seed, parts)
    q_ref, k_ref = run(TorchOps(), args)
    q_out, k_out = run(ops or TritonOps(), args)
    assert q_out.shape == (tokens, heads, nope + rope) and q_out.is_contiguous()
    assert k_out.shape == (tokens, 1, rank + rope) and k_out.is_contiguous()
    assert q_out.dtype == k_out.dtype == dtype
    # The nope parts are copies (of the parts' sum, rounded once).
    q_in = summed_parts(args[0]) if parts else args[0]
    assert torch.equal(q_out[..., :nope], q_in[..., :nope])
    tol = ULPS[dtype]
    if dtype == torch.bfloat16 and device.type == "cpu":
        tol = INTERPRETED_BF16_ULPS
    assert ulps(q_out, q_ref) <= min(tol, 2.0), "q"
    assert ulps(k_out[..., rank:], k_ref[..., rank:]) <= min(tol, 2.0), "rope key"
    assert ulps(k_out[..., :rank], k_ref[..., :rank]) <= tol, "latent"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("q_lora", [None, 24])
def test_torch_op_is_the_interleaved_rotation_and_the_norm(
    dtype: torch.dtype, q_lora: int | None
) -> None:
    """Against float64: one rounding of the rotation, two of the norm (normed, then scaled)."""
    args = inputs(3, 4, 16, 8, 32, q_lora, dtype, CPU, seed=1)
    q_out, k_out = run(TorchOps(), args)
    q_ref, k_ref = float64_reference(*args)
    assert q_out.is_contiguous() and k_out.shape == (3, 1, 40)
    # Rounding to nearest is half an ulp; twice (norm), one ulp and a little more.
    tol = {torch.float32: 2.0, torch.float16: 1.5, torch.bfloat16: 1.5}[dtype]
    # Cancellation in the rotation: the fp32 products' roundings, relative to the largest
    # value (half precision's are within the float32 arithmetic's slack).
    floor = 2.0**-21 if dtype == torch.float32 else 2.0**-20
    assert ulps(q_out, q_ref.to(dtype), floor) <= tol
    assert ulps(k_out, k_ref.to(dtype), floor) <= tol


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("q_lora", [None, 24])
@pytest.mark.parametrize("widths", WIDTHS)
def test_kernel_matches_torch(
    widths: tuple[int, int, int, int], q_lora: int | None, tokens: int, dtype: torch.dtype
) -> None:
    check_against_torch(tokens, widths, q_lora, dtype, CPU, seed=tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_op_sums_parts_first(dtype: torch.dtype) -> None:
    """q and kv as K-slice parts: the result of the op on their sum (float32, rounded once)."""
    q, kv, weight, positions, cos_sin = inputs(3, 4, 16, 8, 32, None, dtype, CPU, 2, parts=3)
    summed = (q.float().sum(0).to(dtype), kv.float().sum(0).to(dtype))
    got = run(TorchOps(), (q, kv, weight, positions, cos_sin))
    want = run(TorchOps(), (*summed, weight, positions, cos_sin))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(ValueError, match="parts"):  # parts of q but not of kv
        run(TorchOps(), (q, kv[0], weight, positions, cos_sin))


@interpreted
# (not bf16: the interpreter rounds the parts' fp32 sum to bf16 toward zero, an ulp off the
# reference's, which the rotation's cancellation can turn into many; the GPU test has bf16)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("parts", [1, 2, 4])
@pytest.mark.parametrize("widths", [WIDTHS[0], WIDTHS[2], WIDTHS[4]])
def test_kernel_sums_parts(
    widths: tuple[int, int, int, int], parts: int, dtype: torch.dtype
) -> None:
    """q and kv as the K-slice parts of the GEMM (linear_split's, without q LoRA): summed in
    the kernel as the reference sums them."""
    check_against_torch(2, widths, None, dtype, CPU, seed=parts, parts=parts)


@interpreted
@pytest.mark.parametrize("heads_block", [1, 2, 16])
def test_kernel_head_blocks(heads_block: int) -> None:
    """Any head block size (one head a program, or all of them in one) gives the same q."""
    ops = TritonOps()
    ops.mla_heads_block = heads_block
    check_against_torch(2, (5, 16, 8, 32), None, torch.float32, CPU, seed=7, ops=ops)


@interpreted
def test_kernel_zero_tokens() -> None:
    args = inputs(0, 4, 16, 8, 32, None, torch.float32, CPU, seed=0)
    q_out, k_out = run(TritonOps(), args)
    assert q_out.shape == (0, 4, 24) and k_out.shape == (0, 1, 40)


@interpreted
def test_kernel_falls_back_where_dtypes_differ() -> None:
    """A float32 norm weight beside half-precision activations: the reference's promotion
    (the normed latent in float32, k promoted by the concatenation)."""
    q, kv, weight, positions, cos_sin = inputs(2, 4, 16, 8, 32, None, torch.float16, CPU, 3)
    args = (q, kv, weight.float(), positions, cos_sin)
    q_ref, k_ref = run(TorchOps(), args)
    q_out, k_out = run(TritonOps(), args)
    assert k_out.dtype == k_ref.dtype == torch.float32
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


@pytest.mark.parametrize("ops", [TorchOps(), TritonOps()], ids=["torch", "triton"])
def test_mismatched_widths_are_refused(ops: KernelOps) -> None:
    q, kv, weight, positions, cos_sin = inputs(2, 4, 16, 8, 32, None, torch.float32, CPU, 4)
    with pytest.raises(ValueError, match="mla_rope_norm"):
        ops.mla_rope_norm(q, kv[:, 1:], weight, EPS, positions, cos_sin)
    with pytest.raises(ValueError, match="rope even"):
        ops.mla_rope_norm(q, kv, weight[:-1], EPS, positions, cos_sin[:, :-1])


class KernelOnly(TorchOps):
    """The torch reference with mla_rope_norm's kernel and TritonOps' linear_split (the decode
    GEMM's K-slice parts, which the kernel sums): a model's layers call them on their real
    views of the GEMM outputs, everything else as the reference does."""

    def __init__(self) -> None:
        super().__init__()
        self.triton = TritonOps()
        self.calls = 0
        self.parts: list[int] = []  # linear_split's part counts

    def mla_rope_norm(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        return self.triton.mla_rope_norm(*args)

    def linear_split(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        parts, bias = self.triton.linear_split(*args)
        self.parts.append(parts.shape[0])
        return parts, bias


@interpreted
@pytest.mark.parametrize("variant", ["lite", "v2"])
def test_tiny_models_with_the_kernel_match_transformers(
    variant: str, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """test_deepseek_v2's packed prompt chunks and decodes, V2-Lite's shape (no q LoRA: q and
    kv strided views of one GEMM output) and V2's (q LoRA), through the kernel: the logits of
    transformers within test_deepseek_v2's tolerance."""
    pytest.importorskip("transformers")
    from test_deepseek_v2 import RTOL, hf_model
    from test_engine import PROMPTS
    from test_models import Runner, check_steps, saved

    ops = KernelOnly()
    monkeypatch.setattr(model_interfaces, "_reference_ops", lambda: ops)
    path, ref = saved(hf_model(variant), tmp_path_factory, variant)
    runner = Runner(path, 4)
    full = {"a": PROMPTS[0], "b": PROMPTS[3][:22]}
    schedule = [[("a", 0, 11), ("b", 0, 21)], [("a", 11, 12), ("b", 21, 22)]]
    check_steps(runner, ref, full, schedule, RTOL)
    assert ops.calls == 2 * 3  # two steps, three layers
    if variant == "lite":  # qkv_a_proj through linear_split: the decode step's in parts
        assert len(ops.parts) == 2 * 3 and max(ops.parts) > 1
    else:
        assert not ops.parts  # q LoRA: qkv_a_proj whole


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("tokens", [1, 2, 3, 64, 1000])
@pytest.mark.parametrize("q_lora", [None, 1536])
def test_gpu_kernel_matches_torch_at_v2_lite_widths(tokens: int, q_lora: int | None) -> None:
    """bf16 on the GPU (round to nearest): within an ulp of the reference (two in the latent);
    without q LoRA also on 4 K-slice parts of the GEMM."""
    cuda = torch.device("cuda")
    check_against_torch(tokens, (16, 128, 64, 512), q_lora, torch.bfloat16, cuda, seed=tokens)
    if q_lora is None:
        check_against_torch(
            tokens, (16, 128, 64, 512), None, torch.bfloat16, cuda, seed=tokens, parts=4
        )


@pytest.mark.gpu
@on_gpu
def test_gpu_kernel_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed on new values (the positions and both inputs rewritten in
    place): the reference's result each time."""
    device = torch.device("cuda")
    args = inputs(2, 16, 128, 64, 512, None, torch.bfloat16, device, seed=5)
    ops = TritonOps()
    run(ops, args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out, k_out = run(ops, args)
    fresh = inputs(2, 16, 128, 64, 512, None, torch.bfloat16, device, seed=6)
    for static, new in zip(args[:4], fresh[:4], strict=True):
        static.copy_(new)
    graph.replay()
    q_ref, k_ref = run(TorchOps(), fresh)
    assert ulps(q_out, q_ref) <= 1.0 and ulps(k_out, k_ref) <= 2.0
