"""Compiled grammars' memory: charged at what they hold, bounded by the cache's budget,
counted by the memory guard as memory it takes back."""

from __future__ import annotations

import gc
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                                reason="xgrammar is not installed (./setup.sh installs it)")

from omlx_core.grammar import GrammarCompilerCache, GrammarSpec, compiler_for  # noqa: E402
from omlx_core.grammar.compiler import compiled_grammar_bytes  # noqa: E402
from omlx_core.memory.usage import MemoryUsage, trim_heap  # noqa: E402

MIB = 1024**2


def schema(i: int) -> GrammarSpec:
    return GrammarSpec.json_schema({"type": "object", "properties": {f"n{i}": {"type": "integer"}},
                                    "required": [f"n{i}"]})


def resident() -> int:
    """This process's resident set once freed objects and heap pages are gone."""
    gc.collect()
    trim_heap()
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Rss line in smaps_rollup")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from mlx_lm import load

    _, tokenizer = load(str(tiny_model_path("llama")))
    return tokenizer


def test_compiled_grammars_are_memory_the_guard_counts_and_takes_back(tokenizer):
    """The cache is reclaimable to the guard (a request is never refused for room that
    cached grammars hold) and its reclaim empties every cache; what a grammar is charged
    is what xgrammar says it holds, never less."""
    cache = compiler_for(tokenizer, vocab_size=512)
    compiled = [cache.compile(schema(i)) for i in range(3)]
    assert cache.bytes >= sum(c.grammar.memory_size_bytes for c in compiled) > 0
    del compiled
    usage = MemoryUsage()
    assert compiled_grammar_bytes() >= cache.bytes
    assert usage.reclaimable_outside_engines() >= cache.bytes
    held = cache.bytes
    assert usage.reclaim_outside_engines() >= held
    assert len(cache) == 0 and cache.bytes == 0 and compiled_grammar_bytes() == 0
    assert not cache.compile(schema(0)).cached  # compiled again when asked for
    # A reader that does not see this process's footprint does not count them either.
    fake = MemoryUsage(read_active=lambda: 0, read_footprint=lambda: 0)
    assert fake.reclaimable_outside_engines() == 0 and len(cache) == 1
    cache.close()


def test_the_guard_empties_mlxs_buffer_cache_before_it_drops_compiled_grammars(tokenizer):
    """Compiled grammars and idle grammar workers are the last the guard takes back: a
    worker restarts in about a second of CPU and a grammar compiles again, while mlx's
    freed buffers cost nothing to give back. (Dropping both for every shortfall
    restarted a worker every few seconds in the soak.)"""
    from omlx_core.config import load_config
    from omlx_core.memory.guard import MemoryGuard
    from omlx_core.pluginmanager import PluginManager

    cache = compiler_for(tokenizer, vocab_size=512)
    cache.compile(schema(0))
    guard = MemoryGuard(PluginManager(), load_config(tier="cpu-small", env={}),
                        usage=MemoryUsage(), mlx_cache=lambda: 8 * MIB)
    assert guard.reclaim(4 * MIB) == 8 * MIB
    assert len(cache) == 1  # mlx's buffer cache was enough
    held = cache.bytes
    assert guard.reclaim(8 * MIB + held) >= 8 * MIB + held
    assert len(cache) == 0
    cache.close()


@pytest.mark.slow
def test_distinct_grammars_keep_resident_memory_within_the_cache_budget(default_model_dir):
    """Forty distinct schemas for the default model's 49k-token vocabulary (~2 MiB each:
    80 MiB kept without a bound) through a 16 MiB cache: the process keeps at most the
    budget of them."""
    from mlx_lm import load

    _, tokenizer = load(str(default_model_dir))
    budget = 16 * MIB
    cache = GrammarCompilerCache(tokenizer, cache_bytes=budget)
    cache.compile(schema(-1))  # the first compile's one-time costs are not the cache's
    cache.release(dry_run=False)
    before = resident()
    for i in range(40):
        cache.compile(schema(i))
    assert cache.bytes <= budget and cache.stats.evictions >= 30
    kept = resident() - before
    # Unbounded, they would keep ~80 MiB; the heap of a process not set up as the server
    # sets up its allocator (threads' arenas) keeps some freed pages on top of the budget.
    assert kept <= 2 * budget, f"{kept / MIB:.1f} MiB kept for {budget / MIB:.0f} MiB of cache"
