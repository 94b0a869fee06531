"""InferX GPU kernels: the Triton attention backend and fused Triton ops (FlashInfer later)."""

__version__ = "0.1.0"
