"""omlx-core: a plugin-extensible LLM serving engine on MLX."""

__version__ = "0.1.0"
