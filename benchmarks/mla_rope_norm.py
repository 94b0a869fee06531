"""KernelOps.mla_rope_norm at DeepSeek-V2-Lite's widths (16 heads, nope 128, rope 64, latent
512, bf16): the torch reference (`torch`) against the one Triton launch (`triton`), each call
captured in a CUDA graph as a decode step runs it (graph_timing.time_calls: µs a call, launch
gaps between consecutive calls included). "x layers" is that times the model's 27 layers.

python benchmarks/mla_rope_norm.py [--tokens 1,8,64,512]
"""

from __future__ import annotations

import argparse

import torch
from graph_timing import time_calls

from inferx_core.ops_torch import TorchOps
from inferx_kernels_cuda.ops import TritonOps
from inferx_models.layers import RotaryEmbedding

HEADS, NOPE, ROPE, RANK, LAYERS = 16, 128, 64, 512, 27
EPS = 1e-6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,8,64,512")
    args = parser.parse_args()
    device = torch.device("cuda")
    params = {"rope_type": "default", "rope_theta": 10000.0}
    cos_sin = RotaryEmbedding(ROPE, 4096, params, device).cos_sin
    weight = torch.randn(RANK, device=device, dtype=torch.bfloat16)
    for tokens in (int(t) for t in args.tokens.split(",")):
        # q and kv as V2-Lite's qkv_a_proj output hands them over: views of one GEMM row
        fused = torch.randn(
            tokens, HEADS * (NOPE + ROPE) + RANK + ROPE, device=device, dtype=torch.bfloat16
        )
        q = fused[:, : HEADS * (NOPE + ROPE)].view(tokens, HEADS, NOPE + ROPE)
        kv = fused[:, HEADS * (NOPE + ROPE) :]
        positions = torch.randint(0, 4096, (tokens,), device=device)
        row = [f"tokens {tokens:4d}"]
        call = (q, kv, weight, EPS, positions, cos_sin)
        for name, ops in (("torch", TorchOps()), ("triton", TritonOps())):
            us = time_calls([lambda ops=ops, call=call: ops.mla_rope_norm(*call)], True)
            row.append(f"{name} {us:7.2f} µs (x {LAYERS} layers {us * LAYERS / 1e3:.3f} ms)")
        print("  ".join(row))


if __name__ == "__main__":
    main()
