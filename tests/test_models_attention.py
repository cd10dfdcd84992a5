"""Row-block attention on the CPU backend gives mlx-lm's attention: per call, per model, greedily."""

from __future__ import annotations

import sys

import mlx.core as mx
import pytest
from mlx_lm.models import base
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import make_prompt_cache

from omlx_core.models import attention
from omlx_core.models.attention import (
    MAX_ROW_BLOCKS,
    MIN_BLOCK_ROWS,
    install_cpu_attention,
    row_block_attention,
    row_blocks,
)
from omlx_core.models.loader import load_model

ROWS, HEADS, KV_HEADS, HEAD_DIM = 256, 9, 3, 64  # one prefill chunk of the default model


def inputs(rows: int, keys: int, batch: int = 1, seed: int = 0):
    q_key, k_key, v_key = mx.random.split(mx.random.key(seed), 3)
    # Queries come out of the projection as (B, L, H, D) and are transposed, as in mlx-lm.
    queries = mx.random.normal((batch, rows, HEADS, HEAD_DIM), key=q_key).transpose(0, 2, 1, 3)
    keys_ = mx.random.normal((batch, KV_HEADS, keys, HEAD_DIM), key=k_key)
    values = mx.random.normal((batch, KV_HEADS, keys, HEAD_DIM), key=v_key)
    return queries, keys_, values


def mlx_lm_attention(queries, keys, values, mask, cache=None):
    return base.scaled_dot_product_attention(queries, keys, values, cache=cache,
                                             scale=HEAD_DIM**-0.5, mask=mask)


def blocked_attention(queries, keys, values, mask, cache=None, cores=2):
    return row_block_attention(queries, keys, values, cache, HEAD_DIM**-0.5, mask,
                               fallback=base.scaled_dot_product_attention, cores=cores)


@pytest.fixture
def split_small_calls(monkeypatch):
    """Split every call with enough rows, however small: tiny models' calls are far below the threshold."""
    monkeypatch.setattr(attention, "MIN_SPLIT_SCORES", 0)
    monkeypatch.setattr(attention, "available_cores", lambda: 4)


def test_row_blocks_cover_the_rows_once_and_only_split_calls_that_pay():
    assert row_blocks(ROWS, HEADS, 4096, cores=2) == [(0, 128), (128, 256)]
    for cores in (3, 4, 16):
        blocks = row_blocks(ROWS, HEADS, 4096, cores=cores)
        assert len(blocks) == min(cores, MAX_ROW_BLOCKS)
        assert blocks[0][0] == 0 and blocks[-1][1] == ROWS
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        assert all(stop - start >= MIN_BLOCK_ROWS for start, stop in blocks)
    assert row_blocks(ROWS, HEADS, 4096, cores=1) == [(0, ROWS)]
    assert row_blocks(1, HEADS, 4096, cores=4) == [(0, 1)]  # a decode step
    assert row_blocks(ROWS, HEADS, 256, cores=4) == [(0, ROWS)]  # too small to pay
    assert row_blocks(2 * MIN_BLOCK_ROWS - 1, 64, 4096, cores=4) == [(0, 2 * MIN_BLOCK_ROWS - 1)]


@pytest.mark.parametrize("offset", [0, 256, 3840])
@pytest.mark.parametrize("cores", [2, 4])
def test_a_split_causal_call_equals_mlx_lm_attention(offset, cores, split_small_calls):
    keys_total = offset + ROWS
    queries, keys, values = inputs(ROWS, keys_total, seed=offset)
    assert len(row_blocks(ROWS, HEADS, keys_total, cores=cores)) == cores
    expected = mlx_lm_attention(queries, keys, values, "causal")
    got = blocked_attention(queries, keys, values, "causal", cores=cores)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert mx.allclose(got, expected, rtol=1e-5, atol=1e-6).item()


# (heads, kv_heads, head_dim, rows, offset): the default model's chunk at 3.8k and 1k
# context, wide heads, a thin chunk; the split runs only where its peak stays at or below
# mlx-lm's, and the others must fall back.
PEAK_SHAPES = [(9, 3, 64, 256, 3840), (9, 3, 64, 256, 1024), (16, 8, 128, 256, 1024),
               (16, 8, 128, 512, 1536), (9, 3, 64, 64, 2000)]


@pytest.mark.parametrize("heads, kv_heads, head_dim, rows, offset", PEAK_SHAPES)
@pytest.mark.parametrize("cores", [2, 4])
def test_the_split_never_raises_the_peak_memory(heads, kv_heads, head_dim, rows, offset, cores):
    keys_total = offset + rows
    q_key, k_key, v_key = mx.random.split(mx.random.key(rows + offset), 3)
    queries = mx.random.normal((1, rows, heads, head_dim), key=q_key).transpose(0, 2, 1, 3)
    keys = mx.random.normal((1, kv_heads, keys_total, head_dim), key=k_key)
    values = mx.random.normal((1, kv_heads, keys_total, head_dim), key=v_key)
    mx.eval(queries, keys, values)

    def peak(attend) -> int:
        # The same call's peak varies by a few KiB (small temporaries): take the highest.
        peaks = []
        for _ in range(3):
            mx.synchronize()
            mx.reset_peak_memory()
            resident = mx.get_active_memory()
            mx.eval(attend(queries, keys, values, None, head_dim**-0.5, "causal"))
            peaks.append(mx.get_peak_memory() - resident)
        return max(peaks)

    def blocked(*args):
        return row_block_attention(*args, fallback=base.scaled_dot_product_attention, cores=cores)

    assert peak(blocked) <= peak(base.scaled_dot_product_attention)


def test_calls_it_does_not_split_go_to_mlx_lm_unchanged():
    calls = []

    def fallback(queries, keys, values, cache, scale, mask, sinks=None):
        calls.append((queries.shape, mask if isinstance(mask, str) else type(mask), sinks))
        return base.scaled_dot_product_attention(queries, keys, values, cache=cache,
                                                 scale=scale, mask=mask, sinks=sinks)

    class QuantizedCache:
        bits = 8

    quantized = (mx.zeros((1, KV_HEADS, 4096, HEAD_DIM // 4), dtype=mx.uint32),) * 3

    queries, keys, values = inputs(ROWS, 4096)
    sinks = mx.zeros((HEADS,))
    array_mask = create_causal_mask(ROWS, 4096 - ROWS)
    row_block_attention(queries[:, :, :1], keys, values, None, 0.125, None, fallback=fallback, cores=4)
    row_block_attention(queries, keys, values, None, 0.125, "causal", sinks, fallback=fallback, cores=4)
    row_block_attention(queries, quantized, quantized, QuantizedCache(), 0.125, "causal",
                        fallback=lambda *a, **k: calls.append("quantized"), cores=4)
    row_block_attention(queries, keys, values, None, 0.125, "causal", fallback=fallback, cores=1)
    row_block_attention(queries, keys, values, None, 0.125, array_mask, fallback=fallback, cores=4)
    row_block_attention(queries, keys, values, None, 0.125, None, fallback=fallback, cores=4)
    # 64 rows in 2 blocks leave out too few keys to pay for joining 64-wide outputs.
    row_block_attention(queries[:, :, :64], keys, values, None, 0.125, "causal",
                        fallback=fallback, cores=2)
    assert calls == [
        ((1, HEADS, 1, HEAD_DIM), type(None), None),
        ((1, HEADS, ROWS, HEAD_DIM), "causal", sinks),
        "quantized",
        ((1, HEADS, ROWS, HEAD_DIM), "causal", None),
        ((1, HEADS, ROWS, HEAD_DIM), mx.array, None),
        ((1, HEADS, ROWS, HEAD_DIM), type(None), None),
        ((1, HEADS, 64, HEAD_DIM), "causal", None),
    ]


def mlx_lm_route(monkeypatch, modules):
    for name in modules:
        monkeypatch.setattr(sys.modules[name], "scaled_dot_product_attention",
                            base.scaled_dot_product_attention)


def prefill_and_decode(model, prompt: list[int], chunk: int, new_tokens: int):
    """Every chunk's logits and the greedy continuation, as a chunked prefill then decoding."""
    cache = make_prompt_cache(model)
    chunk_logits = []
    for start in range(0, len(prompt), chunk):
        logits = model(mx.array([prompt[start:start + chunk]]), cache=cache)
        mx.eval(logits)
        chunk_logits.append(logits)
    tokens = []
    token = mx.argmax(chunk_logits[-1][:, -1], axis=-1)
    for _ in range(new_tokens):
        tokens.append(token.item())
        token = mx.argmax(model(token[:, None], cache=cache)[:, -1], axis=-1)
    return chunk_logits, tokens


def assert_same_as_mlx_lm(model, modules, monkeypatch, prompt, chunk, new_tokens, atol):
    logits, tokens = prefill_and_decode(model, prompt, chunk, new_tokens)
    with monkeypatch.context() as patch:
        mlx_lm_route(patch, modules)
        expected_logits, expected_tokens = prefill_and_decode(model, prompt, chunk, new_tokens)
    for got, expected in zip(logits, expected_logits):
        assert mx.allclose(got, expected, rtol=1e-4, atol=atol).item(), mx.abs(got - expected).max()
    assert tokens == expected_tokens


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "qwen3_next"])
def test_tiny_models_prefill_and_decode_as_with_mlx_lm_attention(family, tiny_model_path,
                                                                 split_small_calls, monkeypatch):
    model, _tokenizer = load_model(tiny_model_path(family))
    modules = install_cpu_attention(model)
    assert modules, f"no {family} module calls mlx-lm's scaled_dot_product_attention"
    assert all(getattr(sys.modules[name].scaled_dot_product_attention,
                       "_omlx_row_block_attention", False) for name in modules)
    # 128-row chunks split in 4 blocks, the last 44-token chunk in one; gemma3's local
    # layers attend through array masks (16-token window), which are never split.
    prompt = mx.random.randint(3, 200, (300,), key=mx.random.key(1)).tolist()
    assert_same_as_mlx_lm(model, modules, monkeypatch, prompt, chunk=128, new_tokens=12, atol=1e-4)


def test_installing_twice_wraps_once(tiny_model_path):
    model, _tokenizer = load_model(tiny_model_path("llama"))
    module = sys.modules[install_cpu_attention(model)[0]]
    installed = module.scaled_dot_product_attention
    assert install_cpu_attention(model) == [module.__name__]
    assert module.scaled_dot_product_attention is installed


@pytest.mark.slow
def test_default_model_prefill_and_greedy_tokens_as_with_mlx_lm_attention(default_model_dir,
                                                                          monkeypatch):
    monkeypatch.setattr(attention, "available_cores", lambda: 2)
    model, tokenizer = load_model(default_model_dir)
    modules = install_cpu_attention(model)
    text = ("The history of the printing press begins in the fifteenth century. " * 60)
    prompt = tokenizer.encode(text)[:700]
    assert len(prompt) == 700
    # Chunks of 256 at offsets 256 and 512 are big enough to split on two cores.
    assert len(row_blocks(256, 9, 512)) == 2
    assert_same_as_mlx_lm(model, modules, monkeypatch, prompt, chunk=256, new_tokens=16, atol=1e-3)


def greedy_engine_outputs(path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of the batched engine for ``prompts`` submitted together (their
    prefill batched into one forward with array masks, on the MLX thread's streams)."""
    from omlx_core.config import load_config
    from omlx_core.engine import GenerationRequest, SamplingParams
    from omlx_core.mlx_thread import mlx_thread
    from omlx_core.models.registry import spec_for_path
    from omlx_core.plugins.batched import BatchedEngine
    from omlx_core.testing.host import make_test_host

    settings = {"plugin.batched.prefill_step_size": 128, "plugin.batched.block_size": 16}
    config = load_config("base", overrides=[(k, str(v), "test") for k, v in settings.items()], env={})
    spec = spec_for_path(path)
    engine = BatchedEngine(spec, make_test_host(config, model_id=spec.id))
    engine.start()
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=10)
        handles = mlx_thread().run(lambda: [
            engine.submit(GenerationRequest(f"attention-{index}", prompt, greedy))
            for index, prompt in enumerate(prompts)])
        return [[token for output in handle for token in output.token_ids] for handle in handles]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_batched_engine_generates_as_with_mlx_lm_attention(family, tiny_model_path,
                                                              split_small_calls, monkeypatch):
    path = tiny_model_path(family)
    key = mx.random.key(2)
    prompts = [mx.random.randint(3, 200, (length,), key=k).tolist()
               for length, k in zip((300, 140, 90), mx.random.split(key, 3))]
    blocked = greedy_engine_outputs(path, prompts)
    with monkeypatch.context() as patch:
        model, _tokenizer = load_model(path)
        mlx_lm_route(patch, install_cpu_attention(model))
        patch.setattr(attention, "install_cpu_attention", lambda model: [])
        expected = greedy_engine_outputs(path, prompts)
    assert all(len(tokens) == 10 for tokens in expected)
    assert blocked == expected
