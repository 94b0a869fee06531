"""Greedy sampling's argmax over the vocabulary: torch's argmax against the triton KernelOps'
(two launches), µs per call inside a CUDA graph (bench_gemv.graph_us), per rows and vocabulary.

    python benchmarks/bench_argmax.py [--rows 1,8,64,256] [--vocabs 151936,128256] [--json OUT]

The decode step ends in one argmax over [batch, vocab] bf16 logits (an all-greedy step);
profile_decode put torch's at 8.3 µs at batch 1 and 21.6 µs at batch 64 for Qwen2.5's vocabulary
on the H200. Both are checked to give the same tokens first.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_gemv import graph_us
from commit_id import commit_id

from inferx_kernels_cuda.ops import TritonOps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument("--vocabs", default="151936,128256")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ops = TritonOps()
    rows_out = []
    print(f"{'vocab':>7} {'rows':>5} {'torch us':>9} {'triton us':>10}")
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
            if not torch.equal(ops.argmax(x), x.argmax(dim=1)):
                raise SystemExit(f"TritonOps.argmax differs from torch's at {rows} x {vocab}")
            one = graph_us(lambda logits: logits.argmax(dim=1), [x])
            two = graph_us(ops.argmax, [x])
            rows_out.append({"vocab": vocab, "rows": rows, "torch_us": one, "triton_us": two})
            print(f"{vocab:>7} {rows:>5} {one:>9.2f} {two:>10.2f}")
    if args.json:
        doc = {"commit": commit_id(), "gpu": torch.cuda.get_device_name(), "rows": rows_out}
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
