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
