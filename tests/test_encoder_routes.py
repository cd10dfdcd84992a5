"""The BERT forward's CPU routes (``plugins/encoder/cpu_routes.py``) against the plain
``mlx.nn`` path: the same model's token states with the CPU kernels (packed rows for
short inputs, padded rows with the kernels' GELU and layer norms for long ones) and
without them (``nn.LayerNorm``, ``nn.gelu``, mlx's attention over a padding mask)."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest

from omlx_core.models import cpu_kernels
from omlx_core.plugins.encoder import cpu_routes
from omlx_core.plugins.encoder.bert import BertConfig, BertModel
from omlx_core.testing.encoder_models import TINY_BERT

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the kernels build on Linux")


@pytest.fixture(scope="module")
def model() -> BertModel:
    assert cpu_kernels.kernels() is not None, cpu_kernels.unavailable_reason()
    config = BertConfig.from_dict({**TINY_BERT, "vocab_size": 500})
    mx.random.seed(7)
    model = BertModel(config)
    weights = [(name, mx.random.normal(value.shape) * 0.2)
               for name, value in _flat(model.parameters())]
    model.load_weights(weights)  # fuses each layer's query, key and value projections
    assert all("qkv" in layer.attention.self_attn for layer in model.encoder.layer)
    return model


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat(value, f"{prefix}{key}.")
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from _flat(value, f"{prefix}{index}.")
    else:
        yield prefix[:-1], tree


def _rows(lengths: list[int], seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    width = max(lengths)
    ids = np.zeros((len(lengths), width), dtype=np.int32)
    types = np.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :length] = rng.integers(1, 500, length)
        types[row, length // 2:length] = 1
    return ids, types, np.array(lengths, dtype=np.int32)


def _plain(model: BertModel, ids, types, lengths, monkeypatch) -> np.ndarray:
    """The padded forward on mlx's own ops (no kernels anywhere, mlx's erf GELU)."""
    with monkeypatch.context() as patch:
        patch.setattr(cpu_kernels, "kernels", lambda: None)
        patch.setattr(cpu_routes, "numpy_gelu", lambda x, fallback: fallback(x))
        states = model(mx.array(ids), mx.array(lengths), mx.array(types))
        assert model.packed(ids[0, :lengths[0]], lengths[:1]) is None  # packs only on kernels
        mx.eval(states)
    return np.array(states)


@pytest.mark.parametrize("lengths", [[1], [9, 3, 14, 1, 7, 12], [64, 2, 33]])
def test_packed_rows_give_the_plain_paths_states(model, lengths, monkeypatch):
    ids, types, lens = _rows(lengths, sum(lengths))
    want = _plain(model, ids, types, lens, monkeypatch)
    real = np.arange(ids.shape[1])[None, :] < lens[:, None]
    got = model.packed(ids[real], lens, types[real])
    assert got is not None and got.shape == (sum(lengths), TINY_BERT["hidden_size"])
    np.testing.assert_allclose(np.array(got), want[real], rtol=1e-4, atol=1e-4)


def test_long_rows_run_padded_with_the_kernels_and_give_the_plain_paths_states(model,
                                                                               monkeypatch):
    lengths = [cpu_routes.KERNEL_MAX_WIDTH + 1, 5, 40]
    ids, types, lens = _rows(lengths, 3)
    assert model.packed(ids[0], lens[:1]) is None  # over the packed route's width
    want = _plain(model, ids, types, lens, monkeypatch)
    got = np.array(model(mx.array(ids), mx.array(lens), mx.array(types)))
    real = np.arange(ids.shape[1])[None, :] < lens[:, None]
    np.testing.assert_allclose(got[real], want[real], rtol=1e-4, atol=1e-4)
