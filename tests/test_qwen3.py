"""Qwen3 and Qwen3-MoE against transformers on the CPU in fp32: logits, and greedy generation
token for token — batched, chunked, from the prefix cache and after preemption; both expert
layouts; the presets' checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from conftest import interpreted  # noqa: E402
from test_engine import PROMPTS, generate, make_llm, reference  # noqa: E402
from test_models import (  # noqa: E402
    CHUNKED_PREFILL,
    PACKED_CHUNKS,
    PREEMPTING,
    Runner,
    check_preemption,
    check_prefix_hit,
    check_preset_command,
    check_stacked_experts,
    check_steps,
    saved,
    spread_weights,
)

from inferx_core.interfaces.model import BuildContext  # noqa: E402
from inferx_core.quant_none import Unquantized  # noqa: E402
from inferx_models.presets import preset  # noqa: E402
from inferx_models.qwen3 import (  # noqa: E402
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    SparseMoeBlock,
    is_moe_layer,
)

RTOL = 1e-4
VOCAB = 256

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,  # not hidden / heads
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
)


def hf_config(arch: str, **overrides: Any) -> transformers.PretrainedConfig:
    """overrides: COMMON's keys changed (head_dim=32 for the triton attention backend, which
    takes power-of-two head dims only)."""
    common = COMMON | overrides
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, tie_word_embeddings=True)
    return transformers.Qwen3MoeConfig(
        **common,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],  # layers 0 and 2 routed, 1 dense
    )


def hf_model(arch: str, **overrides: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    cls = transformers.Qwen3ForCausalLM if arch == "qwen3" else transformers.Qwen3MoeForCausalLM
    # q_norm and k_norm among the norms spread away from 1.
    return spread_weights(cls(hf_config(arch, **overrides)).eval())


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def checkpoint(request, tmp_path_factory):
    return saved(hf_model(request.param), tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def expected(checkpoint):
    return reference(checkpoint[1], PROMPTS)


def test_published_layout_is_what_transformers_writes(checkpoint):
    """Per-expert tensors, as the Hub's Qwen3-MoE checkpoints hold them; and q/k norms."""
    path, model = checkpoint
    names = set(load_file(path / "model.safetensors"))
    assert "model.layers.0.self_attn.q_norm.weight" in names
    if isinstance(model, transformers.Qwen3MoeForCausalLM):
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
        assert "model.layers.0.mlp.gate.weight" in names
        assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer
        assert not any(n.endswith("gate_up_proj") for n in names)


def test_logits_packed_and_chunked_match_transformers(checkpoint):
    path, ref = checkpoint
    runner = Runner(path, 4)
    full = {"a": PROMPTS[0], "b": PROMPTS[3][:21], "c": PROMPTS[4]}
    check_steps(runner, ref, full, PACKED_CHUNKS, RTOL)


def test_batched_greedy_equals_transformers(checkpoint, expected):
    llm = make_llm(checkpoint[0])
    layers = llm.engine.executor.model.model.layers
    if "moe" in checkpoint[0].name:
        assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [True, False, True]
    assert generate(llm) == expected


def test_chunked_prefill_equals_transformers(checkpoint, expected):
    assert generate(make_llm(checkpoint[0], **CHUNKED_PREFILL)) == expected


def test_prefix_cache_hit_equals_transformers(checkpoint):
    """Two prompts sharing a 40-token prefix, one after the other: the second reads the
    first's cached blocks."""
    path, model = checkpoint
    check_prefix_hit(make_llm(path, **{"kv_cache.block_size": 4}), model, generate, reference)


def test_preemption_equals_transformers(checkpoint, expected):
    check_preemption(make_llm(checkpoint[0], **PREEMPTING), generate, expected)


def test_stacked_expert_layout_loads_the_same(tmp_path: Path):
    """transformers 5's in-memory layout as checkpoint names gives the per-expert checkpoint's
    logits exactly."""
    stacked = "model.layers.0.mlp.experts.gate_up_proj"
    check_stacked_experts(hf_model("qwen3-moe"), tmp_path, stacked, PROMPTS[4], RTOL)


def _moe_model(cfg: dict[str, Any]) -> Qwen3MoeForCausalLM:
    from inferx_core.attention_torch import TorchAttention

    cpu = torch.device("cpu")
    backend = TorchAttention(Qwen3MoeForCausalLM.kv_layout(cfg), 4, torch.float32, cpu)
    return Qwen3MoeForCausalLM(cfg, BuildContext(torch.float32, cpu, backend, Unquantized()))


def test_missing_and_unexpected_expert_tensors_are_named():
    cfg = hf_config("qwen3-moe").to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]}
    shapes = Qwen3MoeForCausalLM.checkpoint_shapes(cfg)
    weights = {name: torch.zeros(shape) for name, shape in shapes.items()}
    dropped = "model.layers.2.mlp.experts.5.up_proj.weight"
    with pytest.raises(ValueError, match=f"Qwen3MoeForCausalLM: checkpoint lacks {dropped}"):
        _moe_model(cfg).load_weights((n, t) for n, t in weights.items() if n != dropped)
    for extra in (
        "model.layers.1.mlp.experts.0.up_proj.weight",  # the dense layer has no experts
        "model.layers.0.mlp.experts.0.fc_proj.weight",
    ):
        with pytest.raises(ValueError, match=f"unexpected checkpoint tensor '{extra}'"):
            _moe_model(cfg).load_weights([*weights.items(), (extra, torch.zeros(32, 64))])
    with pytest.raises(ValueError, match=r"experts\.8\.gate_proj.*no expert 8"):
        bad = ("model.layers.0.mlp.experts.8.gate_proj.weight", torch.zeros(32, 64))
        _moe_model(cfg).load_weights([*weights.items(), bad])
    _moe_model(cfg).load_weights(weights.items())


def test_moe_layer_rule():
    cfg = {"num_experts": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert [is_moe_layer(cfg, i) for i in range(6)] == [False, True, False, False, False, True]
    assert not is_moe_layer({"num_experts": 0}, 0)
    assert is_moe_layer({"num_local_experts": 4}, 0)  # transformers 5's name for it


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_checkpoint_command_writes_a_loadable_preset(tmp_path: Path, capsys, name: str):
    arch = check_preset_command(name, tmp_path, capsys, PROMPTS[4], RTOL)
    assert arch in (Qwen3ForCausalLM, Qwen3MoeForCausalLM)


@interpreted
def test_fused_rotary_backend_gets_normed_q_and_k(monkeypatch: pytest.MonkeyPatch):
    """The triton backend rotates q and k itself (forward_with_rotary): the q/k norm runs
    before it. In decode-only steps, where the backend would take the QKV GEMM's K-split parts,
    the norm needs the whole product and the backend gets that. TritonOps and TritonAttention
    against TorchOps and TorchAttention, fp32."""
    pytest.importorskip("triton")
    from test_kernel_ops import assert_steps_match_torch_ops, model_weights, run_model

    from inferx_kernels_cuda.ops import TritonOps
    from inferx_kernels_cuda.triton_attention import TritonAttention

    calls: list[tuple[bool, int]] = []
    real = TritonAttention.forward_with_rotary

    def spy(self: TritonAttention, layer: Any, q: torch.Tensor, *args: Any, **kw: Any) -> Any:
        calls.append((self.takes_qkv_parts(), q.dim()))
        return real(self, layer, q, *args, **kw)

    monkeypatch.setattr(TritonAttention, "forward_with_rotary", spy)
    cfg = preset("tiny-qwen3") | {"head_dim": 32}  # a head dim the triton backend takes
    weights = model_weights(cfg, seed=3)
    cpu = torch.device("cpu")
    ours = run_model(cfg, TritonOps(), weights, torch.float32, cpu, TritonAttention)
    assert_steps_match_torch_ops(cfg, weights, ours)
    assert (True, 3) in calls and all(dim == 3 for _, dim in calls)  # whole q, never parts


def test_published_presets_have_the_published_shapes():
    dense = Qwen3ForCausalLM.checkpoint_shapes(preset("qwen3-8b"))
    assert dense["model.layers.35.self_attn.q_proj.weight"] == (4096, 4096)
    assert dense["model.layers.0.self_attn.k_norm.weight"] == (128,)
    assert dense["lm_head.weight"] == (151936, 4096)
    assert sum(map(_numel, dense.values())) == 8_190_735_360
    moe = Qwen3MoeForCausalLM.checkpoint_shapes(preset("qwen3-30b-a3b"))
    assert moe["model.layers.47.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert moe["model.layers.0.self_attn.q_proj.weight"] == (4096, 2048)
    assert sum(map(_numel, moe.values())) == 30_532_122_624


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
