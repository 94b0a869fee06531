"""Where a batch-1 decode step's GPU time goes: one prompt generated greedily on the offline
engine (dummy weights of a preset, CUDA graphs on, the table's engine settings), its kernels
timed by torch.profiler and printed per decode step, largest first.

python benchmarks/decode_profile.py --model gpt-oss-20b --tokenizer DIR [--steps 128]
    [--prompt-len 128] [--batch 1] [--top 28] [--set KEY=VALUE ...] [--shared-experts-apart]
python benchmarks/decode_profile.py --model gpt-oss-20b --tokenizer DIR --batch 256 \
    --prompt-len 512 --steps 255      # the offline figure's batch: prefill and decode together

--batch N generates N prompts at once (the offline figure's shape: where its time goes, prefill
included; the kernels' total is printed in ms too).

--set model.path=DIR profiles a checkpoint of the preset's shapes from disk (as gpu_table.py);
--set parallel.tensor=2 profiles rank 0 of two GPUs (its NCCL all-reduces among the kernels).

DIR holds the preset's tokenizer (../shared/fixtures/tokenizers/{qwen,llama3,gpt-oss}); for
DeepSeek-V2 pass Llama 3's, which is cut down to its vocabulary as gpu_table.py does. Kernels
launched with programmatic dependent launch (inferx_kernels_cuda.pdl) start before the kernel
ahead of them ends and wait inside: their times include that wait, so the rows overlap and
their sum exceeds the step. --shared-experts-apart builds MoE shared experts (DeepSeek-V2's)
as a separate MLP instead of the triton ops' default expert slots (TritonOps.
fuse_shared_experts), for their A/B. GPU only.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from inferx_core.config import load_config
from inferx_core.engine import LLM
from inferx_core.sequence import SamplingParams


def tokenizer_for(preset: str, tokenizer: str, scratch: str) -> str:
    """The preset's tokenizer directory: `tokenizer`, or for a model type with a derived
    tokenizer (DeepSeek-V2) the one derived from it under scratch."""
    from inferx_models.derived_tokenizers import BY_MODEL_TYPE
    from inferx_models.presets import preset as preset_config

    config = preset_config(preset)
    derive = BY_MODEL_TYPE.get(config["model_type"])
    if derive is None:
        return tokenizer
    return str(derive.write(tokenizer, f"{scratch}/{preset}", int(config["vocab_size"])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True, help="a preset, e.g. gpt-oss-20b")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--steps", type=int, default=128, help="decode steps profiled")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="prompts generated together")
    ap.add_argument("--top", type=int, default=28, help="kernels printed")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--shared-experts-apart",
        action="store_true",
        help="MoE shared experts as their own MLP, not slots of the routed experts",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_profile.py times CUDA kernels: it needs a GPU")
    if args.shared_experts_apart:
        from inferx_kernels_cuda.ops import TritonOps

        TritonOps.fuse_shared_experts = False  # the engine below builds its ops in this process
    with tempfile.TemporaryDirectory() as scratch:
        overrides = {
            "model.preset": args.model,
            "model.tokenizer": tokenizer_for(args.model, args.tokenizer, scratch),
            "model.dtype": "bfloat16",
            "engine.attention_backend": "triton",
            "kv_cache.memory": "0.5",
            "scheduler.prefix_cache": "false",
        }
        overrides |= dict(kv.split("=", 1) for kv in args.set)
        if overrides.get("model.path"):  # a checkpoint of the preset's shapes on disk (W4A16's)
            del overrides["model.preset"]
        llm = LLM(load_config(None, overrides))
        prompt = [[7 + b + i for i in range(args.prompt_len)] for b in range(args.batch)]
        warm = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        llm.generate(prompt, warm)  # graphs and compiles before the profile
        torch.cuda.synchronize()
        params = SamplingParams(max_tokens=args.steps + 1, temperature=0, ignore_eos=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompt, params)
            torch.cuda.synchronize()
    rows = sorted(
        (
            (e.device_time_total / args.steps, e.count / args.steps, e.key)
            for e in prof.key_averages()
            if e.device_time_total > 0
        ),
        reverse=True,
    )
    total = sum(us for us, _, _ in rows)
    print(
        f"{args.model}, {torch.cuda.get_device_name()}: kernel time a decode step {total:.1f} µs "
        f"(the prompt's prefill spread over the {args.steps} steps; batch {args.batch}, "
        f"{total * args.steps / 1e3:.1f} ms in all)"
    )
    print(f"{'µs a step':>10} {'calls':>6}  kernel")
    for us, calls, key in rows[: args.top]:
        print(f"{us:10.1f} {calls:6.1f}  {key[:100]}")


if __name__ == "__main__":
    from inferx_core.distributed import exit_if_joined

    main()
    # with parallel.tensor > 1 this process joined a process group: end it as inferx does
    raise SystemExit(exit_if_joined(0))
