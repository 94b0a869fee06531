"""The FP8 (e4m3) KV cache: the torch reference backend against attention over the exact
dequantized keys and values, capacity, checkpoint scales, and whole models against the same
model with a cache in the model's dtype (top-5 sense), at short and 8k-token contexts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_fp8 import PARAMS, agree_in_top5, tiny_llama

from inferx_core.attention_torch import FP8, TorchAttention
from inferx_core.batch import make_attention_batch
from inferx_core.config import load_config
from inferx_core.engine import LLM
from inferx_core.interfaces.kv import KVLayerSpec


def dense(q, k, v, scale):
    """Causal attention in float64: q [n, H, D] the last n of the c positions of k, v."""
    n, c = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(g, 1)
    v = v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    s = s.masked_fill(torch.arange(c)[None] > torch.arange(c - n, c)[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def through_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-448, 448).to(FP8).float() * scale


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.05, 0.2)])
def test_fp8_cache_attends_over_the_dequantized_values(k_scale, v_scale):
    torch.manual_seed(0)
    spec = KVLayerSpec(4, 2, 32, dtype="fp8_e4m3")
    bs, scale = 4, 32**-0.5
    backend = TorchAttention([spec], bs, torch.float32, torch.device("cpu"))
    backend.allocate(16)
    assert backend.caches[0].dtype == FP8
    ks, vs = torch.tensor([k_scale]), torch.tensor([v_scale])
    layer = backend.layer(0, scale, k_scale=ks, v_scale=vs)
    q, k, v = torch.randn(13, 4, 32), torch.randn(13, 2, 32) * 3, torch.randn(13, 2, 32)
    table = [[5, 2, 9, 0]]
    # a 10-token prompt, then three decode steps
    out = []
    for start, n in [(0, 10), (10, 1), (11, 1), (12, 1)]:
        batch = make_attention_batch([n], [start + n], table, bs)
        backend.begin_step(batch)
        out.append(backend.forward(layer, q[start : start + n], k[start : start + n],
                                   v[start : start + n]))  # fmt: skip
    got = torch.cat(out)
    kd, vd = through_fp8(k, k_scale), through_fp8(v, v_scale)
    decodes = [dense(q[i : i + 1], kd[: i + 1], vd[: i + 1], scale) for i in (10, 11, 12)]
    want = torch.cat([dense(q[:10], kd[:10], vd[:10], scale), *decodes])
    assert (got.double() - want).abs().max() < 1e-5
    # and the e4m3 rounding is what separates it from full precision, not more
    exact = dense(q[12:], k, v, scale)
    assert (got[12:].double() - exact).abs().max() < 0.1 * exact.abs().max()


def test_an_fp8_block_takes_a_quarter_of_a_float32_one():
    layers = [KVLayerSpec(4, 2, 32), KVLayerSpec(4, 2, 32)]
    fp8 = [KVLayerSpec(4, 2, 32, dtype="fp8_e4m3")] * 2
    cpu = torch.device("cpu")
    plain = TorchAttention(layers, 16, torch.float32, cpu).bytes_per_block()
    assert TorchAttention(fp8, 16, torch.float32, cpu).bytes_per_block() * 4 == plain
    assert TorchAttention(fp8, 16, torch.bfloat16, cpu).bytes_per_block() * 2 == (
        TorchAttention(layers, 16, torch.bfloat16, cpu).bytes_per_block()
    )


# --- whole models ---


def make_llm(path, **overrides) -> LLM:
    base = {"model.path": str(path), "model.dtype": "float32", "engine.device": "cpu"}
    return LLM(load_config(None, {**base, **overrides}))


def run(llm, prompts):
    done = llm.generate(prompts, PARAMS)
    return [(c.token_ids, [[t for t, _ in top] for _, top in c.logprobs]) for c in done]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("llama"), 64, 4, 2, 128)


PROMPTS = [list(range(3, 60)), [5, 9, 17, 33, 65, 129, 200], list(range(100, 180))]


def test_fp8_kv_model_agrees_with_the_full_precision_cache(llama):
    fp8 = make_llm(llama, **{"kv_cache.dtype": "fp8_e4m3", "kv_cache.memory": "4MiB"})
    plain = make_llm(llama, **{"kv_cache.memory": "4MiB"})
    assert fp8.engine.executor.num_kv_blocks == 4 * plain.engine.executor.num_kv_blocks
    agree_in_top5(run(fp8, PROMPTS), run(plain, PROMPTS))


def test_checkpoint_kv_scales_are_read_under_either_name(llama, tmp_path):
    """self_attn.k_scale / v_scale, or the older k_proj / v_proj.output_scale."""
    import shutil

    path = tmp_path / "scaled"
    shutil.copytree(llama, path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([0.25])
    tensors["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([2.0])
    tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor(4.0)
    save_file(tensors, path / "model.safetensors")
    llm = make_llm(path, **{"kv_cache.dtype": "fp8_e4m3"})
    layers = llm.engine.executor.model.model.layers
    got = [(a.self_attn.attn.k_scale.item(), a.self_attn.attn.v_scale.item()) for a in layers]
    assert got == [(0.5, 0.25), (2.0, 4.0)]
    agree_in_top5(run(llm, PROMPTS), run(make_llm(llama), PROMPTS))
    # a cache in the model's dtype loads the same checkpoint and ignores the scales
    assert make_llm(path).engine.executor.model.model.layers[0].self_attn.k_scale is None


@pytest.mark.slow
def test_fp8_kv_agrees_at_an_8k_token_context(tmp_path):
    path = tiny_llama(tmp_path / "long", 64, 4, 2, 128, positions=16384)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (8192,), generator=g).tolist()]
    over = {"model.max_model_len": 8300, "kv_cache.memory": "64MiB"}
    fp8 = make_llm(path, **over, **{"kv_cache.dtype": "fp8_e4m3"})
    agree_in_top5(run(fp8, prompts), run(make_llm(path, **over), prompts))


def test_an_fp8_kv_cache_scheme_in_the_checkpoint_is_accepted(llama):
    from inferx_core.interfaces.quant import QuantConfig
    from inferx_quant.fp8 import Fp8

    cfg = json.loads((llama / "config.json").read_text())
    scheme = {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "float-quantized",
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                        "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "symmetric": True, "dynamic": True}}},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                            "symmetric": True, "dynamic": False},
        "ignore": ["lm_head"],
    }  # fmt: skip
    assert cfg["architectures"]
    Fp8(QuantConfig(scheme))  # no refusal
    scheme["kv_cache_scheme"]["strategy"] = "channel"
    with pytest.raises(ValueError, match="kv_cache_scheme"):
        Fp8(QuantConfig(scheme))
