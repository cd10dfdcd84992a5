"""Loads a model directory into memory: the one path real and test models both take."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omlx_core.models.registry import ModelError


def load_model(path: Path | str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from an mlx-lm directory; the tokenizer is mlx-lm's wrapper."""
    from mlx_lm import load

    try:
        return load(str(path))
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load model from {path}: {type(exc).__name__}: {exc}") from exc


def activation_dtype_bytes(model: Any) -> int:
    """Bytes per element of the model's activations: its most common float parameter dtype."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    counts: dict[Any, int] = {}
    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            counts[value.dtype] = counts.get(value.dtype, 0) + value.size
    if not counts:
        raise ValueError("model has no floating-point parameters to take the activation dtype from")
    return max(counts, key=lambda dtype: counts[dtype]).size
