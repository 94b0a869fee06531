"""DeepSeek-V2's MLA layers on the `triton` backend under TRITON_INTERPRET=1: the latent cache
written by mla_write_kernel, decodes through the Triton MLA decode kernel (split contexts),
prompt chunks through the Triton MLA prefill (fresh prompts over their own rows, chunks over
cached prefixes gathered, contexts in several passes); the tiny checkpoints of test_deepseek_v2
give transformers' greedy tokens under chunked prefill, prefix hits and decode, and the decode
and mixed graph runners' static buffers generate like eager. On a GPU: the V2-Lite-shaped dummy
in bf16 with CUDA graphs against transformers."""

from __future__ import annotations

import pytest
import torch
from conftest import interpreted

pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")

from test_deepseek_v2 import VARIANTS, hf_model  # noqa: E402
from test_engine import PROMPTS, generate, make_llm, reference  # noqa: E402
from test_models import CHUNKED_PREFILL, saved  # noqa: E402

from inferx_core.engine import LLM  # noqa: E402
from inferx_kernels_cuda import triton_attention  # noqa: E402
from inferx_kernels_cuda.mla_decode import write_latent  # noqa: E402
from inferx_kernels_cuda.triton_attention import TritonAttention  # noqa: E402

TRITON = {"engine.attention_backend": "triton"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """test_deepseek_v2's tiny V2 (q LoRA); V2-Lite's shape runs the prefix and graph tests (the
    interpreter makes each whole-model run minutes long on CI's two cores)."""
    assert "v2" in VARIANTS
    return saved(hf_model("v2"), tmp_path_factory, "v2")


@pytest.fixture(scope="module")
def lite(tmp_path_factory):
    return saved(hf_model("lite"), tmp_path_factory, "lite")


@pytest.fixture(scope="module")
def expected(checkpoint):
    return reference(checkpoint[1], PROMPTS)


def split_mla_decodes(llm: LLM) -> TritonAttention:
    """MLA decodes split their contexts in 32-token pieces (the kernel's tile) over up to 8
    programs a sequence: contexts past 32 tokens combine several splits, shorter ones leave
    empty splits."""
    attention = llm.engine.executor.attention
    assert isinstance(attention, TritonAttention)
    attention.mla_min_split_len = 16
    attention.mla_max_splits = 8
    attention.target_programs = 10**6
    return attention


@pytest.fixture
def prefill_plans(monkeypatch) -> list:
    """Every MLA prefill plan the triton backend makes (None for steps without prompt rows)."""
    plans: list = []
    plan = triton_attention.plan_prefill

    def recorded(*args, **kwargs):
        plans.append(plan(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(triton_attention, "plan_prefill", recorded)
    return plans


def gathered(plans: list) -> list:
    """The plans that gather contexts from the cache (a chunk over a cached prefix)."""
    return [p for p in plans if p is not None and p.passes[0].slots is not None]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_latent_write_skips_padding_slots(dtype: torch.dtype):
    """mla_write_kernel puts each row at its slot, casts to the cache's dtype, and writes
    nothing for slot -1 (a graph's padding rows)."""
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(6, 4, 1, 40, generator=g).to(dtype)
    rows = torch.randn(5, 40, generator=g)
    slots = torch.tensor([7, -1, 0, 23, -1])
    want = cache.clone().view(-1, 40)
    keep = slots >= 0
    want[slots[keep]] = rows[keep].to(dtype)
    write_latent(rows, cache, slots)
    assert torch.equal(cache.view(-1, 40), want)


@interpreted
def test_triton_chunked_prefill_and_split_decodes_equal_transformers(
    checkpoint, expected, prefill_plans
):
    """Prompt chunks of 7 over cached prefixes packed with decodes (mixed eager steps: the
    decode rows gathered), contexts expanded at most 20 rows a pass, then decodes over split
    contexts: transformers' tokens."""
    llm = make_llm(checkpoint[0], **TRITON, **CHUNKED_PREFILL)
    split_mla_decodes(llm).mla_context_rows = 20
    assert generate(llm) == expected
    assert any(p.pieces for p in gathered(prefill_plans))


@interpreted
def test_triton_prefix_cache_hit_equals_transformers(lite, prefill_plans):
    path, model = lite
    first = list(range(3, 43)) + [50, 51, 52]
    second = list(range(3, 43)) + [90, 91]
    llm = make_llm(path, **TRITON, **{"kv_cache.block_size": 4})
    split_mla_decodes(llm)
    assert generate(llm, [first]) == reference(model, [first])
    assert generate(llm, [second]) == reference(model, [second])
    assert llm.engine.scheduler.stats().prefix_hits > 0
    assert gathered(prefill_plans)  # the second prompt's chunk over its cached prefix
    assert any(p is not None and p.passes[0].slots is None for p in prefill_plans)  # fresh


@interpreted
def test_triton_prefix_hit_replays_the_mixed_runner(lite, monkeypatch):
    """A prefix hit through the mixed runner's static buffers (on the CPU: no graph, the same
    padded pass): the second prompt shares 40 tokens (ten 4-token blocks) with the first, so
    its step is a 3-token chunk over a 40-token cached prefix, its rows plain and its prefix
    absorbed, merged by log-sum-exp; it replays (not declined), and both prompts give
    transformers' first greedy tokens (decodes through the decode runner)."""
    from inferx_core.sequence import SamplingParams
    from inferx_kernels_cuda.cuda_graphs import DecodeGraphRunner, MixedGraphRunner

    path, model = lite
    first = list(range(3, 43)) + [50, 51, 52]
    second = list(range(3, 43)) + [90, 91, 92]
    llm = make_llm(path, **TRITON, **{"kv_cache.block_size": 4})
    ex = llm.engine.executor
    attention = ex.attention
    attention.mla_prefix_rows = 4  # (the interpreter runs every absorbed row's programs)
    ex.graphs = DecodeGraphRunner(ex.model, attention, ex.device, 1, ex.max_model_len, 4)
    ex.mixed = MixedGraphRunner(ex.model, attention, ex.device, 8, 2, ex.max_model_len, 4)
    replayed: list[tuple[list[int], list[int]]] = []
    replay = attention.prepare_mixed_replay

    def recorded(batch, num_tokens: int) -> None:
        replayed.append((list(batch.query_lens), list(batch.context_lens)))
        replay(batch, num_tokens)

    monkeypatch.setattr(attention, "prepare_mixed_replay", recorded)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for prompt in (first, second):
        got = [c.token_ids for c in llm.generate([prompt], greedy)]
        assert got == [t[:6] for t in reference(model, [prompt])]
    assert llm.engine.scheduler.stats().prefix_hits > 0
    assert replayed == [([3], [43])] and not ex.mixed.declined, (replayed, ex.mixed.declined)


@interpreted
def test_triton_graph_runners_generate_like_eager(lite, monkeypatch):
    """The decode and mixed graph runners' static buffers on the CPU without graphs (block
    tables and context lengths of the padded batch, slot -1 on padding rows; the mixed steps'
    prompt tiles over the step's own rows): the eager steps' tokens and logits. 5-token chunks:
    a prompt's first chunk (a fresh prompt) and its later chunks (over a cached prefix: its own
    rows plain, the prefix absorbed) beside decodes replay the mixed runner; none is declined.
    (Prefix cache off: the eager run's blocks would turn the second run's prompts into hits,
    other steps than the eager run's; test_triton_prefix_hit_replays_the_mixed_runner has
    those.)"""
    from test_cuda_graphs import generates_like_eager

    from inferx_kernels_cuda.cuda_graphs import DecodeGraphRunner, MixedGraphRunner

    config = {**TRITON, "scheduler.max_running": 4, "scheduler.prefill_chunk": 5}
    llm = make_llm(lite[0], **config, **{"scheduler.prefix_cache": False})
    attention = split_mla_decodes(llm)
    ex = llm.engine.executor
    assert attention.supports_mixed_graphs and ex.graphs is None and ex.mixed is None
    bs = ex.block_size
    replayed: list[tuple[list[int], list[int]]] = []
    replay = attention.prepare_mixed_replay

    def recorded(batch, num_tokens: int) -> None:
        replayed.append((list(batch.query_lens), list(batch.context_lens)))
        replay(batch, num_tokens)

    monkeypatch.setattr(attention, "prepare_mixed_replay", recorded)

    def install() -> None:
        ex.graphs = DecodeGraphRunner(ex.model, attention, ex.device, 4, ex.max_model_len, bs)
        ex.mixed = MixedGraphRunner(ex.model, attention, ex.device, 16, 4, ex.max_model_len, bs)

    generates_like_eager(llm, install)
    assert ex.graphs.replays and ex.mixed.replays and not ex.mixed.declined
    over_prefix = [s for s in replayed if any(1 < q < c for q, c in zip(*s, strict=True))]
    assert len(over_prefix) >= 3, replayed


@interpreted
def test_triton_kernels_with_fused_shared_experts_equal_transformers(lite):
    """engine.kernels triton (TritonOps) builds V2-Lite's MoE layers with the shared experts as
    slots 8 and 9 of the routed experts (fuse_shared_experts, its default): topk_softmax
    appends them and the grouped GEMMs run them; greedy tokens are transformers'."""
    path, model = lite
    prompts = [PROMPTS[1], PROMPTS[2]]
    llm = make_llm(path, **TRITON, **{"engine.kernels": "triton"})
    moe = [layer.mlp for layer in llm.engine.executor.model.model.layers[1:]]
    assert all(m.shared is None and m.experts.spec.shared == 2 for m in moe)
    assert generate(llm, prompts) == reference(model, prompts)


@pytest.mark.gpu
def test_dummy_v2_lite_on_triton_with_graphs_matches_transformers(tmp_path):
    """test_deepseek_v2's GPU check on the triton backend with CUDA graphs: V2-Lite's shapes
    (4 layers), random weights, bf16, four prompts (one of 300 tokens), 64 tokens each: equal
    to transformers until the first divergence, there each side's token in the other's
    top-5. The triton kernel ops run the shared experts as expert slots (their default)."""
    from test_deepseek_v2 import dummy_v2_lite_matches_transformers

    llm = dummy_v2_lite_matches_transformers(tmp_path, "triton", cuda_graphs=True)
    ex = llm.engine.executor
    moe = [layer.mlp for layer in ex.model.model.layers[1:]]
    assert all(m.shared is None and m.experts.spec.shared == 2 for m in moe)
    assert ex.graphs is not None and ex.mixed is not None
    assert ex.graphs.replays and ex.mixed.replays  # the four fresh prompts in one step
