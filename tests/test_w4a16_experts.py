"""W4A16 MoE experts (inferx_quant.w4a16_experts) on the CPU: GPTQ and AWQ expert tensors written
by test_w4a16's writers (from the published layouts' definitions), the layer against float64
on the exact dequantized weights, per expert and stacked, tensor-parallel shards, refusals and
missing tensors, the schemes' choices; tiny Qwen3-MoE checkpoints in the GPTQ and AWQ layouts
through the engine against a reference holding the exact dequantized weights (greedy tokens
agree in vLLM's top-5 sense); on a GPU the same in bf16 through the fused kernels."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from conftest import on_gpu  # noqa: E402
from experts_reference import gen, moe_layers, reference, rel, routing, shapes  # noqa: E402
from test_fp8 import agree_in_top5, fake_rank, make_llm, run  # noqa: E402
from test_qwen3 import hf_config, spread_weights  # noqa: E402
from test_w4a16 import AWQ, GPTQ, awq_tensors, gptq_tensors, quantize, write_w4  # noqa: E402

from inferx_core.interfaces.moe import ExpertsSpec  # noqa: E402
from inferx_core.interfaces.quant import LinearSpec, QuantConfig  # noqa: E402
from inferx_core.moe import UnquantizedExperts  # noqa: E402
from inferx_core.parallel import ParallelContext  # noqa: E402
from inferx_core.quant_none import DenseLinear  # noqa: E402
from inferx_quant.w4a16 import Awq, Gptq, W4A16Linear, W4Format  # noqa: E402
from inferx_quant.w4a16_experts import W4A16Experts  # noqa: E402

CPU = torch.device("cpu")
SPEC = ExpertsSpec("model.layers.0.mlp.experts", 4, 64, 64)
SWIGLU = ExpertsSpec("model.layers.0.mlp.experts", 4, 64, 64, "swiglu_oai", bias=True)
PARTS = ("gate", "up", "down")
FORMATS = {
    "gptq-sym-g32": W4Format("gptq", 32, True, 1),
    "gptq-v2-asym-g64": W4Format("gptq", 64, False, 0),
    "gptq-act-order-g32": W4Format("gptq", 32, True, 1, desc_act=True),
    "gptq-asym-act-order-g32": W4Format("gptq", 32, False, 1, desc_act=True),
    "gptq-per-channel": W4Format("gptq", -1, True, 1),
    "awq-g32": W4Format("awq", 32, False),
}


def random_experts(spec: ExpertsSpec, fmt: W4Format, seed: int):
    """Per (expert, projection): (its checkpoint tensors in the published layout, the exact
    float32 weight [out, in] they stand for); biases where the spec has them. An expert's gate
    and up share one act-order (GPTQ gives them one: they share their input), down has its
    own."""
    g = gen(seed)
    weights = {}
    for e in range(spec.num_experts):
        order = int(torch.randint(0, 2**31, (1,), generator=g))
        for part, shape in shapes(spec).items():
            w = torch.randn(shape, generator=g) * 0.1
            t = quantize(
                w,
                fmt.group_size,
                fmt.sym,
                gen(order + (part == "down")),
                act_order=fmt.desc_act,
                zero_min=fmt.zero_offset,  # the original GPTQ format cannot store a zero of 0
            )
            v2 = not fmt.zero_offset
            tensors = awq_tensors(t) if fmt.method == "awq" else gptq_tensors(t, v2)
            weights[e, part] = (tensors, t["exact"])
    biases = {}
    if spec.bias:
        for e in range(spec.num_experts):
            for part, (rows, _) in shapes(spec).items():
                biases[e, part] = torch.randn(rows, generator=g)
    return weights, biases


def loaded(spec, fmt, weights, biases, parallel=None, stacked=False) -> W4A16Experts:
    experts = W4A16Experts(spec, torch.float32, CPU, parallel or ParallelContext(), fmt)
    if stacked:  # over all experts; gate and up as one gate_up tensor
        kinds = weights[0, "gate"][0].keys()
        for kind in kinds:
            gate_up = []
            for e in range(spec.num_experts):
                g, u = weights[e, "gate"][0][kind], weights[e, "up"][0][kind]
                # gate then up outputs (silu's layout), whole packed words side by side
                gate_up.append(g if kind == "g_idx" else torch.cat([g, u], -1))
            experts.load(f"gate_up.{kind}", torch.stack(gate_up))
            down = [weights[e, "down"][0][kind] for e in range(spec.num_experts)]
            experts.load(f"down.{kind}", torch.stack(down))
    else:
        for (e, part), (tensors, _) in weights.items():
            for kind, t in tensors.items():
                experts.load(f"{part}.{kind}", t, e)
    for (e, part), b in biases.items():
        experts.load(f"{part}.bias", b, e)
    experts.finish_loading()
    return experts


# --- the layer ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_weights_and_forward_are_exact(name: str, stacked: bool) -> None:
    """Each expert's dequantized weight equals the one the checkpoint stands for, bit for bit;
    forward is within 1e-5 of float64 (float32 accumulation); the kernels' ExpertWeights
    carry zeros only for asymmetric checkpoints and perms only for act-order ones."""
    fmt = FORMATS[name]
    weights, biases = random_experts(SPEC, fmt, seed=1)
    experts = loaded(SPEC, fmt, weights, biases, stacked=stacked)
    for e in range(SPEC.num_experts):
        gate_up = torch.cat([weights[e, "gate"][1], weights[e, "up"][1]])
        torch.testing.assert_close(experts.weight("gate_up", e), gate_up, rtol=0, atol=0)
        torch.testing.assert_close(experts.weight("down", e), weights[e, "down"][1], rtol=0, atol=0)
    x = torch.randn(9, SPEC.hidden_size, generator=gen(2))
    topk_weights, topk_ids = routing(9, SPEC, 2, seed=3)
    got = experts(x, topk_weights, topk_ids)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert rel(got, reference(x, topk_weights, topk_ids, SPEC, weights, biases)) < 1e-5
    w = experts.expert_weights()
    assert w.format == "w4a16" and w.group_size == fmt.group_size
    assert w.gate_up.dtype == torch.int32 and w.gate_up.shape == (4, 64 // 8, 128)
    assert w.down.shape == (4, 64 // 8, 64) and w.gate_up_scales.dtype == torch.float16
    assert (w.gate_up_zeros is None) == (w.down_zeros is None) == fmt.sym
    assert (w.gate_up_perm is None) == (w.down_perm is None) == (not fmt.desc_act)


def test_interleaved_gate_up_with_biases() -> None:
    """gpt-oss's layout (gate and up columns interleaved, biases), per expert: gate columns
    at even places, forward within 1e-5 of float64."""
    fmt = FORMATS["gptq-v2-asym-g64"]
    weights, biases = random_experts(SWIGLU, fmt, seed=4)
    experts = loaded(SWIGLU, fmt, weights, biases)
    torch.testing.assert_close(experts.weight("gate_up", 1)[1::2], weights[1, "up"][1])
    x = torch.randn(7, SWIGLU.hidden_size, generator=gen(5))
    topk_weights, topk_ids = routing(7, SWIGLU, 2, seed=6)
    want = reference(x, topk_weights, topk_ids, SWIGLU, weights, biases)
    assert rel(experts(x, topk_weights, topk_ids), want) < 1e-5


@pytest.mark.parametrize(
    "fmt",
    [W4Format("gptq", 32, False, 0), FORMATS["awq-g32"], FORMATS["gptq-per-channel"]],
    ids=["gptq-v2-asym-g32", "awq-g32", "gptq-per-channel"],
)
def test_tensor_parallel_shards_hold_the_whole(fmt: W4Format) -> None:
    """Two ranks keep gate and up columns and down rows (in whole groups) of each expert: put
    together they are the whole layer's weights, and their partial outputs sum to its output."""
    weights, biases = random_experts(SPEC, fmt, seed=7)
    whole = loaded(SPEC, fmt, weights, biases)
    ranks = [loaded(SPEC, fmt, weights, biases, fake_rank(r)) for r in (0, 1)]
    half = SPEC.intermediate_size // 2
    assert ranks[1].gate_up.shape == (4, 64 // 8, 2 * half)
    assert ranks[1].down.shape == (4, half // 8, 64)
    assert_shards_make_the_whole(ranks, whole)
    x = torch.randn(5, 64, generator=gen(8))
    topk_weights, topk_ids = routing(5, SPEC, 2, seed=9)
    summed = sum(r(x, topk_weights, topk_ids) for r in ranks)
    torch.testing.assert_close(summed, whole(x, topk_weights, topk_ids), rtol=1e-5, atol=1e-5)


def assert_shards_make_the_whole(shards: list, whole) -> None:
    """Each expert's down (split along its K) and gate (along its outputs) put together from
    the ranks' shards are the whole layer's weights bit for bit."""
    n = SPEC.intermediate_size // len(shards)
    for e in range(SPEC.num_experts):
        down = torch.cat([r.weight("down", e) for r in shards], 1)
        torch.testing.assert_close(down, whole.weight("down", e), rtol=0, atol=0)
        gate = torch.cat([r.weight("gate_up", e)[:n] for r in shards])
        gate_whole = whole.weight("gate_up", e)[: SPEC.intermediate_size]
        torch.testing.assert_close(gate, gate_whole, rtol=0, atol=0)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", ["gptq-act-order-g32", "gptq-asym-act-order-g32"])
def test_act_order_experts_split_over_ranks(name: str, ranks: int) -> None:
    """Act-order experts over 2 and 4 ranks: gate and up keep their whole K (and its order),
    down's rows are split along K, each expert's sorted by group with down_row_group and the
    scales of the groups they touch; put together the ranks' weights are the whole layer's bit
    for bit, and their outputs summed its output within 1e-5."""
    fmt = FORMATS[name]
    weights, biases = random_experts(SPEC, fmt, seed=12)
    whole = loaded(SPEC, fmt, weights, biases)
    shards = [
        loaded(SPEC, fmt, weights, biases, ParallelContext(r, ranks, group=object()))
        for r in range(ranks)
    ]
    n = SPEC.intermediate_size // ranks
    for r in shards:
        w = r.expert_weights()
        assert w.down_row_group is not None and w.down_row_group.shape == (4, n)
        assert w.down_perm is not None and w.gate_up_perm is not None
        assert w.down_scales.shape == (4, int(w.down_row_group.max()) + 1, 64)
        assert bool((w.down_row_group[:, 1:] >= w.down_row_group[:, :-1]).all())
    assert_shards_make_the_whole(shards, whole)
    x = torch.randn(5, 64, generator=gen(13))
    topk_weights, topk_ids = routing(5, SPEC, 2, seed=14)
    summed = sum(r(x, topk_weights, topk_ids) for r in shards)
    assert rel(summed, whole(x, topk_weights, topk_ids).double()) < 1e-5


def test_tensor_parallel_sizes_that_cut_a_group_or_a_kernel_tile_are_refused() -> None:
    """64 intermediate columns over 2 ranks cut a group of 64 (rank 1 would start at 32);
    act-order may cut groups but not the kernels' K tiles of 16 rows (8 a rank over 8 ranks).
    A desc_act checkpoint whose down g_idx is plain k // g keeps the one-rank layout."""
    with pytest.raises(ValueError, match=r"parallel.tensor = 2 splits .*experts's intermediate"):
        W4A16Experts(SPEC, torch.float32, CPU, fake_rank(1), W4Format("gptq", 64, True, 1))
    eight = ParallelContext(1, 8, group=object())
    with pytest.raises(ValueError, match=r"size 64 at 8, not on a multiple of 16 rows"):
        W4A16Experts(SPEC, torch.float32, CPU, eight, FORMATS["gptq-act-order-g32"])
    plain_fmt = FORMATS["gptq-sym-g32"]
    weights, biases = random_experts(SPEC, plain_fmt, seed=15)  # g_idx = k // g
    fmt = FORMATS["gptq-act-order-g32"]
    whole = loaded(SPEC, fmt, weights, biases)
    shards = [loaded(SPEC, fmt, weights, biases, fake_rank(r)) for r in (0, 1)]
    for r in shards:
        w = r.expert_weights()
        assert w.down_row_group is None and w.down_perm is None and w.down_scales.shape[1] == 1
    down = torch.cat([r.weight("down", 2) for r in shards], 1)
    torch.testing.assert_close(down, whole.weight("down", 2), rtol=0, atol=0)
    # a rank sees its rows of g_idx alone: a group past the last (2 groups of 32) is refused
    weights, biases = random_experts(SPEC, fmt, seed=16)
    tensors = dict(weights[3, "down"][0])
    tensors["g_idx"] = torch.full((64,), 2, dtype=torch.int32)
    weights[3, "down"] = (tensors, weights[3, "down"][1])
    with pytest.raises(ValueError, match=r"experts\.3\.down_proj\.g_idx does not give each"):
        loaded(SPEC, fmt, weights, biases, fake_rank(0))


def test_missing_and_wrong_tensors_are_named() -> None:
    fmt = FORMATS["gptq-act-order-g32"]
    weights, _ = random_experts(SPEC, fmt, seed=10)
    experts = W4A16Experts(SPEC, torch.float32, CPU, fmt=fmt)
    for (e, part), (tensors, _) in weights.items():
        for kind, t in tensors.items():
            if (e, part, kind) != (2, "up", "qzeros"):
                experts.load(f"{part}.{kind}", t, e)
    with pytest.raises(ValueError, match=r"lacks model\.layers\.0\.mlp\.experts\.2\.up_proj\.qzer"):
        experts.finish_loading()
    # an expert's gate and up with different act-orders
    experts.load("up.qzeros", weights[2, "up"][0]["qzeros"], 2)
    experts.load("up.g_idx", weights[1, "down"][0]["g_idx"], 2)
    with pytest.raises(ValueError, match=r"experts\.2\.gate_proj\.g_idx differs from its up_proj"):
        experts.finish_loading()
    with pytest.raises(ValueError, match="gptq experts have no 'gate.weight'"):
        experts.load("gate.weight", torch.zeros(64, 64), 0)
    with pytest.raises(ValueError, match=r"down\.qweight of expert 1 has shape \(8, 32\)"):
        experts.load("down.qweight", torch.zeros(8, 32, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match=r"gate\.qweight is torch.float32, expected int32"):
        experts.load("gate.qweight", torch.zeros(8, 64), 1)
    awq = W4A16Experts(SPEC, torch.float32, CPU, fmt=FORMATS["awq-g32"])
    with pytest.raises(ValueError, match="awq experts have no 'gate.g_idx'"):
        awq.load("gate.g_idx", torch.zeros(64, dtype=torch.int32), 0)
    sym = W4A16Experts(SPEC, torch.float32, CPU, fmt=FORMATS["gptq-sym-g32"])
    with pytest.raises(ValueError, match=r"symmetric \(sym\) but its qzeros are not the zero"):
        sym.load("gate.qzeros", torch.zeros(2, 8, dtype=torch.int32), 0)


# --- the schemes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cls, cfg", [(Gptq, GPTQ), (Awq, AWQ)], ids=["gptq", "awq"])
def test_the_schemes_build_w4a16_experts_and_leave_routers_dense(cls, cfg) -> None:
    """gptq and awq give W4A16Experts; a MoE router (".gate") stays a dense linear layer, as
    GPTQ and AWQ tools leave it; experts left unquantized by modules_to_not_convert are
    UnquantizedExperts, and only some of them a refusal (one layout a layer)."""
    spec = ExpertsSpec("model.layers.0.mlp.experts", 4, 128, 128)
    scheme = cls(QuantConfig(cfg))
    experts = scheme.experts(spec, torch.float32, CPU)
    assert isinstance(experts, W4A16Experts) and experts.fmt.method == cls.name
    router = LinearSpec("model.layers.0.mlp.gate", 128, (4,))
    assert type(scheme.linear(router, torch.float32, CPU)) is DenseLinear
    gate_proj = LinearSpec("model.layers.1.mlp.gate_up_proj", 128, (128, 128))
    assert isinstance(scheme.linear(gate_proj, torch.float32, CPU), W4A16Linear)
    left = cls(QuantConfig(dict(cfg, modules_to_not_convert=["mlp.experts"])))
    assert type(left.experts(spec, torch.float32, CPU)) is UnquantizedExperts
    some = cls(QuantConfig(dict(cfg, modules_to_not_convert=["experts.3.down_proj"])))
    with pytest.raises(ValueError, match=r"leaves .*experts\.3\.down_proj unquantized but not"):
        some.experts(spec, torch.float32, CPU)


# --- whole models through the engine --------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """test_qwen3's tiny Qwen3-MoE (layers 0 and 2 routed over 8 experts, top-2) with a moe
    intermediate size of 64, two groups of 32, so that act-order orders down's rows too."""
    path = tmp_path_factory.mktemp("qwen3-moe-w4")
    cfg = hf_config("qwen3-moe")
    cfg.moe_intermediate_size = 64
    torch.manual_seed(0)
    spread_weights(transformers.Qwen3MoeForCausalLM(cfg).eval()).save_pretrained(path)
    return path


CHECKPOINTS = {
    "gptq-g32": dict(GPTQ, group_size=32),
    "gptq-v2-asym-act-order-g32": dict(
        GPTQ, group_size=32, desc_act=True, sym=False, checkpoint_format="gptq_v2"
    ),
    "awq-g32": dict(AWQ, group_size=32),
}


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_moe_checkpoint_agrees_with_its_dequantized_weights(qwen3_moe, tmp_path, name) -> None:
    cfg = CHECKPOINTS[name]
    quant, ref = write_w4(qwen3_moe, tmp_path / name, cfg)
    stored = load_file(quant / "model.safetensors")
    prefix = "model.layers.2.mlp.experts.7"
    gptq = cfg["quant_method"] == "gptq"
    assert stored[f"{prefix}.down_proj.qweight"].shape == ((64 // 8, 64) if gptq else (64, 8))
    assert stored[f"{prefix}.gate_proj.scales"].shape == (2, 64)
    assert "model.layers.2.mlp.gate.weight" in stored  # the router, unquantized
    llm = make_llm(quant)
    for mlp in moe_layers(llm):
        assert isinstance(mlp.experts, W4A16Experts) and type(mlp.gate) is DenseLinear
        assert (mlp.experts.down_perm is not None) == cfg.get("desc_act", False)
        assert (mlp.experts.down_zeros is not None) == (not cfg.get("sym", False))
    qkv = llm.engine.executor.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, W4A16Linear)
    agree_in_top5(run(llm), run(make_llm(ref)))


def test_a_moe_checkpoint_missing_an_expert_tensor_names_it(qwen3_moe, tmp_path) -> None:
    quant, _ = write_w4(qwen3_moe, tmp_path / "gptq", dict(GPTQ, group_size=32))
    tensors = load_file(quant / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.down_proj.scales"]
    save_file(tensors, quant / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks model\.layers\.2\.mlp\.experts\.5\.down_proj\.sc"):
        make_llm(quant)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_gpu_moe_checkpoint_agrees_with_its_dequantized_weights(qwen3_moe, tmp_path, name):
    """The same in bf16 on CUDA: the fused MoE kernels' "w4a16" path (GEMV at decode, grouped
    GEMM at prefill) with CUDA graphs, against the dequantized checkpoint served in bf16."""
    quant, ref = write_w4(qwen3_moe, tmp_path / name, CHECKPOINTS[name])
    gpu = {"engine.device": "cuda", "model.dtype": "bfloat16", "kv_cache.memory": "1GiB"}
    llm = make_llm(quant, **gpu)
    for mlp in moe_layers(llm):
        assert isinstance(mlp.experts, W4A16Experts) and mlp.experts.gate_up.is_cuda
    agree_in_top5(run(llm), run(make_llm(ref, **gpu)))


def test_act_order_moe_over_two_ranks_gives_the_greedy_tokens_of_one(qwen3_moe, tmp_path):
    """A GPTQ act-order Qwen3-MoE checkpoint (group 32) at parallel.tensor = 2 (gloo ranks on
    the CPU): each expert's down split along K with row groups (rank 0's checked here), as
    o_proj's; the same greedy tokens as one rank."""
    from test_distributed import GREEDY, PROMPTS, generate
    from test_distributed import make_llm as make_ranks

    cfg = dict(GPTQ, group_size=32, desc_act=True)
    quant, _ = write_w4(qwen3_moe, tmp_path / "act-order", cfg)
    one = generate(quant, 1)
    llm = make_ranks(quant, 2)
    try:
        for mlp in moe_layers(llm):
            assert mlp.experts.down_row_group is not None
        assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == one
    finally:
        llm.engine.executor.close()
