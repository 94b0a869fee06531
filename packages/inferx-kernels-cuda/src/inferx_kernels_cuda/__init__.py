"""InferX GPU kernels: the Triton attention backend (and, later, FlashInfer and fused kernels)."""

__version__ = "0.1.0"
