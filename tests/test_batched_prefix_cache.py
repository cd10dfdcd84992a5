"""The in-memory prefix cache and the cutting and rebuilding of model caches."""

from __future__ import annotations

import ast
import gc
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omlx_core.kvblocks import BlockStore, StoredBlock
from omlx_core.scheduling.cache_layout import CacheLayout
from omlx_core.mlx_thread import mlx_thread
from omlx_core.scheduling.prefix_cache import (TAILS_PER_PREFIX, CachedBlock, CachedTail, PrefixCache,
                                                     chain_hashes, root_hash)
from omlx_core.testing.host import make_test_host

BLOCK = 4


def blocks_for(cache: PrefixCache, tokens: list[int], nbytes: int = 100,
               reusable: set[int] | None = None) -> list[CachedBlock]:
    hashes = cache.hashes(tokens)
    return [CachedBlock(h, hashes[i - 1] if i else cache.root, i, cache.block_size, (), None,
                        reusable_end=reusable is None or i in reusable, nbytes=nbytes)
            for i, h in enumerate(hashes)]


class DictStore(BlockStore):
    """A lower tier kept in a dict: the smallest real BlockStore."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, CachedBlock] = {}

    def get(self, block_hash: bytes) -> CachedBlock | None:
        return self.blocks.get(block_hash)

    def describe(self, block_hash: bytes) -> StoredBlock | None:
        block = self.blocks.get(block_hash)
        return None if block is None else StoredBlock(block.nbytes, block.boundary is not None)

    def put(self, block: CachedBlock) -> None:
        self.blocks[block.block_hash] = block


def test_chain_hashes_name_whole_prefixes():
    root = root_hash("model")
    a = chain_hashes(list(range(10)), BLOCK, root)
    b = chain_hashes(list(range(8)) + [99, 98, 97, 96], BLOCK, root)
    assert len(a) == 2  # the partial third block is not hashed
    assert a == b[:2]
    c = chain_hashes([0, 1, 2, 3, 9, 5, 6, 7], BLOCK, root)
    assert c[0] == a[0] and c[1] != a[1]
    # Same tokens after a different first block: a different prefix, a different hash.
    d = chain_hashes([7, 7, 7, 7, 4, 5, 6, 7], BLOCK, root)
    assert d[1] != a[1]
    assert chain_hashes(list(range(8)), BLOCK, root_hash("other")) != a


def test_lookup_reuses_longest_cached_prefix_and_counts():
    cache = PrefixCache(BLOCK, 10_000, "m")
    turn_one = list(range(12))
    cache.insert(blocks_for(cache, turn_one))
    turn_two = turn_one + [50, 51, 52, 53, 54]
    found = cache.lookup(cache.hashes(turn_two))
    assert [b.index for b in found] == [0, 1, 2]
    assert cache.lookup(cache.hashes([9, 9, 9, 9])) == []
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["tokens_saved"]) == (1, 1, 12)
    assert stats["blocks"] == 3 and stats["bytes"] == 300


def test_lookup_backs_off_to_last_block_with_a_boundary_state():
    cache = PrefixCache(BLOCK, 10_000, "m")
    tokens = list(range(16))
    cache.insert(blocks_for(cache, tokens, reusable={1}))
    found = cache.lookup(cache.hashes(tokens))
    assert [b.index for b in found] == [0, 1]
    assert cache.peek(cache.hashes(tokens)) == 2


def test_a_block_gains_its_boundary_state_later():
    cache = PrefixCache(BLOCK, 10_000, "m")
    tokens = list(range(8))
    cache.insert(blocks_for(cache, tokens, reusable=set()))
    assert cache.lookup(cache.hashes(tokens)) == []
    cache.insert(blocks_for(cache, tokens, reusable={1})[1:])
    assert len(cache.lookup(cache.hashes(tokens))) == 2


def test_lru_evicts_leaves_before_their_parents_under_the_byte_budget():
    cache = PrefixCache(BLOCK, 450, "m")
    chain_a = list(range(12))  # 3 blocks
    cache.insert(blocks_for(cache, chain_a))
    cache.touch(cache.hashes(chain_a))
    chain_b = [100 + t for t in range(8)]  # 2 blocks: 500 bytes in all, over budget
    cache.insert(blocks_for(cache, chain_b))
    cache.touch(cache.hashes(chain_b))
    assert cache.nbytes <= 450
    # A's deepest block went first; its first two blocks still form a usable prefix.
    assert [b.index for b in cache.lookup(cache.hashes(chain_a))] == [0, 1]
    assert cache.stats()["evictions"] == 1


def test_block_larger_than_budget_is_not_stored():
    cache = PrefixCache(BLOCK, 50, "m")
    cache.insert(blocks_for(cache, list(range(4)), nbytes=51))
    assert cache.stats()["blocks"] == 0


def test_zero_budget_turns_the_cache_off():
    cache = PrefixCache(BLOCK, 0, "m")
    cache.insert(blocks_for(cache, list(range(8))))
    assert not cache.enabled
    assert cache.lookup(cache.hashes(list(range(8)))) == []
    assert cache.stats()["misses"] == 0


def test_lower_tier_receives_every_block_and_serves_misses():
    cache = PrefixCache(BLOCK, 250, "m")
    store = DictStore()
    cache.attach_lower(store)
    tokens = list(range(12))
    cache.insert(blocks_for(cache, tokens))
    assert len(store.blocks) == 3  # written through, the one that did not fit included
    assert cache.stats()["evictions"] == 1
    # Peek counts memory only; lookup promotes the block back from the lower tier.
    assert cache.peek(cache.hashes(tokens)) == 2
    assert len(cache.lookup(cache.hashes(tokens))) == 3


def test_a_prefix_the_lower_tier_holds_counts_as_cached_for_the_estimate():
    """What a request would reuse (preflight and admission cost it by this) includes
    the blocks only the lower tier holds: they are read, not prefilled."""
    cache = PrefixCache(BLOCK, 250, "m")
    cache.attach_lower(DictStore())
    tokens = list(range(12))
    cache.insert(blocks_for(cache, tokens))
    assert cache.peek(cache.hashes(tokens)) == 2  # in memory
    assert cache.peek_prefix(cache.hashes(tokens), tokens) == 12
    assert cache.stats()["evictions"] == 1  # peeking promoted nothing


def _prefill(model, cache, tokens, step):
    for start in range(0, len(tokens), step):
        logits = model(mx.array(tokens[start:start + step])[None], cache=cache)
    return logits[0, -1]


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_next", "gpt_oss"])
def test_restored_cache_continues_exactly_like_the_original(tiny_model_path, family):
    from omlx_core.models.loader import load_model

    path = tiny_model_path(family)
    tokens = [(7 * i + 3) % 300 + 10 for i in range(40)]

    def compute():
        model, _tokenizer = load_model(path)
        layout = CacheLayout(model)
        cache = layout.new_cache()
        _prefill(model, cache, tokens[:32], 16)
        mx.eval([c.state for c in cache])
        prefix = PrefixCache(8, 1 << 30, family)
        hashes = prefix.hashes(tokens[:32])
        blocks = [layout.make_block(h, hashes[i - 1] if i else prefix.root, i, 8,
                                    layout.cut(cache, 8 * i, 8 * i + 8),
                                    layout.capture(cache) if i == 3 else None)
                  for i, h in enumerate(hashes)]
        restored = layout.restore(blocks)
        continued = _prefill(model, cache, tokens[32:], 16)
        resumed = _prefill(model, restored, tokens[32:], 16)
        return layout, blocks, np.array(continued), np.array(resumed)

    layout, blocks, continued, resumed = mlx_thread().run(compute)
    assert layout.needs_boundaries == (family != "llama")
    assert blocks[-1].reusable_end
    assert all(b.reusable_end for b in blocks) == (family == "llama")
    np.testing.assert_allclose(resumed, continued, rtol=1e-5, atol=1e-5)


#: mlx's allocator serves a request from a freed buffer smaller than twice its size and
#: than its size plus two pages (4 KiB on Linux x86-64)
ALLOCATOR_SLACK = 2 * 4096


def active_memory_settled() -> int:
    """mlx's active memory once unreferenced arrays are collected and the stream has
    caught up (its worker frees a buffer only after running what reads it)."""
    gc.collect()
    mx.synchronize()
    return mx.get_active_memory()


def test_a_block_holds_its_bytes_where_the_allocator_has_larger_buffers_free(tiny_model_path):
    """The budget counts a block's bytes. mlx's allocator hands an array a freed buffer up
    to twice its size: each of a block's per-layer arrays in such a buffer, the blocks held
    up to 28 % more (tiny models' conversations). Its arrays share one buffer instead,
    copied into it once."""
    from omlx_core.models.loader import load_model

    def compute():
        model, _tokenizer = load_model(tiny_model_path("llama"))
        layout = CacheLayout(model)
        cache = layout.new_cache()
        _prefill(model, cache, list(range(10, 74)), 16)
        mx.eval([c.state for c in cache])
        sizes = [layer.keys[..., :64, :].nbytes for layer in cache for _ in "kv"]
        mx.clear_cache()
        spare = [mx.zeros((n + n // 2,), mx.uint8) + 1 for n in sizes]
        mx.eval(spare)
        del spare  # each array's size and a half, free in mlx's buffer cache
        before = active_memory_settled()
        mx.reset_peak_memory()
        block = layout.make_block(b"b" * 16, b"r" * 16, 0, 64, layout.cut(cache, 0, 64), None)
        peak = mx.get_peak_memory() - before
        return active_memory_settled() - before, peak, block.nbytes, sum(sizes)

    held, peak, nbytes, counted = mlx_thread().run(compute)
    assert nbytes == counted
    assert nbytes <= held < nbytes + ALLOCATOR_SLACK
    # copied once, straight from the cache: no temporary copy beside the block
    assert peak < nbytes + ALLOCATOR_SLACK


def _tail(cache: PrefixCache, parent: bytes, tokens: list[int], nbytes: int = 10) -> CachedTail:
    return CachedTail(parent, tuple(tokens), (), nbytes)


def test_tail_lookup_finds_the_longest_shared_run_under_its_prefix():
    cache = PrefixCache(BLOCK, 10_000, "m")
    parent = cache.hashes(list(range(8)))[-1]
    cache.insert_tail(_tail(cache, parent, [1, 2, 3]))
    cache.insert_tail(_tail(cache, parent, [1, 5]))
    tail, shared = cache.lookup_tail(parent, [1, 2, 9, 9])
    assert tail.tokens == (1, 2, 3) and shared == 2
    assert cache.lookup_tail(parent, [7]) == (None, 0)
    assert cache.lookup_tail(cache.root, [1, 2]) == (None, 0)  # only under its own prefix
    stats = cache.stats()
    assert (stats["tails"], stats["tail_hits"], stats["tokens_saved"]) == (2, 1, 2)


def test_a_longer_tail_replaces_the_one_it_extends_and_tails_are_bounded():
    cache = PrefixCache(BLOCK, 10_000, "m")
    cache.insert_tail(_tail(cache, cache.root, [1, 2]))
    cache.insert_tail(_tail(cache, cache.root, [1, 2, 3]))
    cache.insert_tail(_tail(cache, cache.root, [1]))  # covered by the kept one: ignored
    assert cache.stats()["tails"] == 1 and cache.stats()["bytes"] == 10
    for first in range(10, 10 + TAILS_PER_PREFIX):
        cache.insert_tail(_tail(cache, cache.root, [first]))
    assert cache.stats()["tails"] == TAILS_PER_PREFIX
    assert cache.lookup_tail(cache.root, [1, 2, 3])[1] == 0  # the oldest went


def test_a_tail_goes_before_the_blocks_it_continues():
    cache = PrefixCache(BLOCK, 250, "m")
    tokens = list(range(8))
    cache.insert(blocks_for(cache, tokens))
    cache.insert_tail(_tail(cache, cache.hashes(tokens)[-1], [5, 6], nbytes=60))
    assert cache.stats()["tails"] == 0 and cache.stats()["blocks"] == 2


def test_blocks_and_tails_share_one_lru_order():
    cache = PrefixCache(BLOCK, 300, "m")
    old, new = list(range(8)), [100 + t for t in range(4)]
    cache.insert(blocks_for(cache, old))
    cache.insert(blocks_for(cache, new))
    parent = cache.hashes(new)[-1]
    # A full budget makes room for a new tail by evicting the least recently used entry,
    # the old chain's leaf, rather than dropping the tail at once.
    cache.insert_tail(_tail(cache, parent, [5, 6], nbytes=60))
    assert cache.lookup_tail(parent, [5, 6, 7])[1] == 2
    assert [b.index for b in cache.lookup(cache.hashes(old))] == [0]
    # Using a tail refreshes the chain above it too: its prefix outlives other blocks.
    cache.lookup_tail(parent, [5])
    cache.insert(blocks_for(cache, [200 + t for t in range(4)]))
    assert cache.lookup(cache.hashes(old)) == [] and cache.lookup_tail(parent, [5])[1] == 1
    assert cache.nbytes <= 300


def test_the_least_recently_used_tail_of_a_prefix_goes_first():
    cache = PrefixCache(BLOCK, 10_000, "m")
    for first in range(TAILS_PER_PREFIX):
        cache.insert_tail(_tail(cache, cache.root, [first]))
    assert cache.lookup_tail(cache.root, [0])[1] == 1  # the oldest tail, just used
    cache.insert_tail(_tail(cache, cache.root, [99]))
    assert cache.stats()["tails"] == TAILS_PER_PREFIX
    assert cache.peek_tail(cache.root, [0]) == 1 and cache.peek_tail(cache.root, [1]) == 0


def test_a_lower_tier_must_be_a_block_store():
    class Duck:
        def get(self, block_hash):
            return None

        def put(self, block):
            pass

    cache = PrefixCache(BLOCK, 1000, "m")
    with pytest.raises(TypeError, match="subclass omlx_core.kvblocks.BlockStore"):
        cache.attach_lower(Duck())
    assert cache.stats()["lower_tier"] is None


def test_a_tier_without_queue_or_counters_frees_and_reports_only_memory():
    cache = PrefixCache(BLOCK, 1000, "m")
    cache.attach_lower(DictStore())
    tokens = list(range(12))
    cache.insert(blocks_for(cache, tokens))
    assert cache.reclaimable_bytes() == cache.nbytes == 300
    assert "lower" not in cache.stats()
    assert cache.release(150) == 200 and cache.nbytes == 100
    # The tier offers no continuations, so a lookup past memory asks it block by block.
    assert [b.index for b in cache.lookup_prefix(cache.hashes(tokens), tokens)[0]] == [0, 1, 2]


def test_the_prefix_cache_never_probes_what_a_tier_has():
    """Every call on a lower tier is declared by omlx_core.kvblocks.BlockStore."""
    package = Path(__file__).resolve().parents[1] / "omlx_core" / "scheduling"
    offenders = [f"{path.name}:{node.lineno}: {node.func.id}(...)"
                 for path in (package / "prefix_cache.py", package / "block_lru.py",
                              package / "block_hashes.py")
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                 and node.func.id in ("getattr", "hasattr")]
    assert not offenders, "probing in the prefix cache:\n" + "\n".join(offenders)


def test_the_lower_tier_is_told_of_every_chain_stored_or_found():
    class TouchedStore(DictStore):
        def __init__(self) -> None:
            super().__init__()
            self.touched: list[list[bytes]] = []

        def touch(self, hashes) -> None:
            self.touched.append(list(hashes))

    cache = PrefixCache(BLOCK, 10_000, "m")
    store = TouchedStore()
    cache.attach_lower(store)
    tokens = list(range(12))
    hashes = cache.hashes(tokens)
    cache.insert(blocks_for(cache, tokens)[2:], chain=hashes)
    assert store.touched == [hashes]  # the whole chain, root to leaf
    cache.insert(blocks_for(cache, tokens)[:2], chain=hashes[:2])
    assert cache.lookup(cache.hashes(tokens + [1, 2, 3, 4])) and store.touched[-1] == hashes
    touched = len(store.touched)
    assert cache.lookup(cache.hashes([9, 9, 9, 9])) == []
    assert len(store.touched) == touched  # nothing found, nothing to tell


@pytest.mark.parametrize("reuse", [0, 3, 5])
def test_restore_with_a_tail_continues_exactly(tiny_model_path, reuse):
    from omlx_core.models.loader import load_model

    path = tiny_model_path("llama")
    tokens = [(5 * i + 1) % 300 + 10 for i in range(30)]

    def compute():
        model, _tokenizer = load_model(path)
        layout = CacheLayout(model)
        cache = layout.new_cache()
        _prefill(model, cache, tokens[:21], 8)
        mx.eval([c.state for c in cache])
        prefix = PrefixCache(8, 1 << 30, "llama")
        hashes = prefix.hashes(tokens[:16])
        blocks = [layout.make_block(h, hashes[i - 1] if i else prefix.root, i, 8,
                                    layout.cut(cache, 8 * i, 8 * i + 8), None)
                  for i, h in enumerate(hashes)]
        tail = layout.make_tail(hashes[-1], tokens[16:21], cache, 16)
        restored = layout.restore(blocks, tail, reuse)
        reference = layout.new_cache()
        _prefill(model, reference, tokens[:16 + reuse], 16 + reuse)
        return (np.array(_prefill(model, restored, tokens[16 + reuse:], 32)),
                np.array(_prefill(model, reference, tokens[16 + reuse:], 32)))

    resumed, cold = mlx_thread().run(compute)
    np.testing.assert_allclose(resumed, cold, rtol=1e-4, atol=1e-4)


def test_a_cached_block_is_reused_up_to_the_first_token_that_differs(tiny_model_path):
    """Same system prompt, new question: the block holding the end of the shared part
    is cut to the shared tokens instead of recomputed."""
    from omlx_core.engine import GenerationRequest, SamplingParams
    from omlx_core.config import load_config
    from omlx_core.models.registry import spec_for_path
    from omlx_core.plugins.batched import BatchedEngine

    config = load_config("base", overrides=[("plugin.batched.block_size", "16", "test"),
                                            ("plugin.batched.prefill_step_size", "32", "test")], env={})
    engine = BatchedEngine(spec_for_path(tiny_model_path("llama")), make_test_host(config))
    engine.start()
    try:
        system = [(5 * i) % 150 + 20 for i in range(40)]  # 2 full blocks + 8 tokens
        first = system + [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
        second = system + [40, 41, 42, 43, 44]
        greedy = SamplingParams(temperature=0.0, max_tokens=3)

        def run(prompt, rid):
            outputs = list(engine.submit(GenerationRequest(rid, prompt, greedy)))
            return [t for o in outputs for t in o.token_ids], outputs[-1].usage

        run(first, "first")
        assert engine.cached_tokens(second) == len(system)  # 32 from blocks + 8 cut from one
        tokens, usage = run(second, "second")
        assert usage.cached_tokens == len(system)
        engine.prefix_cache.clear()
        cold, _ = run(second, "cold")
        assert tokens == cold
    finally:
        engine.shutdown()


def test_matching_a_prefix_reads_and_counts_nothing_until_it_is_reused():
    """What the lower tier holds is described, not read: the memory it takes is asked for
    first (omlx_core/scheduling/prefix_restore.py). A block read back is not kept here too."""
    class CountingStore(DictStore):
        def __init__(self) -> None:
            super().__init__()
            self.reads = 0

        def get(self, block_hash):
            self.reads += 1
            return super().get(block_hash)

    cache = PrefixCache(BLOCK, 250, "m")
    store = CountingStore()
    cache.attach_lower(store)
    tokens = list(range(12))
    cache.insert(blocks_for(cache, tokens))  # the third does not fit: the store alone has it
    match = cache.match_prefix(cache.hashes(tokens), tokens)
    assert [b is not None for b in match.held] == [True, True, False]
    assert match.stored[2].nbytes == 100 and store.reads == 0
    assert cache.stats()["hits"] == cache.stats()["misses"] == 0
    blocks = list(cache.blocks_of(match, 3))
    assert [b.index for b in blocks] == [0, 1, 2] and store.reads == 1
    cache.record_reuse(match, 3)
    assert cache.stats()["hits"] == 1 and cache.stats()["tokens_saved"] == 12
    assert cache.peek(cache.hashes(tokens)) == 2  # not promoted: the reader holds it
