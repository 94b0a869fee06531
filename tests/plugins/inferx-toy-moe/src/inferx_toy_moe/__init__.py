"""A toy third-party InferX plugin: a mixture-of-experts model and an int8 weight-only scheme."""
