"""A request starting from KV only the SSD tier holds: the memory the blocks take is asked
for before they are read, and a block read back is held once (docs/reliability.md,
"Peak RSS under the ceiling")."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omlx_core.config import load_config
from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.memory.forward_gate import PrefillForwardGate
from omlx_core.memory.types import CeilingBreakdown, LimitSnapshot
from omlx_core.memory.usage import MemoryUsage
from omlx_core.mlx_thread import mlx_thread
from omlx_core.models.registry import spec_for_path
from omlx_core.plugins.batched import BatchedEngine
from omlx_core.scheduling.cache_layout import CacheLayout
from omlx_core.scheduling.prefix_cache import PrefixCache
from omlx_core.scheduling.prefix_restore import PrefixRestorer
from omlx_core.plugins.estimator import estimate_peak
from omlx_core.plugins.ssd_cache.store import PagedSSDStore
from omlx_core.testing.host import make_test_host

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def tokens_of(count: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + salt) % 200 + 10 for i in range(count)]


def mlx_in_use() -> MemoryUsage:
    """Current use as mlx counts it: what the forward gate compares with the limit here
    (the process's resident set would also count whatever else the test process does)."""
    return MemoryUsage(read_active=lambda: int(mx.get_active_memory()), read_footprint=lambda: 0)


def limits(hard: int) -> LimitSnapshot:
    return LimitSnapshot(hard_bytes=hard, breakdown=CeilingBreakdown(custom=hard, tier="custom"))


def _prefill(model, cache, tokens, step=64):
    for start in range(0, len(tokens), step):
        logits = model(mx.array(tokens[start:start + step])[None], cache=cache)
    mx.eval(logits)
    return logits[0, -1]


# -- the engine asks its forward gate before it reads ---------------------------------------------


@pytest.fixture
def warm_engine(tiny_model_path, tmp_path):
    """A batched engine whose SSD tier holds a 129-token prompt's 8 blocks, memory cold,
    and that prompt's greedy answer from a cold cache."""
    config = load_config("base", overrides=[("plugin.batched.block_size", str(BLOCK), "test"),
                                            ("plugin.batched.prefill_step_size", "64", "test")],
                         env={})
    engine = BatchedEngine(spec_for_path(tiny_model_path("llama")), make_test_host(config))
    engine.start()
    store = PagedSSDStore(tmp_path / "ssd", identity="b" * 32, budget=1 << 30)
    engine.prefix_cache.attach_lower(store)
    prompt = tokens_of(8 * BLOCK + 1)  # the part a request may reuse: 8 whole blocks
    outputs = list(engine.submit(GenerationRequest("cold", prompt, GREEDY)))
    assert store.flush(10) and store.stats()["saves_persisted"] >= 8
    mlx_thread().run(engine.prefix_cache.clear)
    try:
        yield engine, store, prompt, [t for o in outputs for t in o.token_ids]
    finally:
        engine.shutdown()
        store.close()


def guard(engine, hard: int) -> None:
    gate = PrefillForwardGate(estimate_peak, mlx_in_use(), 0, reclaim=engine.prefix_cache.release)
    engine.scheduler.set_forward_gate(gate)
    engine.scheduler.apply_memory_limits(limits(hard))


def test_no_block_is_read_from_the_ssd_tier_without_room_for_it(warm_engine):
    engine, store, prompt, _cold = warm_engine
    in_use = mlx_thread().run(mx.get_active_memory)
    # Room for a few KiB: less than one block of the eight, let alone the copy of them.
    guard(engine, in_use + 4096)
    loads = store.stats()["loads"]
    outputs = list(engine.submit(GenerationRequest("no-room", prompt, GREEDY)))
    assert store.stats()["loads"] == loads
    # It would prefill the prompt instead; the forward gate stops that before it runs.
    assert outputs[-1].finish_reason == "error" and outputs[-1].rejected is not None
    assert outputs[-1].rejected.rejection.stage == "forward"
    assert engine.prefix_cache.stats()["tokens_saved"] == 0


def test_with_room_every_block_is_read_once_and_the_answer_is_unchanged(warm_engine):
    engine, store, prompt, cold = warm_engine
    guard(engine, mlx_thread().run(mx.get_active_memory) + (1 << 30))
    loads = store.stats()["loads"]
    outputs = list(engine.submit(GenerationRequest("room", prompt, GREEDY)))
    assert outputs[-1].error is None and outputs[-1].usage.cached_tokens == 8 * BLOCK
    assert [t for o in outputs for t in o.token_ids] == cold
    assert store.stats()["loads"] == loads + 8


# -- the restore itself: no more than it asked for ------------------------------------------------


def test_a_restore_brings_in_no_more_than_the_room_it_was_given(tiny_model_path, tmp_path):
    """18 blocks only the SSD tier holds: with all the room they ask for, all are read, and
    mlx's peak stays within it (a block read back is copied into the request's cache and
    dropped, never held twice); with less, the longest prefix that fits is read and nothing
    else; with none, nothing."""
    from omlx_core.models.loader import load_model

    tokens = tokens_of(18 * BLOCK + 12, salt=5)

    def compute():
        model, _tokenizer = load_model(tiny_model_path("llama"))
        layout = CacheLayout(model)
        store = PagedSSDStore(tmp_path / "ssd", identity="c" * 32, budget=1 << 30)
        writer = PrefixCache(BLOCK, 1 << 30, "llama")
        writer.attach_lower(store)
        cache = layout.new_cache()
        _prefill(model, cache, tokens)
        hashes = writer.hashes(tokens)
        writer.insert([layout.make_block(h, hashes[i - 1] if i else writer.root, i, BLOCK,
                                         layout.cut(cache, BLOCK * i, BLOCK * (i + 1)), None)
                       for i, h in enumerate(hashes)])
        assert store.flush(10)
        del cache, writer
        fresh = PrefixCache(BLOCK, 1 << 30, "llama")  # a restarted server: memory cold
        fresh.attach_lower(store)
        restorer = PrefixRestorer(fresh, layout)
        results = []
        asked: list[int] = []
        for share in (None, 1, 0):  # all it asks for, one byte less, nothing
            def room(nbytes, share=share):
                asked.append(nbytes)
                return nbytes if share is None else nbytes - 1 if share else 0
            loads = store.stats()["loads"]
            mx.clear_cache()
            before = mx.get_active_memory()
            mx.reset_peak_memory()
            restored = restorer.start(hashes, tokens, room)
            peak = max(0, mx.get_peak_memory() - before)
            reused = restored.blocks * BLOCK
            # The restored prefix continues exactly like one prefilled from scratch.
            resumed = cold = None
            if reused:
                resumed = np.array(_prefill(model, restored.cache, tokens[reused:]))
                reference = layout.new_cache()
                _prefill(model, reference, tokens[:reused])
                cold = np.array(_prefill(model, reference, tokens[reused:]))
            results.append((restored.blocks, store.stats()["loads"] - loads, peak, resumed, cold))
            del restored
        store.close()
        return asked, results, fresh.nbytes

    asked, results, held = mlx_thread().run(compute)
    full, short, none = results
    assert asked[0] == asked[1] == asked[2] > 0
    blocks, loads, peak, resumed, cold = full
    assert (blocks, loads) == (18, 18) and peak <= asked[0]
    np.testing.assert_allclose(resumed, cold, rtol=1e-4, atol=1e-4)
    blocks, loads, peak, resumed, cold = short
    assert 0 < blocks < 18 and loads == blocks and peak <= asked[1] - 1
    np.testing.assert_allclose(resumed, cold, rtol=1e-4, atol=1e-4)
    blocks, loads, peak, _resumed, _cold = none
    assert (blocks, loads) == (0, 0) and peak == 0
    assert held == 0  # nothing read back was kept in memory as well


def test_a_restore_without_a_lower_tier_or_cache_reads_nothing(tiny_model_path):
    from omlx_core.models.loader import load_model

    def compute():
        model, _tokenizer = load_model(tiny_model_path("llama"))
        asked: list[int] = []
        restorer = PrefixRestorer(PrefixCache(BLOCK, 1 << 30, "llama"), CacheLayout(model))
        restored = restorer.start(restorer.prefix_cache.hashes(tokens_of(40)), tokens_of(40),
                                  lambda n: asked.append(n) or n)
        return restored.blocks, restored.tail_tokens, asked

    # Nothing cached: nothing to ask for, nothing restored.
    assert mlx_thread().run(compute) == (0, 0, [])


def test_the_ssd_store_describes_a_block_by_its_files(tmp_path):
    from tests.test_ssd_cache import make_block, make_store

    store = make_store(tmp_path)
    block = make_block(0, seed=40)
    assert store.describe(block.block_hash) is None
    store.put(block)
    assert store.flush(10)
    described = store.describe(block.block_hash)
    files = sum(p.stat().st_size for p in Path(store.blocks_dir).iterdir())
    assert described.nbytes == files >= block.nbytes and not described.has_boundary
    store.close()
    assert store.describe(block.block_hash) is None  # a closed store serves nothing
