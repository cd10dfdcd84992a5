"""What the server can serve: every ``[models.<id>]`` entry and every model found under
``server.model_dirs``, with what loading one would cost before a byte of it is read.

A directory under ``server.model_dirs`` is a model when it holds ``config.json`` and
``*.safetensors`` (mlx-lm and mlx-vlm save that layout; a ``vision_config`` in
``config.json`` makes it a ``vlm`` model; a sentence-transformers ``modules.json`` or a
BERT-family ``model_type`` an ``encoder`` model for embeddings, or for reranking when it
is a ``*ForSequenceClassification``); a ``*.gguf`` file there is a model too,
converted on first use like a configured ``gguf`` entry. A configured id wins over a
discovered one of the same name.

A model's weights bytes come from its safetensors headers (the ``safetensors``
library reads only the header of each file: shapes and dtypes, no tensor data).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from omlx_core.config import ModelEntry, Sourced
from omlx_core.models.errors import ModelError

if TYPE_CHECKING:
    from omlx_core.config import Config

log = logging.getLogger(__name__)

#: model_types of the encoders the ``encoder`` engine serves (a directory of one is an
#: embedding model, or a reranker when it is a ``*ForSequenceClassification``)
ENCODER_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "camembert"})
#: bytes per element of each safetensors dtype
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
               "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def discover_models(config: Config) -> list[str]:
    """Add an entry to ``config.models`` for each model under ``server.model_dirs`` that
    no ``[models.<id>]`` names; returns the ids added."""
    added = []
    for root_text in config["server.model_dirs"]:
        root = Path(root_text).expanduser()
        if not root.is_dir():
            log.warning("server.model_dirs: %s is not a directory; no model is found there", root)
            continue
        for child in sorted(root.iterdir()):
            entry = _entry_for(child, f"server.model_dirs {root_text}")
            if entry is None or entry.id in config.models:
                continue
            config.models[entry.id] = entry
            added.append(entry.id)
    if added:
        log.info("models found under server.model_dirs: %s", ", ".join(added))
    return added


def _entry_for(path: Path, source: str) -> ModelEntry | None:
    if path.is_file() and path.suffix == ".gguf":
        return ModelEntry(path.stem, {"gguf": Sourced(str(path), source),
                                      "engine": Sourced("batched", source)})
    if not (path.is_dir() and (path / "config.json").is_file()
            and any(path.glob("*.safetensors"))):
        return None
    try:
        model_config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        log.warning("%s: config.json cannot be read (%s); the directory is skipped", path, exc)
        return None
    if not isinstance(model_config, dict):
        model_config = {}
    fields = {"path": Sourced(str(path), source)}
    if (path / "modules.json").is_file() or model_config.get("model_type") in ENCODER_MODEL_TYPES:
        cross = any(str(a).endswith("ForSequenceClassification")
                    for a in model_config.get("architectures") or [])
        fields.update(engine=Sourced("encoder", source),
                      task=Sourced("rerank" if cross else "embed", source))
    else:
        fields["engine"] = Sourced("vlm" if "vision_config" in model_config else "batched", source)
    return ModelEntry(path.name, fields)


def tensor_headers(path: Path) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, dtype)`` of every tensor in ``path``'s ``*.safetensors`` files, from
    their headers (nothing is loaded).

    :raises ModelError: a file's header cannot be read (a truncated or corrupt file).
    """
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{path} has no *.safetensors weights")
    tensors = []
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as weights:
                for name in weights.keys():
                    piece = weights.get_slice(name)
                    tensors.append((name, tuple(piece.get_shape()), piece.get_dtype()))
        except Exception as exc:  # safetensors raises its own SafetensorError, and OSError
            raise ModelError(f"{file.name}: the safetensors header cannot be read "
                             f"({type(exc).__name__}: {exc}); the file is truncated or "
                             "corrupt: convert or download the model again") from None
    return tensors


def tensors_bytes(tensors: Iterable[tuple[str, tuple[int, ...], str]]) -> int:
    """The bytes of ``tensors`` (:func:`tensor_headers`' rows)."""
    return sum(math.prod(shape) * DTYPE_BYTES.get(dtype, 4) for _, shape, dtype in tensors)


def weights_bytes(path: Path) -> int:
    """The bytes of every tensor in ``path``'s ``*.safetensors`` files, from their headers.

    :raises ModelError: a file's header cannot be read (a truncated or corrupt file).
    """
    return tensors_bytes(tensor_headers(path))
