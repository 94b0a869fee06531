"""Sweep the Triton prefill attention's tiles and launch options, per prompt shape.

    python benchmarks/tune_prefill_attention.py [--shapes 16x512,1x2048,1x8192] [--heads 16,2]
        [--head-dim 128] [--layers 4] [--grid KEY=V1,V2 ...] [--json OUT.json]

The prefill kernel has run at the tiles it was first written with (64 query rows, 64-key tiles,
4 warps, no software pipelining). In the 3B offline run's 8192-token prompt step it took ~5% of
the GPU time, at ~90 TFLOPS of attention (BENCHMARKS.md, profile_prefill). For each shape
(prompts x tokens, fresh prompts, no cached prefix) this times `--layers` layers of
TritonAttention.forward (the KV write, then the prefill kernel) over one prefill-only step,
eagerly as such steps run past graph_max_tokens, and prints µs a layer for the default and the
best config, with the attention's TFLOPS (causal: 4 x query heads x head_dim x L(L+1)/2 a
prompt). Keys (`--grid KEY=V1,V2`, repeatable; the others stay at the backend's defaults):
block_m (query rows a tile: queries x the GQA group), block_n (keys a tile), warps and stages
(Triton's num_stages: software pipelining of the K/V tile loads). Every config's output is
checked against the default's (a config that changes results is an error, not a winner).
Without a GPU it runs under TRITON_INTERPRET=1 in float32, for tests at toy sizes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from commit_id import commit_id

from inferx_core.batch import make_attention_batch
from inferx_core.interfaces.kv import KVLayerSpec
from inferx_kernels_cuda.triton_attention import TritonAttention

BLOCK = 16
KEYS = ("block_m", "block_n", "warps", "stages")


def defaults(backend: TritonAttention, group: int) -> dict[str, int]:
    """The config a backend runs for layers of this GQA group unless told otherwise."""
    launch = backend.prefill_options(group)
    return {
        "block_m": backend.prefill_block_m,
        "block_n": backend.prefill_block_n,
        "warps": launch["num_warps"],
        "stages": launch["num_stages"],
    }


def parse_grid(items: list[str], default: dict[str, int]) -> list[dict[str, int]]:
    """--grid KEY=V1,V2 items -> every combination of the named values, the rest at default."""
    axes = {k: (v,) for k, v in default.items()}
    for item in items:
        key, _, values = item.partition("=")
        if key not in KEYS or not values:
            raise SystemExit(f"--grid {item!r}: expected KEY=V1,V2 with KEY one of {list(KEYS)}")
        axes[key] = tuple(int(v) for v in values.split(","))
    return [dict(zip(axes, vals, strict=True)) for vals in itertools.product(*axes.values())]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """ "16x512,1x2048" -> [(16, 512), (1, 2048)]: prompts x tokens each."""
    shapes = []
    for item in text.split(","):
        n, _, length = item.partition("x")
        shapes.append((int(n), int(length)))
    return shapes


def build(
    cfg: dict[str, int] | None,
    spec: KVLayerSpec,
    layers: int,
    shape: tuple[int, int],
    device: torch.device,
) -> tuple[TritonAttention, object]:
    """A backend of `layers` caches, the tiles of `cfg` (None: its defaults), and the step of
    `shape` fresh prompts over scattered blocks, as a block manager hands them out."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = TritonAttention([spec] * layers, BLOCK, dtype, device)
    if cfg is not None:
        backend.prefill_block_m = cfg["block_m"]
        backend.prefill_block_n = cfg["block_n"]
        launch = {"num_warps": cfg["warps"], "num_stages": cfg["stages"]}
        backend.prefill_launch = backend.prefill_launch_small_group = launch
    n, length = shape
    per_seq = -(-length // BLOCK)
    backend.allocate(n * per_seq + 1)
    ids = (torch.randperm(n * per_seq, generator=torch.Generator().manual_seed(0)) + 1).tolist()
    tables = [ids[i * per_seq : (i + 1) * per_seq] for i in range(n)]
    batch = make_attention_batch([length] * n, [length] * n, tables, BLOCK, device)
    return backend, batch


def inputs(
    spec: KVLayerSpec, tokens: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """q, k, v of a step's `tokens` new tokens, [tokens, heads, head_dim], seeded."""
    gen = torch.Generator(device=device).manual_seed(1)
    return tuple(
        torch.randn(tokens, h, spec.head_dim, generator=gen, device=device).to(dtype)
        for h in (spec.num_q_heads, spec.num_kv_heads, spec.num_kv_heads)
    )


def measure(
    backend: TritonAttention, batch: object, spec: KVLayerSpec, tokens: int, layers: int, reps: int
) -> tuple[float, torch.Tensor]:
    """µs a layer of a prefill step's attention (mean of `reps` after a warm-up), and the last
    layer's output."""
    device = backend.device
    q, k, v = inputs(spec, tokens, backend.dtype, device)
    scale = spec.head_dim**-0.5
    backend.begin_step(batch)

    def step() -> torch.Tensor:
        for layer in range(layers):
            res = backend.forward(layer, q, k, v, scale)
        return res

    return time_layers(step, reps, layers, device.type == "cuda")


def setup(args: argparse.Namespace, script: str) -> tuple[bool, torch.device, KVLayerSpec]:
    """(on a GPU, the device, the layer spec of --heads and --head-dim); without a GPU only
    under TRITON_INTERPRET=1 (toy runs), else the script exits saying so."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    cuda = torch.cuda.is_available() and not interpret
    if not cuda and not interpret:
        raise SystemExit(f"{script}: no GPU; set TRITON_INTERPRET=1 for a toy run")
    q_heads, kv_heads = (int(h) for h in args.heads.split(","))
    spec = KVLayerSpec(q_heads, kv_heads, args.head_dim)
    return cuda, torch.device("cuda" if cuda else "cpu"), spec


def time_layers(
    step: Callable[[], torch.Tensor], reps: int, layers: int, cuda: bool
) -> tuple[float, torch.Tensor]:
    """µs a layer of `step` (which runs `layers` layers; mean of `reps` after one that
    compiles), and its last output."""
    out = step()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        out = step()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / (reps * layers), out.float().clone()


def write_json(path: str, spec: KVLayerSpec, layers: int, rows: list[dict], cuda: bool) -> None:
    """The rows with the run's commit, device and attention shape."""
    meta = {
        "commit": commit_id(),
        "device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
        "heads": [spec.num_q_heads, spec.num_kv_heads],
        "head_dim": spec.head_dim,
        "layers": layers,
    }
    Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def attention_tflops(spec: KVLayerSpec, shape: tuple[int, int], us: float) -> float:
    """Causal attention FLOPs of a layer (QK^T and PV, 2 each a multiply-add) over its time."""
    n, length = shape
    flops = 4 * spec.num_q_heads * spec.head_dim * n * length * (length + 1) / 2
    return flops / us / 1e6


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="16x512,1x2048,1x8192", help="prompts x tokens, ...")
    ap.add_argument("--heads", default="16,2", help="query heads,KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda, device, spec = setup(args, "tune_prefill_attention.py")
    rows = []
    print(f"{'shape':>8} | {'default us':>10} {'TFLOPS':>6} | {'best us':>8} {'TFLOPS':>6}  best")
    for shape in parse_shapes(args.shapes):
        tokens = shape[0] * shape[1]
        backend, batch = build(None, spec, args.layers, shape, device)
        default = defaults(backend, spec.num_q_heads // spec.num_kv_heads)
        base_us, base_out = measure(backend, batch, spec, tokens, args.layers, args.reps)
        del backend
        results = []
        for cfg in parse_grid(args.grid, default):
            backend, batch = build(cfg, spec, args.layers, shape, device)
            try:
                us, out = measure(backend, batch, spec, tokens, args.layers, args.reps)
            except Exception as e:  # e.g. more shared memory than an SM has: not a candidate
                print(f"  {cfg}: {e}"[:160])
                continue
            err = (out - base_out).abs().max().item() / max(base_out.abs().max().item(), 1e-6)
            if err > 2e-2:
                raise SystemExit(f"{shape}, {cfg}: output differs from the default's ({err:.2e})")
            results.append({"us": us, "tflops": attention_tflops(spec, shape, us), **cfg})
            del backend
            if cuda:
                torch.cuda.empty_cache()
        best = min(results, key=lambda r: r["us"])
        rows.append(
            {
                "prompts": shape[0],
                "tokens": shape[1],
                "default": default,
                "default_us": base_us,
                "default_tflops": attention_tflops(spec, shape, base_us),
                "best": best,
                "all": results,
            }
        )
        label = f"{shape[0]}x{shape[1]}"
        cfg_text = " ".join(f"{k}={best[k]}" for k in KEYS)
        print(f"{label:>8} | {base_us:10.1f} {rows[-1]['default_tflops']:6.1f} | "
              f"{best['us']:8.1f} {best['tflops']:6.1f}  {cfg_text}")  # fmt: skip
    if args.json:
        write_json(args.json, spec, args.layers, rows, cuda)
    return rows


if __name__ == "__main__":
    main()
