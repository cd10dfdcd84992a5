"""The CPU kernels (a vectorized softmax and SwiGLU as mlx primitives) build, load, and
compute what mlx's ops compute."""

from __future__ import annotations

import platform
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from omlx_core.models import cpu_kernels

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="built on Linux only")


@pytest.fixture(scope="module")
def kernels():
    module = cpu_kernels.kernels()
    assert module is not None, cpu_kernels.unavailable_reason()
    return module


def test_the_build_is_cached_under_a_key_of_source_and_versions(kernels):
    first = cpu_kernels.build(announce=lambda line: pytest.fail(f"rebuilt: {line}"))
    assert first.is_file() and first.parent == cpu_kernels.build_dir()
    assert cpu_kernels.build(announce=lambda line: None) == first
    assert platform.machine() in ("x86_64", "aarch64", "arm64")


@pytest.mark.parametrize("shape", [(1, 9), (7, 400), (3, 9, 5, 1037), (2, 1)])
def test_softmax_equals_mlx(kernels, shape):
    x = mx.random.normal(shape, key=mx.random.key(len(shape))) * 6
    got, want = kernels.softmax(x), mx.softmax(x, axis=-1, precise=True)
    assert got.shape == want.shape and got.dtype == mx.float32
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-7).item()


def test_softmax_of_hidden_scores_as_the_attention_fallback_gives(kernels):
    """Hidden scores are the lowest float32 (a padding row hides every key: uniform
    weights, not NaNs); scores far below the row's largest underflow to 0."""
    low = mx.finfo(mx.float32).min
    x = mx.array([[0.0, 1.0, low, low, 2.0, -120.0, 3.0, 0.5, -0.5, 88.0],
                  [low] * 10], dtype=mx.float32)
    got, want = kernels.softmax(x), mx.softmax(x, axis=-1, precise=True)
    assert not mx.isnan(got).any().item()
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-7).item()
    assert mx.allclose(got[1], mx.full((10,), 0.1)).item()


def test_swiglu_equals_mlx_over_the_whole_range(kernels):
    gate = mx.concatenate([mx.linspace(-120, 120, 4001), mx.array([0.0, -0.0, 1e-30])])
    x = mx.random.normal(gate.shape, key=mx.random.key(5))
    got, want = kernels.swiglu(gate, x), nn.silu(gate) * x
    assert got.dtype == mx.float32 and not mx.isnan(got).any().item()
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-30).item()


def test_in_a_graph_the_inputs_buffer_is_reused_and_the_source_kept(kernels):
    x = mx.random.normal((64, 300))
    mx.eval(x)
    kept = mx.array(x)
    got = kernels.softmax(x * 1.0)  # an intermediate: its buffer may become the output
    mx.eval(got)
    assert mx.array_equal(x, kept).item()
    assert mx.allclose(got, mx.softmax(x, axis=-1, precise=True), rtol=1e-5, atol=1e-7).item()


def test_bad_input_is_refused_with_what_is_wrong(kernels):
    with pytest.raises(ValueError, match="float32"):
        kernels.softmax(mx.zeros((2, 3), dtype=mx.float16))
    with pytest.raises(ValueError, match="one shape"):
        kernels.swiglu(mx.zeros((2, 3)), mx.zeros((3, 2)))



def test_strided_inputs_are_made_contiguous_first(kernels):
    x = mx.random.normal((5, 300), key=mx.random.key(2)) * 4
    got = kernels.softmax(x.T)
    assert mx.allclose(got, mx.softmax(x.T, axis=-1, precise=True), rtol=1e-5, atol=1e-7).item()
    gate, up = x[:, ::2], x[:, 1::2]
    assert mx.allclose(kernels.swiglu(gate, up), nn.silu(gate) * up, rtol=1e-5, atol=1e-6).item()


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    assert cpu_kernels.kernels() is None
    assert cpu_kernels.DISABLE_ENV in cpu_kernels.unavailable_reason()


def test_a_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "_COMPILER", "no-such-cxx")
    with pytest.raises(cpu_kernels.KernelBuildError, match="no C\\+\\+ compiler"):
        cpu_kernels.build()
