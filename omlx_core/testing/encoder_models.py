"""Tiny, seeded, random-weight BERT models in sentence-transformers' layout, for the
encoder engine's tests: an embedding model (``modules.json``, mean pooling, Normalize)
or a cross-encoder (``BertForSequenceClassification`` with one label).

Weights carry Hugging Face's names and a WordPiece ``tokenizer.json`` (lower-casing,
``[CLS]``/``[SEP]`` template) is trained in-process on the same corpus as the text
models' tokenizer, so a model built here loads exactly like a downloaded checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from omlx_core.testing.models import cached_build
from omlx_core.testing.tokenizer import TRAINING_CORPUS

TINY_BERT = {
    "model_type": "bert", "architectures": ["BertModel"], "vocab_size": 400,
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 64, "max_position_embeddings": 256, "type_vocab_size": 2,
    "layer_norm_eps": 1e-12, "hidden_act": "gelu", "pad_token_id": 0,
}
#: the longest input a tiny embedding model takes (sentence_bert_config.json)
TINY_MAX_SEQ_LENGTH = 128


def build_wordpiece_tokenizer(out_dir: Path, vocab_size: int) -> int:
    """Train a BERT WordPiece tokenizer on the test corpus into ``out_dir``; returns
    its vocabulary size."""
    from tokenizers.implementations import BertWordPieceTokenizer

    from tokenizers.processors import TemplateProcessing

    tokenizer = BertWordPieceTokenizer(lowercase=True)
    tokenizer.train_from_iterator(TRAINING_CORPUS.splitlines(), vocab_size=vocab_size,
                                  min_frequency=1, show_progress=False)
    # BERT's template, as a downloaded tokenizer.json carries it (training leaves it out).
    tokenizer.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[(token, tokenizer.token_to_id(token)) for token in ("[CLS]", "[SEP]")])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    return tokenizer.get_vocab_size()


def _weights(config: dict[str, Any], seed: int, prefix: str, classifier: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hidden, inner = config["hidden_size"], config["intermediate_size"]

    def dense(name: str, out: int, into: int) -> None:
        weights[f"{name}.weight"] = rng.normal(0, 1 / np.sqrt(into), (out, into))
        weights[f"{name}.bias"] = rng.normal(0, 0.02, (out,))

    def norm(name: str) -> None:
        weights[f"{name}.weight"] = 1 + rng.normal(0, 0.1, (hidden,))
        weights[f"{name}.bias"] = rng.normal(0, 0.1, (hidden,))

    weights: dict[str, np.ndarray] = {}
    for name, rows in (("word_embeddings", config["vocab_size"]),
                       ("position_embeddings", config["max_position_embeddings"]),
                       ("token_type_embeddings", config["type_vocab_size"])):
        weights[f"embeddings.{name}.weight"] = rng.normal(0, 0.5, (rows, hidden))
    norm("embeddings.LayerNorm")
    for layer in range(config["num_hidden_layers"]):
        base = f"encoder.layer.{layer}"
        for part in ("query", "key", "value"):
            dense(f"{base}.attention.self.{part}", hidden, hidden)
        dense(f"{base}.attention.output.dense", hidden, hidden)
        norm(f"{base}.attention.output.LayerNorm")
        dense(f"{base}.intermediate.dense", inner, hidden)
        dense(f"{base}.output.dense", hidden, inner)
        norm(f"{base}.output.LayerNorm")
    dense("pooler.dense", hidden, hidden)
    named = {prefix + name: value.astype(np.float32) for name, value in weights.items()}
    if classifier:
        named["classifier.weight"] = rng.normal(0, 1, (1, hidden)).astype(np.float32)
        named["classifier.bias"] = np.zeros((1,), dtype=np.float32)
    return named


def build_bert_model(out_dir: Path, *, seed: int = 0, cross_encoder: bool = False,
                     overrides: dict[str, Any] | None = None,
                     max_seq_length: int = TINY_MAX_SEQ_LENGTH) -> Path:
    """A tiny BERT in ``out_dir`` (created): a sentence-transformers embedding model taking
    inputs of up to ``max_seq_length`` tokens, or a cross-encoder with ``cross_encoder``.
    The same arguments give identical files."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {**TINY_BERT, **(overrides or {})}
    config["vocab_size"] = build_wordpiece_tokenizer(out_dir, config["vocab_size"])
    if cross_encoder:
        config.update(architectures=["BertForSequenceClassification"], num_labels=1,
                      id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    save_file(_weights(config, seed, "bert." if cross_encoder else "", cross_encoder),
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if not cross_encoder:
        (out_dir / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling",
             "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}], indent=2))
        (out_dir / "1_Pooling").mkdir(exist_ok=True)
        (out_dir / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": config["hidden_size"], "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False}, indent=2))
        (out_dir / "sentence_bert_config.json").write_text(json.dumps(
            {"max_seq_length": max_seq_length, "do_lower_case": False}))
    return out_dir


def cached_bert_model(seed: int = 0, *, cross_encoder: bool = False,
                      cache_dir: Path | None = None) -> Path:
    """Path of a tiny BERT built once per process (see :func:`build_bert_model`)."""
    name = "bert-cross-encoder" if cross_encoder else "bert-embedder"
    return cached_build(name, lambda directory: build_bert_model(
        directory, seed=seed, cross_encoder=cross_encoder), seed, cache_dir)


__all__ = ["TINY_BERT", "TINY_MAX_SEQ_LENGTH", "build_bert_model", "build_wordpiece_tokenizer",
           "cached_bert_model"]
