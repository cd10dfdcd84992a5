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


def test_using_swaps_the_kernels_for_a_block_and_puts_them_back(kernels):
    with cpu_kernels.using(None):
        assert cpu_kernels.kernels() is None
    assert cpu_kernels.kernels() is kernels
    with pytest.raises(RuntimeError), cpu_kernels.using(None):
        raise RuntimeError("the block failed")
    assert cpu_kernels.kernels() is kernels


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    assert cpu_kernels.kernels() is None
    assert cpu_kernels.DISABLE_ENV in cpu_kernels.unavailable_reason()


def test_a_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "_COMPILER", "no-such-cxx")
    with pytest.raises(cpu_kernels.KernelBuildError, match="no C\\+\\+ compiler"):
        cpu_kernels.build()


@pytest.mark.parametrize("shape", [(1, 576), (16, 1, 576), (3, 7, 64), (2, 1, 9, 16)])
def test_rms_norm_is_mlx_bit_for_bit(kernels, shape):
    x = mx.random.normal(shape, key=mx.random.key(11)) * 3
    w = mx.random.normal((shape[-1],), key=mx.random.key(12))
    assert mx.array_equal(kernels.rms_norm(x, w, 1e-5), mx.fast.rms_norm(x, w, 1e-5)).item()
    strided = mx.random.normal((shape[-1], 5), key=mx.random.key(13)).T  # rows not dense
    assert mx.array_equal(kernels.rms_norm(strided, w, 1e-6), mx.fast.rms_norm(strided, w, 1e-6)).item()


@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize("shape,offsets", [((1, 9, 1, 64), 4095), ((16, 9, 1, 64), "rows"),
                                           ((1, 4, 37, 64), 5), ((2, 3, 4, 32), "rows"),
                                           ((5, 2, 1, 16), "strided rows")])
def test_rope_is_mlx_bit_for_bit(kernels, traditional, shape, offsets):
    import math

    batch, heads, steps, dim = shape
    # (batch, positions, heads, dim) transposed: the strided view attention passes.
    x = mx.random.normal((batch, steps, heads, dim), key=mx.random.key(14)).transpose(0, 2, 1, 3)
    given = mx.array([37 * i + 3 for i in range(2 * batch)], dtype=mx.int32)
    given = {"rows": given[:batch], "strided rows": given[::2]}.get(offsets, offsets)
    base, half = 100000.0, dim // 2
    inverse = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * (math.log(base) / half))
    offset = given if isinstance(given, mx.array) else mx.array(given, dtype=mx.int32)
    if offsets == "strided rows":
        # the kernel reads the offsets and frequencies where they lie, views too
        inverse = mx.stack([inverse, inverse * 2]).T[:, 0]
    got = kernels.rope(x, offset, inverse, dim, traditional, 1.0)
    want = mx.fast.rope(x, dim, traditional=traditional, base=base, scale=1.0, offset=given)
    assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("batch,heads,kv_heads,keys,width", [
    (1, 9, 3, 256, 64), (16, 9, 3, 300, 64), (4, 4, 4, 17, 64),
    # wider heads (strips of 64 outputs, query heads of a group 3 at a time), a width
    # that is no multiple of 64, key counts that are no multiple of 4
    (2, 16, 4, 131, 128), (3, 10, 1, 7, 80), (2, 8, 2, 258, 32)])
@pytest.mark.parametrize("masked", [True, False])
def test_decode_attention_equals_mlx(kernels, batch, heads, kv_heads, keys, width, masked):
    """Scores, a decode lane's left-padding mask, softmax and values: mlx's within float32
    rounding of a dot product's order (keys and values as the cache's strided views)."""
    q = mx.random.normal((batch, 1, heads, width), key=mx.random.key(15)).transpose(0, 2, 1, 3)
    k = mx.random.normal((batch, kv_heads, keys + 256, width), key=mx.random.key(16))[:, :, :keys]
    v = mx.random.normal((batch, kv_heads, keys + 256, width), key=mx.random.key(17))[:, :, :keys]
    mask = None
    if masked:
        mask = (mx.arange(keys)[None] >= mx.array([3 * i for i in range(batch)])[:, None])[:, None, None, :]
    got = kernels.decode_attention(q, k, v, mask, 0.125)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert got.shape == want.shape
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()


@pytest.mark.parametrize("bits,group_size", [(8, 64), (8, 32), (4, 64), (4, 32)])
@pytest.mark.parametrize("masked", [True, False])
def test_quantized_decode_attention_is_the_float_kernel_over_the_dequantized_cache(
        kernels, bits, group_size, masked):
    """Each key and value row expanded with mx.dequantize's arithmetic: bit for bit the
    float32 kernel over the dequantized cache (the quantized cache's views, as a batch
    cache's offset slices them)."""
    batch, heads, kv_heads, keys = 5, 9, 3, 300
    q = mx.random.normal((batch, 1, heads, 64), key=mx.random.key(21)).transpose(0, 2, 1, 3)
    quantized = [mx.quantize(mx.random.normal((batch, kv_heads, keys + 64, 64), key=mx.random.key(seed)),
                             group_size=group_size, bits=bits) for seed in (22, 23)]
    k, v = ([part[:, :, :keys] for part in parts] for parts in quantized)
    mask = None
    if masked:
        mask = (mx.arange(keys)[None] >= mx.array([7 * i for i in range(batch)])[:, None])[:, None, None, :]
    got = kernels.quantized_decode_attention(q, *k, *v, mask, 0.125, group_size, bits)
    expanded = [mx.dequantize(*parts, group_size=group_size, bits=bits) for parts in (k, v)]
    assert mx.array_equal(got, kernels.decode_attention(q, *expanded, mask, 0.125)).item()
    want = mx.fast.scaled_dot_product_attention(q, *expanded, scale=0.125, mask=mask)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()


def test_quantized_decode_attention_refuses_what_it_does_not_compute(kernels):
    q = mx.zeros((1, 4, 1, 64))
    k = mx.quantize(mx.zeros((1, 2, 8, 64)), group_size=64, bits=8)
    with pytest.raises(ValueError, match="bits 4 or 8"):
        kernels.quantized_decode_attention(q, *k, *k, None, 1.0, 64, 3)
    with pytest.raises(ValueError, match="uint32 words"):
        kernels.quantized_decode_attention(q, *k, *k, None, 1.0, 32, 8)  # packed for 64
    with pytest.raises(ValueError, match="mask must be bool"):
        kernels.quantized_decode_attention(q, *k, *k, mx.ones((1, 1, 1, 8)), 1.0, 64, 8)


def test_decode_attention_refuses_what_it_does_not_compute(kernels):
    q, k = mx.zeros((1, 4, 2, 16)), mx.zeros((1, 2, 8, 16))
    with pytest.raises(ValueError, match="q \\(B, H, 1, D\\)"):
        kernels.decode_attention(q, k, k, None, 1.0)
    with pytest.raises(ValueError, match="mask must be bool"):
        kernels.decode_attention(q[:, :, :1], k, k, mx.ones((1, 1, 1, 8)), 1.0)


def test_a_model_takes_the_norm_and_rope_kernels_on_decode_steps_only(tiny_model_path):
    """The swapped layers give mlx's results, through the kernels for one position per
    sequence and through mlx's ops for a prefill chunk."""
    from omlx_core.models.layer_kernels import KernelRMSNorm, KernelRoPE
    from omlx_core.models.loader import load_model

    model, _ = load_model(tiny_model_path("llama"))
    layer = model.model.layers[0]
    assert isinstance(layer.input_layernorm, KernelRMSNorm) and isinstance(model.model.norm, KernelRMSNorm)
    assert isinstance(layer.self_attn.rope, KernelRoPE)
    assert "_inverse_frequencies" not in dict(nn.utils.tree_flatten(model.parameters()))
    for positions in (1, 12):
        x = mx.random.normal((3, positions, layer.input_layernorm.weight.shape[0]), key=mx.random.key(18))
        assert mx.array_equal(layer.input_layernorm(x),
                              mx.fast.rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps)).item()
        q = mx.random.normal((3, 4, positions, 16), key=mx.random.key(19))
        rope = layer.self_attn.rope
        want = mx.fast.rope(q, rope.dims, traditional=rope.traditional, base=rope.base,
                            scale=rope.scale, offset=mx.array([5, 9, 30]))
        assert mx.array_equal(rope(q, offset=mx.array([5, 9, 30])), want).item()


# -- the encoder's primitives (plugins/encoder/cpu_routes.py) ------------------------------------


def test_gelu_is_the_exact_gelu_over_the_whole_range(kernels):
    x = mx.concatenate([mx.linspace(-12, 12, 4001), mx.array([0.0, -0.0, 1e-30, -1e-30]),
                        mx.random.normal((70_000,), key=mx.random.key(3)) * 3])
    got, want = kernels.gelu(x), nn.gelu(x)
    assert got.dtype == mx.float32 and got.shape == x.shape and not mx.isnan(got).any().item()
    # Abramowitz and Stegun's erf is within 1.5e-7 of erf: x / 2 times that at most.
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()
    kept = mx.array(x)
    strided = x[:70_000].reshape(7, -1)[:, ::3]
    assert mx.allclose(kernels.gelu(strided), nn.gelu(strided), rtol=1e-5, atol=1e-6).item()
    mx.eval(kernels.gelu(x * 1.0))  # an intermediate: its buffer becomes the output
    assert mx.array_equal(x, kept).item()


@pytest.mark.parametrize("shape", [(1, 384), (3, 7, 384), (2, 5, 33), (300, 64)])
@pytest.mark.parametrize("residual", [False, True])
def test_layer_norm_equals_mlx(kernels, shape, residual):
    keys = mx.random.split(mx.random.key(len(shape)), 4)
    x = mx.random.normal(shape, key=keys[0]) * 3 + 1
    r = mx.random.normal(shape, key=keys[1]) if residual else None
    norm = nn.LayerNorm(shape[-1], eps=1e-12)
    norm.weight = mx.random.normal((shape[-1],), key=keys[2])
    norm.bias = mx.random.normal((shape[-1],), key=keys[3])
    want = norm(x + r if residual else x)
    got = kernels.layer_norm(x, r, norm.weight, norm.bias, 1e-12)
    assert got.shape == x.shape and mx.allclose(got, want, rtol=1e-4, atol=1e-5).item()


@pytest.mark.parametrize("lengths", [[1], [5, 1, 12, 7], [64, 3, 30], [2] * 40])
def test_packed_attention_is_each_sequences_own_attention(kernels, lengths):
    heads, width = 4, 32
    tokens = sum(lengths)
    qkv = mx.random.normal((1, tokens, 3 * heads * width), key=mx.random.key(tokens)) * 2
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    got = kernels.packed_attention(qkv, mx.array(offsets, dtype=mx.int32), heads, 0.17)
    assert got.shape == (1, tokens, heads * width)
    for start, stop in zip(offsets, offsets[1:]):
        part = qkv[0, start:stop].reshape(stop - start, 3, heads, width).transpose(1, 2, 0, 3)
        want = mx.fast.scaled_dot_product_attention(part[0][None], part[1][None], part[2][None],
                                                    scale=0.17)
        want = want[0].transpose(1, 0, 2).reshape(stop - start, heads * width)
        assert mx.allclose(got[0, start:stop], want, rtol=1e-4, atol=1e-5).item()


def test_the_encoder_primitives_refuse_what_they_do_not_compute(kernels):
    with pytest.raises(ValueError, match="float32"):
        kernels.gelu(mx.zeros((2, 3), dtype=mx.float16))
    with pytest.raises(ValueError, match="residual of its shape"):
        kernels.layer_norm(mx.zeros((2, 3)), mx.zeros((3, 2)), mx.ones((3,)), mx.zeros((3,)), 1e-5)
    with pytest.raises(ValueError, match="last axis"):
        kernels.layer_norm(mx.zeros((2, 3)), None, mx.ones((4,)), mx.zeros((3,)), 1e-5)
    with pytest.raises(ValueError, match="3 x heads"):
        kernels.packed_attention(mx.zeros((1, 4, 10)), mx.array([0, 4], dtype=mx.int32), 4, 1.0)
    with pytest.raises(ValueError, match="int32 offsets"):
        kernels.packed_attention(mx.zeros((1, 4, 24)), mx.array([0.0, 4.0]), 4, 1.0)
