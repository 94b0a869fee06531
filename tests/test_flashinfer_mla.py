"""FlashInferAttention's MLA layers (inferx_kernels_cuda.flashinfer_mla): what start-up refuses,
the layout and arguments FlashInfer's MLA wrapper is planned and run with, mixed steps (decode
rows through the wrapper, prompt rows through the Triton MLA prefill) and the CUDA-graph life
cycle, against a torch stand-in for FlashInfer on the CPU; on the GPU (pytest -m gpu) the MLA
conformance suite for the flashinfer and triton backends against TorchAttention and the
float64 plain form, captured decodes replayed, and a tiny DeepSeek-V2 generating like the
torch backend."""

from __future__ import annotations

import types

import pytest
import torch
from conftest import (
    begin_spans,
    beside_reference,
    interpreted,
    on_gpu,
    replay_decodes,
    scattered_tables,
)
from gpu_attention import capture, recorded_runs, replay
from test_flashinfer_attention import (
    GPU_PLANS,
    SMALL_PLANS,
    FakeDecode,
    FakePrefill,
    flashinfer_module,
    plan_info,
)

from inferx_core.attention_torch import TorchAttention, mla_plain
from inferx_core.batch import make_attention_batch
from inferx_core.interfaces.attention import MLAWeights
from inferx_core.interfaces.kv import KVLayerSpec

CPU = torch.device("cpu")
RANK, ROPE = 512, 64
# Largest |a - b| over the largest |b|: fp16 and bf16 round q, the probabilities and the
# latent-space output (as test_mla_decode and test_mla_prefill hold the Triton kernels).
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def mla_spec(heads: int, dtype: str = "auto", rank: int = RANK, rope: int = ROPE) -> KVLayerSpec:
    return KVLayerSpec(
        heads, 1, rank + rope, kind="mla", v_head_dim=rank, rope_dim=rope, dtype=dtype
    )


# -- a torch stand-in for FlashInfer's MLA wrapper ----------------------------------------------


class FakeMLA:
    """BatchMLAPagedAttentionWrapper of FlashInfer 0.6.14 as its docstrings and its C++ launcher
    (csrc/batch_mla_run.cu) describe it, computed in torch: plan() reads int32 host offsets
    and lengths and keeps the page indices (in CUDA-graph mode it copies all four into the
    caller's buffers and the batch size is fixed); run() takes q_nope [n, H, ckv] and q_pe
    [n, H, kpe] and the caches [pages, page_size, ckv] / [pages, page_size, kpe] with any
    token, head and page strides but a contiguous last dim, 16-byte aligned, and attends from
    whatever the buffers hold when it runs."""

    created: list[FakeMLA] = []

    def __init__(
        self,
        workspace: torch.Tensor,
        use_cuda_graph: bool = False,
        qo_indptr: torch.Tensor | None = None,
        kv_indptr: torch.Tensor | None = None,
        kv_indices: torch.Tensor | None = None,
        kv_len_arr: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        self.graph = use_cuda_graph
        self.backend = backend
        self.buffers = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        if use_cuda_graph:
            assert all(b is not None for b in self.buffers), "CUDA-graph mode needs buffers"
            assert len(qo_indptr) == len(kv_indptr) == len(kv_len_arr) + 1
        self.plans: list[dict] = []
        self.runs: list[dict] = []
        FakeMLA.created.append(self)

    def plan(
        self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
        head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type,
    ) -> None:  # fmt: skip
        for t in (qo_indptr, kv_indptr, kv_len_arr):
            assert t.dtype == torch.int32 and t.device == CPU, "int32 host tensors"
        assert kv_indices.dtype == torch.int32
        assert len(kv_indices) >= int(kv_indptr[-1])
        pages = (kv_indptr[1:] - kv_indptr[:-1]).long()
        assert bool(
            ((kv_len_arr > (pages - 1) * page_size) & (kv_len_arr <= pages * page_size)).all()
        )
        assert q_data_type in (torch.float16, torch.bfloat16) and kv_data_type == q_data_type
        if self.graph:
            q_buf, kv_buf, idx_buf, len_buf = self.buffers
            assert len(kv_len_arr) == len(len_buf), "CUDA-graph mode fixes the batch size"
            q_buf.copy_(qo_indptr)
            kv_buf.copy_(kv_indptr)
            idx_buf[: len(kv_indices)].copy_(kv_indices)
            len_buf.copy_(kv_len_arr)
        else:
            self.buffers = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        self.plans.append(
            dict(
                qo_indptr=qo_indptr.tolist(), kv_indptr=kv_indptr.tolist(),
                kv_indices=kv_indices[: int(kv_indptr[-1])].tolist(), kv_len=kv_len_arr.tolist(),
                num_heads=num_heads, head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe,
                page_size=page_size, causal=causal, sm_scale=sm_scale, dtype=q_data_type,
            )
        )  # fmt: skip

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None):
        p = self.plans[-1]
        heads, ckv, kpe, page_size = (
            p["num_heads"],
            p["head_dim_ckv"],
            p["head_dim_kpe"],
            p["page_size"],
        )
        n = q_nope.shape[0]
        assert q_nope.shape == (n, heads, ckv) and q_pe.shape == (n, heads, kpe)
        assert ckv_cache.shape[1:] == (page_size, ckv) and kpe_cache.shape[1:] == (page_size, kpe)
        assert ckv_cache.shape[0] == kpe_cache.shape[0]
        for t in (q_nope, q_pe, ckv_cache, kpe_cache, out):
            assert t.dtype == p["dtype"], "the planned dtypes"
            assert t.stride(-1) == 1 and t.data_ptr() % 16 == 0, "16-byte vector loads"
            assert all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
        assert out is not None and out.shape == q_nope.shape
        self.runs.append(dict(ckv=ckv_cache, kpe=kpe_cache, q_nope=q_nope, q_pe=q_pe, out=out))
        qo, kv_indptr, kv_indices, kv_len = (b.tolist() for b in self.buffers)
        rows = len(kv_len)
        assert qo[-1] == n
        for i in range(rows):
            pages = torch.tensor(kv_indices[kv_indptr[i] : kv_indptr[i + 1]], device=q_nope.device)
            c = kv_len[i]
            lat = ckv_cache[pages.long()].reshape(-1, ckv)[:c].float()
            pe = kpe_cache[pages.long()].reshape(-1, kpe)[:c].float()
            a, b = qo[i], qo[i + 1]
            scores = (
                torch.einsum("qhd,cd->qhc", q_nope[a:b].float(), lat)
                + torch.einsum("qhd,cd->qhc", q_pe[a:b].float(), pe)
            ) * p["sm_scale"]
            if p["causal"]:  # aligned to the end of the context
                pos = torch.arange(c - (b - a), c, device=q_nope.device)
                mask = torch.arange(c, device=q_nope.device)[None, :] <= pos[:, None]
                scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
            out[a:b] = torch.einsum("qhc,cd->qhd", scores.softmax(-1), lat).to(out.dtype)
        return out


FAKE = types.SimpleNamespace(
    BatchDecodeWithPagedKVCacheWrapper=FakeDecode,
    BatchPrefillWithPagedKVCacheWrapper=FakePrefill,
    BatchMLAPagedAttentionWrapper=FakeMLA,
)


def cpu_backend(layers, block_size, dtype, **kwargs):
    """FlashInferAttention on the CPU with the stand-in; its cache writes and the MLA prefill
    run Triton's kernels under the interpreter."""
    fa = flashinfer_module()

    class CpuFlashInfer(fa.FlashInferAttention):
        workspace_bytes = 1024

        def _load_flashinfer(self):
            return FAKE

    FakeMLA.created.clear()
    return CpuFlashInfer(layers, block_size, dtype, CPU, **kwargs)


# -- what start-up refuses ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "dtype", "kwargs", "error", "match"),
    [
        ([mla_spec(16, rank=256)], torch.bfloat16, {}, NotImplementedError, "kv_lora_rank 512"),
        ([mla_spec(16, rope=32)], torch.bfloat16, {}, NotImplementedError, "and 32"),
        ([mla_spec(16, dtype="fp8_e4m3")], torch.bfloat16, {}, NotImplementedError, "fp8"),
        ([mla_spec(16), mla_spec(8)], torch.float16, {}, NotImplementedError, "head counts"),
        ([mla_spec(16)], torch.float32, {}, NotImplementedError, "float32"),
    ],
)
def test_what_flashinfer_mla_cannot_run_is_refused(layers, dtype, kwargs, error, match) -> None:
    """Refused by name before FlashInfer is imported or anything touches the device."""
    fa = flashinfer_module()
    with pytest.raises(error, match=match):
        fa.FlashInferAttention(layers, 16, dtype, torch.device("cuda"), **kwargs)


def test_start_up_takes_mla_models_and_names_the_widths() -> None:
    """check_layers (what start-up asks before building) lets MLA through; widths FlashInfer's
    kernels lack are refused by the constructor, naming the backends that take them."""
    fa = flashinfer_module()
    fa.FlashInferAttention.check_layers([mla_spec(16)] * 3, model="DeepseekV2ForCausalLM")
    assert "mla" in fa.FlashInferAttention.features
    with pytest.raises(NotImplementedError, match="triton and torch backends take other"):
        fa.FlashInferAttention([mla_spec(4, rank=32, rope=8)], 16, torch.float16, CPU)


@interpreted
def test_mla_backend_argument() -> None:
    """mla_backend picks FlashInfer's MLA module (fa2 by default) for the eager wrapper and
    every captured size's."""
    layers = [mla_spec(4)]
    cpu_backend(layers, 4, torch.float16)
    assert [w.backend for w in FakeMLA.created] == ["fa2"]
    backend = cpu_backend(layers, 4, torch.float16, mla_backend="fa3")
    backend.init_graph_buffers(2, 2)
    backend.prepare_for_capture(2)
    assert [w.backend for w in FakeMLA.created] == ["fa3", "fa3"]
    with pytest.raises(ValueError, match="mla_backend must be one of fa2, fa3, auto"):
        cpu_backend(layers, 4, torch.float16, mla_backend="cutlass")


def test_mla_layout_from_paged_layout() -> None:
    """Each row's token count comes from its pages and its last page's length; one query a
    row."""
    fa = flashinfer_module()
    from inferx_kernels_cuda.flashinfer_mla import mla_layout

    paged = fa.paged_layout([1, 1, 1], [1, 16, 33], [[7], [3, 9], [6, 8, 2]], 16, padding_rows=2)
    layout = mla_layout(paged, 16)
    assert layout.qo_indptr.tolist() == [0, 1, 2, 3, 4, 5]
    assert layout.kv_indptr.tolist() == [0, 1, 2, 5, 6, 7]
    assert layout.kv_indices.tolist() == [7, 3, 6, 8, 2, 0, 0]
    assert layout.kv_len.tolist() == [1, 16, 33, 1, 1]
    assert all(t.dtype == torch.int32 for t in vars(layout).values())


# -- steps against TorchAttention and the float64 plain form -------------------------------------


class MLAModel:
    """Random MLA inputs for a plan's sequences: per layer a kv_b_proj and, per sequence, its
    cache rows (latent + rope key) and queries for every position."""

    def __init__(self, layers, nope: int, v: int, totals: list[int], dtype, device, scales):
        self.layers, self.nope, self.v, self.dtype = layers, nope, v, dtype
        self.scales = scales
        self.weights, self.rows, self.queries = [], [], []
        for spec in layers:
            heads = spec.num_q_heads
            w = (torch.randn(heads * (nope + v), RANK) / RANK**0.5).to(dtype).to(device)
            self.weights.append(w)
            self.rows.append([torch.randn(t, RANK + ROPE).to(dtype).to(device) for t in totals])
            self.queries.append(
                [torch.randn(t, heads, nope + ROPE).to(dtype).to(device) for t in totals]
            )

    def mla(self, layer: int, dtype=None) -> MLAWeights:
        heads = self.layers[layer].num_q_heads
        nope, v = self.nope, self.v
        w = self.weights[layer] if dtype is None else self.weights[layer].to(dtype)
        mla = MLAWeights(nope, v, lambda lat: (lat @ w.t()).view(-1, heads, nope + v))
        w3 = w.view(heads, nope + v, RANK)
        mla.w_uk, mla.w_uv = w3[:, :nope], w3[:, nope:]
        return mla

    def reference(self, layer: int, seq: int, a: int, b: int) -> torch.Tensor:
        """The float64 plain form of queries a..b of a sequence over its first b rows."""
        rows = self.rows[layer][seq][:b].double()  # on the inputs' device
        mask = (
            torch.arange(b, device=rows.device)[None, :]
            <= torch.arange(a, b, device=rows.device)[:, None]
        )
        return mla_plain(
            self.queries[layer][seq][a:b].double(),
            rows,
            self.mla(layer, torch.float64),
            self.scales[layer],
            mask,
        )


def check_mla_steps(
    backend, plan, nope: int, v: int, scale_factors=(1.3,), against=TorchAttention
) -> None:
    """Run a plan's steps (conftest.plan_steps) through `backend`'s MLA layers and through
    `against` (same device, scattered tables): every layer's output within TOL of each other
    and of the float64 plain form, the caches equal at the end."""
    layers, dtype, device = backend.layers, backend.dtype, backend.device
    tol = TOL[dtype]
    reference, totals, steps, tables = beside_reference(backend, against, plan)
    factors = [scale_factors[i % len(scale_factors)] for i in range(len(layers))]
    scales = [(nope + ROPE) ** -0.5 * f for f in factors]
    model = MLAModel(layers, nope, v, totals, dtype, device, scales)
    weights = [model.mla(i) for i in range(len(layers))]
    attns = [
        [b.layer(i, scales[i], mla=weights[i]) for i in range(len(layers))]
        for b in (backend, reference)
    ]
    for step, spans in enumerate(steps):
        live, query_lens = begin_spans([backend, reference], spans, tables)
        for layer in range(len(layers)):
            q = torch.cat([model.queries[layer][i][slice(*spans[i])] for i in live])
            k = torch.cat([model.rows[layer][i][slice(*spans[i])] for i in live])[:, None]
            got = backend.forward(attns[0][layer], q, k, k[..., :RANK])
            want = reference.forward(attns[1][layer], q, k, k[..., :RANK])
            assert got.shape == (sum(query_lens), layers[layer].num_q_heads, v)
            assert got.dtype == dtype
            dense = torch.cat([model.reference(layer, i, *spans[i]) for i in live])
            where = f"step {step}, layer {layer}, spans {spans}"
            for other, label in ((dense, "float64 plain form"), (want, against.__name__)):
                err = rel_err(got.cpu(), other.cpu())
                assert err <= tol, f"{where}: {err:.2e} against {label} (limit {tol:.0e})"
    for layer in range(len(layers)):
        assert torch.equal(backend.caches[layer].cpu(), reference.caches[layer].cpu()), layer


@interpreted
@pytest.mark.parametrize(
    ("block_size", "heads", "nope", "dtype"),
    [(4, 4, 16, torch.float16), (16, 3, 12, torch.bfloat16)],  # nope 12: q_pe off 16 bytes
)
def test_steps_run_mla_decodes_through_flashinfer(block_size, heads, nope, dtype) -> None:
    """Prefill-only, mixed (fresh prompts, chunks over cached prefixes, decodes, one-token
    prompts) and decode-only steps of two MLA layers: outputs equal TorchAttention's and the
    float64 plain form when FlashInfer computes what its docs say; a second scale is folded
    into the query."""
    torch.manual_seed(block_size + heads)
    layers = [mla_spec(heads), mla_spec(heads)]
    backend = cpu_backend(layers, block_size, dtype)
    for plan in SMALL_PLANS:
        check_mla_steps(backend, plan, nope, 12, scale_factors=(1.3, 0.8))


@interpreted
def test_plan_and_run_arguments() -> None:
    """A mixed step plans the wrapper over its decode rows alone (one query each, their
    contexts and pages, non-causal, the layer's scale, DeepSeek's widths), the prompt rows go to
    the Triton prefill; run() reads the latent and rope columns as views of the cache rows
    (no copy); a decode-only step plans every row."""
    torch.manual_seed(0)
    bs, heads, nope, v = 4, 2, 16, 8
    layers = [mla_spec(heads)]
    backend = cpu_backend(layers, bs, torch.float16)
    backend.allocate(16)
    (wrapper,) = FakeMLA.created
    model = MLAModel(layers, nope, v, [9, 6, 3], torch.float16, CPU, [0.3])
    attn = backend.layer(0, 0.3, mla=model.mla(0))
    tables = [[5, 2, 9], [7, 1], [3]]
    # sequence 0 decodes its 9th token, 1 is a fresh 6-token prompt, 2 decodes its 3rd
    batch = make_attention_batch([1, 6, 1], [9, 6, 3], tables, bs)
    backend.begin_step(batch)
    plan = wrapper.plans[-1]
    assert plan == dict(
        qo_indptr=[0, 1, 2], kv_indptr=[0, 3, 4], kv_indices=[5, 2, 9, 3], kv_len=[9, 3],
        num_heads=heads, head_dim_ckv=RANK, head_dim_kpe=ROPE, page_size=bs, causal=False,
        sm_scale=0.3, dtype=torch.float16,
    )  # fmt: skip
    step = backend._mla._step
    assert step.decode_at.tolist() == [0, 7] and step.prefill is not None
    q = torch.randn(8, heads, nope + ROPE).to(torch.float16)
    k = torch.randn(8, 1, RANK + ROPE).to(torch.float16)
    out = backend.forward(attn, q, k, k[..., :RANK])
    assert out.shape == (8, heads, v) and not out.isnan().any()
    run = wrapper.runs[-1]
    cache = backend.caches[0]
    assert run["ckv"].data_ptr() == cache.data_ptr()
    assert run["kpe"].data_ptr() == cache.data_ptr() + RANK * cache.element_size()
    assert run["ckv"].stride() == run["kpe"].stride()[:2] + (1,) == (bs * 576, 576, 1)
    assert run["q_nope"].shape == (2, heads, RANK)

    backend.begin_step(make_attention_batch([1, 1], [10, 4], [[5, 2, 9], [3]], bs))
    assert wrapper.plans[-1]["kv_len"] == [10, 4] and wrapper.plans[-1]["qo_indptr"] == [0, 1, 2]
    assert backend._mla._step.decode_at is None and backend._mla._step.prefill is None
    # an empty step plans nothing and runs nothing
    runs = len(wrapper.runs)
    backend.begin_step(make_attention_batch([], [], [], bs))
    empty = torch.zeros(0, heads, nope + ROPE, dtype=torch.float16)
    assert backend.forward(attn, empty, k[:0], k[:0, :, :RANK]).shape == (0, heads, v)
    assert len(wrapper.runs) == runs


@interpreted
def test_graph_life_cycle_replans_static_buffers() -> None:
    """prepare_for_capture builds one CUDA-graph MLA wrapper per size over prefixes of the
    static buffers; each replay re-plans that size's wrapper, so the same forward() serves new
    contexts; padding rows (garbage inputs) write nothing, so caches end equal to eager ones."""
    torch.manual_seed(3)
    dtype, bs, heads, nope, v = torch.float16, 4, 4, 16, 8
    layers = [mla_spec(heads), mla_spec(heads)]
    max_blocks = 48 // bs
    num_blocks = 4 * max_blocks + 1
    static = cpu_backend(layers, bs, dtype)
    eager = cpu_backend(layers, bs, dtype)
    reference = TorchAttention(layers, bs, dtype, CPU)
    for b in (static, eager, reference):
        b.allocate(num_blocks)
        for cache in b.caches:
            torch.manual_seed(1)
            cache.copy_(torch.randn(cache.shape).to(dtype))
    model = MLAModel(layers, nope, v, [1], dtype, CPU, [0.2, 0.2])
    weights = [model.mla(i) for i in range(2)]
    attns = [
        [b.layer(i, 0.2, mla=weights[i]) for i in range(2)] for b in (static, eager, reference)
    ]
    static.init_graph_buffers(8, max_blocks)
    mla = static._mla
    for size in (4, 2):
        static.prepare_for_capture(size)
    graphs = mla._buffers.graphs
    assert sorted(graphs) == [2, 4] and all(w.graph for w in graphs.values())
    assert [len(b) for b in graphs[2].buffers] == [3, 3, 8 * max_blocks, 2]
    assert graphs[4].buffers[2].data_ptr() == graphs[2].buffers[2].data_ptr()  # shared
    assert graphs[4].plans[-1]["kv_len"] == [1] * 4  # padding rows: a token of block 0

    for contexts, size in (([37, 5, 48, 20], 4), ([1, 30], 4), ([47], 2), ([9, 2], 2)):
        n = len(contexts)
        replay_decodes(static, [eager, reference], contexts, size, num_blocks)
        assert mla._step.wrapper is graphs[size]
        assert graphs[size].plans[-1]["kv_len"] == contexts + [1] * (size - n)
        for layer in range(2):
            q = torch.randn(size, heads, nope + ROPE).to(dtype)
            k = torch.randn(size, 1, RANK + ROPE).to(dtype)
            got = static.forward(attns[0][layer], q, k, k[..., :RANK])[:n]
            want = eager.forward(attns[1][layer], q[:n], k[:n], k[:n, :, :RANK])
            ref = reference.forward(attns[2][layer], q[:n], k[:n], k[:n, :, :RANK])
            for other, label in ((want, "eager"), (ref, "torch")):
                err = rel_err(got, other)
                assert err <= TOL[dtype], f"contexts {contexts}, layer {layer}: {err:.2e} {label}"
        for layer in range(2):
            assert torch.equal(static.caches[layer], eager.caches[layer]), (contexts, layer)


@interpreted
def test_graph_life_cycle_checks_its_inputs() -> None:
    backend = cpu_backend([mla_spec(2)], 4, torch.float16)
    backend.allocate(8)
    with pytest.raises(RuntimeError, match="init_graph_buffers"):
        backend.prepare_for_capture(1)
    backend.init_graph_buffers(4, 2)
    decode = make_attention_batch([1], [3], [[1]], 4)
    with pytest.raises(RuntimeError, match=r"prepare_for_capture\(2\)"):
        backend.prepare_for_replay(decode, 2)
    backend.prepare_for_capture(2)
    backend.prepare_for_replay(decode, 2)


# -- on the GPU ---------------------------------------------------------------------------------


@pytest.fixture
def flashinfer():
    """FlashInfer itself; GPU tests skip (not fail) where it is not installed."""
    return pytest.importorskip("flashinfer", reason="FlashInfer is not installed")


def gpu_backend(name: str, layers, block_size: int, dtype=torch.bfloat16, **kwargs):
    if name == "flashinfer":
        from inferx_kernels_cuda.flashinfer_attention import FlashInferAttention as cls
    else:
        from inferx_kernels_cuda.triton_attention import TritonAttention as cls
    return cls(layers, block_size, dtype, torch.device("cuda"), **kwargs)


# V2-Lite's MLA widths: 16 heads, nope 128, rope 64, v 128, latent 512
V2_LITE = dict(heads=16, nope=128, v=128)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize(
    ("backend", "kwargs"),
    [("flashinfer", {}), ("flashinfer", {"mla_backend": "fa3"}), ("triton", {})],
)
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_mla_conformance_bf16(backend: str, kwargs: dict, block_size: int):
    """The conformance plans (test_flashinfer_attention.GPU_PLANS: contexts up to 2049 tokens,
    ragged prefills, a mixed step of fresh prompts, chunks over cached prefixes, decodes and
    one-token prompts, two decode-only steps) through two MLA layers of V2-Lite's widths, bf16,
    against TorchAttention and the float64 plain form (2e-2 of the largest element); the
    triton backend under the same suite."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer", reason="FlashInfer is not installed")
    torch.manual_seed(block_size)
    layers = [mla_spec(V2_LITE["heads"])] * 2
    b = gpu_backend(backend, layers, block_size, **kwargs)
    for plan in GPU_PLANS:
        check_mla_steps(b, plan, V2_LITE["nope"], V2_LITE["v"], scale_factors=(1.3, 0.9))


@pytest.mark.gpu
@on_gpu
def test_gpu_captured_mla_decode_serves_new_contexts(flashinfer) -> None:
    """A decode step of two MLA layers captured per batch size through the backend's graph
    hooks, replayed for new contexts from 1 to 2048 tokens and fewer real rows than captured:
    outputs equal eager FlashInfer (2e-2) and TorchAttention, padding rows write nothing, and
    FlashInfer's plan info (its grid and workspace offsets, baked into the graph) is the same
    at every replay as at capture."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    bs, max_ctx = 16, 2048
    heads, nope, v = V2_LITE["heads"], V2_LITE["nope"], V2_LITE["v"]
    max_blocks = max_ctx // bs
    sizes = [1, 4, 16]
    num_blocks = sizes[-1] * max_blocks + 1
    layers = [mla_spec(heads)] * 2
    graphed = gpu_backend("flashinfer", layers, bs)
    eager = gpu_backend("flashinfer", layers, bs)
    reference = TorchAttention(layers, bs, dtype, dev)
    for b in (graphed, eager, reference):
        b.allocate(num_blocks)
        for cache in b.caches:
            torch.manual_seed(1)
            cache.copy_(torch.randn(cache.shape, device=dev).to(dtype))
    scale = (nope + ROPE) ** -0.5
    model = MLAModel(layers, nope, v, [1], dtype, dev, [scale] * 2)
    weights = [model.mla(i) for i in range(2)]
    attns = [
        [b.layer(i, scale, mla=weights[i]) for i in range(2)] for b in (graphed, eager, reference)
    ]
    graphed.init_graph_buffers(sizes[-1], max_blocks)
    captured = {}
    for size in reversed(sizes):
        q = [torch.zeros(size, heads, nope + ROPE, dtype=dtype, device=dev) for _ in range(2)]
        k = [torch.zeros(size, 1, RANK + ROPE, dtype=dtype, device=dev) for _ in range(2)]

        def step(q=q, k=k) -> list[torch.Tensor]:
            return [graphed.forward(attns[0][i], q[i], k[i], k[i][..., :RANK]) for i in range(2)]

        graph, outs = capture(graphed, size, step)
        captured[size] = (graph, q, k, outs, plan_info(graphed._mla._buffers.graphs[size]))

    cases = [([1, 1000, 2048], 4), ([64, 65, 2047, 7], 4), ([2048], 1), ([5], 4), ([1], 1)]
    cases.append(([int(x) for x in torch.randint(1, max_ctx + 1, (13,))], 16))
    for contexts, size in cases:
        graph, q, k, outs, info = captured[size]
        n = len(contexts)
        tables = scattered_tables(contexts, bs, num_blocks)
        graphed.prepare_for_replay(make_attention_batch([1] * n, contexts, tables, bs), size)
        now = plan_info(graphed._mla._buffers.graphs[size])
        assert now == info, f"size {size}, contexts {contexts}: plan {now}, captured {info}"
        replay(graph, [q, k], [eager, reference], contexts, tables, bs)
        for i in range(2):
            real = (q[i][:n], k[i][:n], k[i][:n, :, :RANK])
            for b, attn, label in (
                (eager, attns[1][i], "eager"),
                (reference, attns[2][i], "torch"),
            ):
                err = rel_err(outs[i][:n], b.forward(attn, *real))
                assert err <= TOL[dtype], (
                    f"size {size}, contexts {contexts}, layer {i}: {err:.2e} vs {label}"
                )
        torch.cuda.synchronize()
        for i in range(2):
            assert torch.equal(graphed.caches[i], eager.caches[i]), (size, contexts, i)


def tiny_deepseek(tmp_path_factory, heads: int = 16, hidden: int = 256, nope: int = 32):
    """test_deepseek_v2's tiny V2-Lite (no q LoRA, YaRN, greedy routing) widened to the latent
    and rope widths FlashInfer's MLA kernels take: kv_lora_rank 512, rope 64."""
    from test_deepseek_v2 import COMMON, VARIANTS

    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV2Config(
        **(COMMON | {"hidden_size": hidden, "num_attention_heads": heads, "qk_nope_head_dim": nope,
                     "qk_rope_head_dim": ROPE, "v_head_dim": nope, "kv_lora_rank": RANK}),
        **VARIANTS["lite"],
    )  # fmt: skip
    config.architectures = ["DeepseekV2ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.7, 1.3)
            else:
                p.normal_(0, 0.05)
    path = tmp_path_factory.mktemp("deepseek-512")
    model.save_pretrained(path)
    return path


@interpreted
def test_engine_serves_deepseek_on_flashinfer(tmp_path_factory, monkeypatch) -> None:
    """A tiny DeepSeek-V2 of FlashInfer's widths through the engine with attention_backend
    "flashinfer" on the CPU (the stand-in for FlashInfer), bf16: the model's layers bring their
    scale to the MLA plans, prompt chunks of 7 beside decodes (mixed steps) and a prefix-cache
    hit give the torch backend's greedy tokens in the top-5 sense; the decode graph runner's
    static buffers (capture and replay hooks, padding rows) generate like eager steps."""
    from test_cuda_graphs import LogitsRecorder, compare_runs, generates_like_eager
    from test_deepseek_v2 import make_llm

    from inferx_core.sequence import SamplingParams
    from inferx_kernels_cuda.cuda_graphs import DecodeGraphRunner

    fa = flashinfer_module()
    monkeypatch.setattr(fa.FlashInferAttention, "_load_flashinfer", lambda self: FAKE)
    monkeypatch.setattr(fa.FlashInferAttention, "workspace_bytes", 1024)
    path = tiny_deepseek(tmp_path_factory, heads=4, hidden=64, nope=16)
    common = list(range(3, 30))
    prompts = [common + [5, 6], [5, 9, 17, 33, 65], common + [40, 41, 42, 43]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
    config = {
        "model.dtype": "bfloat16",
        "scheduler.prefill_chunk": 7,
        "scheduler.max_running": 4,
        "kv_cache.block_size": 4,
        "scheduler.prefix_cache": True,
    }
    runs = {}
    for backend in ("torch", "flashinfer"):
        llm = make_llm(path, **config, **{"engine.attention_backend": backend})
        ex = llm.engine.executor
        recorder = ex.sampler = LogitsRecorder(ex.sampler)
        done = llm.generate(prompts[:2], params) + llm.generate(prompts[2:], params)
        runs[backend] = (done, recorder.take())
        if backend == "flashinfer":
            assert type(ex.attention).__name__ == "FlashInferAttention"
            assert ex.attention._mla.scale == ex.model.model.layers[0].self_attn.attn.scale
            assert llm.engine.scheduler.stats().prefix_hits > 0
    (fi, fi_steps), (ref, ref_steps) = runs["flashinfer"], runs["torch"]
    # tokens equal or a near tie, logits within 5e-2 of the largest on every step before
    problems = compare_runs("flashinfer vs torch", fi, ref, fi_steps, ref_steps, "bfloat16")
    assert not problems, "\n".join(problems)

    config |= {"scheduler.prefix_cache": False, "engine.attention_backend": "flashinfer"}
    llm = make_llm(path, **config)
    ex = llm.engine.executor

    def install() -> None:
        ex.graphs = DecodeGraphRunner(
            ex.model, ex.attention, ex.device, 4, ex.max_model_len, ex.block_size
        )

    generates_like_eager(llm, install)
    assert ex.graphs.replays and set(ex.graphs.replays) <= set(ex.attention._mla._buffers.graphs)


@pytest.mark.gpu
@on_gpu
def test_gpu_tiny_deepseek_generates_like_torch(flashinfer, tmp_path_factory) -> None:
    """Greedy generation, bf16, 64 tokens: attention_backend "flashinfer" (with CUDA graphs
    and without) against "torch": tokens equal or diverging only at a near tie (each side's
    token in the other's top 5, within 0.15 nats), logits within 5e-2 of the largest on every
    step before (test_cuda_graphs.compare_runs); prompts chunked over 32 tokens beside decodes
    (mixed steps: decodes through FlashInfer, chunks through the Triton prefill) and prompts
    that hit the prefix cache."""
    from test_cuda_graphs import compare_runs
    from test_engine import PROMPTS

    from inferx_core.engine import LLM
    from inferx_core.sequence import SamplingParams

    path = tiny_deepseek(tmp_path_factory)
    common = [3 + (7 * i) % 250 for i in range(100)]
    batches = [[PROMPTS[0], PROMPTS[1], common + [5, 6]], [common + [9] * 20, common[:70]]]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=5)
    overrides = {
        "kv_cache.memory": "1GiB",
        "scheduler.max_running": 8,
        "scheduler.prefill_chunk": 32,
        "scheduler.prefix_cache": True,
    }

    def check(llm: LLM) -> None:
        assert type(llm.engine.executor.attention).__name__ == "FlashInferAttention"
        assert llm.engine.scheduler.stats().prefix_hits > 0

    runs = {}
    for backend, graphs in (("torch", False), ("flashinfer", True), ("flashinfer", False)):
        runs[(backend, graphs)] = recorded_runs(
            path,
            backend,
            graphs,
            overrides,
            [(b, params) for b in batches],
            check if backend == "flashinfer" else lambda llm: None,
        )
    problems = []
    for key in (("flashinfer", True), ("flashinfer", False)):
        for n, ((a, a_steps), (b, b_steps)) in enumerate(
            zip(runs[key], runs[("torch", False)], strict=True)
        ):
            assert all(len(c.token_ids) == 64 for c in a)
            name = f"tiny deepseek, flashinfer graphs {key[1]}, batch {n}"
            problems += compare_runs(name, a, b, a_steps, b_steps, "bfloat16")
    assert not problems, "\n".join(problems)
