"""InferX GPU kernels: Triton and FlashInfer attention backends, fused Triton ops."""

__version__ = "0.1.0"
