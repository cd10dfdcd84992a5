"""The packed product of float32 linear layers (omlx_core/models/packed_linear.py): the
product BLAS gives to rounding, a row's result independent of its batch, the same bytes
held, and a loaded model's layers swapped only where the kernel applies."""

from __future__ import annotations

import sys
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from omlx_core.models import cpu_kernels, packed_linear
from omlx_core.models.packed_linear import (PackedEmbedding, PackedLinear, install_packed_linears,
                                            pack_weight, packed_bits, panel_width)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="built on Linux only")


@pytest.fixture(scope="module")
def bits():
    width = packed_bits()
    if width == 0:
        pytest.skip("no packed product on this CPU (it needs AVX2 and FMA or AVX-512)")
    return width


def product(x, weight, bits):
    return cpu_kernels.kernels().packed_matmul(x, pack_weight(weight), bits)


@pytest.mark.parametrize("rows,outputs,inputs", [
    (1, 192, 576), (3, 96, 7), (16, 1536, 576), (13, 576, 1536), (130, 480, 64),
    (9, 64, 33), (5, 16, 3), (0, 48, 5)])
def test_the_product_is_x_times_the_weights_transpose(bits, rows, outputs, inputs):
    keys = mx.random.split(mx.random.key(rows * 7 + outputs), 2)
    x = mx.random.normal((rows, inputs), key=keys[0])
    weight = mx.random.normal((outputs, inputs), key=keys[1])
    got = np.asarray(product(x, weight, bits), dtype=np.float64)
    want = np.asarray(x, dtype=np.float64) @ np.asarray(weight, dtype=np.float64).T
    assert got.shape == (rows, outputs)
    # float32 sums of `inputs` products of unit normals, in another order than float64's
    assert np.abs(got - want).max(initial=0.0) <= 1e-6 * inputs * np.sqrt(inputs) + 1e-6


@pytest.mark.parametrize("outputs,inputs", [(1536, 576), (64, 576), (80, 576), (80, 100)])
def test_a_rows_result_does_not_depend_on_its_batch_or_the_vector_width(bits, outputs, inputs):
    """Every output is one chain of multiply-adds in input order: a row alone, the same
    row among 70 others (chunks, threads, 8/4/2/1-row blocks, each meeting the panel 64
    inputs at a time, the last slice shorter where 64 does not divide the inputs) and the
    AVX2 build agree bit for bit."""
    keys = mx.random.split(mx.random.key(3), 2)
    x = mx.random.normal((71, inputs), key=keys[0])
    weight = mx.random.normal((outputs, inputs), key=keys[1])
    batch = product(x, weight, bits)
    for row in (0, 7, 64, 70):
        assert mx.array_equal(product(x[row:row + 1], weight, bits)[0], batch[row]).item()
    assert mx.array_equal(product(x[5:8], weight, bits), batch[5:8]).item()
    assert mx.array_equal(product(x, weight, 256), batch).item()


def test_leading_axes_and_strided_inputs(bits):
    keys = mx.random.split(mx.random.key(4), 2)
    x = mx.random.normal((2, 5, 96), key=keys[0])
    weight = mx.random.normal((48, 96), key=keys[1])
    assert mx.allclose(product(x, weight, bits), x @ weight.T, atol=1e-4).item()
    strided = x.swapaxes(0, 1)[:, :, ::2]  # (5, 2, 48)
    assert mx.allclose(product(strided, weight[:, :48], bits), strided @ weight[:, :48].T,
                       atol=1e-4).item()


def test_two_streams_at_once_each_get_their_product(bits):
    """The helper threads serve one product at a time; another stream's runs on its own
    thread meanwhile, and both are right."""
    keys = mx.random.split(mx.random.key(5), 2)
    x = mx.random.normal((16, 576), key=keys[0])
    weight = mx.random.normal((1536, 576), key=keys[1])
    packed = pack_weight(weight)
    want = product(x, weight, bits)
    mx.eval(packed, want)
    results, errors = [], []

    def work():
        try:
            with mx.stream(mx.new_stream(mx.cpu)):
                for _ in range(20):
                    got = cpu_kernels.kernels().packed_matmul(x, packed, bits)
                    mx.eval(got)
                    results.append(mx.array_equal(got, want).item())
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a product never finished"
    assert not errors and len(results) == 40 and all(results)


def test_bad_input_is_refused_with_what_is_wrong(bits):
    kernels = cpu_kernels.kernels()
    panels = pack_weight(mx.zeros((48, 8)))
    with pytest.raises(ValueError, match="K"):
        kernels.packed_matmul(mx.zeros((2, 9)), panels, bits)
    with pytest.raises(ValueError, match="float32"):
        kernels.packed_matmul(mx.zeros((2, 8), dtype=mx.float16), panels, bits)
    with pytest.raises(ValueError, match="48, 32 or 16"):
        kernels.packed_matmul(mx.zeros((2, 8)), mx.zeros((2, 8, 24)), bits)
    with pytest.raises(ValueError, match="bits"):
        kernels.packed_matmul(mx.zeros((2, 8)), panels, 128)


def test_a_split_product_is_each_siblings_own_product_bit_for_bit(bits):
    kernels = cpu_kernels.kernels()
    keys = mx.random.split(mx.random.key(8), 4)
    weights = [mx.random.normal((n, 40), key=k) for n, k in zip((96, 48, 48), keys)]
    x = mx.random.normal((5, 1, 40), key=keys[3])
    joined = mx.concatenate([pack_weight(w) for w in weights], axis=0)
    outputs = kernels.packed_matmul_split(x, joined, bits, [2, 1, 1])
    assert [o.shape for o in outputs] == [(5, 1, 96), (5, 1, 48), (5, 1, 48)]
    for out, weight in zip(outputs, weights):
        assert mx.array_equal(out, kernels.packed_matmul(x, pack_weight(weight), bits)).item()
    with pytest.raises(ValueError, match="add up to the panels"):
        kernels.packed_matmul_split(x, joined, bits, [2, 1])
    with pytest.raises(ValueError, match="every split needs a panel"):
        kernels.packed_matmul_split(x, joined, bits, [4, 0])


def test_siblings_are_one_weight_and_one_product(tiny_model_path, bits):
    """q/k/v and gate/up are packed as one weight (each layer's ``packed`` a view of it,
    the bytes counted once) and multiplied in one call; the model's outputs are bit for
    bit those of each layer multiplying alone, and a sibling called with another input
    gets its own product of it."""
    from omlx_core.models.loader import load_model

    model, _ = load_model(tiny_model_path("llama"))
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    shared = {id(layer._shared) for layer in (attention.q_proj, attention.k_proj, attention.v_proj)}
    assert len(shared) == 1 and attention.q_proj._shared is not None
    assert mlp.gate_proj._shared is mlp.up_proj._shared is not None
    assert mlp.down_proj._shared is None and attention.o_proj._shared is None
    tokens = mx.array([[5, 9, 31, 2, 77, 120, 4]])
    joined = model(tokens)
    mx.eval(joined)
    for _, module in model.named_modules():
        if isinstance(module, PackedLinear):
            module._shared = None
    assert mx.array_equal(joined, model(tokens)).item()

    model, _ = load_model(tiny_model_path("llama"))
    attention = model.model.layers[0].self_attn
    x, other = (mx.random.normal((2, 3, attention.q_proj.input_dims), key=mx.random.key(s)) for s in (1, 2))
    alone = [layer.packed for layer in (attention.q_proj, attention.k_proj)]
    q, k_other = attention.q_proj(x), attention.k_proj(other)
    assert mx.array_equal(q, cpu_kernels.kernels().packed_matmul(x, alone[0], bits)).item()
    assert mx.array_equal(k_other, cpu_kernels.kernels().packed_matmul(other, alone[1], bits)).item()
    # once each sibling took its output, nothing of the call is held
    outputs = [layer(x) for layer in (attention.q_proj, attention.k_proj, attention.v_proj)]
    assert attention.q_proj._shared._held.value is None
    assert mx.array_equal(outputs[1], cpu_kernels.kernels().packed_matmul(x, alone[1], bits)).item()


def test_panels_are_the_widest_that_divide_the_outputs():
    assert [panel_width(n) for n in (576, 4096, 80, 49152, 100)] == [48, 32, 16, 48, None]
    weight = mx.arange(64 * 3, dtype=mx.float32).reshape(64, 3)
    packed = pack_weight(weight)
    assert packed.shape == (2, 3, 32)
    assert mx.array_equal(packed[1, 2], weight[32:64, 2]).item()


def test_layers_keep_their_results_and_bytes(bits):
    keys = mx.random.split(mx.random.key(6), 3)
    linear = nn.Linear(40, 96, bias=True)
    embedding = nn.Embedding(160, 40)
    mx.eval(linear.parameters(), embedding.parameters())
    x = mx.random.normal((3, 2, 40), key=keys[0])
    packed_layer, packed_table = PackedLinear(linear, bits), PackedEmbedding(embedding, bits)
    assert mx.allclose(packed_layer(x), linear(x), atol=1e-5).item()
    ids = mx.array([[0, 17, 159], [48, 47, 96]])
    assert mx.array_equal(packed_table(ids), embedding(ids)).item()
    assert mx.allclose(packed_table.as_linear(x), embedding.as_linear(x), atol=1e-5).item()
    assert mx.array_equal(packed_table.weight, embedding.weight).item()
    assert mx.array_equal(packed_layer.rows(mx.array([5, 95])), linear.weight[mx.array([5, 95])]).item()

    def held(module):
        return sum(a.nbytes for _, a in tree_flatten(module.parameters()))

    assert held(packed_layer) == held(linear) and held(packed_table) == held(embedding)


def test_a_loaded_model_packs_exactly_its_float32_linears_and_embeddings(tiny_model_path):
    from omlx_core.models.loader import load_model

    model, _ = load_model(tiny_model_path("llama"))
    kinds = {type(m) for _, m in model.named_modules()}
    if packed_bits() == 0:
        assert PackedLinear not in kinds
        pytest.skip("no packed product on this CPU")
    assert nn.Linear not in kinds and nn.Embedding not in kinds
    assert PackedLinear in kinds and PackedEmbedding in kinds
    # bfloat16 and quantized layers stay as they are
    half = nn.Linear(32, 48)
    half.set_dtype(mx.bfloat16)
    quantized = nn.QuantizedLinear(64, 64)
    holder = nn.Module()
    holder.layers = [half, quantized, nn.Linear(32, 20)]
    assert install_packed_linears(holder) == 0


def test_packed_and_unpacked_models_agree(tiny_model_path, monkeypatch):
    from omlx_core.models.loader import load_model

    path = tiny_model_path("llama")
    tokens = mx.array([[5, 9, 31, 2, 77, 120, 4]])
    packed_model, _ = load_model(path)
    monkeypatch.setenv(packed_linear.OFF_ENV, "0")
    plain_model, _ = load_model(path)
    assert not any(isinstance(m, PackedLinear) for _, m in plain_model.named_modules())
    assert mx.allclose(packed_model(tokens), plain_model(tokens), atol=1e-4).item()


def test_packing_holds_one_weight_twice_at_most(monkeypatch):
    """Packed layer by layer, each old weight let go before the next: a load holds the
    weights plus :func:`packing_bytes` (what the model pool plans a load with), not the
    weights twice."""
    from omlx_core.models.loader import load_model
    from omlx_core.pool.catalog import tensor_headers
    from omlx_core.testing.models import cached_model

    if packed_bits() == 0:
        pytest.skip("no packed product on this CPU")
    path = cached_model("llama", size="small")
    monkeypatch.setenv(packed_linear.OFF_ENV, "0")
    model, _ = load_model(path)
    monkeypatch.delenv(packed_linear.OFF_ENV)
    extra = packed_linear.packing_bytes(tensor_headers(path))
    weights = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    assert 0 < extra < weights / 4
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    assert install_packed_linears(model) > 0
    assert mx.get_peak_memory() - before <= extra + 2**20
    assert sum(a.nbytes for _, a in tree_flatten(model.parameters())) == weights


def test_packing_plans_the_largest_weight_or_twice_a_set_of_siblings(monkeypatch):
    tensors = [("model.embed_tokens.weight", (49152, 576), "F32"),
               ("model.layers.0.mlp.down_proj.weight", (576, 1536), "F32"),
               ("model.layers.0.norm.weight", (100, 7), "F32"),
               ("model.layers.1.mlp.down_proj.weight", (4096, 9), "BF16")]
    assert packed_linear.packing_bytes(tensors) == (49152 * 576 * 4 if packed_bits() else 0)
    # gate and up of one layer are packed as one: 2 x (2 x 16384 x 576) floats beat the table
    siblings = [(f"model.layers.3.mlp.{name}.weight", (16384, 576), "F32")
                for name in ("gate_proj", "up_proj")]
    others = [("model.layers.4.mlp.gate_proj.weight", (16384, 576), "F32")]
    assert packed_linear.packing_bytes(tensors + siblings + others) == (
        2 * 2 * 16384 * 576 * 4 if packed_bits() else 0)
    monkeypatch.setenv(packed_linear.OFF_ENV, "0")
    assert packed_linear.packing_bytes(tensors + siblings) == 0
