"""Write a GPTQ or AWQ checkpoint from a float one: every attention and MLP projection rounded to
nearest into the published layout (inferx_quant.w4a16.quantize_rtn), the rest copied. For
measuring W4A16 end to end on a model's real shapes (random weights are fine), not for quality.

    inferx checkpoint --preset qwen2.5-3b-instruct --tokenizer TOK /tmp/3b
    python benchmarks/w4a16_checkpoint.py /tmp/3b /tmp/3b-gptq --method gptq
    python benchmarks/w4a16_checkpoint.py /tmp/3b /tmp/3b-gptq-act --method gptq --act-order
    python benchmarks/w4a16_checkpoint.py /tmp/3b /tmp/3b-awq --method awq
    inferx generate --model /tmp/3b-gptq --prompt hi --max-tokens 8   # quantization: auto

GPTQ is written symmetric in checkpoint_format "gptq" (zeros stored minus one), group 128 unless
--group; act-order draws one random row order per input (q, k and v share theirs, as do gate
and up, as GPTQ gives them). AWQ is the GEMM layout, asymmetric. Runs on the GPU when there is
one (a 3B model takes seconds), else on the CPU.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inferx_quant.w4a16 import W4Format, quantize_rtn

PROJ = re.compile(r"(.*\.)(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
# The input each projection reads: parts that share one share an act-order.
INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up"}
SHARD_BYTES = 2 << 30


def _files(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [src / n for n in names]
    return sorted(src.glob("*.safetensors"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--method", choices=("gptq", "awq"), default="gptq")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--act-order", action="store_true", help="GPTQ only: desc_act with g_idx")
    args = p.parse_args()
    if args.act_order and args.method != "gptq":
        p.error("--act-order is GPTQ's (AWQ has no g_idx)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.method == "gptq":
        fmt = W4Format("gptq", args.group, True, 1, args.act_order)
        qconfig = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": args.group,
            "desc_act": args.act_order,
            "sym": True,
            "lm_head": False,
            "checkpoint_format": "gptq",
            "pack_dtype": "int32",
        }
    else:
        fmt = W4Format("awq", args.group, False)
        qconfig = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": args.group,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    args.dst.mkdir(parents=True, exist_ok=True)
    for f in args.src.iterdir():  # config, tokenizer, generation config ...
        if f.is_file() and not f.name.endswith(".safetensors") and "index" not in f.name:
            shutil.copy(f, args.dst / f.name)
    config = json.loads((args.src / "config.json").read_text())
    config["quantization_config"] = qconfig
    (args.dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    shards: list[dict[str, torch.Tensor]] = [{}]
    size, quantized = 0, 0
    for file in _files(args.src):
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                t = f.get_tensor(name)
                match = PROJ.match(name)
                if match:
                    prefix, proj = match.groups()
                    order = None
                    if args.act_order:
                        key = f"{prefix}{INPUT.get(proj, proj)}"
                        gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                        order = torch.randperm(t.shape[1], generator=gen)
                    out = quantize_rtn(t.to(device), fmt, order)
                    tensors = {f"{prefix}{proj}.{k}": v.cpu() for k, v in out.items()}
                    quantized += 1
                else:
                    tensors = {name: t}
                for n, v in tensors.items():
                    nbytes = v.numel() * v.element_size()
                    if shards[-1] and size + nbytes > SHARD_BYTES:
                        shards.append({})
                        size = 0
                    shards[-1][n] = v.contiguous()
                    size += nbytes
    if len(shards) == 1:
        save_file(shards[0], args.dst / "model.safetensors")
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, args.dst / fname)
            weight_map.update(dict.fromkeys(shard, fname))
        index = {"metadata": {}, "weight_map": weight_map}
        (args.dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    print(f"{args.dst}: {quantized} projections as {args.method} (group {args.group})")


if __name__ == "__main__":
    main()
