"""End to end on the CPU: greedy generation equals transformers' generate, token for token —
batched, with chunked prefill, with the prefix cache warm, and after preemption."""

from __future__ import annotations

import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")

from inferx_core.config import ConfigError, load_config  # noqa: E402
from inferx_core.engine import LLM  # noqa: E402
from inferx_core.sequence import SamplingParams  # noqa: E402

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def tiny_config(arch: str) -> transformers.PretrainedConfig:
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        return transformers.LlamaConfig(
            **common,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    return transformers.Qwen2Config(**common, rope_theta=10000.0, tie_word_embeddings=True)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    cfg = tiny_config(request.param)
    model_cls = (
        transformers.LlamaForCausalLM if request.param == "llama" else transformers.Qwen2ForCausalLM
    )
    model = model_cls(cfg).eval()
    # Larger weights than the default init so that logits are far apart and greedy is stable.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path, model


PROMPTS = [
    list(range(3, 40)),
    [5, 9, 17, 33, 65, 129, 200],
    [7] * 3,
    list(range(100, 180)),
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
]


def reference(model, prompts):
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def make_llm(path, **overrides):
    base = {"model.path": str(path), "model.dtype": "float32", "engine.device": "cpu"}
    return LLM(load_config(None, {**base, **overrides}))


@pytest.fixture(scope="module")
def expected(checkpoint):
    path, model = checkpoint
    return reference(model, PROMPTS)


def generate(llm, prompts=PROMPTS):
    return [c.token_ids for c in llm.generate(prompts, GREEDY)]


def test_batched_greedy_equals_transformers(checkpoint, expected):
    llm = make_llm(checkpoint[0])
    assert generate(llm) == expected


def test_generate_keeps_no_object_a_token(checkpoint):
    """LLM.generate keeps each request's outputs as flat lists, so the objects Python's full
    collections walk stay level while tokens accrue (keeping every RequestOutput added two a
    request a step: 8 a step here)."""
    llm = make_llm(checkpoint[0])
    counts = []
    step = llm.engine.step

    def counted():
        gc.collect()
        counts.append(len(gc.get_objects()))
        return step()

    llm.engine.step = counted
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    done = llm.generate([list(range(3, 40))] * 4, params)
    assert [len(c.token_ids) for c in done] == [64] * 4
    assert len(counts) >= 64
    assert counts[-1] - counts[4] < 60, counts[4:]


def test_chunked_prefill_equals_transformers(checkpoint, expected):
    llm = make_llm(
        checkpoint[0],
        **{
            "scheduler.prefill_chunk": 7,
            "scheduler.max_batched_tokens": 16,
            "scheduler.max_running": 4,
            "kv_cache.block_size": 4,
        },
    )
    assert generate(llm) == expected


def test_warm_prefix_cache_equals_transformers(checkpoint, expected):
    llm = make_llm(checkpoint[0], **{"kv_cache.block_size": 4})
    assert generate(llm) == expected
    again = generate(llm)
    stats = llm.engine.scheduler.stats()
    assert stats.prefix_hits > 0, "second pass should reuse cached prefix blocks"
    assert again == expected


def test_preemption_equals_transformers(checkpoint, expected):
    # 20 blocks of 4 tokens cannot hold all five sequences at once: some are preempted.
    llm = make_llm(
        checkpoint[0],
        **{"kv_cache.block_size": 4, "kv_cache.num_blocks": 40, "scheduler.prefix_cache": False},
    )
    assert generate(llm) == expected
    assert llm.engine.scheduler.stats().preemptions > 0


def test_stream_equals_one_shot(checkpoint, expected):
    llm = make_llm(checkpoint[0])
    got = [t for out in llm.stream(PROMPTS[0], GREEDY) for t in out.token_ids]
    assert got == expected[0]


def test_every_block_is_free_afterwards(checkpoint):
    llm = make_llm(checkpoint[0], **{"scheduler.prefix_cache": False})
    generate(llm)
    kv = llm.engine.kv
    assert kv.usage() == 0.0


def test_prompt_longer_than_context_is_refused(checkpoint):
    llm = make_llm(checkpoint[0], **{"model.max_model_len": 64})
    with pytest.raises(ValueError, match="context of 64 tokens"):
        llm.generate([list(range(3, 60))], SamplingParams(max_tokens=16))


def test_context_past_the_checkpoints_positions_is_a_config_error(checkpoint):
    """model.max_model_len above max_position_embeddings would index past the rotary table
    at the first long sequence (an IndexError mid-serving); it is refused at start-up."""
    limit = tiny_config("llama").max_position_embeddings
    with pytest.raises(ConfigError, match=rf"model.max_model_len: {limit + 1} .*\({limit}\)"):
        make_llm(checkpoint[0], **{"model.max_model_len": limit + 1})
    assert make_llm(checkpoint[0], **{"model.max_model_len": limit}).engine.max_model_len == limit


def test_a_bad_batch_is_refused_whole(checkpoint):
    """generate() with a bad prompt (or a params list of the wrong length) raises and leaves
    nothing of the call in the engine: the prompts before the bad one are not left running."""
    llm = make_llm(checkpoint[0])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([PROMPTS[0], []], GREEDY)
    with pytest.raises(ValueError, match="2 prompts and 1 SamplingParams"):
        llm.generate(PROMPTS[:2], [GREEDY])
    assert not llm.engine.has_work() and not llm.engine.requests
    assert llm.engine.kv.usage() == 0.0


def test_seeded_sampling_is_reproducible_across_batches(checkpoint):
    llm = make_llm(checkpoint[0])
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], params)[0].token_ids
    batched = llm.generate(PROMPTS, [params if i == 1 else GREEDY for i in range(5)])[1].token_ids
    assert alone == batched


def test_warm_up_steps_leave_generation_unchanged(checkpoint, expected):
    """The start-up warm-up (run on GPUs) writes into cache blocks nobody holds yet: greedy
    output after it still equals transformers'."""
    llm = make_llm(
        checkpoint[0],
        **{"kv_cache.block_size": 4, "model.max_model_len": 128, "engine.executor": "cuda"},
    )
    llm.engine.executor._warm_up()
    assert generate(llm) == expected


def test_warm_up_runs_the_backends_prompt_lengths(checkpoint, expected):
    """A backend's warm_up_prompt_lens (kernel variants of their own, from those lengths) each
    get one fresh-prompt step at start-up's warm-up, where a chunk that long can be scheduled;
    generation after it is unchanged."""
    overrides = {"model.max_model_len": 128, "scheduler.prefill_chunk": 64}
    llm = make_llm(checkpoint[0], **overrides, **{"engine.executor": "cuda"})
    executor = llm.engine.executor
    executor.attention.warm_up_prompt_lens = (40, 64, 65)  # 65: past the chunk, never fresh
    seen = []
    step = executor._profile_step

    def recording(query_lens, tables, rows, sample, context_lens=None):
        seen.append((list(query_lens), list(context_lens or query_lens)))
        return step(query_lens, tables, rows, sample, context_lens)

    executor._profile_step = recording
    executor._warm_up()
    assert ([40], [40]) in seen and ([64], [64]) in seen
    assert all(q != [65] for q, _ in seen)
    assert generate(llm) == expected


def test_eager_step_inputs_are_16_byte_aligned(checkpoint, expected):
    """The eager path packs ids, positions and sampled rows into one host tensor; each part must
    start 16-byte aligned whatever the token count (Triton compiles a kernel variant per pointer
    alignment: an odd count once compiled a new rotary variant in the middle of serving)."""
    llm = make_llm(checkpoint[0])
    model = llm.engine.executor.model
    seen = []
    forward = model.forward

    def recording(input_ids, positions):
        seen.append((input_ids.shape[0], input_ids.data_ptr() % 16, positions.data_ptr() % 16))
        return forward(input_ids, positions)

    model.forward = recording
    assert generate(llm) == expected
    assert any(n % 2 for n, _, _ in seen), "no step had an odd token count"
    assert all(a == 0 and b == 0 for _, a, b in seen), seen


def test_gemms_split_along_k_still_equal_transformers(checkpoint, expected, monkeypatch):
    """The model hands o_proj and down_proj outputs to the next norm as partial results; with
    every such GEMM split in 4 (as on a GPU at decode sizes, forced here on the CPU), greedy
    output still equals transformers'."""
    from inferx_core import quant_none

    def split(self, x):
        return quant_none.split_k_bmm(x, self.weight, 4)

    monkeypatch.setattr(quant_none.DenseLinear, "forward_parts", split)
    calls = []
    real = quant_none.split_k_bmm
    monkeypatch.setattr(quant_none, "split_k_bmm", lambda *a: calls.append(a[2]) or real(*a))
    assert generate(make_llm(checkpoint[0])) == expected
    assert calls and set(calls) == {4}


# -- a model with sliding-window layers (two KV groups) ------------------------------------------


@pytest.fixture(scope="module")
def sliding_checkpoint(tmp_path_factory):
    """Qwen2 with a window of 8 tokens on layers 1 and 2 (max_window_layers=1): layer 0 is one
    KV group, the sliding layers another."""
    torch.manual_seed(0)
    base = tiny_config("qwen2").to_dict()
    for key in ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"):
        base.pop(key, None)
    cfg = transformers.Qwen2Config(
        **{k: v for k, v in base.items() if k in tiny_config("qwen2").to_diff_dict()},
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    )
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp("qwen2-sliding")
    model.save_pretrained(path)
    return path, model, reference(model, PROMPTS)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "scheduler.prefill_chunk": 7,
            "scheduler.max_batched_tokens": 16,
            "scheduler.max_running": 4,
            "kv_cache.block_size": 4,
        },
        # 39 usable blocks: a request of 112 tokens needs 28 full and 5 sliding ones at once
        {"kv_cache.block_size": 4, "kv_cache.num_blocks": 40, "scheduler.prefill_chunk": 8},
    ],
    ids=["batched", "chunked", "preempted"],
)
def test_sliding_window_greedy_equals_transformers(sliding_checkpoint, overrides):
    path, _, expected = sliding_checkpoint
    assert max(map(len, PROMPTS)) > 8, "prompts longer than the window"
    llm = make_llm(path, **overrides)
    kv = llm.engine.kv
    assert [(g.kind, g.window, g.layers) for g in kv.groups] == [
        ("full", None, (0,)),
        ("sliding", 8, (1, 2)),
    ]
    assert generate(llm) == expected
    if "kv_cache.num_blocks" in overrides:
        assert llm.engine.scheduler.stats().preemptions > 0
    assert kv.usage() == 0.0


def test_sliding_model_on_a_backend_without_windows_is_refused(sliding_checkpoint):
    """FlashInfer's wrappers are not given windows (ARCHITECTURE, KV cache groups): start-up
    refuses the model, naming the feature and the backend, before touching FlashInfer."""
    from inferx_core.executor import LoadError

    pytest.importorskip("triton", reason="inferx-kernels-cuda's backends need triton")
    with pytest.raises(LoadError, match="needs sliding attention .*flashinfer attention backend"):
        make_llm(sliding_checkpoint[0], **{"engine.attention_backend": "flashinfer"})


def test_start_up_says_each_phase(caplog):
    """The executor logs a line per start-up phase as it ends ("inferx.startup"; inferx-server
    shows them on a terminal)."""
    import logging

    with caplog.at_level(logging.INFO, logger="inferx.startup"):
        LLM(load_config(None, {"model.preset": "tiny-qwen2", "model.dtype": "float32"}))
    said = [r.getMessage() for r in caplog.records if r.name == "inferx.startup"]
    assert [m.split(" (")[0].split(":")[0] for m in said] == ["open", "weights", "kv cache"]
    assert "blocks" in said[-1]


# A head five windows long: a later request reuses it from the prefix cache, which must then hold
# the sliding layers' blocks that its first query reads (the head's last 8 tokens).
HEAD = list(range(3, 43))
SHARED = [HEAD + [50, 51, 52], HEAD + [60, 61, 62, 63, 64], HEAD + [7, 7], HEAD + [200] * 9]


@pytest.fixture(scope="module")
def shared_expected(sliding_checkpoint):
    return reference(sliding_checkpoint[1], SHARED)


def test_sliding_model_reuses_a_long_prefix(sliding_checkpoint, shared_expected):
    llm = make_llm(sliding_checkpoint[0], **{"kv_cache.block_size": 4})
    assert llm.engine.kv.tree is not None, "the prefix cache is on for a sliding model"
    assert generate(llm, SHARED[:1]) == shared_expected[:1]
    stats = llm.engine.scheduler.stats()
    assert stats.prefix_hits == 0
    assert generate(llm, SHARED[1:2]) == shared_expected[1:2]
    assert llm.engine.scheduler.stats().prefix_hits == len(HEAD), "the whole head was reused"
    assert llm.engine.kv.usage() == 0.0


def test_sliding_model_reuses_prefixes_under_preemption(sliding_checkpoint, shared_expected):
    # 39 usable blocks: one request of 45 + 32 tokens holds up to 19 full and 5 sliding blocks,
    # so four of them, sharing only the head, preempt one another and evict from the cache.
    llm = make_llm(
        sliding_checkpoint[0],
        **{"kv_cache.block_size": 4, "kv_cache.num_blocks": 40, "scheduler.prefill_chunk": 8},
    )
    assert generate(llm, SHARED) == shared_expected
    assert generate(llm, SHARED) == shared_expected
    stats = llm.engine.scheduler.stats()
    assert stats.preemptions > 0 and stats.prefix_hits > 0
    assert llm.engine.kv.usage() == 0.0
