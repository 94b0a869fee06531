"""gpt-oss against transformers on the CPU in fp32: MXFP4 dequantization, the YaRN table, greedy
generation token for token (batched, chunked, past the sliding window) from bf16 and MXFP4
checkpoints, and the checkpoint errors, MXFP4 storage and presets."""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from conftest import interpreted  # noqa: E402
from test_engine import NEW_TOKENS, make_llm, reference  # noqa: E402
from test_models import PACKED_CHUNKS, Runner, check_steps, saved  # noqa: E402

from inferx_core.attention_torch import TorchAttention  # noqa: E402
from inferx_core.batch import make_attention_batch  # noqa: E402
from inferx_core.cli import main  # noqa: E402
from inferx_core.engine import LLM  # noqa: E402
from inferx_core.interfaces.moe import ExpertsSpec  # noqa: E402
from inferx_core.interfaces.quant import QuantConfig  # noqa: E402
from inferx_core.parallel import ParallelContext  # noqa: E402
from inferx_core.sequence import SamplingParams  # noqa: E402
from inferx_models.gptoss import GptOssForCausalLM  # noqa: E402
from inferx_models.layers import RotaryEmbedding, rope_parameters  # noqa: E402
from inferx_models.presets import preset  # noqa: E402
from inferx_quant.mxfp4 import Mxfp4, Mxfp4Experts, dequant_mxfp4  # noqa: E402

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
RTOL = 1e-4
WINDOW = 8
NOT_CONVERT = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}
# Prompts longer and shorter than the window; the first two outlast it by far.
PROMPTS = [
    list(range(3, 40)),
    list(range(100, 180)),
    [5, 9, 17, 33, 65, 129, 200],
    [7] * 3,
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
]


def hf_model() -> torch.nn.Module:
    """A tiny gpt-oss (sliding, full, sliding) with every parameter away from its init: sinks
    that matter, gate_up weights large enough that the SwiGLU clamp at 7 bites."""
    config = transformers.GptOssConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        max_position_embeddings=512,
        rope_parameters=YARN,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.7, 1.3)
            elif name.endswith("sinks"):
                p.normal_(0, 1.0)
            elif name.endswith("gate_up_proj"):
                p.normal_(0, 0.3)
            else:
                p.normal_(0, 0.08)
    return model


def e2m1(code: int) -> float:
    """An e2m1 code's value from its bit fields: sign, 2 exponent bits (bias 1), 1 mantissa."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2))


def random_mxfp4(gen: torch.Generator, rows: int, cols: int, experts: int) -> dict[str, Any]:
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen)
    scales = torch.randint(122, 126, (experts, rows, cols // 32), generator=gen)
    return {"blocks": blocks.to(torch.uint8), "scales": scales.to(torch.uint8)}


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    return saved(hf_model(), tmp_path_factory, "gptoss-bf16")


@pytest.fixture(scope="module")
def mxfp4_checkpoint(bf16_checkpoint, tmp_path_factory):
    """The bf16 checkpoint with its experts replaced by random MXFP4 blocks and scales, as the
    published checkpoints store them; and transformers' model of it (dequantized on load)."""
    src, _ = bf16_checkpoint
    path = tmp_path_factory.mktemp("gptoss-mxfp4")
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.endswith(("gate_up_proj", "down_proj")):
            experts, cols, rows = t.shape  # stored [E, in, out]
            for what, q in random_mxfp4(gen, rows, cols, experts).items():
                tensors[f"{name}_{what}"] = q
        else:
            tensors[name] = t
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERT}
    (path / "config.json").write_text(json.dumps(config))
    model = transformers.GptOssForCausalLM.from_pretrained(
        path,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()
    return path, model


def generate(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(prompts, GREEDY)]


CHUNKED = {
    "scheduler.prefill_chunk": 5,
    "scheduler.max_batched_tokens": 12,
    "scheduler.max_running": 3,
    "kv_cache.block_size": 4,
}


def test_dequant_mxfp4_matches_per_element_reference():
    gen = torch.Generator().manual_seed(0)
    q = random_mxfp4(gen, rows=3, cols=64, experts=2)
    q["scales"][0, 0, 0] = 127  # scale 1
    q["scales"][1, 2, 1] = 100  # far below 1
    out = dequant_mxfp4(q["blocks"], q["scales"])
    assert out.shape == (2, 3, 64) and out.dtype == torch.float32
    blocks, scales = q["blocks"].tolist(), q["scales"].tolist()
    for e in range(2):
        for r in range(3):
            for c in range(64):
                byte = blocks[e][r][c // 32][(c % 32) // 2]
                code = byte >> 4 if c % 2 else byte & 0x0F  # the low nibble is the even element
                want = e2m1(code) * 2.0 ** (scales[e][r][c // 32] - 127)
                assert out[e, r, c].item() == want, (e, r, c)
    # bfloat16 holds every value exactly; transformers' dequantization agrees (it transposes
    # to gpt-oss's [in, out] on top)
    assert torch.equal(dequant_mxfp4(q["blocks"], q["scales"], torch.bfloat16).float(), out)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    theirs = convert_moe_packed_tensors(q["blocks"], q["scales"], dtype=torch.float32)
    assert torch.equal(theirs.transpose(1, 2), out)


@pytest.mark.parametrize(
    "params, head_dim, max_positions",
    [
        (preset("gpt-oss-20b")["rope_scaling"] | {"rope_theta": 150000.0}, 64, 131072),
        (YARN, 16, 512),
        (YARN | {"truncate": True, "beta_fast": 8.0}, 16, 512),
        (YARN | {"mscale": 1.0, "mscale_all_dim": 0.5, "factor": 4.0}, 32, 1024),
    ],
)
def test_yarn_table_matches_transformers(params, head_dim, max_positions):
    config = transformers.GptOssConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_parameters=dict(params),
    )
    rotary = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(config)
    positions = torch.arange(max_positions)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    ours = RotaryEmbedding(
        head_dim, max_positions, rope_parameters({"rope_scaling": params}), torch.device("cpu")
    )
    want = torch.cat([cos[0], sin[0]], dim=-1)
    assert rotary.attention_scaling != 1.0
    assert (ours.cos_sin - want).abs().max().item() <= 1e-6


def test_kv_layout_alternates_windows_with_sinks():
    layout = GptOssForCausalLM.kv_layout(preset("gpt-oss-20b"))
    assert len(layout) == 24
    assert all(s.learned_sinks and s.num_q_heads == 64 and s.num_kv_heads == 8 for s in layout)
    assert [(s.kind, s.window) for s in layout[:2]] == [("sliding", 128), ("full", None)]
    assert all(s.kind == "sliding" for s in layout[0::2])
    assert all(s.kind == "full" for s in layout[1::2])

    class NoSinks(TorchAttention):
        features = frozenset({"sliding"})

    with pytest.raises(NotImplementedError, match="sinks"):
        NoSinks.check_layers(layout, "gpt-oss")


class GroupRunner(Runner):
    """test_models' Runner with a block table per KV group (sliding, full): the groups' layers
    share cache tensors, so the same block in two groups would mix their keys."""

    def step(self, chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        groups = len(self.backend.groups)
        ids, positions, query_lens, context_lens = [], [], [], []
        tables: list[list[list[int]]] = [[] for _ in range(groups)]
        for seq, tokens in chunks:
            start = self.done.get(seq, 0)
            end = start + len(tokens)
            for g in range(groups):
                table = self.tables.setdefault(f"{seq}/{g}", [])
                while len(table) * self.block_size < end:
                    table.append(self.free.pop())
                tables[g].append(table)
            ids += tokens
            positions += range(start, end)
            query_lens.append(len(tokens))
            context_lens.append(end)
            self.done[seq] = end
        batch = make_attention_batch(
            query_lens, context_lens, tables[0], self.block_size, group_tables=tables
        )
        self.backend.begin_step(batch)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions))
            logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))


def test_logits_packed_and_chunked_match_transformers(bf16_checkpoint):
    """Chunks longer than the window over a cached prefix, packed with fresh prompts."""
    path, ref = bf16_checkpoint
    runner = GroupRunner(path, 4)
    full = {"a": PROMPTS[0], "b": PROMPTS[1][:21], "c": PROMPTS[4]}
    check_steps(runner, ref, full, PACKED_CHUNKS, RTOL)


@pytest.mark.parametrize("layout", ["bf16", "mxfp4"])
def test_greedy_batched_and_chunked_equal_transformers(layout, bf16_checkpoint, mxfp4_checkpoint):
    path, model = bf16_checkpoint if layout == "bf16" else mxfp4_checkpoint
    expected = reference(model, PROMPTS)
    llm = make_llm(path)
    experts = llm.engine.executor.model.model.layers[0].mlp.experts
    assert isinstance(experts, Mxfp4Experts) == (layout == "mxfp4")
    assert generate(llm) == expected, "batched"
    assert generate(make_llm(path, **CHUNKED)) == expected, "chunked prefill"


@pytest.mark.slow  # rank processes over gloo: seconds per engine
@pytest.mark.parametrize(("layout", "world"), [("mxfp4", 2), ("mxfp4", 4), ("bf16", 2)])
def test_tensor_parallel_greedy_equals_one_rank(layout, world, bf16_checkpoint, mxfp4_checkpoint):
    """Heads (with their sinks and q/k/v biases) split over the ranks, the KV heads replicated
    at 4 ranks (2 KV heads), o_proj's and the experts' down bias added once, the experts' and
    the MXFP4 scale groups' intermediate columns split (one group a rank at 2, padding at 4),
    the vocabulary split: the greedy tokens of one rank, in fp32, past the sliding window."""
    path, _ = bf16_checkpoint if layout == "bf16" else mxfp4_checkpoint
    cache = {"kv_cache.num_blocks": 64}
    expected = generate(make_llm(path, **cache))
    llm = make_llm(path, **cache, **{"parallel.tensor": world})
    try:
        assert generate(llm) == expected
    finally:
        llm.engine.executor.close()


def test_mxfp4_experts_keep_packed_bytes(mxfp4_checkpoint):
    llm = make_llm(mxfp4_checkpoint[0])
    for layer in llm.engine.executor.model.model.layers:
        experts = layer.mlp.experts
        tensors = dict(experts.named_parameters()) | dict(experts.named_buffers())
        dtypes = {name: t.dtype for name, t in tensors.items()}
        assert dtypes == {
            "gate_up_bias": torch.float32,
            "down_bias": torch.float32,
            "gate_up_blocks": torch.uint8,
            "gate_up_scales": torch.uint8,
            "down_blocks": torch.uint8,
            "down_scales": torch.uint8,
        }
        assert tuple(experts.gate_up_blocks.shape) == (4, 128, 2, 16)
        assert tuple(experts.down_scales.shape) == (4, 64, 2)


@pytest.mark.parametrize(
    "layout, dropped",
    [
        ("mxfp4", "model.layers.1.mlp.experts.down_proj_scales"),
        ("mxfp4", "model.layers.2.mlp.experts.gate_up_proj_blocks"),
        ("bf16", "model.layers.0.mlp.experts.gate_up_proj_bias"),
        ("bf16", "model.layers.2.self_attn.sinks"),
    ],
)
def test_missing_tensor_is_named(layout, dropped, bf16_checkpoint, mxfp4_checkpoint, tmp_path):
    src = (bf16_checkpoint if layout == "bf16" else mxfp4_checkpoint)[0]
    tensors = load_file(src / "model.safetensors")
    del tensors[dropped]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copyfile(src / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=dropped.replace(".", r"\.")):
        make_llm(tmp_path)


@pytest.mark.parametrize("activation", ["swiglu_oai", "silu"])
@pytest.mark.parametrize("world", [2, 4])
def test_mxfp4_experts_shard_in_whole_scale_groups(activation, world):
    """Each rank keeps whole 32-wide scale groups of every expert's intermediate size (3 groups
    here: uneven over 2 ranks, one rank empty over 4), zero-padded to one shape, bytes as
    stored; the ranks' partial sums add up to the unsharded experts' output (float32)."""
    e, hidden, inter = 4, 64, 96
    spec = ExpertsSpec("model.layers.0.mlp.experts", e, hidden, inter, activation, bias=True)
    gen = torch.Generator().manual_seed(3)
    tensors = {
        "gate_up": random_mxfp4(gen, 2 * inter, hidden, e),
        "down": random_mxfp4(gen, hidden, inter, e),
    }
    biases = {"gate_up": torch.randn(e, 2 * inter, generator=gen), "down": torch.randn(e, hidden)}
    scheme = Mxfp4(QuantConfig({"quant_method": "mxfp4"}))

    def build(parallel: ParallelContext) -> Mxfp4Experts:
        experts = scheme.experts(spec, torch.float32, torch.device("cpu"), parallel)
        assert isinstance(experts, Mxfp4Experts)
        for part, q in tensors.items():
            for what, t in q.items():
                experts.load(f"{part}.{what}", t)
            experts.load(f"{part}.bias", biases[part])
        experts.finish_loading()
        return experts

    x = torch.randn(7, hidden, generator=gen)
    logits = torch.randn(7, e, generator=gen)
    weights, ids = logits.topk(2, dim=-1)
    weights = weights.softmax(dim=-1)
    whole = build(ParallelContext())(x, weights, ids)
    total = torch.zeros_like(whole)
    kept = []
    for rank in range(world):
        shard = build(ParallelContext(rank=rank, world_size=world, group=object()))
        assert shard.n == (64 if world == 2 else 32)  # ceil(3 groups / ranks) wide
        assert shard.gate_up_blocks.shape == (e, 2 * shard.n, hidden // 32, 16)
        assert shard.down_blocks.shape == (e, hidden, shard.n // 32, 16)
        assert (shard.down_bias is None) == (rank != 0)
        g0, g = shard.start // 32, shard.kept // 32
        kept.append(g)
        down = tensors["down"]["blocks"][:, :, g0 : g0 + g]
        assert torch.equal(shard.down_blocks[:, :, :g], down)
        assert not shard.down_blocks[:, :, g:].any()
        total += shard(x, weights, ids)
    assert kept == ([1, 2] if world == 2 else [0, 1, 1, 1])
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


def test_modules_to_not_convert_leaves_experts_unquantized():
    spec = ExpertsSpec("model.layers.3.mlp.experts", 4, 64, 64, "swiglu_oai", bias=True)
    checkpoint = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.3.mlp"]}
    scheme = Mxfp4(QuantConfig(checkpoint))
    experts = scheme.experts(spec, torch.float32, torch.device("cpu"), ParallelContext())
    assert not isinstance(experts, Mxfp4Experts)
    other = ExpertsSpec("model.layers.30.mlp.experts", 4, 64, 64, "swiglu_oai", bias=True)
    assert isinstance(scheme.experts(other, torch.float32, torch.device("cpu")), Mxfp4Experts)


def test_published_shapes():
    cfg = preset("gpt-oss-20b")
    shapes = GptOssForCausalLM.checkpoint_shapes(cfg)
    dtypes = GptOssForCausalLM.checkpoint_dtypes(cfg)
    experts = "model.layers.23.mlp.experts."
    assert shapes[experts + "gate_up_proj_blocks"] == (32, 5760, 90, 16)
    assert shapes[experts + "gate_up_proj_scales"] == (32, 5760, 90)
    assert shapes[experts + "gate_up_proj_bias"] == (32, 5760)
    assert shapes[experts + "down_proj_blocks"] == (32, 2880, 90, 16)
    assert shapes["model.layers.0.self_attn.sinks"] == (64,)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4096, 2880)
    assert shapes["model.layers.0.mlp.router.weight"] == (32, 2880)
    assert shapes["lm_head.weight"] == shapes["model.embed_tokens.weight"] == (201088, 2880)
    assert dtypes[experts + "down_proj_scales"] == torch.uint8 and len(dtypes) == 24 * 4
    # about 21B parameters, two a byte of the blocks
    params = sum(
        (2 if name.endswith("_blocks") else 1) * torch.Size(shape).numel()
        for name, shape in shapes.items()
        if not name.endswith("_scales")
    )
    assert 20.8e9 < params < 21.0e9


def test_preset_checkpoint_loads_in_both(tmp_path):
    """`inferx checkpoint --preset tiny-gpt-oss` writes the MXFP4 layout that transformers reads
    too; both generate the same."""
    out = tmp_path / "tiny"
    assert main(["checkpoint", "--preset", "tiny-gpt-oss", str(out), "--dtype", "float32"]) == 0
    names = load_file(out / "model.safetensors")
    assert names["model.layers.1.mlp.experts.down_proj_blocks"].dtype == torch.uint8
    assert "model.layers.1.mlp.experts.down_proj" not in names
    ref = transformers.GptOssForCausalLM.from_pretrained(
        out,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()
    prompts = PROMPTS[:3]
    assert generate(make_llm(out), prompts) == reference(ref, prompts)


# -- the triton attention backend (sliding windows and sinks in its kernels, two KV groups) -----

TRITON = {
    "engine.attention_backend": "triton",
    "engine.overlap": True,  # PENDING tokens beside the graph runners, as on a GPU
    "model.max_model_len": 128,
}


def split_decodes(llm: LLM) -> None:
    """Decodes split their contexts in 16-token pieces (the interpreter's decode tile) on the
    CPU too: the sliding layers' splits before the window read nothing, the sinks join the
    splits' combine."""
    llm.engine.executor.attention.min_split_len = 16
    llm.engine.executor.attention.target_programs = 10**6


@interpreted
def test_triton_greedy_equals_transformers(bf16_checkpoint):
    """The Triton kernels under the interpreter (small: a prompt past the window and two
    within it, 12 tokens each): chunked prefill (5-token chunks over a cached prefix, packed
    with decodes) and decodes split past the window give transformers' tokens; a second run
    matches the prompts' cached blocks (the prefix cache of two KV groups) and gives them
    again."""
    path, model = bf16_checkpoint
    prompts = [PROMPTS[0][:30], PROMPTS[2], PROMPTS[3]]
    expected = [tokens[:12] for tokens in reference(model, prompts)]
    llm = make_llm(path, **TRITON, **CHUNKED, **{"scheduler.prefix_cache": True})
    assert type(llm.engine.executor.attention).__name__ == "TritonAttention"
    split_decodes(llm)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [c.token_ids for c in llm.generate(prompts, params)] == expected, "chunked"
    hits = llm.engine.scheduler.stats().prefix_hits
    assert [c.token_ids for c in llm.generate(prompts, params)] == expected, "prefix cache"
    assert llm.engine.scheduler.stats().prefix_hits > hits


@interpreted
def test_triton_graph_runners_generate_like_eager(bf16_checkpoint):
    """The CUDA-graph runners' static buffers over two KV groups (each group's block table
    and slots staged and copied per replay), run on the CPU without graphs: decode steps
    (DecodeGraphRunner) and steps with prompt chunks (MixedGraphRunner) give the eager steps'
    tokens and logits (test_cuda_graphs.generates_like_eager)."""
    from test_cuda_graphs import generates_like_eager

    from inferx_kernels_cuda.cuda_graphs import DecodeGraphRunner, MixedGraphRunner

    config = {**TRITON, "scheduler.max_running": 4, "scheduler.prefill_chunk": 5}
    llm = make_llm(bf16_checkpoint[0], **config, **{"scheduler.prefix_cache": False})
    split_decodes(llm)
    ex = llm.engine.executor
    assert len(ex.attention.groups) == 2 and ex.graphs is None and ex.mixed is None
    bs = ex.block_size

    def install() -> None:
        ex.mixed = MixedGraphRunner(ex.model, ex.attention, ex.device, 16, 4, ex.max_model_len, bs)
        ex.graphs = DecodeGraphRunner(ex.model, ex.attention, ex.device, 4, ex.max_model_len, bs)

    generates_like_eager(llm, install)
    assert ex.graphs.replays and ex.mixed.replays
