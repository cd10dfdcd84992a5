"""An independent float64 NumPy BERT (Devlin et al.), written from the architecture's
definition and reading a checkpoint by its Hugging Face names: the reference the encoder
engine's mlx model is checked against (``tests/test_encoder_bert.py``,
``tests/test_encoder_engine.py``). It runs one sequence at a time: no padding, no mask."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np


def _erf(values: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(values)


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


class NumpyBert:
    """BERT (Devlin et al.) in float64 NumPy, one sequence at a time."""

    def __init__(self, path: Path):
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        self.config = json.loads((path / "config.json").read_text())
        raw = load_file(str(path / "model.safetensors"))
        self.w = {name.removeprefix("bert."): value.astype(np.float64)
                  for name, value in raw.items()}
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        return x @ self.w[name + ".weight"].T + self.w[name + ".bias"]

    def token_states(self, ids: list[int], type_ids: list[int] | None = None) -> np.ndarray:
        c, w = self.config, self.w
        eps = c["layer_norm_eps"]
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][: len(ids)]
             + w["embeddings.token_type_embeddings.weight"][type_ids or [0] * len(ids)])
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        heads = c["num_attention_heads"]
        size = c["hidden_size"] // heads
        for layer in range(c["num_hidden_layers"]):
            p = f"encoder.layer.{layer}"
            q, k, v = (self._linear(x, f"{p}.attention.self.{part}").reshape(len(ids), heads, size)
                       for part in ("query", "key", "value"))
            scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(size)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            probs = scores / scores.sum(-1, keepdims=True)
            context = np.einsum("hqk,khd->qhd", probs, v).reshape(len(ids), -1)
            x = _layer_norm(x + self._linear(context, f"{p}.attention.output.dense"),
                            w[f"{p}.attention.output.LayerNorm.weight"],
                            w[f"{p}.attention.output.LayerNorm.bias"], eps)
            inner = self._linear(x, f"{p}.intermediate.dense")
            inner = 0.5 * inner * (1 + _erf(inner / math.sqrt(2)))
            x = _layer_norm(x + self._linear(inner, f"{p}.output.dense"),
                            w[f"{p}.output.LayerNorm.weight"], w[f"{p}.output.LayerNorm.bias"], eps)
        return x

    def classify(self, ids: list[int], type_ids: list[int]) -> float:
        """A cross-encoder's logit: BERT's pooler (tanh dense over the first token) and
        its one-label classifier."""
        states = self.token_states(ids, type_ids)
        pooled = np.tanh(self._linear(states[0], "pooler.dense"))
        return float(self._linear(pooled, "classifier")[0])

    def embed(self, text: str, max_length: int) -> np.ndarray:
        ids = self.tokenizer.encode(text).ids
        assert len(ids) <= max_length, f"test text over {max_length} tokens: {text[:40]}"
        vector = self.token_states(ids).mean(0)
        return vector / np.linalg.norm(vector)
