"""Published model configs by name (plain data: listing them imports no torch)."""

from __future__ import annotations

from typing import Any

_QWEN25 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
    "use_cache": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "use_sliding_window": False,
    "use_cache": True,
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
_QWEN3_MOE = _QWEN3 | {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}
_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "use_cache": True,
    "vocab_size": 128256,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
}

# gpt-oss as published: experts in MXFP4, everything else bf16 (modules_to_not_convert).
_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_act": "silu",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "initial_context_length": 4096,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 150000,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "swiglu_limit": 7.0,
    "router_aux_loss_coef": 0.9,
    "output_router_logits": False,
    "use_cache": True,
    "tie_word_embeddings": False,
    "quantization_config": {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    },
    "torch_dtype": "bfloat16",
}

# DeepSeek-V2 as published (config.json of deepseek-ai/DeepSeek-V2-Lite; V2 differs in shapes,
# q LoRA and group-limited routing). The checkpoints' remote-code keys are kept as written.
_DEEPSEEK_V2 = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "initializer_range": 0.02,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "seq_aux": True,
    "pretraining_tp": 1,
    "use_cache": True,
    "tie_word_embeddings": False,
    "vocab_size": 102400,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "torch_dtype": "bfloat16",
}
# Test shapes of both kinds: YaRN over an original context of 64 (prompts run past it).
_TINY_DEEPSEEK_V2 = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "vocab_size": 320,
    "max_position_embeddings": 256,
    "rope_scaling": _DEEPSEEK_V2["rope_scaling"]
    | {"factor": 4.0, "original_max_position_embeddings": 64},
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def _alternating(layers: int) -> list[str]:
    """gpt-oss's layer_types: sliding-window attention on even layers, full on odd ones."""
    return ["full_attention" if i % 2 else "sliding_attention" for i in range(layers)]


def _llama3_scaling(factor: float) -> dict[str, Any]:
    return {
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }


PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b-instruct": _QWEN25
    | {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b-instruct": _QWEN25
    | {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-3b-instruct": _QWEN25
    | {
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b-instruct": _QWEN25
    | {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "qwen3-8b": _QWEN3
    | {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "max_window_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": _QWEN3_MOE
    | {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "max_window_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "tie_word_embeddings": False,
    },
    "gpt-oss-20b": _GPT_OSS
    | {
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "layer_types": _alternating(24),
        "sliding_window": 128,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "vocab_size": 201088,
        "pad_token_id": 199999,
        "eos_token_id": 200002,
    },
    "llama-3.1-8b-instruct": _LLAMA3
    | {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_scaling": _llama3_scaling(8.0),
        "tie_word_embeddings": False,
    },
    "llama-3.2-1b-instruct": _LLAMA3
    | {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rope_scaling": _llama3_scaling(32.0),
        "tie_word_embeddings": True,
    },
    # The demo model's shapes (its weights come as GGUF).
    "smollm2-135m-instruct": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    # Test shapes: GQA, head_dim 16, and llama3 scaling whose original context (64) is short
    # enough that all three frequency bands occur at this head_dim.
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 320,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    },
    "tiny-qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        # Qwen's real vocabulary (and its special ids), so it runs with the Qwen tokenizer.
        "vocab_size": 151936,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "float32",
    },
    # Qwen3 test shapes: head_dim 24, not hidden / heads (Qwen3 sets it apart too).
    "tiny-qwen3": _QWEN3
    | {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "vocab_size": 320,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    },
    # One dense layer (mlp_only_layers) beside the MoE ones, and far fewer experts.
    "tiny-qwen3-moe": _QWEN3_MOE
    | {
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "mlp_only_layers": [1],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 320,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    },
    "deepseek-v2-lite": _DEEPSEEK_V2
    | {
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "n_routed_experts": 64,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "greedy",
        "routed_scaling_factor": 1.0,
    },
    "deepseek-v2": _DEEPSEEK_V2
    | {
        "hidden_size": 5120,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 60,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "n_routed_experts": 160,
        "n_group": 8,
        "topk_group": 3,
        "topk_method": "group_limited_greedy",
        "routed_scaling_factor": 16.0,
    },
    "tiny-deepseek-v2-lite": _DEEPSEEK_V2
    | _TINY_DEEPSEEK_V2
    | {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "topk_method": "greedy"},
    "tiny-deepseek-v2": _DEEPSEEK_V2
    | _TINY_DEEPSEEK_V2
    | {
        "q_lora_rank": 24,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "group_limited_greedy",
        "routed_scaling_factor": 1.5,
    },
    # gpt-oss test shapes, MXFP4 experts: a window of 8 that short prompts already pass, and
    # YaRN over an original context of 64 so the blended frequency band occurs at head_dim 16.
    "tiny-gpt-oss": _GPT_OSS
    | {
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "layer_types": _alternating(2),
        "sliding_window": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 320,
        "max_position_embeddings": 256,
        "rope_scaling": _GPT_OSS["rope_scaling"] | {"original_max_position_embeddings": 64},
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    },
}

# The V2-Lite test shapes with DeepSeek-V2's vocabulary and special ids, so that it runs with
# the DeepSeek-V2 tokenizer derived from Llama 3's (inferx_models.derived_tokenizers): the CPU
# plumbing of benchmarks/gpu_table.py.
PRESETS["tiny-deepseek-v2-lite-vocab"] = PRESETS["tiny-deepseek-v2-lite"] | {
    "vocab_size": _DEEPSEEK_V2["vocab_size"],
    "bos_token_id": _DEEPSEEK_V2["bos_token_id"],
    "eos_token_id": _DEEPSEEK_V2["eos_token_id"],
}
