"""The prompt steps' attention against its peers: our Triton prefill kernel, FlashInfer's FA2
and FA3 prefill, and torch's SDPA, per prompt shape.

    python benchmarks/bench_prefill_peers.py [--shapes 16x512,1x2048,1x8192] [--heads 32,8]
        [--variants triton,triton-dense,fi-fa2,fi-fa3,fi-fa3-ragged,sdpa] [--layers 4]
        [--dense 128x64x8x2,64x64x4x2] [--json OUT.json]

Each shape is fresh prompts (no cached prefix) of one length, laid over scattered blocks of 16
the way the block manager hands them out. µs a layer (mean of `--reps` after a compiling run):

- `triton`: TritonAttention.forward, the KV-cache write and then the prefill kernel;
- `triton-dense`: the same backend with dense_prefill on: the write (keeping k), then
  dense_prefill_kernel over the step's own q, k, v by TMA; once per `--dense` config
  (BLOCK_M x BLOCK_N x warps x stages; none given: the backend's);
- `fi-fa2`, `fi-fa3`: FlashInferAttention.forward with prefill_backend="fa2" / "fa3", the
  same write and then FlashInfer's paged prefill wrapper (planned once, as begin_step does);
- `fi-fa3-ragged`: the write, then FlashInfer's ragged prefill (FA3) over the chunk's own
  contiguous K and V, which a step without a cached prefix could use instead of the pages;
- `sdpa`: torch's scaled_dot_product_attention over [prompts, heads, length, head_dim] with
  GQA, causal: no cache and no write, a peer for the kernel alone.

Every variant's output is checked against the first one's (relative error over 2e-2 is an
error). Attention TFLOPS count causal work: 4 x query heads x head_dim x L(L+1)/2 a prompt.
Without a GPU only `triton` and `sdpa` run, in float32 under TRITON_INTERPRET=1 (toy sizes).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from tune_prefill_attention import (
    BLOCK,
    attention_tflops,
    build,
    inputs,
    parse_shapes,
    setup,
    time_layers,
    write_json,
)

from inferx_core.interfaces.kv import KVLayerSpec
from inferx_kernels_cuda.triton_attention import DenseConfig

VARIANTS = ("triton", "triton-dense", "fi-fa2", "fi-fa3", "fi-fa3-ragged", "sdpa")


def flashinfer_backend(prefill: str, spec: KVLayerSpec, layers: int, shape, device, batch):
    """FlashInferAttention over the same block layout as `build`'s Triton backend."""
    from inferx_kernels_cuda.flashinfer_attention import FlashInferAttention

    backend = FlashInferAttention(
        [spec] * layers, BLOCK, torch.bfloat16, device, prefill_backend=prefill
    )
    n, length = shape
    backend.allocate(n * -(-length // BLOCK) + 1)
    backend.begin_step(batch)
    return backend


def variant_step(
    name: str, spec: KVLayerSpec, layers: int, shape, device, dense: str = ""
) -> Callable:
    """A function that runs `layers` layers of variant `name` and returns the last output.
    dense: triton-dense's BLOCK_MxBLOCK_NxWARPSxSTAGES ("": the backend's defaults)."""
    n, length = shape
    tokens = n * length
    triton, batch = build(None, spec, layers, shape, device)
    dtype = triton.dtype
    q, k, v = inputs(spec, tokens, dtype, device)
    scale = spec.head_dim**-0.5
    if name in ("triton", "triton-dense"):
        if name == "triton-dense":
            triton.dense_prefill = True
            if dense:
                triton.dense_configs = [(0, DenseConfig.parse(dense))]
        triton.begin_step(batch)
        return lambda: [triton.forward(i, q, k, v, scale) for i in range(layers)][-1]
    if name == "sdpa":
        group = spec.num_q_heads // spec.num_kv_heads

        def heads_first(x: torch.Tensor) -> torch.Tensor:
            return x.view(n, length, x.shape[1], spec.head_dim).transpose(1, 2)

        qh, kh, vh = heads_first(q), heads_first(k), heads_first(v)

        def sdpa() -> torch.Tensor:
            for _ in range(layers):
                out = torch.nn.functional.scaled_dot_product_attention(
                    qh, kh, vh, is_causal=True, scale=scale, enable_gqa=group > 1
                )
            return out.transpose(1, 2).reshape(tokens, spec.num_q_heads, spec.head_dim)

        return sdpa
    if device.type != "cuda":
        raise ValueError("FlashInfer needs a GPU")
    if name in ("fi-fa2", "fi-fa3"):
        fi = flashinfer_backend(name[3:], spec, layers, shape, device, batch)
        return lambda: [fi.forward(i, q, k, v, scale) for i in range(layers)][-1]
    if name == "fi-fa3-ragged":
        import flashinfer

        from inferx_kernels_cuda.triton_attention import write_kv

        fi = flashinfer_backend("fa2", spec, layers, shape, device, batch)  # its cache + slots
        workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
        ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")
        indptr = torch.arange(0, tokens + 1, length, dtype=torch.int32)
        ragged.plan(
            indptr, indptr, spec.num_q_heads, spec.num_kv_heads, spec.head_dim,
            causal=True, q_data_type=dtype, kv_data_type=dtype,
        )  # fmt: skip
        slots = fi._plan.slot_mapping

        def run() -> torch.Tensor:
            for i in range(layers):
                cache = fi.caches[i]
                write_kv(k, v, cache[0], cache[1], slots, spec)
                out = ragged.run(q, k, v)
            return out

        return run
    raise AssertionError(name)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="16x512,1x2048,1x8192", help="prompts x tokens, ...")
    ap.add_argument("--heads", default="32,8", help="query heads,KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dense", default="", help="triton-dense configs: BMxBNxWARPSxSTAGES,...")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda, device, spec = setup(args, "bench_prefill_peers.py")
    names = args.variants.split(",")
    if unknown := [n for n in names if n not in VARIANTS]:
        raise SystemExit(f"--variants: unknown {unknown}; expected some of {list(VARIANTS)}")
    dense_configs = args.dense.split(",") if args.dense else [""]
    runs = [(n, c) for n in names for c in (dense_configs if n == "triton-dense" else [""])]
    rows = []
    print(f"{'shape':>8} {'variant':>24} {'us/layer':>9} {'TFLOPS':>7} {'rel err':>8}")
    for shape in parse_shapes(args.shapes):
        ref = None
        for name, dense in runs:
            t0 = time.perf_counter()
            try:
                step = variant_step(name, spec, args.layers, shape, device, dense)
                us, out = time_layers(step, args.reps, args.layers, cuda)
            except (RuntimeError, ImportError, ValueError) as e:  # not built / not supported
                print(f"{shape[0]}x{shape[1]:<6} {name:>24}: {e}"[:200])
                continue
            if ref is None:
                ref = out
            err = (out - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
            if err > 2e-2:
                raise SystemExit(f"{shape}, {name}: output differs from {names[0]}'s ({err:.2e})")
            tflops = attention_tflops(spec, shape, us)
            label = f"{name} {dense}".strip()
            rows.append({"prompts": shape[0], "tokens": shape[1], "variant": label, "us": us,
                         "tflops": tflops, "rel_err": err,
                         "first_run_s": time.perf_counter() - t0})  # fmt: skip
            print(f"{shape[0]}x{shape[1]:<6} {label:>24} {us:9.1f} {tflops:7.1f} {err:8.1e}")
            if cuda:
                torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, spec, args.layers, rows, cuda)
    return rows


if __name__ == "__main__":
    main()
