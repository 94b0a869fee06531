"""Issue 46 item 9: a third-party package (tests/plugins/inferx-toy-moe), really installed, adds
a MoE model through the fused-MoE contract and an int8 weight-only quant scheme; a deployment
TOML picks both, and greedy generation equals a plain torch reference written here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

PACKAGE = Path(__file__).parent / "plugins" / "inferx-toy-moe"
CONFIG = {
    "architectures": ["ToyMoeForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "moe_intermediate_size": 48,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 128,
}
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [30, 31, 40, 50, 60, 61, 62]]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The plugin, really installed (pip, entry points) into a private directory."""
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(PACKAGE)],
        check=True,
    )  # fmt: skip
    return site


def random_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, inter, vocab = CONFIG["hidden_size"], CONFIG["moe_intermediate_size"], 64
    kv = CONFIG["num_key_value_heads"] * h // CONFIG["num_attention_heads"]

    def rand(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": rand(vocab, h, std=1.0)}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + rand(h, std=0.1)
        w[p + "self_attn.q_proj.weight"] = rand(h, h)
        w[p + "self_attn.k_proj.weight"] = rand(kv, h)
        w[p + "self_attn.v_proj.weight"] = rand(kv, h)
        w[p + "self_attn.o_proj.weight"] = rand(h, h)
        w[p + "post_attention_layernorm.weight"] = 1 + rand(h, std=0.1)
        w[p + "mlp.gate.weight"] = rand(CONFIG["num_experts"], h, std=0.5)
        for e in range(CONFIG["num_experts"]):
            w[f"{p}mlp.experts.{e}.gate_proj.weight"] = rand(inter, h)
            w[f"{p}mlp.experts.{e}.up_proj.weight"] = rand(inter, h)
            w[f"{p}mlp.experts.{e}.down_proj.weight"] = rand(h, inter)
    w["model.norm.weight"] = 1 + rand(h, std=0.1)
    w["lm_head.weight"] = rand(vocab, h, std=0.5)
    return w


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("toy-moe")
    weights = random_weights()
    (path / "config.json").write_text(json.dumps(CONFIG))
    safetensors_torch.save_file(weights, str(path / "model.safetensors"))
    return path, weights


def dequantized(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights int8wo multiplies by: per output row, scale = absmax / 127 and
    q = round(w / scale), then q * scale, in float32. Routers, norms, embedding and head stay."""
    out = dict(weights)
    for name, w in weights.items():
        if w.dim() == 2 and "layers" in name and not name.endswith("mlp.gate.weight"):
            scale = w.abs().amax(dim=1, keepdim=True) / 127
            out[name] = torch.round(w / scale).clamp(-127, 127) * scale
    return out


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CONFIG["rms_norm_eps"]) * weight


def reference_forward(w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The whole sequence in float64, straight from the checkpoint's tensors: last logits."""
    w = {k: v.double() for k, v in w.items()}
    heads, kv_heads = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    d = CONFIG["hidden_size"] // heads
    t = len(ids)
    x = w["model.embed_tokens.weight"][ids]
    causal = torch.full((t, t), -torch.inf, dtype=torch.float64).triu(1)
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(t, heads, d)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(t, kv_heads, d)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, kv_heads, d)
        k, v = (z.repeat_interleave(heads // kv_heads, dim=1) for z in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5 + causal
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, heads * d)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        probs = (h @ w[p + "mlp.gate.weight"].T).softmax(-1)
        top = probs.topk(CONFIG["num_experts_per_tok"], dim=-1)
        for row in range(t):
            picked = top.values[row] / top.values[row].sum()  # norm_topk_prob
            for weight, e in zip(picked, top.indices[row].tolist(), strict=True):
                ex = f"{p}mlp.experts.{e}."
                a = torch.nn.functional.silu(w[ex + "gate_proj.weight"] @ h[row])
                a = a * (w[ex + "up_proj.weight"] @ h[row])
                x[row] = x[row] + weight * (w[ex + "down_proj.weight"] @ a)
    return rms(x, w["model.norm.weight"])[-1] @ w["lm_head.weight"].T


def reference_generate(w: dict[str, torch.Tensor], prompt: list[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(NEW_TOKENS):
        ids.append(int(reference_forward(w, ids).argmax()))
    return ids[len(prompt) :]


def run_engine(site: Path, model_dir: Path, tmp_path: Path) -> dict:
    """Both deployments, in a fresh interpreter that sees the installed package."""
    for scheme in ("none", "int8wo"):
        (tmp_path / f"{scheme}.toml").write_text(
            textwrap.dedent(f"""
            [model]
            path = "{model_dir}"
            dtype = "float32"
            [engine]
            device = "cpu"
            [kv_cache]
            num_blocks = 64
            block_size = 4
            [quantization]
            scheme = "{scheme}"
        """)
        )
    code = textwrap.dedent(f"""
        import json
        from inferx_core.engine import LLM
        from inferx_core.plugins import plugins
        from inferx_core.sequence import SamplingParams
        params = SamplingParams(max_tokens={NEW_TOKENS}, temperature=0, ignore_eos=True)
        out = {{}}
        for scheme in ("none", "int8wo"):
            llm = LLM(scheme + ".toml")
            model = llm.engine.executor.model
            experts = model.layers[0].mlp.experts
            out[scheme] = {{
                "tokens": [d.token_ids for d in llm.generate({PROMPTS}, params)],
                "model": type(model).__name__,
                "experts": type(experts).__name__,
                "linear": type(model.layers[0].qkv_proj).__name__,
                "router": type(model.layers[0].mlp.gate).__name__,
                "int8": str(getattr(experts, "down_q", None) is not None
                            and experts.down_q.dtype),
            }}
        reg = plugins()
        out["packages"] = [reg.entry("model_arch", "ToyMoeForCausalLM").package,
                           reg.entry("quant_scheme", "int8wo").package]
        print(json.dumps(out))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def engine(site, checkpoint, tmp_path_factory) -> dict:
    return run_engine(site, checkpoint[0], tmp_path_factory.mktemp("deploy"))


def test_plugin_model_and_scheme_come_from_the_package(engine):
    assert engine["packages"] == ["inferx-toy-moe", "inferx-toy-moe"]
    assert engine["none"]["model"] == "ToyMoeForCausalLM"
    assert engine["none"]["experts"] == "UnquantizedExperts"
    assert engine["int8wo"]["experts"] == "Int8Experts"
    assert engine["int8wo"]["linear"] == "Int8Linear"
    assert engine["int8wo"]["router"] == "DenseLinear"  # the scheme leaves routers alone
    assert engine["int8wo"]["int8"] == "torch.int8"


def test_toy_moe_greedy_equals_torch_reference(engine, checkpoint):
    want = [reference_generate(checkpoint[1], p) for p in PROMPTS]
    assert engine["none"]["tokens"] == want


def test_int8wo_greedy_equals_reference_on_dequantized_weights(engine, checkpoint):
    weights = dequantized(checkpoint[1])
    want = [reference_generate(weights, p) for p in PROMPTS]
    assert engine["int8wo"]["tokens"] == want
    # the quantization is real: with these weights one prompt's greedy tokens change
    assert engine["int8wo"]["tokens"] != engine["none"]["tokens"]
