"""The MoE layer alone (router + routed experts, and shared experts where the shape has them)
at decode and prefill sizes: the Triton path (TritonOps: topk_softmax, grouping, grouped GEMMs)
replayed in a CUDA graph and eagerly, against the torch path (TorchOps), and against the floor
of the bytes the layer must read at the GPU's bandwidth.

python benchmarks/moe_layer.py [--shapes gpt-oss-20b,qwen3-30b-a3b] [--tokens 1,8,64,2048]
                               [--bandwidth 3.35e12] [--layers 8] [--json out.json]
python benchmarks/moe_layer.py --shapes deepseek-v2-lite-shared --tokens 1,8,64,256
                                           # shared experts fused into the GEMMs or apart
python benchmarks/moe_layer.py --sweep     # the grouped GEMMs alone over candidate tiles
python benchmarks/moe_layer.py --profile [--unfused]  # each kernel's share of the Triton path
python benchmarks/moe_layer.py --smoke     # tiny shapes on the CPU, under TRITON_INTERPRET=1

`--layers` distinct layers run back to back per timed step, so that the weights of one step
outlast the L2 cache (a decode step reads every layer once, as a model does); times are per
layer. "atomic": the Triton path with the top-k sum by atomics in the down GEMM
(TritonOps.moe_atomic_sum), in a graph. "no-tma": where the Triton path runs bf16 experts on
moe_tma_gemv_kernel (up to moe_kernels.TMA_GEMV_MAX_TOKENS tokens), the same in a graph with it
off (TMA_GEMV_MAX_TOKENS 0: moe_gemm_kernel's tiles), the A/B of that switch. The floor counts
the router, each expert that some token picked (weights, scales, biases, once), the shared
experts, the input and the output. --sweep also times the TMA kernels' tiles at decode sizes
(bf16 experts' moe_tma_gemv_kernel, MXFP4's moe_gemv_tma_kernel: columns, K columns a step,
stages).

Shapes with shared experts ("deepseek-v2-lite-shared": V2-Lite's whole MoE layer, 2 shared
experts of 1408) are built as the model builds them (DeepseekV2ForCausalLM.build_mlp): the
Triton columns with TritonOps' default, the shared experts as slots of the routed experts'
grouped GEMMs (fuse_shared_experts), and "unfused" the same with the shared MLP apart (its
own gate_up and down GEMMs and an add), in a graph and eagerly: the A/B of that switch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from inferx_core.interfaces import BuildContext, ExpertsSpec, RouterSpec  # noqa: E402
from inferx_core.moe import FusedMoE  # noqa: E402
from inferx_core.ops_torch import TorchOps  # noqa: E402
from inferx_core.parallel import ParallelContext  # noqa: E402
from inferx_core.quant_none import Unquantized  # noqa: E402
from inferx_kernels_cuda import moe_kernels  # noqa: E402
from inferx_kernels_cuda.moe_kernels import GemmConfig, fused_experts  # noqa: E402
from inferx_kernels_cuda.ops import TritonOps  # noqa: E402
from inferx_models.deepseek_v2 import DeepseekV2ForCausalLM  # noqa: E402
from inferx_quant.mxfp4 import Mxfp4  # noqa: E402

# name: (hidden, intermediate, experts, top_k, format, activation, router bias, renormalize,
# shared experts)
SHAPES = {
    "gpt-oss-20b": (2880, 2880, 32, 4, "mxfp4", "swiglu_oai", True, False, 0),
    "gpt-oss-20b-bf16": (2880, 2880, 32, 4, "bf16", "swiglu_oai", True, False, 0),
    "qwen3-30b-a3b": (2048, 768, 128, 8, "bf16", "silu", False, True, 0),
    "deepseek-v2-lite": (2048, 1408, 64, 6, "bf16", "silu", False, False, 0),
    "deepseek-v2-lite-shared": (2048, 1408, 64, 6, "bf16", "silu", False, False, 2),
    "smoke-mxfp4": (64, 64, 4, 2, "mxfp4", "swiglu_oai", True, False, 0),
    "smoke-bf16": (64, 32, 8, 2, "bf16", "silu", False, True, 0),
    "smoke-shared": (64, 32, 8, 2, "bf16", "silu", False, False, 2),
}


def unfused_ops() -> TritonOps:
    """TritonOps with the shared experts apart (a shared MLP after the routed experts)."""
    ops = TritonOps()
    ops.fuse_shared_experts = False
    return ops


def build(shape: str, ops, device: torch.device, dtype: torch.dtype, seed: int) -> FusedMoE:
    hidden, inter, experts, k, fmt, act, router_bias, renorm, shared = SHAPES[shape]
    gpt_oss = act == "swiglu_oai"
    scheme = Mxfp4() if fmt == "mxfp4" else Unquantized()
    ctx = BuildContext(dtype, device, None, scheme, ops, ParallelContext())
    if shared:  # a DeepSeek-V2 MoE layer: greedy softmax routing, not renormalized
        cfg = {
            "hidden_size": hidden, "moe_intermediate_size": inter, "n_routed_experts": experts,
            "num_experts_per_tok": k, "n_shared_experts": shared, "first_k_dense_replace": 0,
        }  # fmt: skip
        layer = DeepseekV2ForCausalLM.build_mlp(cfg, 0, ctx)
    else:
        router = RouterSpec(experts, k, softmax_after_topk=gpt_oss, renormalize=renorm)
        spec = ExpertsSpec("mlp.experts", experts, hidden, inter, act, bias=gpt_oss)
        layer = FusedMoE(ctx, "mlp", hidden, router, spec, router_bias=router_bias)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
        for name, b in layer.named_buffers():
            if name.endswith("blocks"):
                b.random_(0, 256)
            elif name.endswith("scales"):
                b.random_(118, 123)
    return layer


@contextlib.contextmanager
def patched(name: str, value) -> Iterator[None]:  # noqa: ANN001
    """moe_kernels.<name> set to `value` inside the block (None: left as it is); fused_experts
    reads it at each call, so a graph captured inside keeps that choice."""
    saved = getattr(moe_kernels, name)
    if value is not None:
        setattr(moe_kernels, name, value)
    try:
        yield
    finally:
        setattr(moe_kernels, name, saved)


def nbytes(module: torch.nn.Module | None) -> int:
    if module is None:
        return 0
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def expert_bytes(layer: FusedMoE) -> int:
    """One expert's tensors in bytes (weights, scales, biases); shared slots count as experts."""
    return nbytes(layer.experts) // layer.experts.spec.num_experts


def floor_bytes(layer: FusedMoE, x: torch.Tensor) -> int:
    """What one call must read and write: the router weight, each picked expert once (shared
    slots included), a shared MLP apart, the input and the output."""
    with torch.no_grad():
        _, ids = layer.ops.route_experts(layer.gate(x), layer.router, layer.selection_bias)
    active = int(torch.unique(ids).numel())
    io = 2 * x.numel() * x.element_size()
    return nbytes(layer.gate) + active * expert_bytes(layer) + nbytes(layer.shared) + io


def time_calls(fn, device: torch.device, graph: bool, iters: int) -> float:
    """Seconds per call of fn() (already warmed up): CUDA events around `iters` graph replays
    or eager calls; wall time on the CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def bench(shape: str, tokens: int, args, device: torch.device) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden = SHAPES[shape][0]
    row: dict = {"shape": shape, "tokens": tokens}
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    atomic = TritonOps()
    atomic.moe_atomic_sum = True
    runs = [("triton", TritonOps()), ("atomic", atomic), ("torch", TorchOps())]
    if SHAPES[shape][8]:  # shared experts: the same layer with them apart
        runs.insert(1, ("unfused", unfused_ops()))
    if SHAPES[shape][4] == "bf16" and tokens <= moe_kernels.TMA_GEMV_MAX_TOKENS:
        runs.insert(1, ("no_tma", TritonOps()))  # run with TMA_GEMV_MAX_TOKENS 0
    for name, ops in runs:
        with patched("TMA_GEMV_MAX_TOKENS", 0 if name == "no_tma" else None):
            time_run(name, ops, shape, x, row, args, device, dtype)
    row["floor_us"] = row["floor_bytes"] / args.bandwidth * 1e6
    best = row.get("triton_graph_us", row["triton_eager_us"])
    row["of_floor"] = row["floor_us"] / best
    return row


def time_run(
    name: str,
    ops,
    shape: str,
    x: torch.Tensor,
    row: dict,
    args,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """One run of bench(): `args.layers` layers under `ops`, timed in the run's modes into row
    (`{name}_{mode}_us`)."""
    layers = [build(shape, ops, device, dtype, seed) for seed in range(args.layers)]

    def step(layers=layers) -> None:
        for layer in layers:
            layer(x)

    with torch.no_grad():
        if device.type == "cuda":
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step()  # compile and warm up off the capture
            torch.cuda.current_stream().wait_stream(s)
        else:
            step()
        modes = [("eager", False)]
        if device.type == "cuda":
            graphed = [("graph", True), *modes]
            modes = {"triton": graphed, "unfused": graphed}.get(name, modes)
            if name in ("atomic", "no_tma"):
                modes = [("graph", True)]
        for mode, graph in modes:
            sec = time_calls(step, device, graph, args.iters) / args.layers
            row[f"{name}_{mode}_us"] = sec * 1e6
    if name == "triton":
        row["floor_bytes"] = sum(floor_bytes(layer, x) for layer in layers) / args.layers
    del layers
    if device.type == "cuda":
        torch.cuda.empty_cache()


def candidates(decode: bool, mxfp4: bool) -> list[tuple[GemmConfig, GemmConfig]]:
    """(gate_up, down) tiles to try: one shape for both GEMMs, or down twice as wide; for MXFP4
    beyond decode sizes also swapped operands (SWAP_AB: the weight tile, 64 or 128 output
    columns, as wgmma's register operand; 16 to 128 rows of pairs), 128 K columns a step, and
    16-32 rows unswapped."""
    out = []
    if mxfp4 and not decode:
        for bm in (16, 32, 64, 128):
            for bn, warps in ((64, 4), (128, 4), (128, 8)):
                for bk in (64, 128) if (bn, warps) != (128, 4) else (64,):
                    c = GemmConfig(bm, bn, bk, warps, 3, swap_ab=True)
                    out.append((c, c))
        for bm, bn, warps in ((64, 64, 4), (64, 128, 8), (128, 64, 4), (128, 128, 8)):
            c = GemmConfig(bm, bn, 128, warps, 3 if bn == 64 else 2)
            out.append((c, c))
        # 16-32 rows of pairs unswapped: mma.sync, not wgmma (whose steps wait on each other)
        for bm, bn, bk, warps in (
            (32, 64, 64, 4),
            (32, 64, 128, 4),
            (32, 128, 64, 8),
            (16, 64, 128, 4),
        ):
            c = GemmConfig(bm, bn, bk, warps, 3)
            out.append((c, c))
    if decode:
        for bn in (16, 32, 64):
            for bk in (64, 128, 256):
                if mxfp4 or bk < 256:
                    for stages in (3, 4):
                        c = GemmConfig(16, bn, bk, 4, stages)
                        out.append((c, c))
    else:
        for bm in (64, 128, 256):  # 256 rows: MXFP4 tiles dequantized once for more rows
            for bn in (64, 128):
                for warps in (4, 8) if bm < 256 else (8,):
                    c = GemmConfig(bm, bn, 64, warps, 3)
                    out.append((c, c))
                    if bn == 64:
                        out.append((c, GemmConfig(bm, 128, 64, warps, 3)))
    return out


def sweep(shape: str, tokens: int, args, device: torch.device) -> list[tuple[float, object]]:
    """The experts alone (routing fixed), per layer, under each candidate (None: fused_experts'
    defaults; at decode sizes also moe_gemv_kernel at a few widths, and for bf16 experts
    moe_tma_gemv_kernel's tiles): fastest first."""
    dtype = torch.bfloat16
    layers = [build(shape, TritonOps(), device, dtype, seed) for seed in range(args.layers)]
    x = torch.randn(tokens, SHAPES[shape][0], device=device, dtype=dtype)
    with torch.no_grad():
        routed = [
            layer.ops.route_experts(layer.gate(x), layer.router, layer.selection_bias)
            for layer in layers
        ]
    spec = layers[0].experts.spec
    pairs = routed[0][1].numel()  # tokens x (top_k + shared slots)
    decode = pairs <= 16 * spec.num_experts
    results = []
    mxfp4 = SHAPES[shape][4] == "mxfp4"
    # (configs, gemv, tma, gemv_tma) of each run
    Run = tuple[tuple | None, bool | None, bool | None, bool | None]

    def run(gate_up: GemmConfig, down: GemmConfig, kernel: str) -> Run:
        """moe_gemv_kernel ("gemv"), moe_tma_gemv_kernel ("tma"), moe_gemv_tma_kernel."""
        return (gate_up, down), kernel != "tma", kernel == "tma", kernel == "gemv_tma"

    runs: list[Run] = [(None, None, None, None)]
    runs += [(cfg, False, False, False) for cfg in candidates(decode, mxfp4)]
    if decode:  # moe_gemv_kernel: output columns, K columns a step, warps (, down's K runs)
        runs += [
            run(GemmConfig(16, bn, bk, warps), GemmConfig(16, bn, bk, warps, split_k=s), "gemv")
            for bn in (8, 16, 32, 64)
            for bk in (256, 512, 1024)
            for warps in (4, 8)
            for s in ((1, 2, 3) if bn <= 16 and bk != 512 else (1,))
        ]
    if decode and mxfp4:  # moe_gemv_tma_kernel: (gate_up, down) columns and warps, K, stages
        widths = ((8, 4, 16, 4), (8, 4, 8, 2), (8, 2, 16, 2), (8, 4, 8, 4), (16, 4, 32, 4))
        runs += [
            run(
                GemmConfig(16, gn, bk, gw, st),
                GemmConfig(16, dn, bk, dw, st, split_k=s),
                "gemv_tma",
            )
            for gn, gw, dn, dw in widths
            for bk in (512, 1024, 2048)
            for st in (2, 3, 4)
            for s in ((1, 2) if (gn, gw, dn, dw, bk) == (*widths[0], 1024) else (1,))
        ]
    if decode and SHAPES[shape][4] == "bf16":  # moe_tma_gemv_kernel (down also split)
        runs += [
            run(GemmConfig(16, bn, bk, 4, st), GemmConfig(16, bn, bk, 4, st, split_k=s), "tma")
            for bn in (16, 32, 64, 128)
            for bk in (64, 128)
            for st in (2, 3, 4)
            for s in (1, 2)
        ]
    for cfg, gemv, tma, gemv_tma in runs:

        def step(cfg=cfg, gemv=gemv, tma=tma, gemv_tma=gemv_tma) -> None:
            for layer, (w, ids) in zip(layers, routed, strict=True):
                w_all = layer.experts.expert_weights()
                fused_experts(
                    x, w, ids, w_all, spec, configs=cfg, gemv=gemv, tma=tma, gemv_tma=gemv_tma
                )

        if tma:
            label = f"tma gate_up {cfg[0]}  down {cfg[1]}"
        elif gemv_tma:
            g, d = cfg
            label = (
                f"gemv tma gate_up {g.block_n} x {g.block_k} by {g.num_warps} warps, down "
                f"{d.block_n} x {d.block_k} by {d.num_warps}, {g.num_stages} stages"
            )
            label += f", down K in {d.split_k}" if d.split_k > 1 else ""
        elif gemv:
            label = f"gemv {cfg[0].block_n} x {cfg[0].block_k}, {cfg[0].num_warps} warps"
            label += f", down K in {cfg[1].split_k}" if cfg[1].split_k > 1 else ""
        else:
            label = cfg
        try:
            with torch.no_grad():
                step()
                torch.cuda.synchronize()
                sec = time_calls(step, device, True, args.iters) / args.layers
        except Exception as err:  # a tile that does not compile or fit: skip it, say so
            print(f"  {label}: {type(err).__name__}")
            continue
        results.append((sec * 1e6, label))
    results.sort(key=lambda r: r[0])
    return results


def profile(shape: str, tokens: int, args, device: torch.device) -> None:
    """Each kernel's GPU time in eager calls of one layer of the Triton path."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    layer = build(shape, unfused_ops() if args.unfused else TritonOps(), device, torch.bfloat16, 0)
    x = torch.randn(tokens, SHAPES[shape][0], device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                layer(x)
            torch.cuda.synchronize()
    print(f"{shape} {tokens} tokens, {args.iters} calls:")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=12))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", default="gpt-oss-20b,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,8,64,2048")
    ap.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s (H100 SXM)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 1 and 8 tokens, CPU ok")
    ap.add_argument("--sweep", action="store_true", help="time candidate tiles (GPU only)")
    ap.add_argument("--profile", action="store_true", help="kernel times (GPU only)")
    ap.add_argument(
        "--unfused", action="store_true", help="--profile with shared experts apart (their MLP)"
    )
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.shapes, args.tokens = "smoke-mxfp4,smoke-bf16,smoke-shared", "1,8"
        args.layers, args.iters = 2, 1
    if args.profile:
        for shape in args.shapes.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                profile(shape, tokens, args, device)
        return
    if args.sweep:
        for shape in args.shapes.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                results = sweep(shape, tokens, args, device)
                print(f"{shape} {tokens} tokens: the experts alone, per layer, fastest first")
                shown = results[:6] + [r for r in results[6:] if r[1] is None]
                for us, cfg in shown:
                    if cfg is None or isinstance(cfg, str):
                        label = cfg or "default"
                    else:
                        label = f"gate_up {cfg[0]}  down {cfg[1]}"
                    print(f"  {us:8.1f} us  {label}")
        return
    rows = []
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (interpreter)"
    print(f"MoE layer, {name}, floor at {args.bandwidth / 1e12:.2f} TB/s, per layer")
    print("unfused: shared experts apart (graph where there is one, else eager; - : none)")
    print("no-tma: bf16 experts on moe_gemm_kernel, not the TMA kernel (graph; - : none)")
    head = f"{'shape':<24}{'tokens':>7}{'floor us':>10}{'graph us':>10}{'eager us':>10}"
    print(
        head + f"{'no-tma us':>10}{'unfused us':>11}{'atomic us':>10}"
        f"{'torch us':>10}{'of floor':>10}"
    )
    for shape in args.shapes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            r = bench(shape, tokens, args, device)
            rows.append(r)
            graph = f"{r['triton_graph_us']:>10.1f}" if "triton_graph_us" in r else f"{'-':>10}"
            key = "atomic_graph_us" if "atomic_graph_us" in r else "atomic_eager_us"
            unfused = r.get("unfused_graph_us", r.get("unfused_eager_us"))
            apart = f"{unfused:>11.1f}" if unfused is not None else f"{'-':>11}"
            no_tma = r.get("no_tma_graph_us", r.get("no_tma_eager_us"))
            gemm = f"{no_tma:>10.1f}" if no_tma is not None else f"{'-':>10}"
            print(
                f"{shape:<24}{tokens:>7}{r['floor_us']:>10.1f}{graph}{r['triton_eager_us']:>10.1f}"
                f"{gemm}{apart}{r[key]:>10.1f}{r['torch_eager_us']:>10.1f}"
                f"{r['of_floor']:>10.0%}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
