"""A quantized KV cache end to end: the batch cache, the scheduler's greedy tokens, the
prefix cache's blocks, the SSD tier's files, the estimate, and the bad settings.

The reference for tokens is a plain loop over a request's own quantized cache
(``RotatedQuantizedKVCache``: mlx-lm's ``QuantizedKVCache`` fed rotated rows; the prompt
but its last token in one forward, then one token at a time), which is what the engine's
first prefill chunk, first-token forward and decode lane compute. The rotation itself is
checked against attention over the dequantized rows rotated back, on every path that
reads a quantized cache.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import QuantizedKVCache

from omlx_core.models.attention import cpu_attention, install_kv_rotation
from omlx_core.models.kv_rotation import rotate, rotated_attention
from omlx_core.engine import SamplingParams
from omlx_core.mlx_thread import mlx_thread
from omlx_core.models.loader import load_model
from omlx_core.models.registry import ModelError, spec_for_path
from omlx_core.scheduling import BatchedEngine
from omlx_core.scheduling.kv_cache import (
    BatchQuantizedKVCache,
    KVFormat,
    RotatedQuantizedKVCache,
    make_request_cache,
    merge_layers,
    position_bytes,
)
from omlx_core.testing.host import make_test_host
from omlx_core.testing.models import build_model, routed_modules

from tests.test_batched_engine import collect, make_config, prompt_of, submit, wait_idle

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
#: mlx quantizes in groups of 32, 64 or 128 elements: the tiny models' 16-wide heads
#: cannot be, so these tests build them with 64-wide heads
HEADS = {"head_dim": 64}


@pytest.fixture(scope="module")
def quantizable(tmp_path_factory):
    built: dict[str, Path] = {}

    def path(family: str) -> Path:
        if family not in built:
            built[family] = build_model(family, tmp_path_factory.mktemp(family), overrides=HEADS)
        return built[family]

    return path


def reference_greedy(model: Any, prompt: list[int], count: int, kv_format: KVFormat) -> list[int]:
    """Greedy tokens over a request's own quantized cache, one row, no batching."""
    cache = make_request_cache(model, kv_format)
    if len(prompt) > 1:
        mx.eval(model(mx.array(prompt[:-1])[None], cache=cache))
    token, tokens = prompt[-1], []
    for _ in range(count):
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
        token = int(mx.argmax(logits, axis=-1).item())
        tokens.append(token)
    return tokens


def start(path: Path, **overrides: Any) -> BatchedEngine:
    engine = BatchedEngine(spec_for_path(path), make_test_host(make_config(**overrides)))
    engine.start()
    return engine


@pytest.mark.parametrize("bits", [8, 4])
def test_the_batch_cache_holds_each_rows_own_quantized_kv(bits):
    """Merging, growing, filtering and extending rows keeps each row's values: a row
    extracted from the batch equals the cache it came from, its padding dropped."""
    def run() -> list[bool]:
        fmt = KVFormat(bits=bits, group_size=32)
        rows = []
        for length in (5, 12, 3):
            cache = RotatedQuantizedKVCache(group_size=fmt.group_size, bits=bits)
            keys = mx.random.normal((1, 2, length, 64), key=mx.random.key(length))
            cache.update_and_fetch(keys, keys * 2)
            rows.append(cache)
        batch = BatchQuantizedKVCache.merge(rows[:2])
        batch.extend(BatchQuantizedKVCache.merge(rows[2:]))
        new = mx.random.normal((3, 2, 1, 64), key=mx.random.key(9))
        batch.update_and_fetch(new, new * 2)
        batch.filter([0, 2])
        same = []
        for index, original in zip((0, 1), (rows[0], rows[2])):
            extracted = batch.extract(index)
            length = original.offset
            assert extracted.offset == length + 1
            for mine, theirs in zip((*extracted.keys, *extracted.values), (*original.keys, *original.values)):
                same.append(bool(mx.array_equal(mine[..., :length, :], theirs[..., :length, :]).item()))
        return same

    assert all(mlx_thread().run(run))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "qwen3_next"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_gives_the_tokens_of_a_requests_own_cache(quantizable, family, bits):
    """Rows of different lengths decoding together (left padding, masked) give each row
    the tokens it gets alone over its own quantized cache."""
    path = quantizable(family)
    # 4-bit keys sit in tiles of 64 tokens, and a prefix-cache block holds whole tiles.
    engine = start(path, **{"engine.kv_bits": bits, "plugin.batched.prefill_step_size": 256,
                            **({"plugin.batched.block_size": 64} if bits == 4 else {})})
    try:
        prompts = [prompt_of(engine, words, salt) for words, salt in ((3, 1), (11, 2), (25, 3))]
        handles = [submit(engine, prompt, GREEDY) for prompt in prompts]
        outputs = [collect(handle).token_ids for handle in handles]
        fmt = engine.kv_format
        references = mlx_thread().run(lambda: [
            reference_greedy(load_model(path)[0], prompt, GREEDY.max_tokens, fmt) for prompt in prompts])
        stats = engine.stats()
    finally:
        engine.shutdown()
    for output, reference in zip(outputs, references):
        assert output == reference[:len(output)]
        assert len(output) == GREEDY.max_tokens or reference[len(output)] in (0, 1, 2)
    assert stats["kv_cache"].startswith(engine.kv_format.describe())
    assert ("keys per channel" in stats["kv_cache"]) == (bits == 4)


def _outlier_rows(shape: tuple[int, ...], seed: int) -> mx.array:
    """Rows like a model's keys: most channels small, a few large and offset."""
    rows = mx.random.normal(shape, key=mx.random.key(seed))
    return rows + mx.zeros((shape[-1],)).at[mx.array([3, 40])].add(mx.array([12.0, -8.0]))


def _unrotated(triple: tuple[mx.array, ...], fmt: KVFormat) -> mx.array:
    """Stored rows dequantized and rotated back: the KV the rotated attention reads."""
    rows = mx.dequantize(*triple, group_size=fmt.group_size, bits=fmt.bits)
    return rotate(rows)


def _mlx_lm_attention(queries, keys, values, cache, scale, mask, sinks=None):
    return base.scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)


@pytest.mark.parametrize("path", ["decode kernel", "prefill chunk", "mlx-lm"])
@pytest.mark.parametrize("bits", [8, 4])
def test_attention_over_a_rotated_cache_is_attention_over_its_kv_rotated_back(path, bits):
    """Queries rotated in and the output rotated back (exact in real arithmetic): every
    path that reads a quantized cache (the CPU kernels' decode attention, a chunk's
    dequantize-then-attend, mlx-lm's quantized attention) gives mlx's float attention
    over the stored rows dequantized and rotated back, grouped heads included."""
    fmt = KVFormat(bits=bits, group_size=32)

    def run() -> tuple[tuple[int, ...], tuple[int, ...], float]:
        cache = RotatedQuantizedKVCache(group_size=fmt.group_size, bits=bits)
        keys, values = _outlier_rows((2, 2, 40, 64), 1), mx.random.normal((2, 2, 40, 64), key=mx.random.key(2))
        stored_keys, stored_values = cache.update_and_fetch(keys, values)
        rows = 1 if path == "decode kernel" else 7
        queries = mx.random.normal((2, 4, rows, 64), key=mx.random.key(3))
        mask = None if rows == 1 else "causal"
        attend = _mlx_lm_attention if path == "mlx-lm" else partial(cpu_attention, fallback=_mlx_lm_attention)
        ours = rotated_attention(attend, queries, stored_keys, stored_values, cache, 0.125, mask)
        reference = mx.fast.scaled_dot_product_attention(
            queries, _unrotated(stored_keys, fmt), _unrotated(stored_values, fmt), scale=0.125, mask=mask)
        return ours.shape, reference.shape, mx.max(mx.abs(ours - reference)).item()

    shape, expected_shape, difference = mlx_thread().run(run)
    assert shape == expected_shape
    assert difference < 1e-4


@pytest.mark.parametrize("bits", [8, 4])
def test_rotation_spreads_a_rows_large_channels_before_quantizing(bits):
    """What the rotation is for: rows with a few large channels (as keys have) come back
    from 4-bit storage with a fraction of the error unrotated storage leaves."""
    fmt = KVFormat(bits=bits, group_size=64)

    def errors() -> tuple[float, float]:
        rows = _outlier_rows((1, 2, 256, 64), 4)
        plain = mx.dequantize(*mx.quantize(rows, group_size=64, bits=bits), group_size=64, bits=bits)
        cache = RotatedQuantizedKVCache(group_size=64, bits=bits)
        stored, _ = cache.update_and_fetch(rows, rows)
        return (mx.sqrt(mx.mean((plain - rows) ** 2)).item(),
                mx.sqrt(mx.mean((_unrotated(stored, fmt) - rows) ** 2)).item())

    plain, rotated = mlx_thread().run(errors)
    assert rotated < 0.5 * plain, (plain, rotated)


def test_models_the_cpu_route_leaves_to_mlx_lm_read_rotated_caches_too(tiny_model_path):
    """qwen3_next (recurrent layers) keeps mlx-lm's attention, wrapped to rotate; llama's
    CPU route reads rotated caches itself."""
    hybrid, _ = load_model(tiny_model_path("qwen3_next"))
    dense, _ = load_model(tiny_model_path("llama"))
    assert routed_modules(hybrid, "scaled_dot_product_attention", "_omlx_kv_rotation")
    assert not routed_modules(dense, "scaled_dot_product_attention", "_omlx_kv_rotation")
    assert install_kv_rotation(hybrid) == install_kv_rotation(hybrid)


def test_a_model_whose_attention_skips_the_rotation_is_refused_at_start(quantizable, monkeypatch):
    """A layer that computes attention some other way than through the routed function
    would read rotated keys with unrotated queries: the start-up check counts the
    layers that read their cache rotated and refuses the format, naming it."""
    from omlx_core.scheduling.kv_cache import check_kv_format

    def check() -> None:
        model, _ = load_model(quantizable("llama"))
        check_kv_format(model, KVFormat(bits=8), "plain")  # routed: every layer counted
        for name in routed_modules(model, "scaled_dot_product_attention", "_omlx_cpu_attention"):
            monkeypatch.setattr(sys.modules[name], "scaled_dot_product_attention",
                                base.scaled_dot_product_attention)
        check_kv_format(model, KVFormat(bits=8), "unrouted")

    with pytest.raises(ValueError, match=r"'unrouted' cannot be served with kv_bits=8: 2 of its 2 "
                                         r"quantized attention layers .*allowed for it: kv_bits=0"):
        mlx_thread().run(check)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_prefix_is_restored_as_stored(quantizable, bits):
    """Blocks are kept quantized (six arrays a layer; at 4 bits whole tiles of keys per
    channel, the tail's keys in float) and restored without quantizing again: a prefix
    hit gives the same tokens as the first time."""
    tiles = {"plugin.batched.block_size": 64} if bits == 4 else {}
    engine = start(quantizable("llama"), **{"engine.kv_bits": bits, **tiles})
    try:
        prompt = prompt_of(engine, 90 if tiles else 40, 7)
        first = collect(submit(engine, prompt, GREEDY))
        wait_idle(engine)
        cache = engine.prefix_cache
        blocks = mlx_thread().run(lambda: [cache.get(h) for h in cache.hashes(prompt[:-1])])
        again = collect(submit(engine, prompt, GREEDY))
    finally:
        engine.shutdown()
    held = [block for block in blocks if block is not None]
    assert held and all(len(parts) == 6 for block in held for parts in block.kv if parts is not None)
    assert again.usage.cached_tokens > 0
    assert again.token_ids == first.token_ids


@pytest.mark.parametrize("tiled", [False, True])
def test_a_quantized_block_survives_the_ssd_tier(tmp_path, tiled):
    """Six arrays a layer, per-row groups or a tile of keys per channel alike."""
    from omlx_core.plugins.ssd_cache.blockfile import kv_of, payload_of_kv, read_arrays, write_payload
    from omlx_core.scheduling.kv_tiles import TiledKVCache

    def roundtrip() -> bool:
        size = 64 if tiled else 8
        keys = mx.random.normal((1, 2, size, 64), key=mx.random.key(1))
        if tiled:
            cache = TiledKVCache(64, 4)
            cache.update_and_fetch(keys, -keys)
            kv = (tuple(mx.array(a) for a in cache.cut(0, size)), None)
        else:
            cache = RotatedQuantizedKVCache(group_size=64, bits=4)
            cache.update_and_fetch(keys, -keys)
            kv = (tuple(mx.array(a[..., :size, :]) for a in (*cache.keys, *cache.values)), None)
        payload = payload_of_kv(kv, block_hash=b"h" * 16, parent_hash=b"p" * 16, index=0,
                                block_size=size, identity="m", layer_types=["QuantizedKVCache", "uncut"])
        write_payload(payload.to_host(), tmp_path / "block.safetensors")
        _, arrays = read_arrays(tmp_path / "block.safetensors")
        (back, missing) = kv_of(arrays, 2)
        return missing is None and all(mx.array_equal(a, b).item() for a, b in zip(back, kv[0]))

    assert mlx_thread().run(roundtrip)


def test_the_estimate_counts_quantized_kv_exactly(quantizable):
    """The estimator's KV per token is the bytes a quantized cache holds per token
    (packed values, scales and biases), and a quantized prefill's measured peak stays
    under its estimate."""
    from omlx_core.memory.types import PeakQuery
    from omlx_core.plugins.estimator import estimate_peak

    path = quantizable("llama")

    def measure(bits: int) -> tuple[int, int, int, int]:
        model, _ = load_model(path)
        cache = make_request_cache(model, KVFormat(bits=bits))
        prompt = mx.array(list(range(3, 200)))[None]
        mx.eval(model.parameters())
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        # What the engine's prefill evaluates: the cache, not the logits.
        model(prompt, cache=cache)
        mx.eval([layer.state for layer in cache])
        peak = mx.get_peak_memory() - base
        query = PeakQuery(model_config=spec_for_path(path).config, new_tokens=197, chunk_size=512,
                          kv_bits=bits, kv_group_size=64, first_token=False)
        estimate = estimate_peak(query)
        # Bytes per KV position over every layer, from the buffers the prefill filled.
        return position_bytes(cache), estimate.kv_bytes_per_token, peak, estimate.total

    for bits in (8, 4):
        measured, estimated, peak, total = mlx_thread().run(lambda: measure(bits))
        assert estimated == measured
        assert peak <= total


def test_kv_bits_on_a_model_without_plain_attention_is_refused_at_start(tmp_path):
    path = build_model("gemma3", tmp_path / "sliding", overrides={"sliding_window_pattern": 100})
    with pytest.raises(ModelError, match=r"kv_bits=8 .*allowed for it: kv_bits=0") as error:
        start(path, **{"engine.kv_bits": 8})
    assert "'sliding'" in str(error.value) or path.name in str(error.value)


def test_heads_narrower_than_a_group_are_refused_at_start(tiny_model_path):
    """The tiny models' heads are 16 wide; mlx quantizes groups of 32 at least."""
    with pytest.raises(ModelError, match=r"cannot be served with kv_bits=4, kv_group_size=32: .*"
                                         r"divisible by the quantization group size 32"):
        start(tiny_model_path("llama"), **{"engine.kv_bits": 4, "engine.kv_group_size": 32,
                                           "plugin.batched.block_size": 64})


@pytest.mark.parametrize("value", ["3", "16", "-8"])
def test_kv_bits_outside_what_is_offered_is_a_config_error(value):
    from omlx_core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"engine.kv_bits: {value} KV bits are not offered; use one of 0, 8, 4"):
        load_config("base", overrides=[("engine.kv_bits", value, "cli --kv-bits")], env={})


def test_the_batch_merge_of_plain_rows_stays_mlx_lms(quantizable):
    """Full-precision rows merge into mlx-lm's own BatchKVCache (quantized ones into ours)."""
    def kinds() -> tuple[str, str]:
        model, _ = load_model(quantizable("llama"))
        plain = make_request_cache(model)
        quantized = make_request_cache(model, KVFormat(bits=8))
        return type(merge_layers([plain])[0]).__name__, type(merge_layers([quantized])[0]).__name__

    assert mlx_thread().run(kinds) == ("BatchKVCache", "BatchQuantizedKVCache")
