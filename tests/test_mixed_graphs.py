"""CUDA graphs of steps with prompt tokens (MixedGraphRunner and the Triton backend's mixed hooks):
the padded, static-buffer path against eager steps, on the CPU under the Triton interpreter, and
graphs against eager steps on the GPU."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

pytest.importorskip("transformers")

from conftest import interpreted, on_gpu, scattered_tables  # noqa: E402
from test_cuda_graphs import (  # noqa: E402
    check_static_step,
    checkpoint,
    cpu_triton_llm,
    generates_like_eager,
    seeded_backends,
    triton_attention,
)
from test_mla_prefill import SMALL  # noqa: E402
from test_mla_prefill import Case as MLACase  # noqa: E402
from test_mla_prefill import rel_err as mla_rel_err  # noqa: E402

from inferx_core.attention_torch import TorchAttention, to_fp8  # noqa: E402
from inferx_core.batch import make_attention_batch  # noqa: E402
from inferx_core.config import load_config  # noqa: E402
from inferx_core.engine import LLM  # noqa: E402
from inferx_core.interfaces.attention import AttentionLayer, MLAWeights  # noqa: E402
from inferx_core.interfaces.kv import KVLayerSpec  # noqa: E402
from inferx_core.sequence import SamplingParams  # noqa: E402
from inferx_kernels_cuda.cuda_graphs import MixedGraphRunner, token_ladder  # noqa: E402
from inferx_kernels_cuda.runtime import first_tokens  # noqa: E402

CPU = torch.device("cpu")


def test_token_ladder() -> None:
    assert token_ladder(2048) == [64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert token_ladder(1000) == [64, 128, 192, 256, 384, 512, 768, 1000]
    assert token_ladder(200) == [64, 128, 192, 200]
    assert token_ladder(64) == [64]
    assert token_ladder(10) == [10]
    with pytest.raises(ValueError, match="at least 1"):
        token_ladder(0)


def split_options(target_programs: int | None) -> dict[str, int]:
    """The Triton backends' options for target_programs (None: the defaults, unsplit on the
    CPU), with splits of one 16-token tile, the interpreter's decode tile."""
    return {"target_programs": target_programs, "min_split_len": 16} if target_programs else {}


@interpreted
@pytest.mark.parametrize(
    ("block_size", "group", "dtype", "target_programs"),
    [
        (4, 1, torch.float32, None),
        (16, 2, torch.float32, None),
        (4, 4, torch.float16, None),
        (16, 2, torch.bfloat16, None),
        (4, 2, torch.float32, 64),
        (16, 4, torch.bfloat16, 64),
    ],
)
def test_static_mixed_path_matches_eager(
    block_size: int, group: int, dtype: torch.dtype, target_programs: int | None
) -> None:
    """One set of buffers serves steps of prompt chunks beside decodes, padded to 48 tokens:
    chunks over a cached prefix, a fresh prompt, decodes, a step of exactly 48 tokens (its
    unused decode slots point past the last row), then a smaller step (rows and tiles that held
    real sequences turn into padding). Outputs equal the eager step's and TorchAttention's;
    padding tokens (garbage queries and keys) write no cache slot. target_programs 64: the
    decode slots split their contexts (SEQ_SPLIT) and the reduce combines them."""
    torch.manual_seed(block_size * 10 + group)
    layers = [KVLayerSpec(2 * group, 2, 16), KVLayerSpec(group, 1, 32)]
    max_blocks = 64 // block_size
    num_blocks = 6 * max_blocks + 1
    static, eager, reference = seeded_backends(
        layers, block_size, dtype, num_blocks, **split_options(target_programs)
    )
    static.init_mixed_graph_buffers(48, 6, max_blocks)
    static.prepare_mixed_capture(48)
    assert static._plan.num_splits == (1 if target_programs is None else 4)
    steps = (
        ([9, 1, 20, 1, 3], [30, 17, 20, 64, 3]),
        ([40, 1, 1, 6], [50, 33, 7, 6]),
        ([1, 13], [40, 13]),
    )
    for query_lens, contexts in steps:
        tables = scattered_tables(contexts, block_size, num_blocks)
        batch = make_attention_batch(query_lens, contexts, tables, block_size)
        static.prepare_mixed_replay(batch, 48)
        check_static_step(static, eager, reference, batch, 48, dtype, f"{query_lens}")


@interpreted
@pytest.mark.parametrize("target_programs", [None, 64])
def test_unused_decode_slots_read_no_query(target_programs: int | None) -> None:
    """A mixed graph's unused decode slots point at the empty sequence after the step's last,
    whose query row is one past the step's rows when the step fills its graph: the decode
    kernel must read no query there (on the H200 that read faulted an 8B server, session 36).
    The empty sequence's query row is set far past any allocation, so a read of it faults; the
    real rows still match eager and TorchAttention."""
    torch.manual_seed(7)
    layers = [KVLayerSpec(4, 2, 16)]
    static, eager, reference = seeded_backends(
        layers, 4, torch.float32, 33, **split_options(target_programs)
    )
    static.init_mixed_graph_buffers(32, 6, 16)
    # a step filling its 32-token graph, then one padded to 16
    for query_lens, contexts, padded in (([20, 11, 1], [20, 30, 11], 32), ([9, 1], [40, 7], 16)):
        tables = scattered_tables(contexts, 4, 33)
        batch = make_attention_batch(query_lens, contexts, tables, 4)
        static.prepare_mixed_replay(batch, padded)
        n = len(query_lens)  # (the last sequence is a decode: query_start[n] ends no prompt)
        static._mixed.query_start[n : n + 2] = 1 << 24  # the empty sequence: rows GBs past q
        check_static_step(static, eager, reference, batch, padded, torch.float32, f"{query_lens}")


@interpreted
def test_mixed_buffers_check_their_inputs() -> None:
    backend = triton_attention([KVLayerSpec(2, 1, 16)], 4, torch.float32, CPU)
    with pytest.raises(RuntimeError, match="init_mixed_graph_buffers"):
        backend.prepare_mixed_capture(8)
    backend.init_mixed_graph_buffers(16, 3, 4)
    with pytest.raises(ValueError, match="outside the mixed graph buffers' 1..16"):
        backend.prepare_mixed_capture(17)
    too_many_tokens = make_attention_batch([9], [9], [[1, 2, 3]], 4)
    with pytest.raises(ValueError, match="got 9 tokens of 1 sequences"):
        backend.prepare_mixed_replay(too_many_tokens, 8)
    too_many_seqs = make_attention_batch([1] * 4, [1] * 4, [[1], [2], [3], [4]], 4)
    with pytest.raises(ValueError, match="3 sequences"):
        backend.prepare_mixed_replay(too_many_seqs, 8)
    too_wide = make_attention_batch([2], [20], [[1, 2, 3, 4, 5]], 4)
    with pytest.raises(ValueError, match="4 blocks each"):
        backend.prepare_mixed_replay(too_wide, 8)


# -- MLA layers (DeepSeek-V2): fresh prompts beside decodes ----------------------------------


def mla_backends(
    widths: tuple,
    dtype: torch.dtype,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    kv_dtype: str = "auto",
) -> tuple:
    """A Triton backend to run from static buffers, one to run eagerly and TorchAttention, over
    one MLA layer of test_mla_prefill's widths (heads, nope, rope, v, rank); kv_dtype:
    "fp8_e4m3" for an e4m3 cache."""
    heads, _, rope, _, rank = widths
    spec = KVLayerSpec(heads, 1, rank + rope, kind="mla", v_head_dim=rank, rope_dim=rope,
                       dtype=kv_dtype)  # fmt: skip
    static = triton_attention([spec], block_size, dtype, device)
    eager = triton_attention([spec], block_size, dtype, device)
    reference = TorchAttention([spec], block_size, dtype, device)
    for b in (static, eager, reference):
        b.allocate(num_blocks)
    return static, eager, reference


# Steps of (query lengths, contexts) over one mixed buffer of 48 tokens and 6 sequences: fresh
# prompts and decodes, chunks over a cached prefix (prefixes of 5 to 40 tokens, inside a
# block and on boundaries of 4- and 16-token blocks; chunks of 2 to 28 rows) beside them,
# exactly 48 tokens (the unused absorbed rows write the output's spare row), a smaller step
# (tiles and rows that held real sequences turn into padding), one-row chunks over a prefix
# (decodes), decodes alone.
MLA_STEPS = (
    ([9, 1, 20, 1, 3], [9, 17, 20, 40, 3]),
    ([7, 1, 12, 1, 2], [40, 9, 17, 33, 2]),
    ([30, 1, 1, 16], [30, 33, 7, 16]),
    ([5, 1, 19, 6], [21, 30, 35, 6]),
    ([20, 28], [60, 45]),
    ([1, 13], [40, 13]),
    ([1, 2, 1], [17, 34, 2]),
    ([1, 1, 1], [5, 9, 30]),
)


def mla_static_steps(
    widths: tuple,
    dtype: torch.dtype,
    block_size: int,
    device: str,
    tol: float,
    graph: bool,
    fp8: bool = False,
) -> None:
    """MLA_STEPS through a backend's mixed-graph path, padded to 48 tokens (NaN queries and
    cache rows on the padding tokens, slot -1), against the eager step and TorchAttention
    (prompt rows plain over their whole context, decodes absorbed) and, for the prompt rows,
    the float64 plain form (mla_plain): within tol of the largest element. In the graph a
    chunk over a cached prefix attends its own rows plain and its prefix absorbed, merged by
    log-sum-exp. graph: captured once as a CUDA graph and
    replayed for every step. fp8: over an e4m3 cache (k_scale 0.5), the same bytes in every
    backend's (test_mla_fp8 holds the eager path to the float64 forms on the dequantized rows).
    Padding writes no cache slot: the caches end equal."""
    dev = torch.device(device)
    padded, rank = 48, widths[4]
    kv_dtype = "fp8_e4m3" if fp8 else "auto"
    k_scale = torch.tensor([0.5], device=dev) if fp8 else None
    static, eager, reference = mla_backends(widths, dtype, 64, block_size, dev, kv_dtype)
    static.init_mixed_graph_buffers(padded, 6, 64 // block_size)
    static.prepare_mixed_capture(padded)
    first = MLACase([2], [2], widths, dtype, block_size, seed=9, device=device)
    mla = mla_weights(first)  # one kv_b_proj for every step (a graph holds its weights)
    q_in = torch.zeros(padded, *first.q.shape[1:], dtype=dtype, device=dev)
    rows_in = torch.zeros(padded, first.rows.shape[1], dtype=dtype, device=dev)
    layer = AttentionLayer(0, static.layers[0], first.scale, k_scale=k_scale, mla=mla)

    def forward() -> torch.Tensor:
        return static.forward(layer, q_in, rows_in[:, None], rows_in[:, None, :rank])

    out = forward()  # the capture layout: every tile and slot empty
    cuda_graph = None
    if graph:
        torch.cuda.synchronize(dev)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            out = forward()
    for seed, (query_lens, contexts) in enumerate(MLA_STEPS):
        case = MLACase(query_lens, contexts, widths, dtype, block_size, seed=10 + seed,
                       device=device)  # fmt: skip
        case.w = first.w
        assert static.takes_mixed_step(query_lens, contexts) and case.cache.shape[0] <= 64
        real = sum(query_lens)
        q_in.fill_(float("nan"))  # the padding's garbage: NaN must not reach a real row
        rows_in.fill_(float("nan"))
        q_in[:real], rows_in[:real] = case.q, case.rows
        for b in (static, eager, reference):
            cache = b.caches[0].view(torch.uint8) if fp8 else b.caches[0]
            cache.zero_()
            rows = to_fp8(case.cache, k_scale).view(torch.uint8) if fp8 else case.cache
            cache[: case.cache.shape[0]].copy_(rows)
            cache.view(-1, cache.shape[-1])[case.batch.slot_mapping] = 0  # the step writes them
        batch = make_attention_batch(query_lens, contexts, case.tables, block_size)  # host
        static.prepare_mixed_replay(batch, padded)
        if cuda_graph is not None:
            cuda_graph.replay()
        else:
            out = forward()
        got = out[:real]
        k = case.rows[:, None]
        want, ref = [], []
        for b, into in ((eager, want), (reference, ref)):
            b.begin_step(case.batch)
            layer_b = AttentionLayer(0, b.layers[0], case.scale, k_scale=k_scale, mla=mla)
            into.append(b.forward(layer_b, case.q, k, k[..., :rank]))
        want, ref = want[0], ref[0]
        label = f"{query_lens}"
        assert got.shape == want.shape == ref.shape == (real, widths[0], widths[3])
        assert mla_rel_err(got, want) <= tol, label
        assert mla_rel_err(got, ref) <= tol, label
        if not fp8:
            case.check(got, tol)
        caches = [b.caches[0].view(torch.uint8) for b in (static, eager, reference)]
        assert torch.equal(caches[0], caches[1]) and torch.equal(caches[0], caches[2]), label


def mla_weights(case) -> MLAWeights:
    """The case's kv_b_proj as MLAWeights with W_UK / W_UV set (both forms on hand)."""
    heads, nope, _, v, rank = case.widths
    mla = case.mla()
    w = case.w.view(heads, nope + v, rank)
    mla.w_uk, mla.w_uv = w[:, :nope], w[:, nope:]
    return mla


@interpreted
@pytest.mark.parametrize(
    ("block_size", "dtype", "tol", "fp8"),
    [
        (4, torch.float32, 1e-5, False),
        (16, torch.float16, 3e-3, False),
        (4, torch.float32, 1e-5, True),
    ],
)
def test_static_mla_mixed_path_matches_eager(
    block_size: int, dtype: torch.dtype, tol: float, fp8: bool
) -> None:
    """mla_static_steps on the CPU, the padded static path run eagerly: fp32 within 1e-5, fp16
    within 3e-3; fp32 over an e4m3 cache."""
    mla_static_steps(SMALL, dtype, block_size, "cpu", tol, graph=False, fp8=fp8)


@interpreted
def test_mla_chunks_over_a_cached_prefix_are_bounded() -> None:
    """Mixed graphs of MLA layers take chunks over a cached prefix (prefix hits,
    continuations) while their rows, in all, are at most mla_prefix_rows (128 by default),
    whatever the prefix (both forms' costs grow with it); fresh prompts and decodes (one-token
    chunks over a prefix) do not count. Past the bound the step is declined (the runner runs
    it eagerly) and a replay of it is refused by name; mla_prefix_rows 0 or the unfused
    absorbed form take none. The buffers hold the bound set when they were made."""
    static, _, _ = mla_backends(SMALL, torch.float32, 40, 4, CPU)
    assert static.mla_prefix_rows == 128
    assert static.takes_mixed_step([128, 1], [10_000, 9])
    assert static.takes_mixed_step([100, 28, 1], [5000, 40, 9])
    assert not static.takes_mixed_step([129, 1], [200, 9])
    assert not static.takes_mixed_step([100, 29], [5000, 40])
    assert static.takes_mixed_step([500, 1, 1], [500, 9, 4000])  # fresh and decodes
    static.mla_prefix_rows = 8
    static.init_mixed_graph_buffers(32, 4, 16)
    assert static.supports_mixed_graphs
    assert static.takes_mixed_step([5, 1, 1], [5, 30, 2])
    assert static.takes_mixed_step([7, 1, 20], [40, 9, 20])
    assert static.takes_mixed_step([4, 4, 1], [39, 8, 3])
    assert not static.takes_mixed_step([9, 1], [40, 9])
    assert not static.takes_mixed_step([5, 4], [20, 30])
    static.mla_prefix_rows = 128  # the buffers hold 8
    assert not static.takes_mixed_step([9, 1], [40, 9])
    batch = make_attention_batch([9, 1], [40, 9], scattered_tables([40, 9], 4, 40), 4)
    with pytest.raises(ValueError, match="mla_prefix_rows"):
        static.prepare_mixed_replay(batch, 32)
    # a full graph: 3 decodes and 8 chunk rows fill its min(32, 4 + 8) absorbed rows
    batch = make_attention_batch(
        [1, 8, 1, 1], [5, 20, 9, 3], scattered_tables([5, 20, 9, 3], 4, 40), 4
    )
    static.prepare_mixed_replay(batch, 32)
    mm = static._mixed.mla
    assert mm.context_len.tolist() == [5, 9, 3] + [12] * 8 + [0]
    assert mm.merge_row.tolist() == [-1] * 3 + list(range(1, 9)) + [-1]
    assert mm.row_seq.tolist() == [0, 2, 3] + [1] * 8 + [4]
    static.mla_prefix_rows = 0
    assert not static.takes_mixed_step([7, 1], [40, 9])
    assert static.takes_mixed_step([7, 1], [7, 9])
    unfused, _, _ = mla_backends(SMALL, torch.float32, 40, 4, CPU)
    unfused.mla_fused_absorb = False
    assert not unfused.takes_mixed_step([7, 1], [40, 9])
    unfused.init_mixed_graph_buffers(32, 4, 16)
    assert unfused._mixed.mla.prefix_rows == 0 and unfused._mixed.mla.row_seq.shape == (4,)
    plain = triton_attention([KVLayerSpec(2, 1, 16)], 4, torch.float32, CPU)
    assert plain.takes_mixed_step([700, 1], [4000, 9])


def test_first_tokens() -> None:
    assert first_tokens([8, 8, 8], 20) == [8, 8, 4]
    assert first_tokens([8, 8], 16) == [8, 8]
    assert first_tokens([8, 8], 100) == [8, 8]
    assert first_tokens([8], 3) == [3]


@interpreted
@pytest.mark.parametrize(("prefill_chunk", "max_seqs"), [(512, 4), (5, 4), (5, 2)])
def test_runner_generates_like_eager_steps(
    tmp_path_factory, prefill_chunk: int, max_seqs: int
) -> None:
    """The executor path on the CPU: MixedGraphRunner.run (padding, the static layout; no graph
    to replay on the CPU, so the same padded pass runs eagerly) for every step with prompt
    tokens, against ordinary eager steps. With 5-token chunks prompts are chunked and run beside
    decodes, some steps sampling only some rows; with overlap on, decodes beside a chunk read
    their last token from the device. With max_seqs 2, steps over 3 sequences run eagerly."""
    llm = cpu_triton_llm(checkpoint("llama", tmp_path_factory), prefill_chunk)
    ex = llm.engine.executor
    assert ex.mixed is None  # on the CPU: no graphs unless a test sets a runner

    def install() -> None:
        ex.mixed = MixedGraphRunner(
            ex.model, ex.attention, ex.device, 16, max_seqs, ex.max_model_len, 16
        )

    static_logits = generates_like_eager(llm, install)
    runner = ex.mixed
    # No decode runner here, so decode-only steps replay the mixed runner too.
    if prefill_chunk == 512:  # 27 prompt tokens, over 16: eager; then 7 decode steps
        assert runner.replays == Counter({16: 7})
    elif max_seqs == 4:  # every step fits 16 tokens: chunks of 5 beside decodes, then decodes
        assert runner.replays == Counter({16: len(static_logits)})
    else:  # steps over 3 sequences eagerly: the replays are the rest
        assert 0 < runner.replays[16] < len(static_logits)


@interpreted
def test_runner_dry_run_walks_every_size(tmp_path_factory, monkeypatch) -> None:
    """dry_run (start-up's compile pass): one forward of every token count, largest first,
    each over its capture layout; no static output is kept."""
    llm = cpu_triton_llm(checkpoint("llama", tmp_path_factory), 512)
    ex = llm.engine.executor
    runner = MixedGraphRunner(ex.model, ex.attention, ex.device, 128, 4, ex.max_model_len, 16)
    forwards: list[int] = []
    model_forward = ex.model.forward
    monkeypatch.setattr(
        ex.model, "forward", lambda ids, pos: forwards.append(len(ids)) or model_forward(ids, pos)
    )
    runner.dry_run()
    assert forwards == sorted(runner.sizes, reverse=True) and len(forwards) > 1
    assert runner.hidden is None and not runner.graphs


# -- on the GPU ---------------------------------------------------------------------------------


def graphs_llm(path, graphs: bool, prefix_cache: bool) -> LLM:
    """A tiny fp32 model on the triton backend for the generate tests: 4 sequences at a time,
    chunks of up to 100 tokens, mixed graphs up to 300 tokens when `graphs`."""
    config = {
        "model.path": str(path),
        "model.dtype": "float32",
        "model.max_model_len": 256,
        "engine.attention_backend": "triton",
        "engine.cuda_graphs": graphs,
        "engine.graph_max_tokens": 300,
        "kv_cache.memory": "1GiB",  # sized after the profiling pass, which runs
        "scheduler.max_running": 4,
        "scheduler.prefix_cache": prefix_cache,
        "scheduler.prefill_chunk": 100,
    }
    return LLM(load_config(None, config))


@on_gpu
@pytest.mark.gpu
def test_gpu_mixed_graphs_generate_like_eager(tmp_path_factory) -> None:
    """Real graphs on the GPU, sized by the start-up profiling pass: prompts of random lengths
    beside decodes (chunks of up to 100 tokens, 4 sequences at a time), with graphs on (decode,
    and mixed at token_ladder(300): 64 to 256 and 300 tokens) and off, in fp32 (the tiny
    model's greedy choices are far apart there): the same tokens."""
    path = checkpoint("llama", tmp_path_factory)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(3, 200))] for _ in range(10)]
    params = [
        SamplingParams(max_tokens=rng.randrange(4, 24), temperature=0, ignore_eos=True)
        for _ in prompts
    ]
    outs = {}
    for graphs in (True, False):
        llm = graphs_llm(path, graphs, prefix_cache=False)
        ex = llm.engine.executor
        assert (ex.mixed is not None) == graphs
        outs[graphs] = [c.token_ids for c in llm.generate(prompts, params)]
        if graphs:  # several sizes share the pool; steps over 300 tokens ran eagerly
            assert ex.mixed is not None and set(ex.mixed.graphs) == set(token_ladder(300))
            replayed = set(ex.mixed.replays)
            assert replayed <= set(ex.mixed.graphs) and len(replayed) >= 3, ex.mixed.replays
    assert outs[True] == outs[False]


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("widths", "dtype", "tol"),
    [
        (SMALL, torch.float32, 1e-4),  # pointer loads
        ((16, 128, 64, 128, 512), torch.bfloat16, 2e-2),  # V2-Lite's widths: TMA on Hopper
    ],
)
def test_gpu_mla_mixed_graph_replays_like_eager(widths: tuple, dtype: torch.dtype, tol) -> None:
    """mla_static_steps with a real CUDA graph: captured once over the empty layout, replayed
    for each step (fresh prompts beside decodes, a full graph, a smaller step, decodes alone)
    with 16-token blocks."""
    mla_static_steps(widths, dtype, 16, "cuda", tol, graph=True)


@on_gpu
@pytest.mark.gpu
def test_gpu_mla_mixed_graphs_generate_like_eager(tmp_path_factory, monkeypatch) -> None:
    """A tiny DeepSeek-V2-Lite (test_deepseek_v2's, MLA over a 32 + 8 latent) on the triton
    backend, fp32, with graphs on and off: prompts of random lengths (four sharing a 40-token
    prefix, for prefix hits) in chunks of up to 100 tokens beside decodes. The same tokens;
    steps of fresh prompts and steps with chunks over a cached prefix (prefix hits and later
    chunks, up to mla_prefix_rows rows) replayed mixed graphs."""
    from test_deepseek_v2 import hf_model
    from test_models import saved

    path, _ = saved(hf_model("lite"), tmp_path_factory, "lite")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(3, 200))] for _ in range(8)]
    shared = [rng.randrange(3, 250) for _ in range(40)]
    prompts += [shared + [rng.randrange(3, 250) for _ in range(n)] for n in (5, 30, 9, 60)]
    params = [
        SamplingParams(max_tokens=rng.randrange(4, 24), temperature=0, ignore_eos=True)
        for _ in prompts
    ]
    outs = {}
    for graphs in (True, False):
        llm = graphs_llm(path, graphs, prefix_cache=True)
        ex = llm.engine.executor
        assert (ex.mixed is not None) == graphs
        replayed: list[tuple[list[int], list[int]]] = []
        replay = ex.attention.prepare_mixed_replay

        def recorded(batch, num_tokens: int, replay=replay, replayed=replayed) -> None:
            replayed.append((list(batch.query_lens), list(batch.context_lens)))
            replay(batch, num_tokens)

        monkeypatch.setattr(ex.attention, "prepare_mixed_replay", recorded)
        outs[graphs] = [c.token_ids for c in llm.generate(prompts, params)]
        if graphs:
            assert ex.mixed is not None and set(ex.mixed.graphs) == set(token_ladder(300))
            assert ex.mixed.replays, ex.mixed.replays
            over_prefix = [s for s in replayed if any(1 < q < c for q, c in zip(*s, strict=True))]
            assert over_prefix, (replayed, ex.mixed.declined)
    assert outs[True] == outs[False]
