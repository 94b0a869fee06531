"""W4A16's decode GEMV under programmatic dependent launch (w4a16.pdl_launch, pdl.gemv_launch):
which launches get PDL at which rows, which trigger the kernel after them, and that the kernel
ahead of each one triggers: the rules of the bf16 decode GEMVs. PDL never runs on the CPU, so
the device check is faked; the interpreter runs grid dependency control as no-ops."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted, on_gpu  # noqa: E402
from test_w4a16 import CASES, loaded  # noqa: E402

from inferx_core.interfaces.kv import KVLayerSpec  # noqa: E402
from inferx_core.interfaces.quant import LinearSpec, QuantLinear  # noqa: E402
from inferx_kernels_cuda import pdl, w4a16  # noqa: E402
from inferx_kernels_cuda.ops import TritonOps  # noqa: E402
from inferx_kernels_cuda.triton_attention import TritonAttention  # noqa: E402
from inferx_quant.w4a16 import W4A16Linear  # noqa: E402

CPU = torch.device("cpu")
PDL_KEYS = ("PDL", "TRIGGER", "LATE", "launch_pdl")
HIDDEN, HEADS_DIM, INTER = 256, 128, 256


@pytest.fixture
def pdl_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every device takes PDL (as a Hopper GPU does), at pdl's default row ranges."""
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)


def test_pdl_launch_takes_the_bf16_gemvs_rules_up_to_pdl_max_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """w4a16.pdl_launch: on a device without PDL (the CPU, by pdl's own check) PDL and
    TRIGGER off at every row count up to PDL_MAX_ROWS (the TMA GEMVs' limit), so the kernel
    compiles as without them; on a device with PDL pdl.gemv_launch's arguments there: at 1 row
    a trigger after the K loop (LATE) or, asked, at the start; ALL_ROWS (2-16) and CHAIN_ROWS
    (33-64) at the start; 17-32 late. Past PDL_MAX_ROWS nothing, whatever the device."""
    assert TritonOps().tma_gemv_max_rows == w4a16.PDL_MAX_ROWS == 64
    assert not pdl.pdl_enabled(CPU)
    off = {"PDL": False, "TRIGGER": False}
    assert all(w4a16.pdl_launch(CPU, m, t) == off for m in (1, 8, 64) for t in (False, True))
    assert w4a16.pdl_launch(CPU, 65) == w4a16.pdl_launch(CPU, 65, trigger=True) == {}
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)  # as on Hopper
    start = {"PDL": True, "TRIGGER": True, "launch_pdl": True}
    late = {"PDL": True, "TRIGGER": False, "launch_pdl": True, "LATE": True}
    assert w4a16.pdl_launch(CPU, 1) == late
    assert w4a16.pdl_launch(CPU, 1, trigger=True) == start
    assert [w4a16.pdl_launch(CPU, m) for m in (2, 16, 17, 32, 33, 64)] == [
        start, start, late, late, start, start,
    ]  # fmt: skip
    assert w4a16.pdl_launch(CPU, 65) == w4a16.pdl_launch(CPU, 65, trigger=True) == {}


def test_the_kernels_ahead_of_the_attention_gemvs_trigger(pdl_device) -> None:
    """The decode kernel (ahead of o_proj's GEMV, or of the reduce) and the reduce (ahead of
    o_proj's) trigger at every row count of a CUDA-graph decode step up to 64, as for the
    bf16 GEMVs; the decode kernel launches early (PDL) exactly where pdl.ATTENTION_ROWS has
    QKV's GEMV trigger (TritonOps.linear_split)."""
    spec = KVLayerSpec(16, 2, 128)
    backend = TritonAttention([spec], 16, torch.float32, CPU)
    for rows in range(1, 65):
        plan = SimpleNamespace(num_decode=rows, all_decode=True, seq_split=True)
        assert backend._pdl(plan, spec)["TRIGGER"], rows
        decode = backend._decode_pdl(plan, spec)
        assert decode["TRIGGER"], rows
        assert decode["PDL"] == pdl.attention_early(CPU, rows), rows


def _w4_layers(name: str) -> dict[str, W4A16Linear]:
    """A decode layer's four W4A16 linears (QKV with a bias, fused gate_up), small."""
    fmt, kw = CASES[name]
    specs = {
        "qkv": LinearSpec(
            "model.layers.0.self_attn.qkv_proj", HIDDEN, (HEADS_DIM, 64, 64), bias=True,
            part_names=("q_proj", "k_proj", "v_proj"),
        ),
        "o": LinearSpec("model.layers.0.self_attn.o_proj", HEADS_DIM, (HIDDEN,)),
        "gate_up": LinearSpec(
            "model.layers.0.mlp.gate_up_proj", HIDDEN, (INTER, INTER),
            part_names=("gate_proj", "up_proj"),
        ),
        "down": LinearSpec("model.layers.0.mlp.down_proj", INTER, (HIDDEN,)),
    }  # fmt: skip
    return {key: loaded(fmt, spec, seed=i, **kw)[0] for i, (key, spec) in enumerate(specs.items())}


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict]]:
    """Every Triton launch from here on, in order: (kernel name, its PDL arguments); the W4A16
    layers run their kernel on the CPU (the interpreter), as on a GPU."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: list[tuple[str, dict]] = []
    run = InterpretedFunction.run

    def recorded(self, *args, grid, warmup, **kwargs):
        if not warmup:
            seen.append((self.fn.__name__, {k: v for k, v in kwargs.items() if k in PDL_KEYS}))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    monkeypatch.setattr(W4A16Linear, "_kernels", lambda self, x: w4a16)
    return seen


def _decode_layer(ops: TritonOps, layers: dict, rows: int) -> None:
    """A decode layer's calls as the models make them, from the last layer's down_proj parts
    to this one's: the input norm and QKV, the attention (here a norm standing in for its last
    kernel, which triggers: test_the_kernels_ahead_of_the_attention_gemvs_trigger), o_proj,
    the post-attention norm and gate_up with its SiLU (for W4A16 made by gate_up's reduce),
    down_proj, and the next layer's norm and QKV."""
    g = torch.Generator().manual_seed(rows)
    down = torch.randn(2, rows, HIDDEN, generator=g)
    residual = torch.randn(rows, HIDDEN, generator=g)
    norm_w = torch.rand(HIDDEN, generator=g) + 0.5
    qkv, _, residual = ops.rms_norm_linear_split(down, norm_w, 1e-6, residual, layers["qkv"])
    attention = ops.rms_norm(qkv.sum(0)[:, :HEADS_DIM].contiguous(), norm_w[:HEADS_DIM], 1e-6)
    o = ops.linear_parts(layers["o"], attention)
    act, residual = ops.rms_norm_linear_silu_and_mul(o, norm_w, 1e-6, residual, layers["gate_up"])
    down = ops.linear_parts(layers["down"], act)
    ops.rms_norm_linear_split(down, norm_w, 1e-6, residual, layers["qkv"])


@interpreted
@pytest.mark.parametrize("rows", [1, 3, 20, 40, 65])
def test_a_decode_layers_w4a16_gemvs_launch_as_the_bf16_ones(
    pdl_device, launches, monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    """Through TritonOps, as the models call it: on a device with PDL each W4A16 GEMV of up to
    64 rows launches with PDL; QKV triggers where pdl.ATTENTION_ROWS takes the rows (the
    decode kernel then launches early), o_proj and down_proj where NORM_ROWS does (the norm
    after them then launches early), every GEMV at ALL_ROWS and CHAIN_ROWS, the others
    after their K loop, but gate_up, which triggers at its start: its K split is summed, and
    silu(gate) * up made, by split_k_reduce_kernel (no silu_and_mul_kernel), which launches
    with PDL and triggers at its start. Every kernel launched with PDL
    follows one that triggers (the norms, the attention's kernels, the reduce ahead of
    down_proj). On a device without PDL no kernel launches with PDL: the W4A16 GEMVs get PDL
    and TRIGGER off (nothing past 64 rows)."""
    monkeypatch.setattr(pdl, "ATTENTION_ROWS", ((1, 1),))  # apart, to tell the rules apart
    monkeypatch.setattr(pdl, "NORM_ROWS", ((20, 20),))
    layers, ops = _w4_layers("awq-g64"), TritonOps()
    _decode_layer(ops, layers, rows)
    gemvs = [args for name, args in launches if name == "w4a16_kernel"]
    assert len(gemvs) == 5  # QKV, o_proj, gate_up (then its reduce), down_proj, QKV
    if rows > 64:
        assert gemvs == [{}] * 5
    else:
        start = {"PDL": True, "TRIGGER": True, "launch_pdl": True}
        late = {"PDL": True, "TRIGGER": False, "launch_pdl": True, "LATE": True}
        want = {  # QKV, o_proj, gate_up, down_proj, QKV
            1: [start, late, start, late, start],
            3: [start, start, start, start, start],
            20: [late, start, start, start, late],
            40: [start, start, start, start, start],
        }[rows]
        assert gemvs == want
    untriggered = [
        ahead_name
        for (ahead_name, ahead), (_, args) in zip(launches, launches[1:], strict=False)
        if args.get("PDL") and not (ahead.get("TRIGGER") or ahead.get("LATE"))
    ]
    assert untriggered == [], launches
    names = [name for name, _ in launches]
    assert names.count("split_k_reduce_kernel") == 1 and "silu_and_mul_kernel" not in names
    reduce = launches[names.index("split_k_reduce_kernel")][1]
    assert reduce == ({} if rows > 64 else {"PDL": True, "TRIGGER": True, "launch_pdl": True})

    launches.clear()
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: False)
    _decode_layer(ops, layers, rows)
    off = {} if rows > 64 else {"PDL": False, "TRIGGER": False}
    want_off = [off] * 5
    assert [args for name, args in launches if name == "w4a16_kernel"] == want_off
    assert not any(args.get("PDL") or args.get("LATE") for _, args in launches), launches


@interpreted
@pytest.mark.parametrize("gated", [False, True])
def test_a_split_reduce_joins_the_pdl_chain(
    pdl_device, launches, monkeypatch: pytest.MonkeyPatch, gated: bool
) -> None:
    """w4a16_linear with a K split at one row (gated: gate_up, silu(gate) * up made by the
    reduce; else a plain projection), with a bias. With PDL on the GEMV
    triggers at its start (not after its K loop, as it would at one row otherwise) and
    split_k_reduce_kernel launches with PDL and triggers at its start, so the kernel after it
    may launch early; on a device without PDL neither has PDL. The same
    bits every way (the interpreter's grid dependency control is a no-op): the exact
    product's, or silu(gate) * up of it."""
    fmt, kw = CASES["gptq-sym-g64"]
    spec = LinearSpec(
        "model.layers.0.mlp.gate_up_proj", 1024, (64, 64), bias=True, part_names=("g", "u")
    )
    layer = loaded(fmt, spec, seed=1, **kw)[0]
    assert w4a16.default_config(1, 128, 1024).split_k > 1
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(1))
    chained = {"PDL": True, "TRIGGER": True, "launch_pdl": True}
    want = {  # PDL on the device: the GEMV's arguments, the reduce's
        True: (chained, chained),
        False: ({"PDL": False, "TRIGGER": False}, {}),
    }
    results = []
    for device_pdl, (gemv_args, reduce_args) in want.items():
        monkeypatch.setattr(pdl, "pdl_enabled", lambda device, on=device_pdl: on)
        launches.clear()
        y = w4a16.w4a16_linear(x, *layer._kernel_args(), bias=layer.bias, gated=gated)
        results.append(y)
        assert launches == [
            ("w4a16_kernel", gemv_args),
            ("split_k_reduce_kernel", reduce_args),
        ], device_pdl
    assert all(torch.equal(got, results[0]) for got in results[1:])
    want_y = x.double() @ layer.dequantized_weight().double().t() + layer.bias.double()
    if gated:
        gate, up = want_y.chunk(2, dim=-1)
        want_y = torch.nn.functional.silu(gate) * up
    err = (results[0].double() - want_y).abs().max().item()
    assert err <= 2.0**-16 * want_y.abs().max().item(), (err, want_y.abs().max().item())


@interpreted
def test_gate_up_split_along_k_chains_its_reduce(pdl_device, launches) -> None:
    """gate_up and its SiLU through TritonOps with a K split: the layer's GEMV launches with
    PDL (the norm ahead triggers) and triggers at its start; the split reduce after it, which
    makes silu(gate) * up (no silu_and_mul_kernel), launches with PDL and triggers too; the
    result is silu(gate) * up of the exact product."""
    fmt, kw = CASES["gptq-sym-g64"]
    spec = LinearSpec("model.layers.0.mlp.gate_up_proj", 1024, (64, 64), part_names=("g", "u"))
    layer = loaded(fmt, spec, seed=1, **kw)[0]
    assert w4a16.default_config(1, 128, 1024).split_k > 1
    ops = TritonOps()
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(1))
    got = ops.linear_silu_and_mul(layer, x)
    chained = {"PDL": True, "TRIGGER": True, "launch_pdl": True}
    assert launches == [("w4a16_kernel", chained), ("split_k_reduce_kernel", chained)]
    gate, up = (x.double() @ layer.dequantized_weight().double().t()).chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    err = (got.double() - want).abs().max().item()
    assert err <= 2.0**-16 * want.abs().max().item(), (err, want.abs().max().item())


def test_only_methods_that_take_it_get_a_trigger() -> None:
    """QuantLinear.takes_trigger: off by default (a plugin's forward_parts(x) is called as
    before), on for W4A16."""
    assert QuantLinear.takes_trigger is False and W4A16Linear.takes_trigger is True


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_w4a16_gemvs_read_what_the_kernels_ahead_wrote_inside_a_graph(
    rows: int, act_order: bool
) -> None:
    """On Hopper (PDL on), in a CUDA graph replayed on fresh inputs, at Qwen2.5-3B's widths: a slow
    cuBLAS GEMM writes y; add + RMSNorm (TRIGGER) reads it; a square GEMV (PDL, its first
    weight loads before its wait, triggering at NORM_ROWS) the norm's output; add + RMSNorm
    of its parts (PDL at NORM_ROWS); gate_up (PDL, a K split and its reduce, with PDL);
    SiLU-and-mul (TRIGGER); down (PDL, triggering at NORM_ROWS); a last add + RMSNorm of its
    parts; then gate_up gated (silu(gate) * up made by its reduce, which launches with PDL and
    triggers) and down behind that reduce (PDL). A kernel that read its input before the
    kernel ahead had written it would read the last replay's values, off by O(1)."""
    from test_w4a16_kernel import random_weights

    from inferx_core.ops_torch import TorchOps
    from inferx_kernels_cuda.w4a16 import w4a16_linear, w4a16_linear_parts

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs Hopper")
    dev, bf16, eps = torch.device("cuda"), torch.bfloat16, 1e-6
    hidden, inter = 2048, 11008
    assert pdl.pdl_enabled(dev) and w4a16.pdl_launch(dev, rows)["PDL"]
    o_args, o_w = random_weights(hidden, hidden, 128, act_order, dev)
    gate_up_args, gate_up_w = random_weights(2 * inter, hidden, 128, act_order, dev)
    down_args, down_w = random_weights(hidden, inter, 128, act_order, dev)
    g = torch.Generator(device=dev).manual_seed(7)
    a = torch.empty(rows, 8192, device=dev, dtype=bf16)
    b = (torch.randn(8192, hidden, generator=g, device=dev) * 8192**-0.5).to(bf16)
    residual = torch.empty(rows, hidden, device=dev, dtype=bf16)
    norm_w = (torch.rand(hidden, generator=g, device=dev) + 0.5).to(bf16)
    ops, ref = TritonOps(), TorchOps()

    def step() -> tuple[torch.Tensor, ...]:
        y = a @ b
        normed, summed = ops.rms_norm(y, norm_w, eps, residual)
        early = pdl.norm_early(dev, rows)
        o = w4a16_linear_parts(normed, *o_args, trigger=early)
        h, summed2 = ops.rms_norm(o, norm_w, eps, summed, parts=True)
        gate_up = w4a16_linear(h, *gate_up_args)
        act = ops.silu_and_mul(gate_up)
        down = w4a16_linear_parts(act, *down_args, trigger=early)
        final, _ = ops.rms_norm(down, norm_w, eps, summed2, parts=True)
        gated = w4a16_linear(h, *gate_up_args, gated=True)
        down_gated = w4a16_linear_parts(gated, *down_args, trigger=early)
        return y, normed, summed, o, h, summed2, gate_up, act, down, final, gated, down_gated

    a.normal_(generator=g)
    residual.normal_(generator=g)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        err = (got.double() - want).abs().max().item()
        assert err <= 2.0**-5 * want.abs().max().item(), (err, want.abs().max().item())

    for _ in range(4):
        a.normal_(generator=g)
        residual.normal_(generator=g)
        graph.replay()
        torch.cuda.synchronize()
        y, normed, summed, o, h, summed2, gate_up, act, down, final, gated, down_gated = outs
        torch.testing.assert_close(y, a @ b, rtol=0, atol=0)
        torch.testing.assert_close(summed, ref.rms_norm(y, norm_w, eps, residual)[1])
        close(o.double().sum(0), normed.double() @ o_w.double().t())
        want_h, want_summed2 = ref.rms_norm(o, norm_w, eps, summed, parts=True)
        torch.testing.assert_close(summed2, want_summed2)
        torch.testing.assert_close(h, want_h, rtol=1.6e-2, atol=1e-2)
        close(gate_up, h.double() @ gate_up_w.double().t())
        torch.testing.assert_close(act, ref.silu_and_mul(gate_up), rtol=1.6e-2, atol=1e-2)
        close(down.double().sum(0), act.double() @ down_w.double().t())
        want_final = ref.rms_norm(down, norm_w, eps, summed2, parts=True)[0]
        torch.testing.assert_close(final, want_final, rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(gated, act, rtol=1.6e-2, atol=1e-2)
        close(down_gated.double().sum(0), gated.double() @ down_w.double().t())
