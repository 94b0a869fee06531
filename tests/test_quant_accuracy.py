"""Quantized real-size models against the model holding their exact dequantized weights (greedy
tokens in vLLM's top-5 sense), with each one's mean logprob distance to the unquantized model
printed: the demo model (SmolLM2-135M's real weights, from its GGUF) and the dummy Qwen2.5-3B.
FP8 (compressed-tensors, per-channel weights, dynamic per-token activations) and GPTQ W4A16
(symmetric; group 128, the demo's 64: its hidden size 576 is no multiple of 128). On the CPU
the demo with FP8 (the reference GEMM); on the GPU every pair, in bf16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES
from safetensors.torch import save_file
from test_fp8 import FP8_DYNAMIC, agree_in_top5, quantize_channel, write_quantized
from test_w4a16 import GPTQ, write_w4

transformers = pytest.importorskip("transformers")

from inferx_core.config import load_config  # noqa: E402
from inferx_core.engine import LLM  # noqa: E402
from inferx_core.sequence import SamplingParams  # noqa: E402

NEW_TOKENS = 32
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
]
Runs = list[tuple[list[int], list[list[int]], list[float]]]


def demo_checkpoint(dst: Path) -> Path:
    """The demo GGUF as a bf16 safetensors checkpoint with its tokenizer (transformers
    dequantizes the GGUF's Q4_1 blocks: these are the weights the demo serves)."""
    from inferx_models.gguf import find_demo_gguf

    gguf = find_demo_gguf()
    kw = {"gguf_file": gguf.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=torch.bfloat16, **kw
    )
    # transformers will not save a model loaded from a GGUF: its tensors and config by hand
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    dst.mkdir(parents=True)
    save_file(tensors, dst / "model.safetensors")
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (dst / "config.json").write_text(json.dumps(config))
    transformers.AutoTokenizer.from_pretrained(gguf.parent, **kw).save_pretrained(dst)
    return dst


def qwen3b_checkpoint(dst: Path) -> Path:
    from inferx_models.presets import write_checkpoint

    tok = FIXTURES / "tokenizers" / "qwen"
    return write_checkpoint("qwen2.5-3b-instruct", dst, tokenizer_dir=tok, dtype=torch.bfloat16)


def quantized(scheme: str, src: Path, dst: Path, group: int) -> tuple[Path, Path]:
    """(the quantized checkpoint, the reference with its exact dequantized weights)."""
    if scheme == "fp8":
        return write_quantized(src, dst, FP8_DYNAMIC, quantize_channel, "weight_scale")
    return write_w4(src, dst, GPTQ | {"group_size": group})


def generate(path: Path, prompts: list[list[int]], settings: dict[str, str]) -> Runs:
    """Per prompt: greedy tokens, each step's top-5 ids, each chosen token's logprob."""
    llm = LLM(load_config(None, {"model.path": str(path), **settings}))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    runs = [
        (c.token_ids, [[t for t, _ in top] for _, top in c.logprobs], [lp for lp, _ in c.logprobs])
        for c in llm.generate(prompts, params)
    ]
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return runs


def logprob_distance(got: Runs, base: Runs) -> tuple[float, int]:
    """Mean |logprob(quantized) - logprob(unquantized)| of the chosen tokens up to the first
    divergence of each prompt (where both chose the same token), and how many tokens."""
    diffs = []
    for (tokens_a, _, lp_a), (tokens_b, _, lp_b) in zip(got, base, strict=True):
        for a, b, x, y in zip(tokens_a, tokens_b, lp_a, lp_b, strict=True):
            if a != b:
                break
            diffs.append(abs(x - y))
    return sum(diffs) / max(1, len(diffs)), len(diffs)


def check(model: str, scheme: str, tmp: Path, settings: dict[str, str], texts: int = 4) -> None:
    src = demo_checkpoint(tmp / "src") if model == "demo" else qwen3b_checkpoint(tmp / "src")
    quant, ref = quantized(scheme, src, tmp / scheme, 64 if model == "demo" else 128)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    prompts = [tok.encode(t) for t in TEXTS[:texts]]
    got = generate(quant, prompts, settings)
    agree_in_top5([r[:2] for r in got], [r[:2] for r in generate(ref, prompts, settings)])
    mean, n = logprob_distance(got, generate(src, prompts, settings))
    assert n > 0
    print(f"\n{model} {scheme} ({settings.get('model.dtype')}): mean |logprob - unquantized| "
          f"{mean:.4f} over {n} tokens")  # fmt: skip


def test_demo_fp8_on_the_cpu(tmp_path: Path) -> None:
    check("demo", "fp8", tmp_path, {"model.dtype": "float32", "engine.device": "cpu"}, texts=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["fp8", "gptq"])
@pytest.mark.parametrize("model", ["demo", "qwen2.5-3b"])
def test_quantized_models_on_the_gpu(model: str, scheme: str, tmp_path: Path) -> None:
    gpu = {"model.dtype": "bfloat16", "engine.device": "cuda", "kv_cache.memory": "4GiB"}
    check(model, scheme, tmp_path, gpu)
