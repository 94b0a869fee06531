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
}
