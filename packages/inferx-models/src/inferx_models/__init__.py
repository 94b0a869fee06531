"""InferX model architectures and checkpoint formats."""
