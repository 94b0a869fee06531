"""A toy third-party InferX plugin: one model architecture and one attention backend."""
