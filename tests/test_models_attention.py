"""CPU attention (softmax in NumPy, in place) gives mlx-lm's attention: per call, per model, greedily."""

from __future__ import annotations

import sys
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base
from mlx_lm.models.base import create_causal_mask

from omlx_core.models import attention, cpu_kernels
from omlx_core.models.attention import cpu_attention, install_cpu_attention, softmax_in_place
from omlx_core.models.loader import load_model
from omlx_core.testing.models import greedy_after_chunked_prefill, routed_modules

ROWS, HEADS, KV_HEADS, HEAD_DIM = 256, 9, 3, 64  # one prefill chunk of the default model


def inputs(rows: int, keys: int, *, batch: int = 1, heads: int = HEADS, kv_heads: int = KV_HEADS,
           seed: int = 0, dtype=mx.float32):
    q_key, k_key, v_key = mx.random.split(mx.random.key(seed), 3)
    # Queries come out of the projection as (B, L, H, D) and are transposed, as in mlx-lm.
    queries = mx.random.normal((batch, rows, heads, HEAD_DIM), key=q_key).transpose(0, 2, 1, 3)
    keys_ = mx.random.normal((batch, kv_heads, keys, HEAD_DIM), key=k_key)
    values = mx.random.normal((batch, kv_heads, keys, HEAD_DIM), key=v_key)
    return queries.astype(dtype), keys_.astype(dtype), values.astype(dtype)


def mlx_lm_attention(queries, keys, values, mask, cache=None, sinks=None):
    return base.scaled_dot_product_attention(queries, keys, values, cache=cache,
                                             scale=HEAD_DIM**-0.5, mask=mask, sinks=sinks)


class Fallback:
    """mlx-lm's function, counting the calls handed to it."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return base.scaled_dot_product_attention(*args, **kwargs)


def ours(queries, keys, values, mask, cache=None, sinks=None, cores=None):
    fallback = Fallback()
    out = cpu_attention(queries, keys, values, cache, HEAD_DIM**-0.5, mask, sinks,
                        fallback=fallback, cores=cores)
    return out, fallback.calls


@pytest.fixture
def every_call(monkeypatch):
    """The route takes calls of any size (the tests' are below :data:`MIN_SCORES`)."""
    monkeypatch.setattr(attention, "MIN_SCORES", 0)
    monkeypatch.setattr(attention, "MIN_KEYS", 0)


@pytest.fixture
def no_kernels(monkeypatch):
    """As where the CPU kernels could not be built: what the route does not take goes to
    mlx-lm's function."""
    monkeypatch.setattr(cpu_kernels, "_loaded", {"module": None, "reason": "test"})


@pytest.fixture(params=["route", "kernels"])
def either_path(request, monkeypatch):
    """The NumPy route takes every call, or none (then the CPU kernels' graph does)."""
    if request.param == "route":
        monkeypatch.setattr(attention, "MIN_SCORES", 0)
        monkeypatch.setattr(attention, "MIN_KEYS", 0)
    else:
        assert cpu_kernels.kernels() is not None, cpu_kernels.unavailable_reason()
        monkeypatch.setattr(attention, "route_takes", lambda *sizes: False)


def close(got, expected) -> bool:
    return got.shape == expected.shape and got.dtype == expected.dtype and \
        mx.allclose(got, expected, rtol=1e-5, atol=1e-6).item()


@pytest.mark.parametrize("offset", [0, 256, 3840])
@pytest.mark.parametrize("cores", [1, 2, 4])
def test_a_causal_prefill_chunk_equals_mlx_lm_attention(offset, cores, every_call):
    queries, keys, values = inputs(ROWS, offset + ROWS, seed=offset)
    got, handed_on = ours(queries, keys, values, "causal", cores=cores)
    assert handed_on == 0
    assert close(got, mlx_lm_attention(queries, keys, values, "causal"))


def test_array_masks_equal_mlx_lm_attention_padding_rows_included(either_path):
    batch, rows, offset = 2, 128, 200
    queries, keys, values = inputs(rows, offset + rows, batch=batch, seed=7)
    # The batched engine's masks: (batch, 1, rows, keys) booleans; row 0 of the second
    # request is left padding that sees no key at all (mlx gives it uniform weights).
    mask = mx.broadcast_to(create_causal_mask(rows, offset), (batch, 1, rows, offset + rows))
    hidden_row = mx.arange(rows)[:, None] == 0
    mask = mx.stack([mask[0], mx.where(hidden_row, False, mask[1])])
    got, handed_on = ours(queries, keys, values, mask)
    assert handed_on == 0
    assert not mx.isnan(got).any().item()
    assert close(got, mlx_lm_attention(queries, keys, values, mask))
    # A sliding window (2-D), a per-head mask and an additive one.
    window = create_causal_mask(rows, offset, window_size=64)
    per_head = mx.broadcast_to(window, (batch, HEADS, rows, offset + rows))
    additive = mx.where(window, 0.0, -1e4).astype(mx.float32)[None, None]
    for mask in (window, per_head, additive):
        got, handed_on = ours(queries, keys, values, mask)
        assert handed_on == 0
        assert close(got, mlx_lm_attention(queries, keys, values, mask))


def test_many_heads_without_grouping_and_no_mask(either_path):
    queries, keys, values = inputs(ROWS, 1024, heads=4, kv_heads=4, seed=3)
    got, handed_on = ours(queries, keys, values, None)
    assert handed_on == 0
    assert close(got, mlx_lm_attention(queries, keys, values, None))


def test_calls_the_route_does_not_take_run_in_the_graph_with_the_cpu_kernels():
    # A decode step, a chunk over a short context: the route does not take them; the CPU
    # kernels' softmax computes them in the graph, nothing evaluated mid-forward.
    assert cpu_kernels.kernels() is not None, cpu_kernels.unavailable_reason()
    for rows, keys in ((1, 4096), (256, 768)):
        assert not attention.route_takes(1, HEADS, rows, keys)
        queries, k, v = inputs(rows, keys)
        got, handed_on = ours(queries, k, v, "causal")
        assert handed_on == 0 and close(got, mlx_lm_attention(queries, k, v, "causal"))


def test_without_the_kernels_calls_the_route_does_not_take_go_to_mlx_lm(no_kernels):
    for rows, keys in ((1, 4096), (256, 768)):
        queries, k, v = inputs(rows, keys)
        got, handed_on = ours(queries, k, v, "causal")
        assert handed_on == 1 and close(got, mlx_lm_attention(queries, k, v, "causal"))


def test_calls_neither_path_supports_go_to_mlx_lm_unchanged():
    queries, keys, values = inputs(ROWS, 1024)
    # Half precision (NumPy's exp is not vectorized there), attention sinks.
    half = [a.astype(mx.float16) for a in (queries, keys, values)]
    assert ours(*half, "causal")[1] == 1
    sinks = mx.zeros((HEADS,))
    got, handed_on = ours(queries, keys, values, "causal", sinks=sinks)
    assert handed_on == 1 and close(got, mlx_lm_attention(queries, keys, values, "causal", sinks=sinks))
    # A chunk over a thousand keys is taken, and so is a small chunk over a long context
    # (what the decode budget cuts a long prompt into) on the CPU device.
    assert attention.route_takes(1, HEADS, 256, 1024)
    queries, keys, values = inputs(16, attention.MIN_KEYS)
    assert attention._taken(queries, keys, values, None, "causal", None)


def test_a_speculative_step_of_a_few_rows_takes_the_route_and_agrees():
    """Eight rows each feeding a pending token and four drafts over a short context
    (a verify step of the batched engine's speculation): taken, with mlx-lm's output
    under the left-padding mask a batch cache makes."""
    batch, rows, keys = 8, 5, 400
    assert attention.route_takes(batch, HEADS, rows, keys)
    assert not attention.route_takes(batch, HEADS, 1, keys)  # a plain decode step
    assert not attention.route_takes(1, HEADS, 2, 16)  # too small to pay
    queries, k, v = inputs(rows, keys, batch=batch, seed=5)
    padding = mx.arange(batch)[:, None] * 7
    mask = (mx.arange(keys)[None, :] >= padding)[:, None, None, :] & mx.tril(
        mx.ones((rows, keys), dtype=mx.bool_), k=keys - rows)[None, None]
    got, handed_on = ours(queries, k, v, mask)
    assert handed_on == 0
    assert close(got, mlx_lm_attention(queries, k, v, mask))


def test_the_peak_memory_is_mlx_lms(every_call):
    """The estimator assumes mlx's fallback: the score matrix materialized, then the
    output. In place, this route allocates the same (NumPy's temporaries are a row's
    maximum and sum)."""
    queries, keys, values = inputs(ROWS, 1024 + ROWS, seed=11)
    mx.eval(queries, keys, values)
    peaks = {}
    for name, function in (("mlx-lm", lambda: mlx_lm_attention(queries, keys, values, "causal")),
                           ("ours", lambda: ours(queries, keys, values, "causal")[0])):
        mx.synchronize()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        mx.eval(function())
        peaks[name] = mx.get_peak_memory() - before
    scores = HEADS * ROWS * (1024 + ROWS) * 4
    assert peaks["ours"] <= peaks["mlx-lm"]
    assert peaks["ours"] >= scores  # the scores are materialized, as the estimator counts


def test_softmax_over_threads_equals_one_thread():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(3, 3, 300, 700)).astype(np.float32) * 8
    one, split = scores.copy(), scores.copy()
    softmax_in_place(one, cores=1)
    softmax_in_place(split, cores=4)
    assert np.array_equal(one, split)
    expected = np.exp(scores - scores.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    assert np.allclose(one, expected, rtol=1e-5, atol=1e-7)


def test_a_model_with_recurrent_layers_is_left_to_mlx_lm(tiny_model_path):
    """qwen3_next's linear-attention layers: evaluating mid-forward would change which of
    their intermediates are alive together, which the memory estimate does not model."""
    model, _ = load_model(tiny_model_path("qwen3_next"))
    assert install_cpu_attention(model) == []
    assert not routed_modules(model, "scaled_dot_product_attention", "_omlx_cpu_attention")


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_installed_at_load_and_greedy_outputs_unchanged(family, tiny_model_path, monkeypatch):
    """Every family that calls mlx-lm's shared function takes the route at load; chunked
    prefill then greedy decoding give mlx-lm's logits and tokens."""
    monkeypatch.setattr(attention, "MIN_SCORES", 0)  # tiny models' calls are far below it
    monkeypatch.setattr(attention, "MIN_KEYS", 0)
    model, _ = load_model(tiny_model_path(family))
    routed = routed_modules(model, "scaled_dot_product_attention", "_omlx_cpu_attention")
    assert routed, f"{family}: no module routed"
    prompt = mx.random.randint(0, 200, (1, 90), key=mx.random.key(5))

    ours_logits, ours_tokens = greedy_after_chunked_prefill(model, prompt)
    for name in routed:
        monkeypatch.setattr(sys.modules[name], "scaled_dot_product_attention",
                            base.scaled_dot_product_attention)
    theirs_logits, theirs_tokens = greedy_after_chunked_prefill(model, prompt)
    assert ours_tokens == theirs_tokens
    assert mx.allclose(ours_logits, theirs_logits, rtol=1e-4, atol=1e-4).item()
    assert install_cpu_attention(model) == install_cpu_attention(model)


def test_the_softmax_threads_all_start_at_load(tiny_model_path, monkeypatch):
    """A thread started at a server's first long prompt reads as growth to a soak that
    counted the threads after its warm-up (it did, 101 -> 102): every helper thread is up
    once the model is loaded."""
    monkeypatch.setattr(attention, "_pool", None)
    monkeypatch.setattr(attention, "available_cores", lambda: 4)
    before = set(threading.enumerate())
    model, _ = load_model(tiny_model_path("llama"))
    assert routed_modules(model, "scaled_dot_product_attention", "_omlx_cpu_attention")
    started = [t for t in set(threading.enumerate()) - before if t.name.startswith("omlx-softmax")]
    try:
        assert len(started) == 3
        softmax_in_place(np.ones((4, 64 * 4, 8), np.float32))
        assert not [t for t in set(threading.enumerate()) - before
                    if t.name.startswith("omlx-softmax") and t not in started]
    finally:
        attention._pool.shutdown()
