"""Tensor parallelism on the CPU: ranks joined by gloo run Llama, Qwen2, gpt-oss (MXFP4 experts)
and DeepSeek-V2 (MLA) sharded (column/row linear layers, vocab-parallel embedding and head,
replicated KV heads, experts split along their intermediate size, MLA's query heads split over
a whole latent) and must give the logits of the unsharded model, in fp32."""

from __future__ import annotations

import gc
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from inferx_core.attention_torch import TorchAttention
from inferx_core.batch import make_attention_batch
from inferx_core.interfaces.model import BuildContext, ModelArch
from inferx_core.interfaces.quant import LinearSpec, QuantConfig, QuantScheme
from inferx_core.ops_torch import TorchOps
from inferx_core.parallel import SINGLE, ParallelContext
from inferx_core.quant_none import DenseLinear, Unquantized
from inferx_models.deepseek_v2 import DeepseekV2ForCausalLM
from inferx_models.gptoss import GptOssForCausalLM
from inferx_models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from inferx_quant.mxfp4 import Mxfp4

CPU = torch.device("cpu")
# The sharded GEMMs add in another order (row-parallel layers sum per rank, then across):
# fp32 rounding, with logits of order 1.
ATOL = 1e-5
BASE = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 301,  # divisible by neither 2 nor 4: the last rank's rows are padding
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "llama-gqa": BASE | {"architectures": ["LlamaForCausalLM"]},
    "llama-one-kv-head": BASE | {"architectures": ["LlamaForCausalLM"], "num_key_value_heads": 1},
    "qwen2-biases": BASE | {"architectures": ["Qwen2ForCausalLM"]},
    "qwen2-tied": BASE
    | {"architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True, "vocab_size": 300},
    # sinks, q/k/v/o biases, a window of 4 (the decode step passes it), MXFP4 experts of 3
    # scale groups: uneven over 2 ranks, padded over 4
    "gpt-oss-mxfp4": BASE
    | {
        "architectures": ["GptOssForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 4,
        "quantization_config": {"quant_method": "mxfp4"},
    },
    "deepseek-v2-lite": BASE
    | {
        "architectures": ["DeepseekV2ForCausalLM"],
        "moe_intermediate_size": 16,
        "num_key_value_heads": 4,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 6,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
    },
}
# DeepSeek-V2's shape: q LoRA, group-limited routing
CONFIGS["deepseek-v2"] = CONFIGS["deepseek-v2-lite"] | {
    "q_lora_rank": 12,
    "topk_method": "group_limited_greedy",
    "n_group": 4,
    "topk_group": 2,
}
# The same with 2 shared experts held as expert slots (FusingOps): each rank keeps a slice of
# every slot, as of every routed expert.
FUSED = {f"{name}-fused" for name in ("deepseek-v2-lite", "deepseek-v2")}
for _name in FUSED:
    CONFIGS[_name] = CONFIGS[_name.removesuffix("-fused")] | {"n_shared_experts": 2}
ARCHS: dict[str, type[ModelArch]] = {
    a.__name__: a
    for a in (LlamaForCausalLM, Qwen2ForCausalLM, GptOssForCausalLM, DeepseekV2ForCausalLM)
}
BLOCK = 4


def _arch(cfg: dict[str, Any]) -> type[ModelArch]:
    return ARCHS[cfg["architectures"][0]]


def _quant(cfg: dict[str, Any]) -> QuantScheme:
    checkpoint = cfg.get("quantization_config")
    return Mxfp4(QuantConfig(checkpoint)) if checkpoint else Unquantized()


def _weights(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Seeded weights: norms around 1, everything else small, so logits are of order 1; MXFP4
    blocks random bytes, their scales 2^-9 .. 2^-6 (weights up to 6 times that)."""
    g = torch.Generator().manual_seed(0)
    packed = _arch(cfg).checkpoint_dtypes(cfg)
    out = {}
    for name, shape in _arch(cfg).checkpoint_shapes(cfg).items():
        if name in packed:
            low, high = (118, 122) if name.endswith("_scales") else (0, 256)
            out[name] = torch.randint(low, high, shape, generator=g, dtype=torch.uint8)
            continue
        t = torch.randn(shape, generator=g)
        out[name] = 1 + 0.1 * t if name.endswith("norm.weight") else 0.2 * t
    return out


class FusingOps(TorchOps):
    """The torch ops with MoE shared experts built as expert slots."""

    fuse_shared_experts = True


def _logits(
    cfg: dict[str, Any], parallel: ParallelContext, ops: TorchOps | None = None
) -> list[torch.Tensor]:
    """Logits of a prefill step of two prompts, then of a decode step of both."""
    arch = _arch(cfg)
    backend = TorchAttention(arch.kv_layout(cfg, parallel), BLOCK, torch.float32, CPU)
    backend.allocate(16)
    ctx = BuildContext(torch.float32, CPU, backend, _quant(cfg), ops or TorchOps(), parallel)
    model = arch(cfg, ctx)
    if isinstance(ops, FusingOps):
        assert all(layer.mlp.shared is None for layer in model.model.layers[1:])
    model.load_weights(_weights(cfg).items())
    tables = [[3, 5], [7, 2]]
    # a table per KV group (gpt-oss: sliding, full), on blocks of their own
    group_tables = [tables, [[9, 11], [13, 8]]][: len(backend.groups)]
    steps = [([5, 3], [5, 3], [11, 4, 250, 9, 299, 17, 3, 140]), ([1, 1], [6, 4], [23, 298])]
    out = []
    for query_lens, context_lens, ids in steps:
        positions = [
            p for q, c in zip(query_lens, context_lens, strict=True) for p in range(c - q, c)
        ]
        batch = make_attention_batch(
            query_lens, context_lens, tables, BLOCK, group_tables=group_tables
        )
        backend.begin_step(batch)
        with torch.no_grad():
            hidden = model(torch.tensor(ids), torch.tensor(positions))
            out.append(model.compute_logits(hidden))
    return out


def _check(rank: int, world_size: int, names: list[str]) -> None:
    parallel = ParallelContext(rank, world_size, dist.group.WORLD)
    for name in names:
        cfg = CONFIGS[name]
        ops = FusingOps() if name in FUSED else None
        got = _logits(cfg, parallel, ops)
        if rank == 0:
            refs = [_logits(cfg, SINGLE, ops)]
            if ops is not None:  # and the shared MLP apart, unsharded
                refs.append(_logits(cfg, SINGLE))
            for ref_logits in refs:
                for step, (ours, ref) in enumerate(zip(got, ref_logits, strict=True)):
                    assert ours.shape == ref.shape, (name, step, ours.shape, ref.shape)
                    err = (ours - ref).abs().max().item()
                    assert err <= ATOL, f"{name} at world size {world_size}, step {step}: {err}"


def _rank(rank: int, world_size: int, port: int, names: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        _check(rank, world_size, names)
        # Models and contexts that outlive the group reach gloo's threads only at interpreter
        # exit, where tearing them down aborts now and then: collect them first, leave together.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sharded_models_give_the_unsharded_logits(world_size: int) -> None:
    mp.spawn(_rank, args=(world_size, _free_port(), list(CONFIGS)), nprocs=world_size)


def _ctx(rank: int, n: int) -> ParallelContext:
    return ParallelContext(rank, n, group=object())  # no collective runs in these checks


def test_kv_heads_are_replicated_over_ranks_beyond_them() -> None:
    spec = LinearSpec("qkv", 2, (8, 4, 4), False, "column", ("q", "k", "v"), (4, 2, 2))
    whole = torch.arange(16.0)[:, None].expand(16, 2)
    rows = []
    for rank in range(4):
        layer = DenseLinear(spec, torch.float32, CPU, _ctx(rank, 4))
        for part, t in enumerate(whole.split([8, 4, 4])):
            layer.load("weight", t, part)
        rows.append(layer.weight[:, 0].tolist())
    # q: two rows each; k and v: head 0 (rows 8-9, 12-13) on ranks 0-1, head 1 on ranks 2-3
    assert rows == [
        [0, 1, 8, 9, 12, 13],
        [2, 3, 8, 9, 12, 13],
        [4, 5, 10, 11, 14, 15],
        [6, 7, 10, 11, 14, 15],
    ]


@pytest.mark.parametrize(
    ("change", "n", "message"),
    [
        ({}, 3, "parallel.tensor = 3 does not divide num_attention_heads"),
        ({"num_attention_heads": 6, "num_key_value_heads": 6}, 4, "num_attention_heads"),
        ({"num_attention_heads": 12, "num_key_value_heads": 6}, 4, "num_key_value_heads"),
        ({"num_attention_heads": 6, "num_key_value_heads": 2}, 3, "multiple of num_key_value"),
        ({"intermediate_size": 50}, 4, "does not divide intermediate_size"),
    ],
)
def test_world_sizes_that_do_not_fit_are_named(change: dict, n: int, message: str) -> None:
    cfg = CONFIGS["llama-gqa"] | change
    backend = TorchAttention(LlamaForCausalLM.kv_layout(cfg), BLOCK, torch.float32, CPU)
    ctx = BuildContext(torch.float32, CPU, backend, Unquantized(), parallel=_ctx(0, n))
    with pytest.raises(ValueError, match=message):
        LlamaForCausalLM(cfg, ctx)
    if "intermediate" not in message:
        with pytest.raises(ValueError, match=message):
            LlamaForCausalLM.kv_layout(cfg, _ctx(0, n))
