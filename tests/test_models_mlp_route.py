"""CPU SwiGLU (the SiLU's exponential in NumPy, in place) gives mlx-lm's: per call, per model, greedily."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import activations

from omlx_core.models import cpu_kernels, mlp_route
from omlx_core.models.loader import load_model
from omlx_core.models.mlp_route import cpu_swiglu, install_cpu_swiglu, swiglu_in_place
from omlx_core.testing.models import greedy_after_chunked_prefill, routed_modules

WIDTH = 1536  # the default model's intermediate size


class Fallback:
    """mlx-lm's function, counting the calls handed to it."""

    def __init__(self):
        self.calls = 0

    def __call__(self, gate, x):
        self.calls += 1
        return activations.swiglu(gate, x)


def pair(shape, seed=0, dtype=mx.float32):
    g_key, x_key = mx.random.split(mx.random.key(seed))
    gate = (mx.random.normal(shape, key=g_key) * 4).astype(dtype)
    x = mx.random.normal(shape, key=x_key).astype(dtype)
    mx.eval(gate, x)
    return gate, x


@pytest.mark.parametrize("shape", [(1, 256, WIDTH), (8, 7, WIDTH), (3, 97, 130)])
def test_a_multi_position_call_is_taken_and_agrees(shape, monkeypatch):
    monkeypatch.setattr(mlp_route, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(mlp_route, "BLOCK_ELEMENTS", 1000)  # several blocks and a remainder
    gate, x = pair(shape)
    expected = activations.swiglu(gate, x)
    fallback = Fallback()
    got = cpu_swiglu(mx.array(gate), x, fallback=fallback)
    assert fallback.calls == 0
    assert got.shape == expected.shape and got.dtype == mx.float32
    assert mx.allclose(got, expected, rtol=1e-5, atol=1e-6).item()


SMALL_CALLS = [(8, 1, WIDTH),  # a plain decode step: one position per row
               (1, 2, 64)]  # under MIN_ELEMENTS


@pytest.mark.parametrize("shape", SMALL_CALLS)
def test_calls_it_does_not_take_run_in_the_graph_with_the_cpu_kernels(shape):
    assert cpu_kernels.kernels() is not None, cpu_kernels.unavailable_reason()
    gate, x = pair(shape)
    fallback = Fallback()
    got = cpu_swiglu(gate, x, fallback=fallback)
    assert fallback.calls == 0
    assert mx.allclose(got, activations.swiglu(gate, x), rtol=1e-5, atol=1e-6).item()
    # A strided (transposed) input is made contiguous first.
    got = cpu_swiglu(gate.swapaxes(0, 1), x.swapaxes(0, 1), fallback=fallback)
    assert fallback.calls == 0
    assert mx.allclose(got, activations.swiglu(gate.swapaxes(0, 1), x.swapaxes(0, 1)),
                       rtol=1e-5, atol=1e-6).item()


def test_calls_neither_path_takes_go_to_mlx_lm_unchanged(monkeypatch):
    cases = [pair((1, 256, WIDTH), dtype=mx.float16)]  # half precision
    monkeypatch.setattr(cpu_kernels, "_loaded", {"module": None, "reason": "test"})
    cases += [pair(shape) for shape in SMALL_CALLS]  # no kernels built
    for gate, x in cases:
        fallback = Fallback()
        got = cpu_swiglu(gate, x, fallback=fallback)
        assert fallback.calls == 1
        assert mx.array_equal(got, activations.swiglu(gate, x)).item()
    assert mx.default_device().type == mx.cpu


def test_in_place_on_numpy_rows():
    rng = np.random.default_rng(3)
    gate = rng.normal(size=(37, 50)).astype(np.float32) * 4
    up = rng.normal(size=(37, 50)).astype(np.float32)
    expected = gate / (1 + np.exp(-gate)) * up
    swiglu_in_place(gate, up)
    assert np.allclose(gate, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_installed_at_load_and_greedy_outputs_unchanged(family, tiny_model_path, monkeypatch):
    """Chunked prefill then greedy decoding give mlx-lm's logits and tokens."""
    monkeypatch.setattr(mlp_route, "MIN_ELEMENTS", 0)  # tiny models' calls are below it
    model, _ = load_model(tiny_model_path(family))
    routed = routed_modules(model, "swiglu", "_omlx_cpu_swiglu")
    assert routed, f"{family}: no module routed"
    prompt = mx.random.randint(0, 200, (1, 90), key=mx.random.key(5))

    ours_logits, ours_tokens = greedy_after_chunked_prefill(model, prompt)
    for name in routed:
        monkeypatch.setattr(sys.modules[name], "swiglu", activations.swiglu)
    theirs_logits, theirs_tokens = greedy_after_chunked_prefill(model, prompt)
    assert ours_tokens == theirs_tokens
    assert mx.allclose(ours_logits, theirs_logits, rtol=1e-4, atol=1e-4).item()
    assert install_cpu_swiglu(model) == install_cpu_swiglu(model)


def test_a_model_with_recurrent_layers_is_left_to_mlx_lm(tiny_model_path):
    model, _ = load_model(tiny_model_path("qwen3_next"))
    assert install_cpu_swiglu(model) == []
