"""InferX core: interfaces, plugin manager, config, scheduling and the engine."""

__version__ = "0.1.0"
