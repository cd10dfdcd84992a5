"""Pytest fixtures for tiny test models.

Enable them in ``tests/conftest.py`` with
``pytest_plugins = ["omlx_core.testing.pytest_fixtures"]``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from omlx_core.testing.models import cached_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """A factory ``tiny_model_path(family, seed=0) -> Path``, each model built once per session."""
    root = tmp_path_factory.mktemp("tiny-models")

    def model_path(family: str, seed: int = 0) -> Path:
        return cached_model(family, seed, cache_dir=root)

    return model_path


@pytest.fixture(scope="session")
def tiny_vlm_path(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """A factory ``tiny_vlm_path(family, seed=0) -> Path`` of tiny mlx-vlm models
    (:mod:`omlx_core.testing.vlm_models`), each built once per session."""
    from omlx_core.testing.vlm_models import cached_vlm_model

    root = tmp_path_factory.mktemp("tiny-vlms")

    def model_path(family: str, seed: int = 0) -> Path:
        return cached_vlm_model(family, seed, cache_dir=root)

    return model_path
