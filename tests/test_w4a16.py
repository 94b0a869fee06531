"""W4A16 (inferx_quant.w4a16) on the CPU: GPTQ and AWQ tensors written here by the published
layouts' own definitions (not the module's packers), the reference path against the exact
dequantized weights, the schemes' configs and refusals, and tiny random Llama / Qwen2 models
in each layout against a reference engine holding the exact dequantized weights: greedy tokens
agree in vLLM's top-5 sense."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from inferx_core.executor import LoadError, pick_quant_scheme
from inferx_core.interfaces.quant import LinearSpec, QuantConfig
from inferx_core.parallel import ParallelContext
from inferx_core.plugins import plugins
from inferx_core.quant_none import DenseLinear
from inferx_quant.w4a16 import (
    AWQ_ORDER,
    Awq,
    Gptq,
    W4A16Linear,
    W4Format,
    pack_rows,
    unpack_cols,
    unpack_rows,
)

CPU = torch.device("cpu")


# --- the published layouts, written from their definitions ---


def _word(nibbles: list[int]) -> int:
    """An int32 of eight 4-bit values, nibble i (bits 4i..4i+3) = nibbles[i]."""
    word = sum(int(v) << (4 * i) for i, v in enumerate(nibbles))
    return word - (1 << 32) if word >= 1 << 31 else word


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """_word over the last dimension (8) of a tensor, in one pass: int32 [...]."""
    shifts = 4 * torch.arange(8, dtype=torch.int64)
    word = (nibbles.to(torch.int64) << shifts).sum(-1)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def gptq_qweight(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] -> int32 [K / 8, N]: word [i, n] holds rows 8i..8i+7 of column n, row 8i + j
    in nibble j."""
    k, n = q.shape
    return _words(q.reshape(k // 8, 8, n).transpose(1, 2))


def pack_columns(v: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """v [R, N] -> int32 [R, N / 8]: nibble i of word [r, c] holds column 8c + order[i] (GPTQ's
    qzeros: in order; AWQ's qweight and qzeros: AWQ's [0, 2, 4, 6, 1, 3, 5, 7])."""
    r, n = v.shape
    return _words(v.reshape(r, n // 8, 8)[..., list(order)])


def quantize(
    w: torch.Tensor,
    group: int,
    sym: bool,
    gen: torch.Generator,
    act_order: bool = False,
    zero_min: int = 0,
) -> dict[str, torch.Tensor]:
    """Round-to-nearest 4-bit quantization of w [N, K] in groups of `group` input rows (-1: all),
    in a random act-order when asked: -> q [K, N], zeros [G, N], fp16 scales [G, N], g_idx [K],
    and `exact`, the float32 [N, K] weight the tensors stand for."""
    n, k = w.shape
    g = k if group == -1 else group
    order = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).to(torch.int32)  # groups formed in `order`
    wt = w.t().float()
    groups = k // g
    scales = torch.empty(groups, n, dtype=torch.float16)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    for j in range(groups):
        rows = wt[g_idx == j]
        if sym:
            scales[j] = (rows.abs().amax(0) / 7).half()
            zeros[j] = 8
        else:
            lo, hi = rows.amin(0), rows.amax(0)
            scales[j] = ((hi - lo) / 15).half()
            zeros[j] = (-lo / scales[j].float()).round().clamp(zero_min, 15).long()
    s, z = scales.float()[g_idx.long()], zeros[g_idx.long()]
    q = ((wt / s).round() + z).clamp(0, 15).long()
    exact = ((q - z).float() * s).t().contiguous()
    return {"q": q, "zeros": zeros, "scales": scales, "g_idx": g_idx, "exact": exact}


def gptq_tensors(t: dict[str, torch.Tensor], v2: bool = False) -> dict[str, torch.Tensor]:
    """A GPTQ layer's checkpoint tensors; the original format stores each zero minus one."""
    return {
        "qweight": gptq_qweight(t["q"]),
        "qzeros": pack_columns(t["zeros"] - (0 if v2 else 1)),
        "scales": t["scales"],
        "g_idx": t["g_idx"],
    }


def awq_tensors(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        "qweight": pack_columns(t["q"], AWQ_ORDER),
        "qzeros": pack_columns(t["zeros"], AWQ_ORDER),
        "scales": t["scales"],
    }


def test_the_layouts_bit_positions() -> None:
    """Eight values 0..7 in one word, as each format puts them (hand-written words)."""
    assert _word(list(range(8))) == 0x76543210
    column = torch.arange(8).reshape(8, 1)
    assert gptq_qweight(column).item() == 0x76543210  # rows along K, row j in nibble j
    assert pack_columns(column.t()).item() == 0x76543210  # GPTQ qzeros: columns in order
    assert pack_columns(column.t(), AWQ_ORDER).item() == 0x75316420  # AWQ: 0 2 4 6 1 3 5 7
    assert unpack_rows(torch.tensor([[0x76543210]], dtype=torch.int32)).flatten().tolist() == list(
        range(8)
    )
    awq = torch.tensor([[0x75316420]], dtype=torch.int32)
    assert unpack_cols(awq, AWQ_ORDER).flatten().tolist() == list(range(8))
    # a nibble of 8 or more sets the int32's sign bit: unpacking must not smear it
    high = torch.tensor([[_word([15, 8, 0, 9, 1, 15, 7, 12])]], dtype=torch.int32)
    assert high.item() < 0
    assert unpack_cols(high).flatten().tolist() == [15, 8, 0, 9, 1, 15, 7, 12]
    nibbles = torch.randint(0, 16, (32, 8))
    assert _words(nibbles).tolist() == [_word(row) for row in nibbles.tolist()]
    values = torch.randint(0, 16, (64, 24), dtype=torch.uint8)
    assert torch.equal(unpack_rows(pack_rows(values)), values)
    assert torch.equal(pack_rows(values), gptq_qweight(values.long()))


# --- one layer against the exact dequantized weights ---

QKV = LinearSpec(
    "model.layers.0.self_attn.qkv_proj",
    256,
    (128, 64, 64),
    bias=True,
    part_names=("q_proj", "k_proj", "v_proj"),
)
CASES = {
    "gptq-sym-g64": (W4Format("gptq", 64, True, 1), {}),
    "gptq-sym-perchannel": (W4Format("gptq", -1, True, 1), {}),
    "gptq-act-order-g64": (W4Format("gptq", 64, True, 1, desc_act=True), {"act_order": True}),
    "gptq-v2-asym-g32": (W4Format("gptq", 32, False, 0), {}),
    "gptq-asym-act-order": (W4Format("gptq", 64, False, 1, True), {"act_order": True}),
    "awq-g64": (W4Format("awq", 64, False), {}),
    "awq-g128": (W4Format("awq", 128, False), {}),
}


def loaded(
    fmt: W4Format,
    spec: LinearSpec = QKV,
    seed: int = 0,
    dtype=torch.float32,
    parallel: ParallelContext | None = None,
    **kw,
):
    """A W4A16Linear loaded with random parts -> (layer, exact weight [N, K], bias), the
    weight and bias whole-model (the layer keeps its rank's share)."""
    gen = torch.Generator().manual_seed(seed)
    layer = W4A16Linear(spec, dtype, CPU, parallel or ParallelContext(), fmt=fmt)
    exact, biases = [], []
    # fused parts share one act-order, as GPTQ gives them (they share their input)
    perm_seed = torch.randint(0, 2**31, (1,), generator=gen).item()
    for part, rows in enumerate(spec.output_sizes):
        w = torch.randn(rows, spec.in_features, generator=gen) * 0.05
        t = quantize(
            w,
            fmt.group_size,
            fmt.sym,
            torch.Generator().manual_seed(perm_seed),
            zero_min=fmt.zero_offset,  # the original GPTQ format cannot store a zero of 0
            **kw,
        )
        tensors = awq_tensors(t) if fmt.method == "awq" else gptq_tensors(t, not fmt.zero_offset)
        for kind, tensor in tensors.items():
            layer.load(kind, tensor, part)
        exact.append(t["exact"])
        if spec.bias:
            biases.append(torch.randn(rows, generator=gen))
            layer.load("bias", biases[-1], part)
    layer.finish_loading()
    return layer, torch.cat(exact), torch.cat(biases) if biases else None


@pytest.mark.parametrize("name", CASES)
def test_dequantized_weight_and_forward_are_exact(name: str) -> None:
    """The dequantized weight equals the exact one bit for bit; forward is one float32 GEMM of
    it: within 1e-5 of the output's scale of float64."""
    fmt, kw = CASES[name]
    layer, exact, bias = loaded(fmt, **kw)
    assert layer.dense_weight() is None
    assert layer.qweight.dtype == torch.int32 and layer.qweight.shape == (256 // 8, 256)
    assert (layer.perm is not None) == bool(kw.get("act_order"))
    params = dict(layer.named_parameters())  # what counting a model's weight bytes sees
    assert {"qweight", "scales", "zeros"} <= params.keys() and "bias" in params
    torch.testing.assert_close(layer.dequantized_weight(), exact, rtol=0, atol=0)
    x = torch.randn(2, 5, QKV.in_features)
    got = layer(x)
    want = (x.double() @ exact.double().t() + bias.double()).float()
    assert got.shape == (2, 5, 256) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_act_order_rows_are_stored_in_group_order() -> None:
    """After load, kernel row i is input row perm[i] and each group's rows are contiguous."""
    fmt, kw = CASES["gptq-act-order-g64"]
    layer, exact, _ = loaded(fmt, **kw)
    perm = layer.perm.long()
    assert sorted(perm.tolist()) == list(range(256))
    q = unpack_rows(layer.qweight).float()  # [K, N], group order
    group = torch.arange(256) // 64
    w = (q - layer.zeros.float()[group]) * layer.scales.float()[group]
    torch.testing.assert_close(w, exact.t()[perm], rtol=0, atol=0)


def test_bfloat16_activations_come_back_bfloat16() -> None:
    layer, exact, bias = loaded(CASES["awq-g64"][0], dtype=torch.bfloat16)
    x = torch.randn(3, QKV.in_features).bfloat16()
    got = layer(x)
    want = (x.float() @ exact.t()).bfloat16() + bias.bfloat16()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


def fake_rank(rank: int) -> ParallelContext:
    return ParallelContext(rank, 2, group=object())  # sharding only: no collective runs


@pytest.mark.parametrize(
    "name",
    ["gptq-sym-g64", "gptq-sym-perchannel", "awq-g64", "gptq-act-order-g64", "gptq-asym-act-order"],
)
@pytest.mark.parametrize("style", ["column", "row"])
def test_tensor_parallel_shards_hold_the_whole(name: str, style: str) -> None:
    """Two ranks' shards, put back together, are the whole layer: column-parallel each part's
    halves of its rows, row-parallel the halves of its inputs (in whole groups; act-order's
    with their row groups); their forward passes give the whole layer's output (row-parallel:
    summed, bias once)."""
    fmt, kw = CASES[name]
    spec = LinearSpec(
        "model.layers.0.mlp.gate_up_proj", 256, (128, 64), True, style, ("gate_proj", "up_proj")
    )
    whole, exact, bias = loaded(fmt, spec, seed=3, **kw)
    ranks = [loaded(fmt, spec, seed=3, parallel=fake_rank(r), **kw)[0] for r in (0, 1)]
    weights = [r.dequantized_weight() for r in ranks]
    x = torch.randn(3, 256)
    if style == "column":
        gate = [w[:64] for w in weights] + [w[64:] for w in weights]  # gate halves, up halves
        torch.testing.assert_close(torch.cat(gate), exact, rtol=0, atol=0)
        torch.testing.assert_close(
            torch.cat([r.bias[:64] for r in ranks] + [r.bias[64:] for r in ranks]), bias
        )
        ys = [r(x) for r in ranks]
        y = torch.cat([ys[0][:, :64], ys[1][:, :64], ys[0][:, 64:], ys[1][:, 64:]], 1)
    else:
        torch.testing.assert_close(torch.cat(weights, 1), exact, rtol=0, atol=0)
        assert ranks[1].bias is None  # added once, by rank 0
        y = ranks[0](x[:, :128]) + ranks[1](x[:, 128:])
    torch.testing.assert_close(y, whole(x), rtol=1e-5, atol=1e-5)


def fake_ranks(n: int) -> list[ParallelContext]:
    return [ParallelContext(r, n, group=object()) for r in range(n)]


def split_along_k(fmt: W4Format, k: int, ranks: int, seed: int = 3, **kw):
    """A row-parallel down_proj of k inputs and 96 outputs (bias), whole and as `ranks` fake
    ranks' shards -> (whole layer, exact weight, the ranks' layers)."""
    spec = LinearSpec("model.layers.0.mlp.down_proj", k, (96,), True, "row")
    whole, exact, _ = loaded(fmt, spec, seed=seed, **kw)
    shards = [loaded(fmt, spec, seed=seed, parallel=p, **kw)[0] for p in fake_ranks(ranks)]
    return whole, exact, shards


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", ["gptq-act-order-g64", "gptq-asym-act-order"])
def test_act_order_split_along_its_inputs(name: str, ranks: int) -> None:
    """A row-parallel act-order layer over 2 and 4 ranks: each keeps its input rows sorted by
    group with their row_group and the scales of the groups they touch; their weights side by
    side are the whole layer's bit for bit, and their outputs summed (an all-reduce) the whole
    layer's within 1e-5."""
    fmt, kw = CASES[name]
    whole, exact, shards = split_along_k(fmt, 256, ranks, **kw)
    k = 256 // ranks
    for r in shards:
        assert r.k == k and r.perm is not None and r.row_group is not None
        assert r.row_group.dtype == torch.int32 and r.row_group.shape == (k,)
        assert bool((r.row_group[1:] >= r.row_group[:-1]).all())  # sorted: runs of a group
        assert r.scales.shape == r.zeros.shape == (int(r.row_group.max()) + 1, 96)
    torch.testing.assert_close(
        torch.cat([r.dequantized_weight() for r in shards], 1), exact, rtol=0, atol=0
    )
    x = torch.randn(5, 256)
    y = sum(r(x[:, i * k : (i + 1) * k]) for i, r in enumerate(shards))
    want = whole(x)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_act_order_splits_may_cut_groups_but_not_kernel_steps() -> None:
    """Act-order split along K: a slice may start inside a group (384 inputs in groups of 128
    over 4 ranks, 96 each), which a plain layer refuses; a slice that is not a multiple of 16
    rows (4-bit words of 8, kernel steps of 16) is refused naming the layer and
    parallel.tensor. A desc_act checkpoint
    whose g_idx is plain k // g keeps the one-rank layout: no order, its own groups' scales."""
    fmt, kw = CASES["gptq-act-order-g64"]
    act_order = W4Format("gptq", 128, True, 1, desc_act=True)
    whole, exact, shards = split_along_k(act_order, 384, 4, **kw)
    assert [r.row_group is not None for r in shards] == [True] * 4
    torch.testing.assert_close(
        torch.cat([r.dequantized_weight() for r in shards], 1), exact, rtol=0, atol=0
    )
    spec = LinearSpec("model.layers.0.mlp.down_proj", 384, (64,), parallel="row")
    plain = W4Format("gptq", 128, True, 1)
    with pytest.raises(ValueError, match="splits .* inputs at 96, not on a group of 128"):
        W4A16Linear(spec, torch.float32, CPU, fake_ranks(4)[1], fmt=plain)
    spec = LinearSpec("model.layers.0.mlp.down_proj", 96, (64,), parallel="row")
    g32 = W4Format("gptq", 32, True, 1, desc_act=True)
    message = r"parallel.tensor = 4 splits model\.layers\.0\.mlp\.down_proj's inputs at 24, "
    with pytest.raises(ValueError, match=message + "not on a multiple of 16 rows"):
        W4A16Linear(spec, torch.float32, CPU, fake_ranks(4)[1], fmt=g32)
    # desc_act with g_idx = k // g (no act-order in fact): the plain layout on each rank
    whole, exact, shards = split_along_k(fmt, 256, 2)  # act_order off: g_idx = k // g
    for r in shards:
        assert r.perm is None and r.row_group is None and r.scales.shape == (2, 96)
    torch.testing.assert_close(
        torch.cat([r.dequantized_weight() for r in shards], 1), exact, rtol=0, atol=0
    )


def test_act_order_slices_check_their_g_idx() -> None:
    """A rank sees only its slice of g_idx: a group past G, or more than g rows of one group in
    the slice, is refused naming the tensor."""
    fmt, kw = CASES["gptq-act-order-g64"]
    spec = LinearSpec("model.layers.0.mlp.down_proj", 256, (96,), True, "row")
    gen = torch.Generator().manual_seed(0)
    t = quantize(torch.randn(96, 256, generator=gen), 64, True, gen, act_order=True, zero_min=1)
    for bad in (4, 0):  # group 4 of 4 groups; 128 rows of group 0 on rank 0
        layer = W4A16Linear(spec, torch.float32, CPU, fake_rank(0), fmt=fmt)
        for kind, tensor in gptq_tensors(t).items():
            if kind == "g_idx":
                tensor = tensor.clone()
                tensor[:128] = bad
            layer.load(kind, tensor)
        layer.load("bias", torch.zeros(96))
        with pytest.raises(ValueError, match=r"down_proj\.g_idx does not give each of the 4"):
            layer.finish_loading()
    # act-order column-parallel layers keep every input and so their order
    spec = LinearSpec("model.layers.0.mlp.gate_up_proj", 256, (64, 64), False, "column", ("a", "b"))
    whole = loaded(fmt, spec, seed=1, **kw)[1]
    ranks = [loaded(fmt, spec, seed=1, parallel=fake_rank(r), **kw)[0] for r in (0, 1)]
    w = [r.dequantized_weight() for r in ranks]
    torch.testing.assert_close(
        torch.cat([w[0][:32], w[1][:32], w[0][32:], w[1][32:]]), whole, rtol=0, atol=0
    )


def _tensors(fmt: W4Format, act_order: bool = False) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for rows in QKV.output_sizes:
        t = quantize(torch.randn(rows, 256, generator=gen), fmt.group_size, fmt.sym, gen, act_order)
        out.append(awq_tensors(t) if fmt.method == "awq" else gptq_tensors(t))
    return out


def test_missing_tensors_are_named() -> None:
    fmt = W4Format("gptq", 64, True, 1, desc_act=True)
    layer = W4A16Linear(QKV, torch.float32, CPU, fmt=fmt)
    assert layer.checkpoint_kinds == ("qweight", "qzeros", "scales", "g_idx")
    for part, tensors in enumerate(_tensors(fmt, act_order=True)):
        for kind, t in tensors.items():
            if (kind, part) != ("g_idx", 1):
                layer.load(kind, t, part)
    with pytest.raises(ValueError, match=r"lacks model\.layers\.0\.self_attn\.k_proj\.g_idx"):
        layer.finish_loading()


def test_wrong_payloads_are_refused() -> None:
    layer = W4A16Linear(QKV, torch.float32, CPU, fmt=W4Format("awq", 64, False))
    with pytest.raises(
        ValueError, match=r"q_proj\.qweight: checkpoint shape \(32, 128\), expected"
    ):
        layer.load("qweight", torch.zeros(32, 128, dtype=torch.int32), 0)  # GPTQ's shape
    with pytest.raises(ValueError, match=r"k_proj\.qzeros is torch.float16, expected int32"):
        layer.load("qzeros", torch.zeros(4, 8, dtype=torch.float16), 1)
    with pytest.raises(ValueError, match="awq layer has no 'g_idx' tensor"):
        layer.load("g_idx", torch.zeros(256, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="not a multiple of group_size 128"):
        W4A16Linear(LinearSpec("a.b", 192, (64,)), torch.float32, CPU, fmt=W4Format("gptq"))


def test_symmetric_checkpoints_need_zero_points_of_8() -> None:
    """A gptq_v2 checkpoint read as the original format (or the reverse) would shift every
    weight by one step: the symmetric zero point catches it."""
    fmt = W4Format("gptq", 64, True, 1)
    layer = W4A16Linear(QKV, torch.float32, CPU, fmt=fmt)
    for part, tensors in enumerate(_tensors(fmt)):
        tensors["qzeros"] = torch.full_like(tensors["qzeros"], _word([8] * 8))  # gptq_v2's
        for kind, t in tensors.items():
            layer.load(kind, t, part)
    with pytest.raises(ValueError, match=r"symmetric \(sym\) but its qzeros are not .* 8"):
        layer.finish_loading()


def test_fused_parts_must_share_their_act_order() -> None:
    fmt = W4Format("gptq", 64, True, 1, desc_act=True)
    layer = W4A16Linear(QKV, torch.float32, CPU, fmt=fmt)
    for part, tensors in enumerate(_tensors(fmt, act_order=True)):  # a perm of its own each
        for kind, t in tensors.items():
            layer.load(kind, t, part)
    with pytest.raises(ValueError, match=r"k_proj\.g_idx differs from .*q_proj\.g_idx"):
        layer.finish_loading()


# --- the schemes: configs, unquantized layers, refusals ---

GPTQ = {
    "quant_method": "gptq",
    "bits": 4,
    "group_size": 128,
    "desc_act": False,
    "sym": True,
    "lm_head": False,
    "checkpoint_format": "gptq",
    "pack_dtype": "int32",
    "damp_percent": 0.01,
    "true_sequential": True,
    "static_groups": False,
    "meta": {"quantizer": ["gptqmodel:4.0.0"]},
}
AWQ = {
    "quant_method": "awq",
    "bits": 4,
    "group_size": 128,
    "zero_point": True,
    "version": "gemm",
    "modules_to_not_convert": None,
}


def spec_of(prefix: str, parts: tuple[str, ...] = ()) -> LinearSpec:
    return LinearSpec(prefix, 128, tuple(64 for _ in parts) or (64,), part_names=parts)


def test_configs_give_their_formats() -> None:
    layer = Gptq(QuantConfig(GPTQ)).linear(
        spec_of("model.layers.0.mlp.down_proj"), torch.float32, CPU
    )
    assert isinstance(layer, W4A16Linear) and layer.fmt == W4Format("gptq", 128, True, 1)
    v2 = dict(GPTQ, checkpoint_format="gptq_v2", desc_act=True, sym=False, group_size=-1)
    assert Gptq(QuantConfig(v2)).fmt == W4Format("gptq", -1, False, 0, True)
    new = {k: v for k, v in GPTQ.items() if k != "checkpoint_format"} | {"format": "gptq_v2"}
    assert Gptq(QuantConfig(new)).fmt.zero_offset == 0
    assert Awq(QuantConfig(AWQ)).fmt == W4Format("awq", 128, False)
    old = {
        "quant_method": "awq",
        "w_bit": 4,
        "q_group_size": 64,
        "zero_point": True,
        "version": "GEMM",
    }
    assert Awq(QuantConfig(old)).fmt == W4Format("awq", 64, False)


def test_layers_left_unquantized() -> None:
    qkv = ("q_proj", "k_proj", "v_proj")
    awq = Awq(QuantConfig(dict(AWQ, modules_to_not_convert=["layers.1.self_attn", "visual"])))
    assert (
        type(awq.linear(spec_of("model.layers.1.self_attn.qkv_proj", qkv), torch.float32, CPU))
        is DenseLinear
    )
    assert type(awq.linear(spec_of("model.visual.proj"), torch.float32, CPU)) is DenseLinear
    assert isinstance(
        awq.linear(spec_of("model.layers.11.mlp.down_proj"), torch.float32, CPU), W4A16Linear
    )
    with pytest.raises(ValueError, match=r"leaves model\.layers\.0\.self_attn\.k_proj unquantized"):
        Awq(QuantConfig(dict(AWQ, modules_to_not_convert=["k_proj"]))).linear(
            spec_of("model.layers.0.self_attn.qkv_proj", qkv), torch.float32, CPU
        )
    blocks = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.down_proj"]]
    gptq = Gptq(QuantConfig(dict(GPTQ, modules_in_block_to_quantize=blocks)))
    assert isinstance(
        gptq.linear(spec_of("model.layers.0.self_attn.qkv_proj", qkv), torch.float32, CPU),
        W4A16Linear,
    )
    assert (
        type(gptq.linear(spec_of("model.layers.0.self_attn.o_proj"), torch.float32, CPU))
        is DenseLinear
    )
    dynamic = Gptq(QuantConfig(dict(GPTQ, dynamic={r"-:model\.layers\.1\..*": {}})))
    assert (
        type(dynamic.linear(spec_of("model.layers.1.mlp.down_proj"), torch.float32, CPU))
        is DenseLinear
    )
    assert isinstance(
        dynamic.linear(spec_of("model.layers.0.mlp.down_proj"), torch.float32, CPU), W4A16Linear
    )


@pytest.mark.parametrize(
    "cls, edit, key",
    [
        (Gptq, {"bits": 8}, "bits = 8"),
        (Gptq, {"group_size": 96}, "group_size = 96"),
        (Gptq, {"checkpoint_format": "marlin"}, "checkpoint_format = 'marlin'"),
        (Gptq, {"lm_head": True}, "lm_head = True"),
        (Gptq, {"pack_dtype": "int16"}, "pack_dtype = 'int16'"),
        (Gptq, {"dynamic": {r".*\.1\..*": {"bits": 8}}}, r"dynamic\['.*'\] = \{'bits': 8\}"),
        (Awq, {"bits": 3}, "bits = 3"),
        (Awq, {"version": "gemv"}, "version = 'gemv'"),
        (Awq, {"zero_point": False}, "zero_point = False"),
        (Awq, {"backend": "llm-awq"}, "backend = 'llm-awq'"),
    ],
)
def test_unsupported_configs_are_refused(cls, edit, key: str) -> None:
    base = GPTQ if cls is Gptq else AWQ
    with pytest.raises(ValueError, match=rf"quantization_config\.{key} is not supported"):
        cls(QuantConfig(dict(base, **edit)))


def test_importing_the_schemes_imports_no_kernels() -> None:
    """inferx_quant imports the CUDA kernels only when a GPU layer first runs."""
    import subprocess
    import sys

    code = (
        "import sys, inferx_quant.w4a16 as w; "
        "w.Gptq(w.QuantConfig({'quant_method': 'gptq', 'bits': 4, 'group_size': 128})); "
        "print(sorted(m for m in sys.modules if m.startswith(('triton', 'inferx_kernels'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_gpu_without_the_kernel_package_is_refused(monkeypatch) -> None:
    import inferx_quant.w4a16 as w4

    monkeypatch.setattr(w4, "_cuda_kernels", lambda: None)
    spec = spec_of("model.layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match="'awq' on a GPU runs inferx-kernels-cuda's W4A16"):
        Awq(QuantConfig(AWQ)).linear(spec, torch.bfloat16, torch.device("cuda"))


def test_auto_picks_gptq_and_awq() -> None:
    assert pick_quant_scheme("auto", GPTQ, plugins()) == "gptq"
    assert pick_quant_scheme("auto", AWQ, plugins()) == "awq"
    with pytest.raises(LoadError, match=r"'awq' does not read it"):
        pick_quant_scheme("awq", GPTQ, plugins())
    with pytest.raises(LoadError, match=r"'gptq' needs a checkpoint quantized with it"):
        pick_quant_scheme("gptq", {}, plugins())
    with pytest.raises(LoadError, match=r"gptq \(gptq\).*awq \(awq\)|awq \(awq\).*gptq \(gptq\)"):
        pick_quant_scheme("auto", {"quant_method": "bitsandbytes"}, plugins())


# --- whole models through the engine, against the exact dequantized weights ---


def tiny_qwen2(path, hidden: int, heads: int, kv_heads: int, inter: int):
    """A random Qwen2 (biases on q, k and v) written by transformers in float32, weights spread
    like test_fp8.tiny_llama's."""
    import transformers

    torch.manual_seed(1)
    cfg = transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif name.endswith("proj.bias"):
                p.normal_(0, 0.05)
    model.save_pretrained(path)
    return path


def write_w4(src, dst, quant_config: dict, skip: tuple[str, ...] = ()):
    """dst: src with each projection quantized into quant_config's layout (and the config in
    config.json); -> (dst, the reference: src with the exact dequantized weights in float32).
    Layers named in `skip` keep their float weights. Fused parts (q, k, v; gate, up) share an
    act-order, as GPTQ gives them."""
    from test_fp8 import write_projections

    method = quant_config["quant_method"]
    group = quant_config["group_size"]
    sym = quant_config.get("sym", False)
    act_order = quant_config.get("desc_act", False)
    v2 = quant_config.get("checkpoint_format") == "gptq_v2"

    def w4(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        base = name.removesuffix(".weight")
        leaf = base.rpartition(".")[2]
        layer = int(base.split(".")[2])
        fused = 0 if leaf in ("q_proj", "k_proj", "v_proj") else 1 if leaf != "down_proj" else 2
        gen = torch.Generator().manual_seed(1000 * layer + fused)  # one act-order per fused layer
        zero_min = 1 if method == "gptq" and not v2 else 0
        parts = quantize(w, group, sym, gen, act_order=act_order, zero_min=zero_min)
        tensors = gptq_tensors(parts, v2) if method == "gptq" else awq_tensors(parts)
        return {f"{base}.{kind}": t.contiguous() for kind, t in tensors.items()}, parts["exact"]

    return write_projections(src, dst, quant_config, w4, skip)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from test_fp8 import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("llama"), 128, 4, 2, 256)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return tiny_qwen2(tmp_path_factory.mktemp("qwen2"), 128, 4, 2, 256)


def _agree(quant, ref, kind: str, dense: tuple[str, ...] = ()):
    from test_fp8 import agree_in_top5, layers_of, make_llm, run

    llm = make_llm(quant)
    layers = layers_of(llm)
    for name, layer in layers.items():
        want = DenseLinear if name in dense else W4A16Linear
        assert type(layer) is want, (name, type(layer))
    assert layers["model.layers.0.self_attn.qkv_proj"].fmt.method == kind
    agree_in_top5(run(llm), run(make_llm(ref)))
    return llm


@pytest.mark.parametrize("desc_act", [False, True], ids=["g128", "g128-act-order"])
def test_gptq_checkpoint_agrees_with_its_dequantized_weights(llama, tmp_path, desc_act) -> None:
    cfg = dict(GPTQ, desc_act=desc_act)
    quant, ref = write_w4(llama, tmp_path / "gptq", cfg)
    stored = load_file(quant / "model.safetensors")
    assert stored["model.layers.0.mlp.down_proj.qweight"].shape == (256 // 8, 128)
    assert stored["model.layers.0.mlp.down_proj.qzeros"].shape == (2, 128 // 8)
    assert stored["model.layers.0.mlp.down_proj.scales"].dtype == torch.float16
    assert "lm_head.weight" in stored and "model.layers.0.mlp.up_proj.weight" not in stored
    llm = _agree(quant, ref, "gptq")
    # down_proj's 256 inputs are two groups (one group's act-order is no order at all)
    down = llm.engine.executor.model.get_submodule("model.layers.0.mlp.down_proj")
    assert (down.perm is not None) == desc_act


def test_gptq_v2_asymmetric_per_channel(llama, tmp_path) -> None:
    cfg = dict(GPTQ, checkpoint_format="gptq_v2", sym=False, group_size=-1)
    _agree(*write_w4(llama, tmp_path / "gptq-v2", cfg), "gptq")


def test_awq_checkpoint_agrees_with_its_dequantized_weights(qwen2, tmp_path) -> None:
    """AWQ on Qwen2 (biases on the fused QKV), one decoder layer's MLP left unquantized by
    modules_to_not_convert."""
    cfg = dict(AWQ, group_size=64, modules_to_not_convert=["model.layers.1.mlp"])
    skip = (
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
        "model.layers.1.mlp.down_proj",
    )
    quant, ref = write_w4(qwen2, tmp_path / "awq", cfg, skip)
    stored = load_file(quant / "model.safetensors")
    assert stored["model.layers.0.self_attn.q_proj.qweight"].shape == (128, 128 // 8)
    assert "model.layers.0.self_attn.q_proj.bias" in stored
    dense = ("model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.down_proj")
    llm = _agree(quant, ref, "awq", dense)
    assert llm.engine.executor.model.lm_head.weight.dtype == torch.float32


def test_a_checkpoint_missing_a_tensor_names_it(llama, tmp_path) -> None:
    from test_fp8 import make_llm

    quant, _ = write_w4(llama, tmp_path / "gptq", dict(GPTQ, desc_act=True))
    tensors = load_file(quant / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.qzeros"]
    save_file(tensors, quant / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks .*model\.layers\.1\.self_attn\.v_proj\.qzeros"):
        make_llm(quant)


def test_scales_keep_float16_under_a_bfloat16_model(llama, tmp_path) -> None:
    """The safetensors reader casts float weights to the serving dtype but not the scales,
    whose rounding to bfloat16 would move every weight of their group."""
    from inferx_models.formats import SafetensorsFormat

    quant, _ = write_w4(llama, tmp_path / "awq", AWQ)
    weights = dict(SafetensorsFormat().open(quant, torch.bfloat16).weights)
    assert weights["model.layers.0.mlp.up_proj.scales"].dtype == torch.float16
    assert weights["model.layers.0.mlp.up_proj.qweight"].dtype == torch.int32
    assert weights["model.norm.weight"].dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kind, cfg",
    [("gptq", dict(GPTQ, desc_act=True)), ("awq", dict(AWQ, group_size=64))],
    ids=["gptq-act-order", "awq"],
)
def test_on_the_gpu_the_kernel_agrees_with_the_dequantized_weights(
    llama, tmp_path, kind: str, cfg: dict
) -> None:
    """The same check on CUDA in bf16 (the CUDA runtime, its graphs and the W4A16 Triton
    kernel) against the dequantized checkpoint served unquantized in bf16. kv_cache.memory is
    a size: the default fraction (0.9 of the card) would leave the second engine, built while
    the first still holds its cache, nothing (LoadError)."""
    from test_fp8 import agree_in_top5, make_llm, run

    quant, ref = write_w4(llama, tmp_path / kind, cfg)
    gpu = {"engine.device": "cuda", "model.dtype": "bfloat16", "kv_cache.memory": "1GiB"}
    llm = make_llm(quant, **gpu)
    down = llm.engine.executor.model.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(down, W4A16Linear) and down.qweight.is_cuda
    agree_in_top5(run(llm), run(make_llm(ref, **gpu)))


@pytest.mark.parametrize("name", ["gptq-sym-g64", "gptq-asym-act-order", "awq-g64"])
def test_quantize_rtn_writes_the_published_layout(name: str) -> None:
    """inferx_quant's round-to-nearest writer (for test and benchmark checkpoints) gives the
    tensors this file's layout definitions give for the same rounding, and a layer that loads
    them holds w within half a step of each weight."""
    from inferx_quant.w4a16 import quantize_rtn

    fmt, kw = CASES[name]
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(4)) * 0.05
    order = torch.randperm(256, generator=torch.Generator().manual_seed(9))
    got = quantize_rtn(w, fmt, order if kw else None)
    ref = quantize(
        w, fmt.group_size, fmt.sym, torch.Generator().manual_seed(9), zero_min=fmt.zero_offset, **kw
    )
    want = awq_tensors(ref) if fmt.method == "awq" else gptq_tensors(ref, not fmt.zero_offset)
    assert got.keys() == want.keys()
    for kind in got:
        assert torch.equal(got[kind], want[kind]), kind
    layer = W4A16Linear(LinearSpec("a.b", 256, (64,)), torch.float32, CPU, fmt=fmt)
    for kind, t in got.items():
        layer.load(kind, t)
    layer.finish_loading()
    step = layer.scales.float().max()
    assert (layer.dequantized_weight() - w).abs().max() <= step / 2 + 1e-6


@pytest.mark.parametrize("flags", [["--method", "gptq", "--act-order"], ["--method", "awq"]])
def test_the_benchmark_checkpoint_writer(llama, tmp_path, flags: list[str]) -> None:
    """benchmarks/w4a16_checkpoint.py turns a float checkpoint into one the engine loads with
    quantization auto, every projection quantized to within half a step of its float weight."""
    import subprocess
    import sys
    from pathlib import Path

    from test_fp8 import layers_of, make_llm

    script = Path(__file__).parent.parent / "benchmarks" / "w4a16_checkpoint.py"
    out = tmp_path / "quantized"
    subprocess.run([sys.executable, str(script), str(llama), str(out), *flags], check=True)
    layers = layers_of(make_llm(out))
    assert all(isinstance(m, W4A16Linear) for m in layers.values())
    down = layers["model.layers.1.mlp.down_proj"]
    assert (down.perm is not None) == ("--act-order" in flags)
    w = load_file(llama / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    err = (down.dequantized_weight() - w).abs().max()
    assert err <= down.scales.float().max() / 2 + 1e-6


@pytest.mark.parametrize(
    "cfg",
    [dict(GPTQ, group_size=32), dict(AWQ, group_size=64)],
    ids=["gptq-g32", "awq-g64"],
)
def test_two_ranks_give_the_greedy_tokens_of_one(llama, tmp_path, cfg: dict) -> None:
    """parallel.tensor = 2 (gloo ranks on the CPU): QKV and gate_up split by rows, o_proj and
    down_proj by inputs in whole groups; the same greedy tokens as one rank."""
    from test_distributed import generate

    quant, _ = write_w4(llama, tmp_path / "quantized", cfg)
    assert generate(quant, 2) == generate(quant, 1)


@pytest.mark.parametrize("tensor", [2, 4])
def test_act_order_over_ranks_gives_the_greedy_tokens_of_one(llama, tmp_path, tensor) -> None:
    """A GPTQ act-order checkpoint (group 32) at parallel.tensor = 2 and 4 (gloo ranks on the
    CPU): o_proj and down_proj split along their inputs, each rank's rows sorted by group with
    their row_group (rank 0's layers checked here); the same greedy tokens as one rank."""
    from test_distributed import GREEDY, PROMPTS, generate
    from test_distributed import make_llm as make_ranks
    from test_fp8 import layers_of

    quant, _ = write_w4(llama, tmp_path / "quantized", dict(GPTQ, group_size=32, desc_act=True))
    one = generate(quant, 1)
    llm = make_ranks(quant, tensor)
    try:
        layers = layers_of(llm)
        for name in ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"):
            assert layers[name].row_group is not None and layers[name].perm is not None
        assert layers["model.layers.0.mlp.gate_up_proj"].row_group is None  # whole K
        assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == one
    finally:
        llm.engine.executor.close()
