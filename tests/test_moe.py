"""The fused-MoE contract on the CPU: routing functions of the major MoE families, the unquantized
experts (per-expert and stacked loading, both activations, tensor-parallel slices) and FusedMoE,
each against plain reference code written here, and against transformers' own MoE blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inferx_core.interfaces import BuildContext, ExpertsSpec, RouterSpec
from inferx_core.moe import FusedMoE, UnquantizedExperts, append_shared, route
from inferx_core.ops_torch import TorchOps
from inferx_core.parallel import ParallelContext
from inferx_core.quant_none import Unquantized

T, E, K, H, INTER = 11, 8, 2, 16, 12


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ref_route(logits, k, *, scoring="softmax", after_topk=False, renormalize=False, groups=1,
              topk_groups=1, group_score="max", bias=None, scaling=1.0):  # fmt: skip
    """Token by token, in float64, as the model families' own code reads."""
    weights, ids = [], []
    for row in logits.double():
        if after_topk:
            top = row.topk(k).indices
            w = row[top].softmax(0)
        else:
            scores = row.softmax(0) if scoring == "softmax" else row.sigmoid()
            pick = scores + (0 if bias is None else bias.double())
            per = len(row) // groups
            allowed = list(range(len(row)))
            if groups > 1:
                gs = []
                for g in range(groups):
                    vals = pick[g * per : (g + 1) * per].sort(descending=True).values
                    gs.append(vals[0] if group_score == "max" else vals[:2].sum())
                best = torch.stack(gs).topk(topk_groups).indices.tolist()
                allowed = [e for e in allowed if e // per in best]
            cand = torch.tensor(allowed)
            top = cand[pick[cand].topk(k).indices]
            w = scores[top]
            if renormalize:
                w = w / w.sum()
        weights.append(w * scaling)
        ids.append(top)
    return torch.stack(weights), torch.stack(ids)


def same_routing(got, want):
    (gw, gi), (ww, wi) = got, want
    assert gw.dtype == torch.float32
    order_g, order_w = gi.argsort(1), wi.argsort(1)
    assert torch.equal(gi.gather(1, order_g), wi.gather(1, order_w))
    torch.testing.assert_close(
        gw.gather(1, order_g).double(), ww.gather(1, order_w), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_softmax_topk_mixtral_qwen(renormalize):
    logits = torch.randn(T, E, generator=gen())
    spec = RouterSpec(E, K, renormalize=renormalize)
    same_routing(route(logits, spec), ref_route(logits, K, renormalize=renormalize))


def test_route_softmax_after_topk_gpt_oss():
    logits = torch.randn(T, E, generator=gen(1))
    after = route(logits, RouterSpec(E, K, softmax_after_topk=True))
    same_routing(after, ref_route(logits, K, after_topk=True))
    # picking the top raw logits and softmaxing them is softmax-all, top-k and renormalize
    same_routing(after, ref_route(logits, K, renormalize=True))


def test_route_group_limited_deepseek_v2():
    logits = torch.randn(T, 16, generator=gen(2))
    spec = RouterSpec(16, 3, num_groups=4, topk_groups=2, group_score="max", scaling=2.5)
    want = ref_route(logits, 3, groups=4, topk_groups=2, scaling=2.5)
    same_routing(route(logits, spec), want)


def test_route_sigmoid_bias_top2_groups_deepseek_v3():
    logits = torch.randn(T, 16, generator=gen(3))
    bias = torch.randn(16, generator=gen(4)) * 0.3
    spec = RouterSpec(
        16,
        4,
        scoring="sigmoid",
        renormalize=True,
        num_groups=4,
        topk_groups=2,
        group_score="top2",
        selection_bias=True,
        scaling=2.5,
    )
    want = ref_route(
        logits,
        4,
        scoring="sigmoid",
        renormalize=True,
        groups=4,
        topk_groups=2,
        group_score="top2",
        bias=bias,
        scaling=2.5,
    )
    same_routing(route(logits, spec, bias), want)
    same_routing(TorchOps().route_experts(logits, spec, bias), want)


@pytest.mark.parametrize(
    "spec",
    [
        RouterSpec(E, K, renormalize=True),
        RouterSpec(E, K, softmax_after_topk=True, scaling=2.5),
        RouterSpec(16, 3, num_groups=4, topk_groups=2, scaling=2.5),  # DeepSeek-V2
    ],
)
def test_route_appends_shared_experts_unscaled(spec):
    """spec.shared fixed pairs after the top-k: weight 1.0 whatever the routed experts'
    scaling, ids E, E + 1, ...; the picks themselves unchanged. From whole logits and from
    linear_parts' partial logits (KernelOps' default)."""
    logits = torch.randn(T, spec.num_experts, generator=gen(30))
    routed_w, routed_ids = route(logits, spec)
    fused = dataclasses.replace(spec, shared=2)
    e, k = spec.num_experts, spec.top_k
    parts = torch.stack([logits / 2, logits / 2])
    for weights, ids in (route(logits, fused), TorchOps().route_experts(parts, fused)):
        assert weights.shape == ids.shape == (T, k + 2)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int64
        assert torch.equal(ids[:, :k], routed_ids)
        torch.testing.assert_close(weights[:, :k], routed_w, rtol=1e-6, atol=1e-7)
        assert torch.equal(ids[:, k:], torch.tensor([[e, e + 1]]).expand(T, 2))
        assert torch.equal(weights[:, k:], torch.ones(T, 2))
    assert append_shared(routed_w, routed_ids, spec) == (routed_w, routed_ids)


def test_shared_counts_are_checked():
    with pytest.raises(ValueError, match="shared experts -1"):
        RouterSpec(E, K, shared=-1)
    with pytest.raises(ValueError, match="0 <= shared < num_experts"):
        ExpertsSpec("mlp.experts", 2, H, INTER, shared=2)
    assert ExpertsSpec("mlp.experts", E + 2, H, INTER, shared=2).routed == E


def expert_tensors(seed: int, bias: bool) -> dict[str, torch.Tensor]:
    """Per-expert weights in float64 ([out, in]): gate, up [E, I, H], down [E, H, I]."""
    g = gen(seed)
    w = {
        "gate": torch.randn(E, INTER, H, generator=g, dtype=torch.float64) * 0.3,
        "up": torch.randn(E, INTER, H, generator=g, dtype=torch.float64) * 0.3,
        "down": torch.randn(E, H, INTER, generator=g, dtype=torch.float64) * 0.3,
    }
    if bias:
        w["gate_b"] = torch.randn(E, INTER, generator=g, dtype=torch.float64)
        w["up_b"] = torch.randn(E, INTER, generator=g, dtype=torch.float64)
        w["down_b"] = torch.randn(E, H, generator=g, dtype=torch.float64)
    return w


def stacked_gate_up(w: dict[str, torch.Tensor], activation: str, key: str = "") -> torch.Tensor:
    gate, up = w["gate" + key], w["up" + key]
    if activation == "silu":
        return torch.cat([gate, up], dim=1)
    return torch.stack([gate, up], dim=2).flatten(1, 2)  # rows gate0, up0, gate1, up1, ...


def make_experts(w, activation, stacked, parallel=None, dtype=torch.float64):
    spec = ExpertsSpec("mlp.experts", E, H, INTER, activation=activation, bias="gate_b" in w)
    experts = UnquantizedExperts(spec, dtype, torch.device("cpu"), parallel or ParallelContext())
    if stacked:
        experts.load("gate_up.weight", stacked_gate_up(w, activation))
        experts.load("down.weight", w["down"])
        if spec.bias:
            experts.load("gate_up.bias", stacked_gate_up(w, activation, "_b"))
            experts.load("down.bias", w["down_b"])
    else:
        for e in range(E):
            for part in ("gate", "up", "down"):
                experts.load(f"{part}.weight", w[part][e], expert=e)
                if spec.bias:
                    experts.load(f"{part}.bias", w[part + "_b"][e], expert=e)
    experts.finish_loading()
    return experts


def ref_experts(x, topk_weights, topk_ids, w, activation, alpha=1.702, limit=7.0):
    """Token by token, expert by expert, in float64."""
    bias = "gate_b" in w
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            xt = x[t].double()
            gate, up = w["gate"][e] @ xt, w["up"][e] @ xt
            if bias:
                gate, up = gate + w["gate_b"][e], up + w["up_b"][e]
            if activation == "silu":
                a = torch.nn.functional.silu(gate) * up
            else:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                a = gate * torch.sigmoid(alpha * gate) * (up + 1)
            y = w["down"][e] @ a + (w["down_b"][e] if bias else 0)
            out[t] += topk_weights[t, j].double() * y
    return out


def routing(seed: int = 5):
    g = gen(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    weights, ids = route(torch.randn(T, E, generator=g), RouterSpec(E, K, renormalize=True))
    return x, weights, ids


@pytest.mark.parametrize("activation,bias", [("silu", False), ("swiglu_oai", True)])
def test_experts_per_expert_and_stacked_loading_agree(activation, bias):
    w = expert_tensors(6, bias)
    x, weights, ids = routing()
    one = make_experts(w, activation, stacked=False)
    stacked = make_experts(w, activation, stacked=True)
    for a, b in zip(one.parameters(), stacked.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(one(x, weights, ids), stacked(x, weights, ids))


@pytest.mark.parametrize("activation,bias", [("silu", False), ("silu", True), ("swiglu_oai", True)])
def test_experts_match_per_token_reference(activation, bias):
    w = expert_tensors(7, bias)
    if activation == "swiglu_oai":  # large enough that both clamps bite
        w = {k: v * 4 for k, v in w.items()}
    x, weights, ids = routing()
    got = make_experts(w, activation, stacked=True)(x, weights, ids)
    want = ref_experts(x, weights, ids, w, activation)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    if activation == "swiglu_oai":
        assert (w["gate"] @ x.T.double()).abs().max() > 7.0  # the clamps were exercised


class FakeGroup(ParallelContext):
    """A rank of a world of two without a process group; counts all_reduce calls."""

    reduces = 0

    def all_reduce(self, x):
        FakeGroup.reduces += 1
        return x


def test_tensor_parallel_slices_sum_to_the_whole():
    w = expert_tensors(8, bias=True)
    x, weights, ids = routing()
    for activation in ("silu", "swiglu_oai"):
        whole = make_experts(w, activation, stacked=True)(x, weights, ids)
        parts = [
            make_experts(w, activation, stacked=s, parallel=FakeGroup(r, 2, group=object()))
            for r, s in ((0, True), (1, False))
        ]
        assert parts[1].down_bias is None  # added once, by rank 0
        total = sum(p(x, weights, ids) for p in parts)
        torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)


def test_missing_expert_tensor_is_named():
    w = expert_tensors(9, bias=False)
    spec = ExpertsSpec("model.layers.0.mlp.experts", E, H, INTER)
    experts = Unquantized().experts(spec, torch.float32, torch.device("cpu"), ParallelContext())
    assert isinstance(experts, UnquantizedExperts)
    experts.load("gate_up.weight", stacked_gate_up(w, "silu"))
    for e in range(E):
        if e != 3:
            experts.load("down.weight", w["down"][e], expert=e)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.3\.down_proj\.weight"):
        experts.finish_loading()
    with pytest.raises(ValueError, match=r"expected \(16, 12\)"):
        experts.load("down.weight", w["down"][0].T, expert=0)


def context(dtype=torch.float64, parallel=None) -> BuildContext:
    return BuildContext(
        dtype, torch.device("cpu"), None, Unquantized(), TorchOps(), parallel or ParallelContext()
    )


class SharedMLP(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = gen(seed)
        self.up = torch.randn(INTER, H, generator=g, dtype=torch.float64) * 0.3
        self.down = torch.randn(H, INTER, generator=g, dtype=torch.float64) * 0.3

    def forward(self, x):
        return torch.nn.functional.silu(x @ self.up.T) @ self.down.T


def test_fused_moe_with_shared_experts():
    w = expert_tensors(10, bias=False)
    router_w = torch.randn(E, H, generator=gen(11), dtype=torch.float64)
    spec = RouterSpec(E, K, renormalize=False, scaling=1.5)
    shared = SharedMLP(12)
    moe = FusedMoE(
        context(), "mlp", H, spec, ExpertsSpec("mlp.experts", E, H, INTER), shared=shared
    )
    moe.gate.load("weight", router_w)
    moe.experts.load("gate_up.weight", stacked_gate_up(w, "silu"))
    moe.experts.load("down.weight", w["down"])
    moe.experts.finish_loading()
    x = torch.randn(T, H, generator=gen(13), dtype=torch.float64)
    weights, ids = ref_route(x @ router_w.T, K, scaling=1.5)
    want = ref_experts(x, weights, ids, w, "silu") + shared(x)
    torch.testing.assert_close(moe(x), want, rtol=1e-6, atol=1e-6)


class GatedMLP(torch.nn.Module):
    """A shared-experts MLP of intermediate size n_shared * INTER: down(silu(gate x) * up x)."""

    def __init__(self, seed: int, n_shared: int) -> None:
        super().__init__()
        g = gen(seed)
        inter = n_shared * INTER
        self.gate = torch.randn(inter, H, generator=g, dtype=torch.float64) * 0.3
        self.up = torch.randn(inter, H, generator=g, dtype=torch.float64) * 0.3
        self.down = torch.randn(H, inter, generator=g, dtype=torch.float64) * 0.3

    def forward(self, x):
        h = torch.nn.functional.silu(x @ self.gate.T) * (x @ self.up.T)
        return h @ self.down.T


def shared_layers(router: RouterSpec, seed: int, n_shared: int = 2, parallel=None):
    """The same layer two ways: (shared experts apart as a GatedMLP, the reference; its MLP
    as n_shared expert slots E.. of a fused layer, loaded slice by slice on `parallel`'s
    rank)."""
    w = expert_tensors(seed, bias=False)
    router_w = torch.randn(E, H, generator=gen(seed + 1), dtype=torch.float64)
    mlp = GatedMLP(seed + 2, n_shared)
    apart = FusedMoE(
        context(), "mlp", H, router, ExpertsSpec("mlp.experts", E, H, INTER), shared=mlp
    )
    spec = ExpertsSpec("mlp.experts", E + n_shared, H, INTER, shared=n_shared)
    fused = FusedMoE(context(parallel=parallel), "mlp", H, router, spec)
    assert fused.shared is None and fused.router.shared == n_shared
    for layer in (apart, fused):
        layer.gate.load("weight", router_w)
        for e in range(E):
            for part in ("gate", "up", "down"):
                layer.experts.load(f"{part}.weight", w[part][e], expert=e)
    for i in range(n_shared):
        rows = slice(i * INTER, (i + 1) * INTER)
        fused.experts.load("gate.weight", mlp.gate[rows], expert=E + i)
        fused.experts.load("up.weight", mlp.up[rows], expert=E + i)
        fused.experts.load("down.weight", mlp.down[:, rows], expert=E + i)
    for layer in (apart, fused):
        layer.experts.finish_loading()
    return apart, fused


@pytest.mark.parametrize(
    "router",
    [RouterSpec(E, K, scaling=2.5), RouterSpec(E, 3, num_groups=4, topk_groups=2, scaling=1.5)],
)
def test_shared_experts_as_expert_slots_equal_the_shared_mlp(router):
    """Shared experts as slots of the routed experts (each a slice of the shared MLP's
    intermediate size, routed with weight 1.0, never scaled) give the layer with the MLP
    apart: float64, rounding only. Greedy and group-limited routing, both scaled."""
    apart, fused = shared_layers(router, seed=40)
    x = torch.randn(T, H, generator=gen(41), dtype=torch.float64)
    torch.testing.assert_close(fused(x), apart(x), rtol=1e-10, atol=1e-10)
    # against the per-token reference too: the routed part scaled, the MLP not
    weights, ids = route(x @ apart.gate.weight.T, router)
    want = ref_experts(x, weights, ids, expert_tensors(40, bias=False), "silu") + apart.shared(x)
    torch.testing.assert_close(fused(x), want, rtol=1e-10, atol=1e-10)


def test_shared_expert_slots_shard_with_the_ranks():
    """Each rank keeps its slice of every shared slot, as of every routed expert: the ranks'
    partial outputs (FakeGroup's all-reduce passes them through) add up to the whole layer."""
    router = RouterSpec(E, K, renormalize=True)
    _, whole = shared_layers(router, seed=42)
    x = torch.randn(T, H, generator=gen(43), dtype=torch.float64)
    ranks = [shared_layers(router, 42, parallel=FakeGroup(r, 2, group=object()))[1] for r in (0, 1)]
    assert ranks[0].experts.gate_up.shape == (E + 2, INTER, H)  # half of 2 * INTER rows
    total = sum(layer(x) for layer in ranks)
    torch.testing.assert_close(total, whole(x), rtol=1e-12, atol=1e-12)


class LegacyRouting(TorchOps):
    """A KernelOps whose route_experts predates RouterSpec.shared: top-k columns only."""

    fuse_shared_experts = True

    def route_experts(self, logits, spec, selection_bias=None):
        return super().route_experts(logits, dataclasses.replace(spec, shared=0), selection_bias)


def test_a_routing_without_the_shared_slots_gets_them_appended():
    router = RouterSpec(E, K, scaling=2.5)
    apart, fused = shared_layers(router, seed=44)
    fused.ops = LegacyRouting()
    x = torch.randn(T, H, generator=gen(45), dtype=torch.float64)
    torch.testing.assert_close(fused(x), apart(x), rtol=1e-10, atol=1e-10)


def test_fused_moe_refuses_inconsistent_shared_experts():
    spec = ExpertsSpec("mlp.experts", E + 2, H, INTER, shared=2)
    with pytest.raises(ValueError, match="router has 1 shared experts, the experts 2"):
        FusedMoE(context(), "mlp", H, RouterSpec(E, K, shared=1), spec)
    with pytest.raises(ValueError, match="picks among 10 experts, the experts have 8 routed"):
        FusedMoE(context(), "mlp", H, RouterSpec(E + 2, K), spec)
    with pytest.raises(ValueError, match="both fused into the experts and apart"):
        FusedMoE(context(), "mlp", H, RouterSpec(E, K), spec, shared=SharedMLP(46))


def test_fused_moe_all_reduces_once_above_world_size_one():
    FakeGroup.reduces = 0
    for parallel, calls in ((ParallelContext(), 0), (FakeGroup(0, 2, group=object()), 1)):
        moe = FusedMoE(
            context(parallel=parallel),
            "mlp",
            H,
            RouterSpec(E, K),
            ExpertsSpec("mlp.experts", E, H, INTER),
            shared=SharedMLP(14),
        )
        moe(torch.randn(3, H, dtype=torch.float64))
        assert FakeGroup.reduces == calls


transformers = pytest.importorskip("transformers")


def randomize(module: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)


def test_qwen3_moe_block_parity():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=K,
        norm_topk_prob=True,
    )  # fmt: skip
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    randomize(block, 15)
    moe = FusedMoE(
        context(torch.float32),
        "mlp",
        H,
        RouterSpec(E, K, renormalize=True),
        ExpertsSpec("mlp.experts", E, H, INTER),
    )
    # transformers 5 keeps the experts stacked: experts.gate_up_proj [E, 2I, H] (gate rows, then
    # up rows), experts.down_proj [E, H, I]
    state = block.state_dict()
    assert set(state) == {"gate.weight", "experts.gate_up_proj", "experts.down_proj"}
    moe.gate.load("weight", state["gate.weight"])
    moe.experts.load("gate_up.weight", state["experts.gate_up_proj"])
    moe.experts.load("down.weight", state["experts.down_proj"])
    moe.experts.finish_loading()
    x = torch.randn(1, 2 * T, H, generator=gen(16))
    with torch.no_grad():
        want = block(x)[0]
    torch.testing.assert_close(moe(x[0]), want, rtol=1e-5, atol=1e-5)


def test_gpt_oss_mlp_parity():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = transformers.GptOssConfig(
        hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=K
    )
    block = GptOssMLP(cfg).eval()
    randomize(block, 17)
    spec = ExpertsSpec(
        "mlp.experts",
        E,
        H,
        INTER,
        activation="swiglu_oai",
        bias=True,
        alpha=cfg.swiglu_alpha,
        limit=cfg.swiglu_limit,
    )
    router = RouterSpec(E, K, softmax_after_topk=True)
    moe = FusedMoE(context(torch.float32), "mlp", H, router, spec, router_bias=True)
    state = block.state_dict()
    moe.gate.load("weight", state["router.weight"])
    moe.gate.load("bias", state["router.bias"])
    # gpt-oss stores experts [in, out]: gate_up_proj [E, H, 2I] (interleaved), down [E, I, H]
    moe.experts.load("gate_up.weight", state["experts.gate_up_proj"].transpose(-1, -2))
    moe.experts.load("gate_up.bias", state["experts.gate_up_proj_bias"])
    moe.experts.load("down.weight", state["experts.down_proj"].transpose(-1, -2))
    moe.experts.load("down.bias", state["experts.down_proj_bias"])
    moe.experts.finish_loading()
    x = torch.randn(1, 2 * T, H, generator=gen(18)) * 3
    with torch.no_grad():
        want = block(x)[0][0]
    torch.testing.assert_close(moe(x[0]), want, rtol=1e-5, atol=1e-5)
