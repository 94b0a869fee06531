"""One MLA layer's attention for a prompt (DeepSeek-V2-Lite's widths: 16 heads, nope 128, rope
64, v 128, latent 512, bf16) on the `triton` backend: the latent write, kv_b_proj's expansion
of the context and mla_prefill_kernel, as a prompt step runs them, against the torch plain form
(TorchAttention: SDPA over the expanded context). Times are per layer; "x layers" is that times
the model's 27 layers, the attention's share of a prompt's TTFT.

python benchmarks/mla_prefill.py [--tokens 2048] [--prefix 0,2048] [--iters 20] [--json out.json]
python benchmarks/mla_prefill.py --sweep   # the layer under candidate tiles, TMA on and off
python benchmarks/mla_prefill.py --smoke   # tiny widths on the CPU, under TRITON_INTERPRET=1

"expand" is kv_b_proj alone over the context's rows, "kernel" the prefill kernel alone (the
layer less the write, the gather and the expansion); TFLOP/s counts the kernel's causal
attention FLOPs (QK over nope + rope, PV over v).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from inferx_core.attention_torch import TorchAttention  # noqa: E402
from inferx_core.batch import make_attention_batch  # noqa: E402
from inferx_core.interfaces.attention import AttentionLayer, MLAWeights  # noqa: E402
from inferx_core.interfaces.kv import KVLayerSpec  # noqa: E402
from inferx_kernels_cuda.mla_prefill import mla_prefill  # noqa: E402
from inferx_kernels_cuda.triton_attention import DenseConfig, TritonAttention  # noqa: E402

# name: (heads, nope, rope, v, rank, layers)
SHAPES = {"v2-lite": (16, 128, 64, 128, 512, 27), "smoke": (4, 16, 8, 12, 32, 2)}
BLOCK = 16


def time_calls(fn, device: torch.device, iters: int) -> float:
    """Seconds per call of fn() (warmed up): CUDA events around `iters` calls; wall time on
    the CPU."""
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


class Setup:
    """One layer's step: a prompt chunk of `tokens` over a cached prefix of `prefix` tokens (in
    scattered blocks), random q, cache rows and kv_b_proj."""

    def __init__(self, shape: str, tokens: int, prefix: int, device: torch.device) -> None:
        heads, nope, rope, v, rank, self.layers = SHAPES[shape]
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        ctx = prefix + tokens
        blocks = math.ceil(ctx / BLOCK)
        g = torch.Generator().manual_seed(0)
        table = torch.randperm(blocks + 1, generator=g)[:blocks].tolist()
        self.batch = make_attention_batch([tokens], [ctx], [table], BLOCK, device)
        self.spec = KVLayerSpec(heads, 1, rank + rope, kind="mla", v_head_dim=rank, rope_dim=rope)
        self.q = torch.randn(tokens, heads, nope + rope, generator=g).to(device, dtype)
        self.k = torch.randn(tokens, 1, rank + rope, generator=g).to(device, dtype)
        w = (torch.randn(heads * (nope + v), rank, generator=g) / rank**0.5).to(device, dtype)
        self.mla = MLAWeights(nope, v, lambda x: F.linear(x, w).view(-1, heads, nope + v))
        self.mla.w_uk, self.mla.w_uv = w.view(heads, nope + v, rank).split([nope, v], dim=1)
        self.scale = (nope + rope) ** -0.5
        self.tokens, self.prefix, self.num_blocks = tokens, prefix, blocks + 1
        self.widths = (heads, nope, rope, v, rank)
        self.device, self.dtype = device, dtype

    def backend(self, cls: type, config: DenseConfig | None = None, tma: bool | None = None):
        b = cls([self.spec], BLOCK, self.dtype, self.device)
        b.allocate(self.num_blocks)
        b.caches[0].normal_()
        if config is not None:
            b.mla_prefill_config = config
        if tma is not None:
            b.mla_prefill_tma = tma
        b.begin_step(self.batch)
        return b

    def step(self, backend) -> None:
        layer = AttentionLayer(0, self.spec, self.scale, mla=self.mla)
        backend.forward(layer, self.q, self.k, self.k[..., : self.widths[-1]])

    def flops(self) -> float:
        """The causal attention's multiply-adds x 2: each query sees prefix + its index + 1."""
        heads, nope, rope, v, _ = self.widths
        pairs = self.tokens * self.prefix + self.tokens * (self.tokens + 1) / 2
        return 2 * pairs * heads * (nope + rope + v)


def bench(shape: str, tokens: int, prefix: int, args, device: torch.device) -> dict:
    s = Setup(shape, tokens, prefix, device)
    row: dict = {"shape": shape, "tokens": tokens, "prefix": prefix}
    with torch.no_grad():
        triton_b = s.backend(TritonAttention)
        row["layer_us"] = time_calls(lambda: s.step(triton_b), device, args.iters) * 1e6
        context = torch.randn(prefix + tokens, s.widths[-1], device=device, dtype=s.dtype)
        row["expand_us"] = time_calls(lambda: s.mla.expand(context), device, args.iters) * 1e6
        cache = triton_b.caches[0]
        plan = triton_b._mla_prefill
        out = torch.empty(tokens, s.widths[0], s.widths[3], device=device, dtype=s.dtype)
        tma = triton_b.mla_prefill_tma
        config = triton_b.mla_prefill_config
        rows = s.k[:, 0]
        plain = MLAWeights(s.mla.qk_nope_head_dim, s.mla.v_head_dim, lambda x: kv)
        kv = s.mla.expand(context)

        def kernel() -> None:
            mla_prefill(s.q, rows, cache, plain, s.scale, plan, triton_b._plan.query_start,
                        triton_b._plan.context_len, out, config.block_n,
                        {"num_warps": config.num_warps, "num_stages": config.num_stages},
                        tma)  # fmt: skip

        if prefix == 0:  # (over a prefix the context is gathered: not the kernel alone)
            row["kernel_us"] = time_calls(kernel, device, args.iters) * 1e6
            row["kernel_tflops"] = s.flops() / row["kernel_us"] / 1e6
        torch_b = s.backend(TorchAttention)
        row["torch_us"] = time_calls(lambda: s.step(torch_b), device, args.iters) * 1e6
    row["layers"] = s.layers
    row["tma"] = tma
    row["config"] = "x".join(str(c) for c in config)
    return row


def candidates() -> list[DenseConfig]:
    """Tiles and launches to sweep (those past the GPU's shared memory fail and are skipped)."""
    return [
        DenseConfig(bm, bn, w, st)
        for bm in (64, 128)
        for bn in (32, 64, 128)
        for w in (4, 8)
        for st in (2, 3, 4)
    ]


def sweep(shape: str, tokens: int, prefix: int, args, device: torch.device) -> None:
    s = Setup(shape, tokens, prefix, device)
    results = []
    configs = candidates()
    default = TritonAttention([s.spec], BLOCK, s.dtype, device).mla_prefill_config
    for tma in (True, False):
        for config in configs:
            try:
                with torch.no_grad():
                    b = s.backend(TritonAttention, config, tma)
                    us = time_calls(lambda b=b: s.step(b), device, args.iters) * 1e6
            except Exception as err:  # a tile that does not compile or fit: skip it, say so
                print(f"  {'x'.join(map(str, config))} tma={int(tma)}: {type(err).__name__}")
                continue
            results.append((us, config, tma, config == default))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    results.sort(key=lambda r: r[0])
    print(f"{shape} {tokens} tokens over {prefix}: the layer, per layer, fastest first")
    for us, config, tma, default in results[:8] + [r for r in results[8:] if r[3]]:
        mark = "  (default)" if default else ""
        print(f"  {us:8.1f} us  {'x'.join(map(str, config))} tma={int(tma)}{mark}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="v2-lite", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="2048")
    ap.add_argument("--prefix", default="0,2048", help="cached prefix lengths")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny widths, CPU ok")
    ap.add_argument("--sweep", action="store_true", help="time candidate tiles (GPU only)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.shape, args.tokens, args.prefix, args.iters = "smoke", "40", "0,24", 1
    cases = [(int(t), int(p)) for t in args.tokens.split(",") for p in args.prefix.split(",")]
    if args.sweep:
        for tokens, prefix in cases:
            sweep(args.shape, tokens, prefix, args, device)
        return
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (interpreter)"
    print(f"MLA prefill, one layer's attention, {name}, per layer (us)")
    head = f"{'tokens':>7}{'prefix':>8}{'layer':>11}{'expand':>11}{'kernel':>11}{'TFLOP/s':>9}"
    print(head + f"{'torch':>11}{'x layers':>11}  config")
    rows = []
    for tokens, prefix in cases:
        r = bench(args.shape, tokens, prefix, args, device)
        rows.append(r)
        kernel = f"{'-':>11}{'-':>9}"
        if "kernel_us" in r:
            kernel = f"{r['kernel_us']:>11.1f}{r['kernel_tflops']:>9.1f}"
        print(
            f"{tokens:>7}{prefix:>8}{r['layer_us']:>11.1f}{r['expand_us']:>11.1f}{kernel}"
            f"{r['torch_us']:>11.1f}{r['layer_us'] * r['layers'] / 1e3:>9.2f}ms"
            f"  {r['config']} tma={int(r['tma'])}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
