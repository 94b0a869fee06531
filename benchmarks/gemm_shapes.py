"""(K, N) of each decode GEMM of the dense models the W4A16 benchmarks take: fused QKV, o_proj,
fused gate_up, down_proj. No imports, so w4a16_gemm.py can read it before Triton loads (its
--smoke sets TRITON_INTERPRET first) and kernel_sass.py without the kernels."""

MODELS = {
    "qwen2.5-3b": {"qkv": (2048, 2560), "o": (2048, 2048), "gate_up": (2048, 22016),
                   "down": (11008, 2048)},
    "llama-3.1-8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                     "down": (14336, 4096)},
}  # fmt: skip
