"""One MLA layer's decode step (DeepSeek-V2-Lite's widths: 16 heads, nope 128, rope 64, v 128,
latent 512, bf16) replayed from a CUDA graph, as decode graphs run it, on each backend that
takes it: `triton` (mla_decode's kernels, W_UK and W_UV fused into Triton kernels:
TritonAttention.mla_fused_absorb on), `triton-unfused` (the same with it off: cuBLAS einsums
for W_UK and W_UV), `flashinfer` with FlashInfer's MLA module fa2 (the default) and fa3. The
step is the latent write, W_UK, the attention over the paged latent cache, W_UV and the
reshape to [batch, heads * v] that o_proj takes (a copy where the output is a permuted view).
Times are per layer (CUDA events around replays); "x layers" is that times the model's 27
layers, the attention's share of a decode step; "fused" is triton's time over
triton-unfused's (below 1: the fused form is faster), where both run.

python benchmarks/mla_decode.py [--batch 1,16,64] [--context 1024,4096] [--iters 200]
    [--backends triton,triton-unfused,flashinfer-fa2,flashinfer-fa3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from inferx_core.batch import make_attention_batch
from inferx_core.interfaces.attention import MLAWeights
from inferx_core.interfaces.kv import KVLayerSpec

HEADS, NOPE, ROPE, V, RANK, LAYERS = 16, 128, 64, 128, 512, 27
BLOCK = 16


def build(name: str, spec: KVLayerSpec, device: torch.device):
    if name in ("triton", "triton-unfused"):
        from inferx_kernels_cuda.triton_attention import TritonAttention

        backend = TritonAttention([spec], BLOCK, torch.bfloat16, device)
        backend.mla_fused_absorb = name == "triton"
        return backend
    from inferx_kernels_cuda.flashinfer_attention import FlashInferAttention

    module = name.split("-", 1)[1]
    return FlashInferAttention([spec], BLOCK, torch.bfloat16, device, mla_backend=module)


def bench(name: str, batch: int, context: int, iters: int, device: torch.device) -> float:
    """Microseconds per replay of one layer's decode step of `batch` sequences of `context`
    tokens (scattered blocks)."""
    dtype = torch.bfloat16
    spec = KVLayerSpec(HEADS, 1, RANK + ROPE, kind="mla", v_head_dim=RANK, rope_dim=ROPE)
    g = torch.Generator().manual_seed(0)
    per_seq = math.ceil(context / BLOCK)
    num_blocks = batch * per_seq + 1
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = [ids[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    w = (torch.randn(HEADS * (NOPE + V), RANK, generator=g) / RANK**0.5).to(device, dtype)
    mla = MLAWeights(NOPE, V, lambda x: (x @ w.t()).view(-1, HEADS, NOPE + V))
    mla.w_uk, mla.w_uv = w.view(HEADS, NOPE + V, RANK).split([NOPE, V], dim=1)
    backend = build(name, spec, device)
    backend.allocate(num_blocks)
    backend.caches[0].normal_()
    attn = backend.layer(0, (NOPE + ROPE) ** -0.5, mla=mla)
    q = torch.randn(batch, HEADS, NOPE + ROPE, generator=g).to(device, dtype)
    k = torch.randn(batch, 1, RANK + ROPE, generator=g).to(device, dtype)
    backend.init_graph_buffers(batch, per_seq)
    backend.prepare_for_capture(batch)

    def step() -> torch.Tensor:
        # as MLAttention._attend hands it to o_proj: a view of a contiguous output, a copy
        # of a permuted one (the unfused form's)
        return backend.forward(attn, q, k, k[..., :RANK]).reshape(batch, HEADS * V)

    with torch.no_grad():
        step()  # compiles / JIT-builds outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    step = make_attention_batch([1] * batch, [context] * batch, tables, BLOCK)
    backend.prepare_for_replay(step, batch)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--context", default="1024,4096")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--backends", default="triton,triton-unfused,flashinfer-fa2,flashinfer-fa3")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("mla_decode.py times CUDA graphs: it needs a GPU")
    device = torch.device("cuda")
    names = args.backends.split(",")
    print(f"MLA decode, one layer from a CUDA graph, {torch.cuda.get_device_name()} (us)")
    ab = "triton" in names and "triton-unfused" in names
    head = f"{'batch':>6}{'context':>9}" + "".join(f"{n:>16}" for n in names)
    print(head + ("   fused" if ab else "") + "   x layers")
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        for context in (int(c) for c in args.context.split(",")):
            row = {"batch": batch, "context": context}
            for name in names:
                row[name] = bench(name, batch, context, args.iters, device)
            rows.append(row)
            cells = "".join(f"{row[n]:16.1f}" for n in names)
            if ab:
                row["fused"] = row["triton"] / row["triton-unfused"]
                cells += f"{row['fused']:8.2f}"
            best = min(row[n] for n in names) * LAYERS / 1e3
            print(f"{batch:6d}{context:9d}{cells}   {best:.3f} ms (fastest)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
